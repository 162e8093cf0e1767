"""Who may enter a published copy's top directory: its owner taken from the very source top
the stage read, the permission classes its source path denies cleared (store/access.py),
and a reader who proved they can read the source (the node service's caller) let in.

staging.py calls it when it publishes a directory or an archive, and again each time it
finds the copy current: a path may have opened or closed since; and, before a stage would
replace a copy, asks it whether this reader may (``check_replace``).  Each of those, and each
``find`` of the copy, takes the grant back from every user who no longer passes the source
path (``revoke_lapsed``): checked as that user, by a forked child that becomes them.
"""

from __future__ import annotations

import os
import pwd
import stat
from contextlib import suppress
from typing import Any

from shmstage.errors import RefusedError
from shmstage.identity import Caller, Share, become, reading_as
from shmstage.stage.sources.base import Source
from shmstage.stage.sources.beneath import SOURCE_TOP, ident, join_ident, split_ident
from shmstage.stage.sources.kinds import LISTED_KINDS
from shmstage.stage.store import access
from shmstage.stage.store.layout import Record, Store


def restrict_new(
    part: str, source: str, kind: str, src: Source, reader: Caller | None, mode: int | None = None
) -> None:
    """The new copy at ``part`` before its publish: its top's owner from the source top the
    walk opened, its ``mode`` (the source top's: the tree was kept closed while in flight;
    None: its own) less what the source path denies, and the reader let in."""
    walked = getattr(src, "tree", None)
    top = checked_top(
        source,
        kind,
        {SOURCE_TOP: split_ident(walked.top)} if walked is not None else {},
        getattr(src, "fingerprint", None),
        reader,
    )
    revoke_lapsed(part, source, kind, reader)
    access.restrict_root(part, source, kind, mode, owner=top)
    let_in(part, reader)


def recheck(
    store: Store,
    name: str,
    source: str,
    kind: str,
    manifest: dict[str, Any] | None,
    reader: Caller | None = None,
) -> None:
    """An unchanged source: its path may have opened or closed since the copy was made.
    The root's owner is put back only from the very top the stage walked (not a link, and
    for a directory the [dev, ino] its manifest recorded).  The reader, who has just read
    the whole source as themselves, is let in; every other user let in before who no
    longer passes the source path is shut out."""
    revoke_lapsed(store.path(name), source, kind, reader)
    with suppress(OSError, KeyError, IndexError, TypeError):  # best effort: not our copy, ...
        access.restrict_root(
            store.path(name),
            source,
            kind,
            manifest["entries"][0][4],  # type: ignore[index]
            checked_top(source, kind, manifest, (manifest or {}).get("archive"), reader),
        )
    let_in(store.path(name), reader)
    with suppress(OSError):  # its manifest and record: read by who may list the top now
        store.share_bookkeeping(name)


def let_in(root: str, reader: Caller | None) -> None:
    """``reader`` passes through ``root`` (access.grant) where its mode shuts them out; only
    ever called once the reader read the source as themselves."""
    if reader is not None and not reader.is_root:
        access.grant(root, reader.uid)


def revoke_lapsed(root: str, source: str, kind: str, reader: Caller | None = None) -> bool:
    """Take back the grant (access.grant) of each user named on ``root`` who may no longer
    search every directory to ``source`` and read (and, a directory, search) ``source``
    itself, as the kernel judges it for them now (``reaches``); ``reader`` has just read it.
    Their manifests and record follow (the caller's ``share_bookkeeping``).  Only root can
    check as another user or change the copy: as anyone else, nothing.  True: someone lost it."""
    if os.geteuid() != 0 or kind in LISTED_KINDS or "://" in source:
        return False
    try:
        st = os.lstat(root)
        named = access.granted(root)
    except OSError:
        return False
    skip = {st.st_uid, 0} | ({reader.uid} if reader is not None else set())
    gone = [uid for uid in sorted(named) if uid not in skip and not reaches(source, kind, uid)]
    return bool(gone) and access.revoke(root, gone)


def forget_lapsed(store: Store, name: str) -> None:
    """``revoke_lapsed`` for the published copy ``name`` (a ``find`` of it), its manifests
    and record following.  Nothing granted (the usual case): one getxattr."""
    if os.geteuid() != 0:
        return
    with suppress(OSError):
        if not access.granted(store.path(name)):
            return
    record = store.published(name)
    if record is not None and revoke_lapsed(store.path(name), record.source, record.kind):
        with suppress(OSError):
            store.share_bookkeeping(name)


def reaches(source: str, kind: str, uid: int) -> bool:
    """Whether ``uid``, with its passwd entry's gid and groups (os.getgrouplist: the groups
    of a process it may not have running), may pass the path to ``source`` and read it.  A
    forked child becomes the user (identity.become) and opens it: the kernel's own check,
    ACLs included.  A uid with no passwd entry: no (its groups are unknown; it proves itself
    again at its next stage or find)."""
    try:
        pw = pwd.getpwuid(uid)
        who = Caller(uid, pw.pw_gid, tuple(os.getgrouplist(pw.pw_name, pw.pw_gid)))
    except (KeyError, OSError):
        return False
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's exit status is the answer
        code = 1
        try:
            become(who)
            flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
            os.close(os.open(source, flags | (os.O_DIRECTORY if kind == "dir" else 0)))
            if kind == "dir":
                os.stat(os.path.join(source, "."))  # search (x) on the top itself
            code = 0
        except BaseException:  # noqa: BLE001 - any failure: not reached
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def checked_top(
    source: str,
    kind: str,
    manifest: dict[str, Any] | None,
    archive: list[int] | None,
    reader: Caller | None = None,
) -> os.stat_result | None:
    """The source's top as the stage read it (a directory's [dev, ino] as the manifest
    records it; a tar archive's fingerprint [size, mtime, ino]), or None when it is not that
    any more (its owner swapped it for a link to someone else's, say): the copy's root
    takes its owner from it.  Looked up as ``reader``."""
    try:
        with reading_as(reader):
            top = os.stat(source.rstrip("/") or "/", follow_symlinks=False)
    except OSError:
        return None
    if kind == "dir":
        recorded = (manifest or {}).get(SOURCE_TOP)
        same = stat.S_ISDIR(top.st_mode) and (not recorded or ident(top) == join_ident(recorded))
    else:
        same = stat.S_ISREG(top.st_mode) and (
            not archive or [top.st_size, top.st_mtime_ns, top.st_ino] == list(archive)
        )
    return top if same else None


def check_replace(
    store: Store, record: Record, source: str, force: bool, reader: Caller | None
) -> None:
    """A non-root reader may not replace someone else's copy: neither of another source
    (a name collision) nor by ``--force``.  The engine checks it itself: whatever calls it
    (the service, a loader) need not."""
    if reader is None or reader.is_root or (record.source == source and not force):
        return
    try:
        owner = os.lstat(store.path(record.name)).st_uid
    except OSError:
        return  # nothing published to replace
    if owner != reader.uid:
        raise RefusedError(
            f"{record.name} is {user_name(owner)}'s copy of {record.source}: only they or root "
            f"may replace it; stage {source} under another --name"
        )


def check_shared(
    top: str, name: str, source: str, reader: Caller | None, share: Share | None = None
) -> None:
    """An object-store copy is its stager's alone unless the node config shares it: another
    reader who may not list it (and whom ``share`` does not name) is refused, instead of being
    handed a path they cannot read.  Their own keys do not matter: the copy is not theirs."""
    if reader is None or reader.is_root or "://" not in source:
        return
    if share is not None and (
        share.everyone or (share.gid is not None and share.gid in (reader.gid, *reader.groups))
    ):
        return  # the stage re-shares the copy as the config says now
    try:
        owner = os.lstat(top).st_uid
    except OSError:
        return
    if owner == reader.uid or may_list(top, reader):
        return
    raise RefusedError(
        f"{name} is {user_name(owner)}'s copy of {source}; it is not shared with you: ask an "
        "admin to add it to shares: in the node config, or stage it under another --name"
    )


def may_list(top: str, reader: Caller) -> bool:
    """Whether ``reader`` may list and pass through ``top``, as the kernel judges it."""
    try:
        with reading_as(reader):
            os.stat(os.path.join(top, "."))  # search (x)
            os.close(os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
    except OSError:
        return False
    return True


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
