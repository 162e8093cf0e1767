"""``inspect``: one report on what matters before staging, with OK/WARN/FAIL verdicts.

:func:`inspect_node` gathers facts (from :mod:`shmstage.system`, Pillow, torch)
into a :class:`NodeReport`; its JSON form is a stable schema (docs/inspect.md)
that scripts and the Ansible role read.  Only reads; changes nothing.  The fact types
and the checks that judge them are in :mod:`shmstage.verdicts` (importable from here).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
import socket
from dataclasses import dataclass

from shmstage import __version__, capacity, system
from shmstage.errors import RefusedError
from shmstage.verdicts import (
    FAIL,
    OK,
    RANK,
    SMALL_SHM,
    WARN,
    Check,
    CpuInfo,
    DatasetInfo,
    MemoryInfo,
    PillowInfo,
    ShmInfo,
    TorchInfo,
    check_cpu,
    check_dataset,
    check_memlock,
    check_memory,
    check_pillow,
    check_shm,
    check_torch,
    next_step,
)

__all__ = [
    "FAIL",
    "OK",
    "SCHEMA_VERSION",
    "SMALL_SHM",
    "WARN",
    "Check",
    "CpuInfo",
    "DatasetInfo",
    "MemoryInfo",
    "NodeReport",
    "PillowInfo",
    "ShmInfo",
    "TorchInfo",
    "check_cpu",
    "check_dataset",
    "check_memlock",
    "check_memory",
    "check_pillow",
    "check_shm",
    "check_torch",
    "cpu_info",
    "dataset_info",
    "default_dest",
    "inspect_node",
    "memory_info",
    "next_step",
    "pillow_info",
    "shm_info",
    "torch_info",
    "walk",
]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class NodeReport:
    schema_version: int
    shmstage_version: str
    hostname: str
    shm: ShmInfo
    memory: MemoryInfo
    cpu: CpuInfo
    memlock: int | None  # `ulimit -l` in bytes; None = unlimited
    pillow: PillowInfo
    torch: TorchInfo
    dataset: DatasetInfo | None
    checks: tuple[Check, ...]
    verdict: str  # the worst verdict of all checks
    next_step: str  # one line: what to do now

    @property
    def fits(self) -> bool | None:
        """Whether --dataset fits (None without one): ``inspect`` exits 1 when it does not."""
        return None if self.dataset is None else self.dataset.fit.fits


# --- facts ------------------------------------------------------------------


def shm_info(path: str) -> ShmInfo:
    if not os.path.exists(path):
        return ShmInfo(path, False, None, None, False, False, None, None, None, ())
    real = os.path.realpath(path)
    mount = system.mount_of(real)
    usage = system.disk_usage(real)
    return ShmInfo(
        path=path,
        exists=True,
        mountpoint=mount.mountpoint if mount else None,
        fstype=mount.fstype if mount else None,
        is_mountpoint=bool(mount and mount.mountpoint == real),
        memory_backed=bool(mount and mount.fstype in capacity.MEMORY_BACKED),
        size=usage.total,
        used=usage.used,
        free=usage.free,
        options=mount.opts if mount else (),
    )


def memory_info(mem: system.Memory) -> MemoryInfo:
    cg = mem.cgroup
    return MemoryInfo(
        mem.total,
        mem.available,
        mem.usable,
        mem.ceiling,
        cg.version,
        cg.path,
        cg.limit,
        cg.usage,
        cg.reclaimable,
    )


def cpu_info() -> CpuInfo:
    return CpuInfo(
        usable=system.usable_cpus(),
        affinity=system.affinity_cpus(),
        quota=system.cgroup_cpu_quota(),
        machine=platform.machine(),
        avx2=system.has_avx2(),
        avx512=system.avx512_flags(),
    )


def pillow_info() -> PillowInfo:
    from shmstage import pillow

    try:
        st = pillow.check()
    except Exception as e:  # a broken PIL must not break the whole report
        return PillowInfo("unknown", None, None, None, False, f"could not check Pillow: {e}")
    return PillowInfo(
        st.flavor,
        st.version,
        st.libjpeg_turbo,
        st.avx2_build,
        st.ok,
        st.next_step,
        st.avx2,
        st.avx2_instructions,
    )


def torch_info() -> TorchInfo:
    # torch is optional and slow to import: look for it first, import only if present.
    try:
        present = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        present = False
    if not present:
        return TorchInfo(False, None, None, False, (), None)
    try:
        import torch

        available = bool(torch.cuda.is_available())
        names = (
            tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
            if available
            else ()
        )
        return TorchInfo(True, str(torch.__version__), torch.version.cuda, available, names, None)
    except Exception as e:  # a broken install (missing libs, bad driver) is a finding, not a crash
        return TorchInfo(True, None, None, False, (), f"{type(e).__name__}: {e}".splitlines()[0])


def walk(path: str) -> tuple[int, int, int]:
    """(bytes, files, unreadable) under ``path``, counted by the staging estimator
    (:func:`shmstage.stage.build.estimate.estimate`: lstat, hard links once, symlinks not followed)."""
    if not os.path.isdir(path):
        return os.path.getsize(path), 1, 0
    from shmstage.stage.build.estimate import estimate

    est = estimate(path)
    return est.bytes, est.files, est.unreadable


def default_dest(path: str) -> str:
    """Where ``stage`` would put data: ``$SHMSTAGE_DEST`` or its default for /dev/shm, else
    PATH/shmstage."""
    if os.path.normpath(path) != "/dev/shm":
        return os.path.join(path, "shmstage")
    from shmstage.stage import resolve_dest

    return resolve_dest(None)


def dataset_info(
    path: str, dest: str, mem: system.Memory, reserve: int | None = None
) -> DatasetInfo:
    from shmstage.stage.sources.kinds import is_url

    if is_url(path):
        return _object_store_info(path, dest, mem, reserve)
    if not os.path.exists(path):
        raise RefusedError(
            f"dataset {path} does not exist; give the directory to stage with --dataset"
        )
    if not os.access(path, os.R_OK):
        raise RefusedError(
            f"cannot read dataset {path}: permission denied; run as a user who can read it"
        )
    from shmstage.stage.build.estimate import estimate  # the same numbers stage checks

    real = os.path.realpath(path)
    est = estimate(real, dest)
    mount = system.mount_of(real)
    disk = system.block_device(real)
    fstype = mount.fstype if mount else None
    return DatasetInfo(
        path=path,
        bytes=est.bytes,
        files=est.files,
        unreadable=est.unreadable,
        mountpoint=mount.mountpoint if mount else None,
        fstype=fstype,
        device=mount.device if mount else None,
        block_device=disk.name if disk else None,
        rotational=disk.rotational if disk else None,
        network=bool(fstype and system.is_network_fs(fstype)),
        dest=dest,
        fit=capacity.check_fit(est.page_bytes, dest, reserve, memory=mem, inodes=est.inodes),
        kind=est.kind,
        page_bytes=est.page_bytes,
        inodes=est.inodes,
        page_size=est.page_size,
    )


def _object_store_info(url: str, dest: str, mem: system.Memory, reserve: int | None) -> DatasetInfo:
    """An object-store prefix, measured by one LIST with the estimator stage checks against."""
    from shmstage.stage.build.estimate import estimate
    from shmstage.stage.sources import kinds as sources

    est = estimate(url, dest)
    endpoint = sources.open_listed(est.kind, est.source).endpoint  # no request: names it
    return DatasetInfo(
        path=url, bytes=est.bytes, files=est.files, unreadable=0, mountpoint=None,
        fstype=est.kind, device=endpoint, block_device=None, rotational=None, network=True, dest=dest,
        fit=capacity.check_fit(est.page_bytes, dest, reserve, memory=mem, inodes=est.inodes),
        kind=est.kind, page_bytes=est.page_bytes, inodes=est.inodes, page_size=est.page_size,
    )  # fmt: skip


def inspect_node(
    path: str = "/dev/shm",
    dataset: str | None = None,
    *,
    dest: str | None = None,
    reserve: int | None = None,
) -> NodeReport:
    """Everything ``shmstage inspect`` reports, with verdicts.

    Raises :class:`RefusedError` when ``dataset`` is given but does not exist;
    anything wrong with ``path`` is a FAIL check, not an exception."""
    mem = system.memory()
    memory = memory_info(mem)
    shm = shm_info(path)
    cpu = cpu_info()
    memlock = system.memlock_limit()
    data = dataset_info(dataset, dest or default_dest(path), mem, reserve) if dataset else None
    pillow = pillow_info()
    torch = torch_info()
    checks = [
        check_shm(shm, memory),
        check_memory(memory),
        check_cpu(cpu),
        check_memlock(memlock),
        check_pillow(pillow),
        check_torch(torch),
    ]
    if data is not None:
        checks += check_dataset(data)
    verdict = max((c.verdict for c in checks), key=RANK.__getitem__)
    return NodeReport(
        schema_version=SCHEMA_VERSION,
        shmstage_version=__version__,
        hostname=socket.gethostname(),
        shm=shm,
        memory=memory,
        cpu=cpu,
        memlock=memlock,
        pillow=pillow,
        torch=torch,
        dataset=data,
        checks=tuple(checks),
        verdict=verdict,
        next_step=next_step(tuple(checks), dataset),
    )
