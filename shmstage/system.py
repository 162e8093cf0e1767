"""Read-only facts about the node: mounts, memory, cgroup limits, CPUs, CPU flags.

All kernel files are read here and nowhere else.  Every reader takes its root
(``proc``, ``cgroup_root``) as an argument so unit tests can point it at a fake
tree; the defaults are the real ones.  Long because that one job, reading the kernel's
files, covers every kind of fact (mounts, cgroups v1 and v2, CPUs, block devices), and
keeping them in one module is what lets a test fake the whole node in one place.
"""

from __future__ import annotations

import math
import os
import re
import resource
import warnings
from dataclasses import dataclass
from pathlib import Path

from shmstage.paths import is_within

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
    usage: int | None  # charged bytes, page cache included
    # Page cache the kernel drops before it would OOM-kill for the limit: inactive_file
    # (v2 memory.stat; v1 total_inactive_file, hierarchical).  tmpfs/shmem pages sit on the
    # anon LRU, never here (measured on 6.18: a tmpfs write raises shmem and inactive_anon).
    reclaimable: int = 0
    # tmpfs/shmem pages charged to this cgroup (v2 shmem, v1 total_shmem): the most that
    # removing tmpfs files can give back to it; pages charged to another cgroup (a dataset
    # staged by root's prepare, outside a job's cgroup) free nothing under this limit.
    shmem: int = 0


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
        # The same rule as docker stats and the kubelet's working set: usage - inactive_file.
        working_set = max(0, (self.cgroup.usage or 0) - self.cgroup.reclaimable)
        headroom = max(0, self.cgroup.limit - working_set)
        return min(self.available, headroom)

    def usable_after_freeing(self, freed: int, charged: int | None = None) -> int:
        """``usable`` once ``freed`` bytes of tmpfs pages are removed: the node gets them all
        back, but under a cgroup limit only what is charged to this cgroup counts:
        ``charged`` of them (None: all), and never more than the cgroup's shmem.  Any tmpfs
        page of the cgroup is no proof that the removed ones were among them (a job's own
        scratch in /dev/shm is shmem too): the caller says which are (memory_cgroup_id)."""
        if freed <= 0:
            return self.usable
        if self.cgroup.limit is None:
            return self.available + freed
        working_set = max(0, (self.cgroup.usage or 0) - self.cgroup.reclaimable)
        headroom = max(0, self.cgroup.limit - working_set)
        mine = freed if charged is None else max(0, min(freed, charged))
        return min(self.available + freed, headroom + min(mine, self.cgroup.shmem))

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


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def unescape_mount_field(field: str) -> str:
    """Undo the ``\\ooo`` escapes of space, tab, newline and backslash.

    Used by /proc/self/mountinfo and fstab(5) alike; other (UTF-8) characters
    are left as they are, so non-ASCII paths survive."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def escape_mount_field(field: str) -> str:
    """The inverse of :func:`unescape_mount_field` (for writing fstab lines)."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in field)


_unescape = unescape_mount_field


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
        out.append(Mount(_unescape(rf[1]), _unescape(lf[4]), rf[0], tuple(seen)))
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
    import psutil  # only where mountinfo is missing (~15 ms to import: most commands never need it)

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
        if is_within(real, mp) and (best is None or len(mp) >= len(best.mountpoint)):
            best = m
    return best


def is_mountpoint(path: str | os.PathLike[str]) -> bool:
    return os.path.ismount(path)


def disk_usage(path: str | os.PathLike[str]) -> Usage:
    st = os.statvfs(path)  # shutil.disk_usage's numbers (shutil loads bz2, lzma and zlib)
    return Usage(st.f_blocks * st.f_frsize, (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_bavail * st.f_frsize)


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
        stat2 = _read(dirs[0] / "memory.stat")
        return CgroupMemory(
            2,
            paths[""],
            min(limits) if limits else None,
            _read_int(dirs[0] / "memory.current"),
            _stat_value(stat2, "inactive_file"),
            _stat_value(stat2, "shmem"),
        )
    if "memory" in paths and (root / "memory").is_dir():
        dirs = _ancestors(root / "memory", paths["memory"])
        limits = [v for d in dirs if (v := _read_int(d / "memory.limit_in_bytes")) is not None]
        stat = _read(dirs[0] / "memory.stat") or ""
        for line in stat.splitlines():  # v1 folds parent limits in here
            k, _, v = line.partition(" ")
            if k == "hierarchical_memory_limit" and v.strip().isdigit() and int(v) < _UNLIMITED:
                limits.append(int(v))
        return CgroupMemory(
            1,
            paths["memory"],
            min(limits) if limits else None,
            _read_int(dirs[0] / "memory.usage_in_bytes"),
            _stat_value(stat, "total_inactive_file"),
            _stat_value(stat, "total_shmem"),
        )
    return CgroupMemory(None, None, None, None)


def memory_cgroup_id(proc: str = "/proc") -> str | None:
    """Which memory cgroup this process is in, as "<cgroup ns inode>:v1:<path>" (the v1
    memory controller's line of /proc/self/cgroup) or "<ns>:v2:<path>" (the "0::" line);
    None when unknown.  tmpfs pages are charged to the memory cgroup of the process that
    wrote them, so a dataset's record keeps its stager's (see charged_to)."""
    paths = _cgroup_paths(proc)
    try:
        ns = os.stat(f"{proc}/self/ns/cgroup").st_ino
    except OSError:
        return None
    if "memory" in paths:
        return f"{ns}:v1:{paths['memory']}"
    if "" in paths:
        return f"{ns}:v2:{paths['']}"
    return None


def charged_to(writer: str | None, mine: str | None) -> bool:
    """Are the pages a process in memory cgroup ``writer`` wrote charged to ``mine`` (its
    own cgroup or a descendant, seen from the same cgroup namespace)?  False when either is
    unknown: freeing them is then not counted as memory given back to this cgroup."""
    if not writer or not mine:
        return False
    w_ns, _, w_rest = writer.partition(":")
    m_ns, _, m_rest = mine.partition(":")
    w_ver, _, w_path = w_rest.partition(":")
    m_ver, _, m_path = m_rest.partition(":")
    if w_ns != m_ns or w_ver != m_ver or not w_path.startswith("/"):
        return False
    return w_path == m_path or w_path.startswith(m_path.rstrip("/") + "/")


def _stat_value(text: str | None, key: str) -> int:
    """One counter of a memory.stat file; 0 when absent."""
    for line in (text or "").splitlines():
        k, _, v = line.partition(" ")
        if k == key and v.strip().isdigit():
            return int(v)
    return 0


def _cpu_max(text: str | None) -> float | None:
    """CPUs from a v2 ``cpu.max`` ("150000 100000" -> 1.5; "max 100000" -> None)."""
    parts = (text or "").split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_quota(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs allowed by the CFS quota (e.g. 2.5) on this cgroup or a parent; None when unlimited."""
    root = Path(cgroup_root)
    paths = _cgroup_paths(proc)
    quotas: list[float] = []
    if _is_v2(root) and "" in paths:
        for d in _ancestors(root, paths[""]):
            q = _cpu_max(_read(d / "cpu.max"))
            if q is not None:
                quotas.append(q)
    elif "cpu" in paths:
        # v1 mounts the cpu controller as cpu/, cpu,cpuacct/ or both (one a symlink).
        base = next(
            (root / n for n in ("cpu", "cpu,cpuacct", "cpuacct,cpu") if (root / n).is_dir()), None
        )
        if base is not None:
            for d in _ancestors(base, paths["cpu"]):
                q, p = _read_int(d / "cpu.cfs_quota_us"), _read_int(d / "cpu.cfs_period_us")
                if q is not None and q > 0 and p:
                    quotas.append(q / p)
    return min(quotas) if quotas else None


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (taskset, cpuset cgroup)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse_cpu_list(text: str | None) -> int | None:
    """CPUs in a kernel CPU list (``"0-3,8,10-11"`` -> 7); None when empty or malformed."""
    count = 0
    for part in (text or "").strip().split(","):
        lo, sep, hi = part.partition("-")
        if not lo.strip().isdigit() or (sep and not hi.strip().isdigit()):
            return None
        count += int(hi) - int(lo) + 1 if sep else 1
    return count or None


def container_cpus(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs of this process's cpuset cgroup: what any process of the container may be bound
    to (docker --cpuset-cpus, Kubernetes' static CPU manager, Slurm's step); the online CPUs
    when no cpuset says.  An affinity set narrower than this one was narrowed for this
    process (taskset, torchrun --numa-binding, srun --cpu-bind)."""
    root = Path(cgroup_root)
    paths = _cgroup_paths(proc)
    if _is_v2(root) and "" in paths:
        for d in _ancestors(root, paths[""]):
            n = parse_cpu_list(_read(d / "cpuset.cpus.effective"))
            if n is not None:
                return n
    elif "cpuset" in paths and (root / "cpuset").is_dir():
        for d in _ancestors(root / "cpuset", paths["cpuset"]):
            for name in ("cpuset.effective_cpus", "cpuset.cpus"):
                n = parse_cpu_list(_read(d / name))
                if n is not None:
                    return n
    return parse_cpu_list(_read("/sys/devices/system/cpu/online")) or os.cpu_count() or 1


@dataclass(frozen=True)
class CpuSet:
    """The CPUs a process may use, as the kernel tells them (see :func:`cpu_set`)."""

    affinity: int  # CPUs in the process's affinity mask
    container: int  # CPUs of its cpuset cgroup (container_cpus)
    quota: float | None  # CPUs of the CFS quota on its cgroup path; None when unlimited
    launcher: int | None = None  # CPUs in the parent's affinity mask; None when unknown

    @property
    def bound(self) -> bool:
        """Whether the affinity was narrowed for this process by its launcher: narrower than
        the container's CPUs and than its parent's (torchrun --numa-binding, srun --cpu-bind).
        A mask the launcher has too (``numactl --cpunodebind=0 torchrun``, ``taskset``
        around the launcher, systemd's CPUAffinity=) is every rank's: not bound.  Unknown
        parent: not bound (dividing it among the ranks gives fewer workers, never too many)."""
        return (
            self.launcher is not None
            and self.affinity < self.container
            and self.affinity < self.launcher
        )


def parent_affinity_cpus(proc: str = "/proc") -> int | None:
    """CPUs in the parent process's affinity mask (the launcher of a rank: torchrun,
    slurmstepd); None when the parent is not visible (another PID namespace, hidepid)."""
    ppid = os.getppid()
    if ppid < 1:
        return None
    for line in (_read(f"{proc}/{ppid}/status") or "").splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(line.partition(":")[2])
    return None


def cpu_set(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> CpuSet:
    return CpuSet(
        affinity_cpus(),
        container_cpus(proc, cgroup_root),
        cgroup_cpu_quota(proc, cgroup_root),
        parent_affinity_cpus(proc),
    )


def usable_cpus(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may really use: affinity set, capped by the cgroup quota."""
    n = affinity_cpus()
    quota = cgroup_cpu_quota(proc, cgroup_root)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def memory(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> Memory:
    total, available = node_memory(proc)
    return Memory(total, available, cgroup_memory(proc, cgroup_root))


def node_memory(proc: str = "/proc") -> tuple[int, int]:
    """The node's MemTotal and MemAvailable in bytes, from ``proc``/meminfo (what psutil's
    virtual_memory reports; psutil, ~15 ms to import, only where it would not take them as
    they stand)."""
    fields: dict[str, int] = {}
    for line in (_read(f"{proc}/meminfo") or "").splitlines():
        key, _, rest = line.partition(":")
        value = rest.split()
        if key in ("MemTotal", "MemAvailable") and value and value[0].isdigit():
            fields[key] = int(value[0]) * (1024 if value[1:] == ["kB"] else 1)
    if len(fields) == 2 and 0 < fields["MemAvailable"] <= fields["MemTotal"]:
        return fields["MemTotal"], fields["MemAvailable"]
    # Before Linux 3.14, no /proc, or a value psutil does not take as it stands (0: it
    # estimates; more than the total, as lxcfs may say: it takes MemFree): psutil's answer.
    import psutil

    was, psutil.PROCFS_PATH = psutil.PROCFS_PATH, proc
    try:
        with warnings.catch_warnings():  # fields it would have liked: its guess stands
            warnings.simplefilter("ignore", RuntimeWarning)
            vm = psutil.virtual_memory()
    finally:
        psutil.PROCFS_PATH = was
    return vm.total, vm.available


# --- CPU and limits ---------------------------------------------------------


def cpu_flags(proc: str = "/proc") -> frozenset[str]:
    for line in (_read(f"{proc}/cpuinfo") or "").splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def has_avx2(proc: str = "/proc") -> bool:
    return "avx2" in cpu_flags(proc)


def avx512_flags(proc: str = "/proc") -> tuple[str, ...]:
    """The AVX-512 feature flags (avx512f, avx512bw, ...), sorted; empty when none."""
    return tuple(sorted(f for f in cpu_flags(proc) if f.startswith("avx512")))


_CAP_SYS_ADMIN = 21


def has_cap_sys_admin(proc: str = "/proc") -> bool:
    """Whether this process may mount/remount: CAP_SYS_ADMIN in its effective set.

    Root inside a default Docker container lacks it, so ``euid == 0`` is not enough."""
    for line in (_read(f"{proc}/self/status") or "").splitlines():
        if line.startswith("CapEff:"):
            try:
                return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
            except (IndexError, ValueError):
                break
    return os.geteuid() == 0  # no /proc: fall back to the uid


def memlock_limit() -> int | None:
    """``ulimit -l`` in bytes; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


# --- where data lives -------------------------------------------------------

# Shared or remote file systems: reading a dataset from them is what staging avoids.
# Every FUSE file system counts (gcsfuse, s3fs, rclone, sshfs, blobfuse...): the
# ones datasets live on are almost always remote, and all are slow per file.
NETWORK_FSTYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "beegfs",
        "gpfs",
        "ceph",
        "glusterfs",
        "afs",
        "9p",
        "wekafs",
        "panfs",
        "orangefs",
        "juicefs",
        "fuse",
    }
)


def is_network_fs(fstype: str) -> bool:
    return fstype in NETWORK_FSTYPES or fstype.startswith("fuse.")


@dataclass(frozen=True)
class BlockDevice:
    name: str  # kernel name, e.g. "nvme0n1" (the whole disk, not the partition)
    rotational: bool | None  # None when the kernel does not say


def block_device(path: str | os.PathLike[str], sys_root: str = "/sys") -> BlockDevice | None:
    """The disk under ``path`` and whether it spins; None for network/virtual file systems."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    node = Path(sys_root) / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}"
    try:
        real = node.resolve(strict=True)
    except OSError:
        return None  # no block device: nfs, tmpfs, overlay...
    # A partition's queue/ lives on its parent disk (.../sda/sda1 -> .../sda).
    disk = real if (real / "queue").is_dir() else real.parent
    flag = _read(disk / "queue" / "rotational")
    rotational = None if flag is None or flag.strip() not in ("0", "1") else flag.strip() == "1"
    return BlockDevice(disk.name, rotational)


def _node_list(text: str | None) -> tuple[int, ...] | None:
    """A kernel node list (``"0-1,3"`` -> (0, 1, 3)); None when missing or malformed."""
    if text is None:
        return None
    nodes: list[int] = []
    for part in text.strip().split(","):
        lo, sep, hi = part.partition("-")
        if not lo.strip().isdigit() or (sep and not hi.strip().isdigit()):
            return None
        nodes.extend(range(int(lo), int(hi) + 1) if sep else (int(lo),))
    return tuple(nodes)


@dataclass(frozen=True)
class Numa:
    compute: tuple[int, ...]  # nodes with CPUs and (normal) memory: where a tmpfs spreads
    memory: tuple[int, ...]  # every node with memory, a GPU's HBM included (Grace Hopper)


def numa(sys_root: str = "/sys") -> Numa:
    """The node's NUMA nodes, from sysfs; both () without NUMA there.

    Nodes with memory but no CPU are not ``compute``: on Grace Hopper the GPU's HBM is such a
    node, and a tmpfs interleaved onto it would eat GPU memory."""
    base = Path(sys_root) / "devices" / "system" / "node"
    cpus = _node_list(_read(base / "has_cpu"))
    memory = _node_list(_read(base / "has_memory"))
    normal = _node_list(_read(base / "has_normal_memory")) or memory
    if cpus is None or memory is None or normal is None:  # an old kernel: every node*/ directory
        try:
            names = os.listdir(base)
        except OSError:
            return Numa((), ())
        nodes = tuple(sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit()))
        return Numa(nodes, nodes)
    return Numa(tuple(n for n in cpus if n in normal), memory)
