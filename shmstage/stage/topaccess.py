"""Who may enter a published copy's top directory: its owner taken from the very source top
the stage read, the permission classes its source path denies cleared (store/access.py),
and a reader who proved they can read the source (the node service's caller) let in.

staging.py calls it when it publishes a directory or an archive, and again each time it
finds the copy current: a path may have opened or closed since; and, before a stage would
replace a copy, asks it whether this reader may (``check_replace``).
"""

from __future__ import annotations

import os
import pwd
import stat
from contextlib import suppress
from typing import Any

from shmstage.errors import RefusedError
from shmstage.identity import Caller, Share, reading_as
from shmstage.stage.sources.base import Source
from shmstage.stage.sources.beneath import SOURCE_TOP, ident, join_ident, split_ident
from shmstage.stage.store import access
from shmstage.stage.store.layout import Record, Store


def restrict_new(part: str, source: str, kind: str, src: Source, reader: Caller | None) -> None:
    """The new copy at ``part`` before its publish: its top's owner from the source top the
    walk opened, what the source path denies cleared, and the reader let in."""
    walked = getattr(src, "tree", None)
    top = checked_top(
        source,
        kind,
        {SOURCE_TOP: split_ident(walked.top)} if walked is not None else {},
        getattr(src, "fingerprint", None),
        reader,
    )
    access.restrict_root(part, source, kind, owner=top)
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
    the whole source as themselves, is let in."""
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
