"""The verdicts of ``shmstage inspect``: the node facts it judges, as typed values (the JSON
schema of docs/inspect.md), and one OK/WARN/FAIL ``Check`` per fact with the advice to act on.
Judges what :mod:`shmstage.inspection` gathered; reads nothing but whether it may remount.
"""

from __future__ import annotations

from dataclasses import dataclass

from shmstage import capacity, system
from shmstage.sizes import format_size

SMALL_SHM = 1 << 30  # below this DataLoader workers die with "Bus error" (Docker's default is 64M)
OK, WARN, FAIL = "OK", "WARN", "FAIL"
RANK = {OK: 0, WARN: 1, FAIL: 2}  # verdicts, best first: the report's verdict is the worst


@dataclass(frozen=True)
class Check:
    name: str  # shm | memory | cpu | memlock | pillow | torch | dataset | fit
    verdict: str  # OK | WARN | FAIL
    detail: str
    advice: str | None  # what to do about it; None when OK


@dataclass(frozen=True)
class ShmInfo:
    path: str
    exists: bool
    mountpoint: str | None  # the mount that holds path
    fstype: str | None
    is_mountpoint: bool  # path itself is that mount's root
    memory_backed: bool  # tmpfs or ramfs
    size: int | None  # bytes (statvfs); None when path does not exist
    used: int | None
    free: int | None
    options: tuple[str, ...]


@dataclass(frozen=True)
class MemoryInfo:
    total: int  # physical RAM
    available: int  # MemAvailable
    usable: int  # min(available, cgroup limit - (cgroup usage - reclaimable page cache))
    ceiling: int  # min(RAM, cgroup limit): what a tmpfs can ever hold here
    cgroup_version: int | None  # 1, 2, None = no memory cgroup found
    cgroup_path: str | None
    cgroup_limit: int | None  # None = unlimited
    cgroup_usage: int | None
    cgroup_reclaimable: int = 0  # inactive page cache in cgroup_usage (the kernel drops it first)


@dataclass(frozen=True)
class CpuInfo:
    usable: int  # affinity, capped by the CFS quota
    affinity: int
    quota: float | None  # CPUs allowed by the cgroup CPU quota; None = unlimited
    machine: str  # x86_64, aarch64...
    avx2: bool
    avx512: tuple[str, ...]  # avx512f, avx512bw, ...


@dataclass(frozen=True)
class PillowInfo:
    flavor: str  # Pillow | pillow-simd | conflict | none | unknown
    version: str | None
    libjpeg_turbo: bool | None
    avx2_build: bool | None  # what shmstage's build record says was asked for
    ok: bool
    next_step: str | None
    avx2: str = "unverified"  # verified | absent | unverified: AVX2 code in PIL/_imaging
    avx2_instructions: int | None = None  # how many objdump found


@dataclass(frozen=True)
class TorchInfo:
    installed: bool
    version: str | None
    cuda_build: str | None  # torch.version.cuda; None for a CPU-only build
    cuda_available: bool
    devices: tuple[str, ...]  # GPU names
    error: str | None  # when torch is installed but does not import


@dataclass(frozen=True)
class DatasetInfo:
    path: str
    bytes: int  # apparent size of the data (hard links once; an archive: extracted)
    files: int
    unreadable: int  # directories/files that could not be read
    mountpoint: str | None
    fstype: str | None
    device: str | None  # mount source: /dev/nvme0n1p1, server:/export, ...
    block_device: str | None  # the disk, e.g. nvme0n1; None for network/virtual file systems
    rotational: bool | None
    network: bool
    dest: str  # where it would be staged
    fit: capacity.Fit
    kind: str = "dir"  # "dir" or "tar"
    page_bytes: int = 0  # what it takes staged in dest (whole pages): the fit check's "needed"
    inodes: int = 0  # inodes it takes staged: files, hard links, directories, symlinks
    page_size: int = 0  # the allocation unit page_bytes was rounded to


# --- verdicts ---------------------------------------------------------------


def _yes(flag: bool | None) -> str:
    return "unknown" if flag is None else ("yes" if flag else "no")


def _grow_advice(mountpoint: str, size: str) -> str:
    if system.has_cap_sys_admin():
        return f"grow it: shmstage remount --path {mountpoint} --size {size}"
    return (
        "restart the container with a bigger /dev/shm: docker run --shm-size=16g, or on "
        "Kubernetes an emptyDir {medium: Memory, sizeLimit: 16Gi} mounted at /dev/shm"
    )


def check_shm(shm: ShmInfo, mem: MemoryInfo) -> Check:
    if not shm.exists:
        return Check(
            "shm",
            FAIL,
            f"{shm.path} does not exist",
            "pass the tmpfs to use with --path (usually /dev/shm)",
        )
    where = shm.path if shm.is_mountpoint else f"{shm.path} (on {shm.mountpoint})"
    if not shm.memory_backed:
        return Check(
            "shm",
            FAIL,
            f"{where} is {shm.fstype or 'on an unknown file system'}, not RAM-backed tmpfs",
            "point --path at a tmpfs such as /dev/shm",
        )
    assert shm.size is not None and shm.used is not None and shm.free is not None
    opts = ",".join(shm.options)
    detail = (
        f"{where}: {shm.fstype} {format_size(shm.size)}, {format_size(shm.used)} used, "
        f"{format_size(shm.free)} free ({opts})"
    )
    mp = shm.mountpoint or shm.path
    if shm.size == 0:  # statvfs of a tmpfs mounted with size=0
        return Check(
            "shm",
            WARN,
            f"{where}: {shm.fstype} without a size limit ({opts})",
            f"filling it can exhaust RAM; mount it with a size: mount -t tmpfs -o size=50% tmpfs {mp}",
        )
    if shm.size < SMALL_SHM:
        return Check(
            "shm", WARN, detail + "; too small for DataLoader workers", _grow_advice(mp, "50%")
        )
    if shm.size > mem.ceiling:
        return Check(
            "shm",
            WARN,
            detail + f"; bigger than the {format_size(mem.ceiling)} this node/cgroup can hold",
            f"filling it would OOM-kill; shrink it: shmstage remount --path {mp} --size 90%",
        )
    return Check("shm", OK, detail, None)


def check_memory(mem: MemoryInfo) -> Check:
    detail = f"RAM {format_size(mem.total)}, {format_size(mem.available)} available"
    if mem.cgroup_version is None:
        return Check("memory", OK, detail + "; no memory cgroup", None)
    used = "" if mem.cgroup_usage is None else f", {format_size(mem.cgroup_usage)} used"
    if mem.cgroup_usage is not None and mem.cgroup_reclaimable:
        used += f" ({format_size(mem.cgroup_reclaimable)} of it reclaimable page cache)"
    if mem.cgroup_limit is None:
        return Check("memory", OK, detail + f"; cgroup v{mem.cgroup_version} no limit{used}", None)
    detail += f"; cgroup v{mem.cgroup_version} limit {format_size(mem.cgroup_limit)}{used}"
    if mem.cgroup_limit < mem.total:
        return Check(
            "memory",
            WARN,
            detail + "; tmpfs pages count against the limit of the cgroup that writes them",
            "make the memory limit cover the staged data plus training, or stage from outside this cgroup",
        )
    return Check("memory", OK, detail, None)


def check_cpu(cpu: CpuInfo) -> Check:
    quota = "no quota" if cpu.quota is None else f"quota {cpu.quota:g}"
    detail = f"{cpu.usable} usable (affinity {cpu.affinity}, {quota})"
    if cpu.machine not in ("x86_64", "amd64", "i686", "i386"):
        return Check("cpu", OK, detail + f"; {cpu.machine}: no AVX", None)
    avx512 = f"yes ({len(cpu.avx512)} flags)" if cpu.avx512 else "no"
    detail += f"; AVX2 {_yes(cpu.avx2)}, AVX-512 {avx512}"
    if not cpu.avx2:
        return Check("cpu", WARN, detail, "no AVX2: build pillow-simd without it (SSE4 only)")
    return Check("cpu", OK, detail, None)


def check_memlock(limit: int | None) -> Check:
    if limit is None:
        return Check("memlock", OK, "ulimit -l unlimited", None)
    return Check(
        "memlock",
        WARN,
        f"ulimit -l {format_size(limit)}",
        "NCCL over InfiniBand/RDMA needs locked memory: ulimit -l unlimited "
        "(docker: --ulimit memlock=-1; systemd: LimitMEMLOCK=infinity)",
    )


def check_pillow(p: PillowInfo) -> Check:
    if p.flavor == "unknown":
        return Check(
            "pillow",
            WARN,
            "could not check Pillow",
            p.next_step or "run shmstage pillow-simd --check",
        )
    if p.flavor == "none":
        return Check("pillow", WARN, "no Pillow installed", p.next_step)
    detail = (
        f"{p.flavor} {p.version or '?'}, libjpeg-turbo {_yes(p.libjpeg_turbo)}, "
        f"AVX2 build {_yes(p.avx2_build)}, AVX2 code {p.avx2}"
        + (f" ({p.avx2_instructions} instructions)" if p.avx2_instructions is not None else "")
    )
    return Check("pillow", OK if p.ok else WARN, detail, None if p.ok else p.next_step)


def check_torch(t: TorchInfo) -> Check:
    if not t.installed:
        return Check(
            "torch",
            WARN,
            "torch not installed",
            "pip install torch (needed by shmstage's loader helpers)",
        )
    if t.error:
        return Check(
            "torch",
            FAIL,
            f"torch does not import: {t.error}",
            "reinstall torch in this environment",
        )
    if t.cuda_available:
        names = sorted(set(t.devices))
        gpus = f"{len(t.devices)} GPU{'s' if len(t.devices) != 1 else ''} ({', '.join(names)})"
        return Check("torch", OK, f"torch {t.version}, CUDA {t.cuda_build}, {gpus}", None)
    if t.cuda_build is None:
        return Check(
            "torch",
            WARN,
            f"torch {t.version}: CPU-only build",
            "install a CUDA build of torch to train on GPUs",
        )
    return Check(
        "torch",
        WARN,
        f"torch {t.version}, CUDA {t.cuda_build} build, no GPU visible",
        "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES",
    )


def check_dataset(d: DatasetInfo) -> list[Check]:
    from shmstage.stage.sources.kinds import LISTED_KINDS

    kind = []
    if d.kind in LISTED_KINDS:
        kind.append("object store")
    elif d.network:
        kind.append("network file system")
    elif d.fstype in capacity.MEMORY_BACKED:
        kind.append("already in RAM")
    elif d.rotational is not None:
        kind.append("rotational disk" if d.rotational else "SSD")
    where = f"{d.fstype or '?'} {d.device or '?'}" + (f" ({', '.join(kind)})" if kind else "")
    archive = " (tar archive, extracted size)" if d.kind == "tar" else ""
    detail = f"{d.path}: {format_size(d.bytes)} in {d.files:,} files{archive} on {where}"
    if d.unreadable:
        dataset = Check(
            "dataset",
            WARN,
            detail + f"; {d.unreadable:,} entries unreadable",
            f"staging needs to read everything: run as a user who can read all of {d.path}",
        )
    else:
        dataset = Check("dataset", OK, detail, None)
    fit = d.fit
    if fit.fits:
        free = format_size(fit.free)
        detail = (
            f"fits in {d.dest}: needs {capacity.describe(fit.needed, d.files, d.inodes)} + "
            f"{format_size(fit.reserve)} reserve, {free} free"
        )
        return [dataset, Check("fit", OK, detail, None)]
    if fit.suggested_size:
        where = f" --path {fit.mountpoint}" if fit.mountpoint not in (None, "/dev/shm") else ""
        advice = f"shmstage remount{where} --size {fit.suggested_size}, then stage"
    elif fit.fstype in capacity.MEMORY_BACKED:
        advice = "stage to local disk with --dest, or free memory / raise the memory limit"
    else:
        advice = "free space there or stage elsewhere with --dest"
    return [dataset, Check("fit", FAIL, f"does not fit in {d.dest}: {fit.reason}", advice)]


# Which advice wins the one "next step" line when several checks complain.
_PRIORITY = ("fit", "shm", "dataset", "memory", "torch", "pillow", "cpu", "memlock")


def next_step(checks: tuple[Check, ...], dataset: str | None) -> str:
    bad = [c for c in checks if c.verdict != OK and c.advice]
    if bad:
        worst = max(RANK[c.verdict] for c in bad)
        top = min(
            (c for c in bad if RANK[c.verdict] == worst), key=lambda c: _PRIORITY.index(c.name)
        )
        return top.advice or ""
    if dataset:
        return f"ready: shmstage stage {dataset}"
    return "ready: check a dataset fits with shmstage inspect --dataset DIR"
