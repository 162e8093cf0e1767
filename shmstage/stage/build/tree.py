"""The pieces of a tree under partial/<name> that every way of filling it shares: symlinks,
links to the published copy, hard links and directories' owners, modes and times last, then
the source's ACLs, the new manifest, and the copy's progress counter.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from shmstage.errors import ShmstageError
from shmstage.stage.build.chown import copy_group, copy_owner
from shmstage.stage.sources import acls
from shmstage.stage.store import Store


class Counter:
    """Copy progress: reports "copying" when made, then adds copied bytes/files on each call.
    The totals may grow while the copy runs (a first copy walks and copies at once)."""

    def __init__(self, report: Callable[..., None], bytes_total: int, files_total: int) -> None:
        self.report = report
        self.bytes_total, self.files_total = bytes_total, files_total
        self.bytes_done = self.files_done = 0
        self._report()

    def grow(self, nbytes: int, nfiles: int) -> None:
        self.bytes_total += nbytes
        self.files_total += nfiles

    def __call__(self, b: int, f: int) -> None:
        self.bytes_done += b
        self.files_done += f
        self._report()

    def _report(self) -> None:
        self.report(
            "copying",
            bytes_done=self.bytes_done,
            bytes_total=self.bytes_total,
            files_done=self.files_done,
            files_total=self.files_total,
        )


def prepare_manifest(
    store: Store, name: str, location: str, entries: list[Any], **more: Any
) -> None:
    """The new manifest of partial/<name>: its source, its root's inode (what publish
    checks), its entries and what else the source keeps (change keys, an archive's stamp)."""
    root = os.lstat(store.partial(name))
    data = {"source": location, "root": [root.st_ino, root.st_dev], "entries": entries}
    store.prepare_manifest(name, {**data, **more})


def finish_tree(
    part: str,
    hard: list[list[Any]],
    dirs: list[tuple[str, int, int, int]],
    owner: Callable[[str], os.stat_result | None],
    group: Callable[[str], int | None] | None = None,
) -> None:
    """Hard links inside the tree, then each directory's owner (or a user's copy's group),
    mode and times (children first: they touch the parent's mtime; an mtime of 0 is left as
    made).  The top is never opened beyond what it has now (0700, or a live tree's final
    access): partial/ is 0711, so an open top would let anyone read the copy before its
    publish, or forever after a kill; its own access is set at the publish (topaccess.py)."""
    for rel, first in hard:
        os.link(os.path.join(part, first), os.path.join(part, rel), follow_symlinks=False)
    for rel, mode, mtime, atime in reversed(dirs):
        path = os.path.join(part, rel) if rel != "." else part
        st = owner(rel)
        if st is not None:
            copy_owner(path, st)
        gid = group(rel) if group is not None else None
        if gid is not None:
            copy_group(path, gid)
        os.chmod(path, mode & stat.S_IMODE(os.lstat(path).st_mode) if rel == "." else mode)
        if mtime:
            os.utime(path, ns=(atime if atime >= 0 else mtime, mtime), follow_symlinks=False)


def apply_acls(part: str, entries: list[Any]) -> None:
    """Each file's and directory's ACLs as the walk recorded them (acls.py), written
    verbatim onto its copy in ``part`` once owners and modes are set (the top's never: its
    access is topaccess.py's).  A DEST that refuses them (EOPNOTSUPP though it took them
    when the stage began) refuses the stage: the modes were kept for the ACLs to narrow."""
    for e in entries:
        if e[5] is None or e[1] not in ("f", "d") or e[0] == ".":
            continue
        try:
            acls.apply(os.path.join(part, e[0]), e[5])
        except OSError as err:
            raise ShmstageError(
                f"cannot give the copy of {e[0]} its source's ACL: {err.strerror}; nothing "
                "was published"
            ) from None


def drop_acls(path: str) -> None:
    """Remove ``path``'s ACLs (none: nothing to do)."""
    for name in ("system.posix_acl_access", "system.posix_acl_default"):
        with suppress(OSError):
            os.removexattr(path, name, follow_symlinks=False)


def link_unchanged(old: str, new: str, e: list[Any], owner: os.stat_result | None) -> bool:
    """Hard-link the published ``old`` file as ``new`` if it is still what the manifest says
    (entry ``e``; and owned like the source where copies keep owners); False (nothing linked)
    if not.

    The published tree may belong to the source's owner (root keeps owners), who can swap
    a directory in it for a symlink: the check runs on the link made in our private
    partial/ tree, so what it accepts is what gets published."""
    try:
        os.link(old, new, follow_symlinks=False)
    except OSError:
        return False
    st = os.lstat(new)
    ok = stat.S_ISREG(st.st_mode) and (st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode)) == (
        e[2],
        e[3],
        e[4],
    )
    if ok and owner is not None:
        ok = (st.st_uid, st.st_gid) == (owner.st_uid, owner.st_gid)
    if not ok:
        os.unlink(new)
    return ok


def make_symlink(path: str, target: str, mtime: int, owner: os.stat_result | None) -> None:
    """A symlink of the copy, owned like ``owner`` (the source link) when copies keep owners."""
    os.symlink(target, path)
    if owner is not None:
        copy_owner(path, owner)
    os.utime(path, ns=(mtime, mtime), follow_symlinks=False)
