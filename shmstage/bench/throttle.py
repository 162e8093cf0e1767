"""A read-bandwidth cap for benchmarks: ``blkio_throttle(path, bps)`` puts the processes moved
into it under a cgroup v1 ``blkio`` group or a cgroup v2 ``io.max`` rule on the block device
under ``path`` (root only), so a fast disk can stand in for a slow network file system.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from shmstage.errors import PermissionDenied, RefusedError


@dataclass(frozen=True)
class Throttle:
    cgroup: Path  # the group's directory
    device: str  # "MAJ:MIN" of the whole disk
    bps: int
    version: int  # cgroup version, 1 (blkio) or 2 (io)

    def add(self, pid: int) -> None:
        """Move process ``pid`` into the throttled group."""
        (self.cgroup / "cgroup.procs").write_text(f"{pid}\n")

    def enter(self) -> None:
        """Move the calling process into the group: a ``preexec_fn`` for subprocess."""
        self.add(os.getpid())


def block_device(path: str | os.PathLike[str], sys_root: str = "/sys") -> str:
    """``MAJ:MIN`` of the whole disk holding ``path`` (the parent disk when it sits on a partition)."""
    dev = os.stat(path).st_dev
    return whole_disk(os.major(dev), os.minor(dev), sys_root, what=str(path))


def whole_disk(major: int, minor: int, sys_root: str = "/sys", *, what: str = "the path") -> str:
    node = Path(sys_root, "dev", "block", f"{major}:{minor}")
    if not node.exists():
        raise RefusedError(
            f"{what} is not on a block device (device {major}:{minor}): a read throttle needs a local disk"
        )
    real = node.resolve()
    if (real / "partition").exists():  # sda1 -> sda: throttle rules apply to whole disks
        real = real.parent
    return (real / "dev").read_text().strip()


@contextmanager
def blkio_throttle(
    path: str | os.PathLike[str],
    bps: int,
    *,
    name: str = "shmstage-bench",
    cgroup_root: str = "/sys/fs/cgroup",
    sys_root: str = "/sys",
) -> Iterator[Throttle]:
    """A cgroup whose processes read the disk under ``path`` at ``bps`` bytes/s at most; removed on exit."""
    device = block_device(path, sys_root)
    root = Path(cgroup_root)
    controllers = _read(root / "cgroup.controllers")
    if (root / "blkio" / "blkio.throttle.read_bps_device").exists():
        version, parent, limit_file, rule = (
            1,
            root / "blkio",
            "blkio.throttle.read_bps_device",
            f"{device} {bps}",
        )
    elif controllers is not None and "io" in controllers.split():
        version, parent, limit_file, rule = 2, root, "io.max", f"{device} rbps={bps}"
    else:
        raise RefusedError(
            f"no blkio (cgroup v1) or io (cgroup v2) controller under {root}: cannot throttle reads"
        )
    group = parent / f"{name}-{os.getpid()}"
    try:
        if version == 2 and "io" not in (_read(root / "cgroup.subtree_control") or "").split():
            (root / "cgroup.subtree_control").write_text("+io\n")
        group.mkdir()
    except PermissionError:
        raise PermissionDenied(f"creating a cgroup under {parent} needs root") from None
    try:
        try:
            (group / limit_file).write_text(f"{rule}\n")
        except OSError as e:
            raise RefusedError(
                f"the kernel refused the throttle rule '{rule}' in {group / limit_file}: {e.strerror}"
            ) from None
        yield Throttle(group, device, bps, version)
    finally:
        _remove_cgroup(group, parent)


def _remove_cgroup(group: Path, parent: Path) -> None:
    # A process still inside keeps the group busy (EBUSY): move stragglers out first.
    for pid in (_read(group / "cgroup.procs") or "").split():
        with suppress(OSError):  # it exited meanwhile
            (parent / "cgroup.procs").write_text(f"{pid}\n")
    for _ in range(50):
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)  # an exiting child can hold the group for a moment
    group.rmdir()


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
