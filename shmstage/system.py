"""Read-only facts about the node: mounts, memory, cgroup limits, CPUs, CPU flags.

All kernel files are read here and nowhere else.  Every reader takes its root
(``proc``, ``cgroup_root``) as an argument so unit tests can point it at a fake
tree; the defaults are the real ones.
"""

from __future__ import annotations

import math
import os
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil

_UNLIMITED = 1 << 62  # cgroup v1 reports "no limit" as ~2^63 rounded to a page


@dataclass(frozen=True)
class Mount:
    device: str
    mountpoint: str
    fstype: str
    opts: tuple[str, ...]

    def option(self, key: str) -> str | None:
        for opt in self.opts:
            k, _, v = opt.partition("=")
            if k == key:
                return v
        return None


@dataclass(frozen=True)
class Usage:
    total: int
    used: int
    free: int


@dataclass(frozen=True)
class CgroupMemory:
    version: int | None  # 1, 2, or None when no memory controller is found
    path: str | None
    limit: int | None  # bytes, None = unlimited
    usage: int | None


@dataclass(frozen=True)
class Memory:
    total: int
    available: int
    cgroup: CgroupMemory

    @property
    def usable(self) -> int:
        """Memory this process's cgroup can still get: min(node available, cgroup headroom)."""
        if self.cgroup.limit is None:
            return self.available
        headroom = max(0, self.cgroup.limit - (self.cgroup.usage or 0))
        return min(self.available, headroom)

    @property
    def ceiling(self) -> int:
        """The most RAM this node/cgroup could ever hold: min(physical RAM, cgroup limit)."""
        return self.total if self.cgroup.limit is None else min(self.total, self.cgroup.limit)


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: str | Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


# --- mounts -----------------------------------------------------------------


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as \ooo.
    return field.encode().decode("unicode_escape") if "\\" in field else field


def mounts_from_mountinfo(proc: str = "/proc") -> list[Mount]:
    out = []
    text = _read(f"{proc}/self/mountinfo") or ""
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        lf, rf = left.split(), right.split()
        if len(lf) < 6 or len(rf) < 2:
            continue
        opts = lf[5].split(",") + (rf[2].split(",") if len(rf) > 2 else [])
        seen: dict[str, None] = dict.fromkeys(opts)
        out.append(Mount(rf[1], _unescape(lf[4]), rf[0], tuple(seen)))
    return out


def mounts(proc: str = "/proc") -> list[Mount]:
    """Every mount, tmpfs included (psutil hides tmpfs unless ``all=True``)."""
    if proc != "/proc":
        return mounts_from_mountinfo(proc)
    # mountinfo has the superblock options (size=, mode=) that psutil's
    # /proc/mounts view lacks for some kernels; prefer it, fall back to psutil.
    found = mounts_from_mountinfo(proc)
    if found:
        return found
    return [
        Mount(p.device, p.mountpoint, p.fstype, tuple(p.opts.split(",")))
        for p in psutil.disk_partitions(all=True)
    ]


def mount_of(path: str | os.PathLike[str], proc: str = "/proc") -> Mount | None:
    """The mount that holds ``path`` (the last-mounted of the longest matching mountpoint)."""
    real = os.path.realpath(path)
    best: Mount | None = None
    for m in mounts(proc):
        mp = m.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and (
            best is None or len(mp) >= len(best.mountpoint)
        ):
            best = m
    return best


def is_mountpoint(path: str | os.PathLike[str]) -> bool:
    return os.path.ismount(path)


def disk_usage(path: str | os.PathLike[str]) -> Usage:
    u = shutil.disk_usage(path)
    return Usage(u.total, u.used, u.free)


# --- cgroups ----------------------------------------------------------------


def _cgroup_paths(proc: str) -> dict[str, str]:
    """controller -> path from /proc/self/cgroup ("" key is the v2 unified path)."""
    paths: dict[str, str] = {}
    for line in (_read(f"{proc}/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            paths[""] = path
        for c in controllers.split(","):
            if c:
                paths[c.removeprefix("name=")] = path
    return paths


def _ancestors(root: Path, rel: str) -> list[Path]:
    """The cgroup directory of ``rel`` under ``root`` and its parents up to root.

    Inside a container with a private cgroup namespace the path in
    /proc/self/cgroup may not exist under /sys/fs/cgroup; the mount's root
    is then our own cgroup, so fall back to it."""
    rel = rel.strip("/")
    here = root / rel if rel else root
    if not here.is_dir():
        return [root]
    out = [here]
    while here != root:
        here = here.parent
        out.append(here)
    return out


def _is_v2(cgroup_root: Path) -> bool:
    return (cgroup_root / "cgroup.controllers").exists()


def cgroup_memory(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> CgroupMemory:
    """The tightest memory limit on this process's cgroup path, and its usage."""
    root = Path(cgroup_root)
    paths = _cgroup_paths(proc)
    if _is_v2(root) and "" in paths:
        dirs = _ancestors(root, paths[""])
        limits = [v for d in dirs if (v := _read_int(d / "memory.max")) is not None]
        return CgroupMemory(2, paths[""], min(limits) if limits else None, _read_int(dirs[0] / "memory.current"))
    if "memory" in paths and (root / "memory").is_dir():
        dirs = _ancestors(root / "memory", paths["memory"])
        limits = [v for d in dirs if (v := _read_int(d / "memory.limit_in_bytes")) is not None]
        stat = _read(dirs[0] / "memory.stat") or ""
        for line in stat.splitlines():  # v1 folds parent limits in here
            k, _, v = line.partition(" ")
            if k == "hierarchical_memory_limit" and v.strip().isdigit() and int(v) < _UNLIMITED:
                limits.append(int(v))
        return CgroupMemory(1, paths["memory"], min(limits) if limits else None, _read_int(dirs[0] / "memory.usage_in_bytes"))
    return CgroupMemory(None, None, None, None)


def cgroup_cpu_quota(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs allowed by the CFS quota (e.g. 2.5), None when unlimited."""
    root = Path(cgroup_root)
    paths = _cgroup_paths(proc)
    quotas: list[float] = []
    if _is_v2(root) and "" in paths:
        for d in _ancestors(root, paths[""]):
            parts = (_read(d / "cpu.max") or "").split()
            if len(parts) == 2 and parts[0] != "max" and int(parts[1]) > 0:
                quotas.append(int(parts[0]) / int(parts[1]))
    else:
        key = "cpu" if "cpu" in paths else "cpu,cpuacct"
        base = root / "cpu" if (root / "cpu").is_dir() else root / "cpu,cpuacct"
        if key in paths or "cpu" in paths:
            for d in _ancestors(base, paths.get("cpu", paths.get(key, ""))):
                q, p = _read_int(d / "cpu.cfs_quota_us"), _read_int(d / "cpu.cfs_period_us")
                if q is not None and q > 0 and p:
                    quotas.append(q / p)
    return min(quotas) if quotas else None


def usable_cpus(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may really use: affinity set, capped by the cgroup quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota(proc, cgroup_root)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def memory(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> Memory:
    vm = psutil.virtual_memory()
    return Memory(vm.total, vm.available, cgroup_memory(proc, cgroup_root))


# --- CPU and limits ---------------------------------------------------------


def cpu_flags(proc: str = "/proc") -> frozenset[str]:
    for line in (_read(f"{proc}/cpuinfo") or "").splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def has_avx2(proc: str = "/proc") -> bool:
    return "avx2" in cpu_flags(proc)


def memlock_limit() -> int | None:
    """``ulimit -l`` in bytes; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft
