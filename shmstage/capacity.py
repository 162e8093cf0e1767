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
from shmstage.sizes import SizeError, format_size, is_percent, mount_size, parse_size

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
    inodes: int = 0  # inodes to create (0: not checked)
    inodes_free: int | None = None  # free inodes on the destination; None = no limit
    pending: int = 0  # bytes other live stagers of this DEST have reserved and not yet written
    mountpoint: str | None = None  # of the destination file system


def resolve_reserve(reserve: int | str | None, fs_total: int) -> int:
    """``reserve`` in bytes: None = the default, ``"10%"`` = percent of the destination's size."""
    if reserve is None:
        return default_reserve(fs_total)
    if isinstance(reserve, str):
        try:
            if is_percent(reserve):
                return parse_size(reserve, percent_of=fs_total)
            return parse_size(reserve)
        except SizeError as e:
            from shmstage.errors import RefusedError

            raise RefusedError(f"invalid --reserve {reserve!r}: {e}") from None
    return reserve


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
    reserve: int | str | None = None,
    *,
    memory: system.Memory | None = None,
    inodes: int = 0,
    pending: int = 0,
    freed: int = 0,
    charged: int | None = None,
) -> Fit:
    """Can ``needed`` more bytes (and ``inodes`` more inodes) be written under ``dest`` and
    still leave ``reserve`` free?  ``pending``: bytes other live stagers have reserved but not
    written yet (taken off the free space); ``freed``: bytes this stage will delete first
    (on a tmpfs those are RAM pages too: removing them gives their memory back, so they
    count for the RAM check as well as for the free space; under a cgroup limit only as far
    as they are charged to this cgroup: ``charged`` of them, None: all; see
    system.Memory.usable_after_freeing)."""
    where = _existing_dir(os.fspath(dest))
    usage = system.disk_usage(where)
    mount = system.mount_of(where)
    fstype = mount.fstype if mount else "unknown"
    reserve = resolve_reserve(reserve, usage.total)
    free = max(0, usage.free + freed - pending)
    mem_usable: int | None = None
    reason: str | None = None
    suggested: str | None = None
    others = f" ({format_size(pending)} of it promised to other stagers)" if pending else ""
    if needed + reserve > free:
        short = needed + reserve - free
        where_free = mount.mountpoint if mount else where
        reason = (
            f"needs {format_size(needed)} + {format_size(reserve)} reserve but only "
            f"{format_size(free)} is free on {where_free}{others}"
        )
        if fstype in MEMORY_BACKED and mount is not None:
            mem = memory or system.memory()
            mem_usable = max(0, mem.usable_after_freeing(freed, charged) - pending)
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
        mem_usable = max(0, mem.usable_after_freeing(freed, charged) - pending)
        if needed + reserve > mem_usable:
            where_limit = (
                "the memory cgroup limit" if mem.cgroup.limit is not None else "available RAM"
            )
            reason = (
                f"needs {format_size(needed)} + {format_size(reserve)} reserve of RAM but only "
                f"{format_size(mem_usable)} is usable ({where_limit}); tmpfs pages are charged "
                "to the writer's memory, so free memory, raise the limit, or stage to local disk with --dest"
            )
    inodes_free = _free_inodes(where)
    if reason is None and inodes and inodes_free is not None and inodes > inodes_free:
        mp = mount.mountpoint if mount else where
        reason = (
            f"needs {inodes:,} inodes but {mp} has only {inodes_free:,} free; remount it with "
            f"more (`mount -o remount,nr_inodes={_more_inodes(inodes, where)} {mp}`) or stage "
            "elsewhere with --dest"
        )
    return Fit(
        needed,
        reserve,
        free,
        mem_usable,
        fstype,
        reason is None,
        reason,
        suggested,
        inodes,
        inodes_free,
        pending,
        mount.mountpoint if mount else None,
    )


def _free_inodes(path: str) -> int | None:
    try:
        sv = os.statvfs(path)
    except OSError:
        return None
    return sv.f_favail if sv.f_files else None  # f_files 0: no inode limit (nr_inodes=0)


def _more_inodes(inodes: int, path: str) -> int:
    sv = os.statvfs(path)
    used = sv.f_files - sv.f_ffree
    return -(-(used + inodes) * 11 // 10 // 1000) * 1000  # 10% headroom, whole thousands


def describe(needed: int, files: int, inodes: int) -> str:
    """The one wording of what a dataset needs, printed by inspect, stage and prepare."""
    return f"{format_size(needed)} for {files:,} files ({inodes:,} inodes)"


def _ram_word(mem: system.Memory) -> str:
    if mem.cgroup.limit is not None and mem.cgroup.limit < mem.total:
        return "this cgroup's memory limit"
    return "RAM on this node"


def disk_note(dest: str | os.PathLike[str] | None) -> str | None:
    """One line when ``dest`` is not RAM-backed: the copy will be on disk, not in RAM."""
    from shmstage.stage.store import resolve_dest

    where = _existing_dir(resolve_dest(dest))
    mount = system.mount_of(where)
    if mount is None or mount.fstype in MEMORY_BACKED:
        return None
    return (
        f"note: {resolve_dest(dest)} is on {mount.fstype} ({mount.mountpoint}), not tmpfs: "
        "the copy is on disk, not in RAM"
    )
