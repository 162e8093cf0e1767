"""Will it fit?  The one capacity rule shared by ``inspect`` and ``stage``.

Data staged into a tmpfs must leave a reserve free for DataLoader workers,
which pass every batch through /dev/shm (a full /dev/shm kills them with
"Bus error").  For a tmpfs, the pages are also charged to the writer's memory
cgroup, so the data must fit the memory this node/cgroup can still give too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from shmstage import system
from shmstage.sizes import format_size, mount_size

RESERVE_FRACTION = 0.10
RESERVE_CAP = 4 << 30

MEMORY_BACKED = frozenset({"tmpfs", "ramfs"})


def default_reserve(fs_total: int) -> int:
    """10% of the destination file system, at most 4 GiB."""
    return min(RESERVE_CAP, int(fs_total * RESERVE_FRACTION))


@dataclass(frozen=True)
class Fit:
    """The verdict of :func:`check_fit`; ``reason`` is a one-line explanation when it does not fit."""

    needed: int  # bytes to write
    reserve: int  # bytes to keep free afterwards
    free: int  # free bytes on the destination file system
    memory_usable: int | None  # for memory-backed destinations: what the node/cgroup can still give
    fstype: str
    fits: bool
    reason: str | None
    suggested_size: str | None  # a `shmstage remount --size` value that would make it fit


def _existing_dir(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def check_fit(
    needed: int,
    dest: str | os.PathLike[str],
    reserve: int | None = None,
    *,
    memory: system.Memory | None = None,
) -> Fit:
    """Can ``needed`` more bytes be written under ``dest`` and still leave ``reserve`` free?"""
    where = _existing_dir(os.fspath(dest))
    usage = system.disk_usage(where)
    mount = system.mount_of(where)
    fstype = mount.fstype if mount else "unknown"
    if reserve is None:
        reserve = default_reserve(usage.total)
    mem_usable: int | None = None
    reason: str | None = None
    suggested: str | None = None
    if needed + reserve > usage.free:
        short = needed + reserve - usage.free
        where_free = mount.mountpoint if mount else where
        reason = (
            f"needs {format_size(needed)} + {format_size(reserve)} reserve but only "
            f"{format_size(usage.free)} is free on {where_free}"
        )
        if fstype in MEMORY_BACKED and mount is not None:
            mem = memory or system.memory()
            mem_usable = mem.usable
            gib = 1 << 30
            new_total = -(-(usage.total + short) // gib) * gib  # round up to whole GiB
            if new_total > mem.ceiling or needed > mem_usable:
                # Growing the tmpfs cannot help: its pages must come out of RAM.
                reason += (
                    f"; growing {mount.mountpoint} to {mount_size(new_total)} would exceed the "
                    f"{format_size(mem.ceiling)} of {_ram_word(mem)}, so stage to local disk with --dest"
                )
            else:
                suggested = mount_size(new_total)
                reason += (
                    f"; grow it with `shmstage remount --path {mount.mountpoint} --size {suggested}`"
                    " or pass a smaller --reserve"
                )
        else:
            reason += "; free space there or stage elsewhere with --dest"
    if reason is None and fstype in MEMORY_BACKED:
        mem = memory or system.memory()
        mem_usable = mem.usable
        if needed + reserve > mem_usable:
            where_limit = (
                "the memory cgroup limit" if mem.cgroup.limit is not None else "available RAM"
            )
            reason = (
                f"needs {format_size(needed)} + {format_size(reserve)} reserve of RAM but only "
                f"{format_size(mem_usable)} is usable ({where_limit}); tmpfs pages are charged "
                "to the writer's memory, so free memory, raise the limit, or stage to local disk with --dest"
            )
    return Fit(needed, reserve, usage.free, mem_usable, fstype, reason is None, reason, suggested)


def _ram_word(mem: system.Memory) -> str:
    if mem.cgroup.limit is not None and mem.cgroup.limit < mem.total:
        return "this cgroup's memory limit"
    return "RAM on this node"
