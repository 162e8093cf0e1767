"""The files a node writes in the exchange: each one's ``Target`` (where, its metadata, the
bytes still to come), its owner by the copier's rule, the error for a source file that cannot be
read, and the re-read that checks what was written against the owners' checksums.
"""

from __future__ import annotations

import errno
import os
import zlib
from dataclasses import dataclass, field

from shmstage.cluster.plan import Plan
from shmstage.errors import ShmstageError
from shmstage.stage.build import chown
from shmstage.stage.sources.beneath import NotRegular, SourceTree


@dataclass
class Target:
    """A file this node writes: where, its metadata, and the bytes still to come."""

    dst: str
    src: str
    size: int
    mtime: int
    atime: int
    mode: int
    left: int
    fd: int = -1
    crcs: dict[int, int] = field(default_factory=dict)  # offset -> crc (for --verify checksum)
    rel: str = ""  # below the source's top
    ident: int = 0  # the source file the walk found (beneath.ident; 0: not checked)


def give_owner(
    t: Target, fd: int, top: SourceTree, own: bool, groups: frozenset[int] | None
) -> None:
    """``t``'s copy (``fd``) gets its owner and group by the copier's rule, from the walked
    file's own stat below ``top`` (never a path's: the top may have been swapped since)."""
    if not own and groups is None:
        return
    try:
        st = top.stat(t.rel, t.ident)
    except OSError as e:
        raise unreadable(t.src, e) from None
    if not chown.give_owner(fd, st, t.mode, own, groups):
        raise ShmstageError(
            f"source file changed during the copy: {t.src} (its group is not the one the scan "
            "found); re-run when the source is stable"
        )


def unreadable(path: str, e: OSError) -> ShmstageError:
    """A source file that cannot be read, or is not the one the walk found."""
    if isinstance(e, NotRegular):
        return ShmstageError(
            f"source file {path} is not a regular file any more (replaced since the scan, by "
            "a named pipe or a device?); nothing was published: re-run when the source is stable"
        )
    if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
        return ShmstageError(
            f"source file {path} is not the file the scan found: it or a directory on its path "
            "was replaced (by a symlink or another file) since; nothing was published: re-run "
            "when the source is stable, and check who can change it"
        )
    return ShmstageError(f"cannot read source file {path}: {e.strerror}")


def verify_written(targets: dict[int, Target], plan: Plan) -> list[str]:
    """Re-read every written range and compare it with the owner's checksum; the bad paths."""
    bad = []
    for i, t in targets.items():
        fd = os.open(t.dst, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for offset, want in t.crcs.items():
                end = plan.starts[i] + plan.files[i][1]
                length = _segment_length(plan, i, offset, end)
                if zlib.crc32(os.pread(fd, length, offset)) != want:
                    bad.append(plan.files[i][0])
                    break
        finally:
            os.close(fd)
    return sorted(bad)


def _segment_length(plan: Plan, i: int, offset: int, end: int) -> int:
    """A segment of file i from ``offset`` ends at the next share or piece boundary."""
    start = plan.starts[i] + offset
    for r in range(plan.nodes):
        s, e = plan.share(r)
        if s <= start < e:
            k = (start - s) // plan.piece
            _, b = plan.piece_range(r, k)
            return min(b, end) - start
    return end - start
