"""``shmstage demo``: the whole flow on a synthetic dataset, measured.

Generates a JPEG dataset on disk, stages it, and trains a tiny CNN twice through
``shmstage run`` (once reading the original, once the staged copy), so a new user
sees what staging and the loader settings do on their own node in about a minute.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from shmstage import system
from shmstage.capacity import MEMORY_BACKED, check_fit
from shmstage.demo.dataset import GeneratedDataset, generate
from shmstage.errors import RefusedError, ShmstageError
from shmstage.sizes import format_size

DEFAULT_IMAGES = 1200  # ~100 MiB; more than one epoch of the default steps, so no epoch restarts
DEFAULT_STEPS = 30
DEFAULT_BATCH = 32
WORKDIR_BASE = "/var/tmp"  # on disk: /tmp is a tmpfs on many systems, which would hide the gain
_MARKER = ".shmstage-demo.json"


@dataclass(frozen=True)
class TrainResult:
    data: str  # the dataset folder the job read
    steps: int  # measured steps
    warmup_steps: int  # unmeasured steps before them (worker start-up)
    batch_size: int
    images: int  # images trained in the measured steps
    seconds: float  # time of the measured steps
    wait_seconds: float  # of which spent waiting for the next batch
    images_per_s: float  # images / seconds
    stall_share: float  # wait time / step time over the measured steps
    num_workers: int  # loader settings make_loader chose
    pin_memory: bool
    prefetch_factor: int | None  # None without workers
    device: str  # where the model ran ("cpu", "cuda")
    device_name: str  # the GPU's name, or "cpu"
    loss_first: float  # training loss of the first and last step
    loss_last: float


@dataclass(frozen=True)
class NodeFacts:
    cpus: int  # usable CPUs (affinity and cgroup quota)
    memory_usable: int  # bytes of RAM this cgroup can still get
    shm_total: int | None  # /dev/shm size and free bytes (None: no /dev/shm)
    shm_free: int | None
    accelerator: str | None  # GPU name, None without one
    root: bool


@dataclass(frozen=True)
class InspectFacts:
    verdict: str  # worst check of `shmstage inspect --dataset`: OK | WARN | FAIL
    findings: tuple[str, ...]  # "name: detail" of every check that is not OK
    fit: str | None  # the fit check's detail for the dataset


@dataclass(frozen=True)
class PillowFacts:
    flavor: str  # "Pillow" | "pillow-simd" | "conflict" | "none"
    version: str | None
    libjpeg_turbo: bool | None
    cpu_avx2: bool  # the CPU has AVX2 (pillow-simd can use it)
    ok: bool  # the fast build is active
    next_step: str  # what to do about it


@dataclass(frozen=True)
class StagingFacts:
    dest: str  # the dataset's staged path
    dest_fstype: str
    fallback: str | None  # why the default destination was not used
    seconds: float  # staging time
    bytes: int
    files: int
    bytes_per_s: float


@dataclass(frozen=True)
class DemoRun:
    label: str  # "original" | "staged"
    command: str  # the shmstage run command line, as a user would type it
    cached_share: float | None  # share of the data in the page cache just before the run
    result: TrainResult  # what the training job measured


@dataclass(frozen=True)
class DemoReport:
    workdir: str  # where the dataset was generated
    kept: bool  # --keep: the dataset and the staged copy were left in place
    node: NodeFacts
    inspect: InspectFacts | None  # None when the inspection could not run
    pillow: PillowFacts
    dataset: GeneratedDataset
    source_fstype: str  # file system of the original (ext4, xfs, tmpfs...)
    staging: StagingFacts
    cold: bool  # the original's pages were evicted before its run (default; --warm keeps them)
    original: DemoRun  # training read the original
    staged: DemoRun  # training read the staged copy
    speedup: float  # staged images/s / original images/s
    notes: tuple[str, ...]  # what was skipped or changed, and why
    next_steps: tuple[str, ...]  # what to do next, from these measurements


# --- page cache -----------------------------------------------------------------


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


def cached_share(paths: Sequence[str]) -> float | None:
    """The share of these files' pages in the page cache (mincore), None if it cannot be read."""
    try:
        libc = _libc()
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: touches no page
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            pages = (size + page - 1) // page
            vec = ctypes.create_string_buffer(pages)
            ok = libc.mincore(addr, size, vec) == 0
            libc.munmap(addr, size)
            if not ok:
                return None
            resident += sum(b & 1 for b in vec.raw)
            total += pages
        finally:
            os.close(fd)
    return resident / total if total else None


def evict_from_page_cache(paths: Sequence[str]) -> None:
    """Drop these files' clean pages from the page cache (no root needed; other files untouched)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --- steps ----------------------------------------------------------------------


def node_facts() -> NodeFacts:
    """CPUs, memory and /dev/shm (the GPU, if any, is filled in from the training job)."""
    shm_total = shm_free = None
    with contextlib.suppress(OSError):
        usage = system.disk_usage("/dev/shm")
        shm_total, shm_free = usage.total, usage.free
    return NodeFacts(
        cpus=system.usable_cpus(),
        memory_usable=system.memory().usable,
        shm_total=shm_total,
        shm_free=shm_free,
        accelerator=None,
        root=os.geteuid() == 0,
    )


def inspect_facts(dataset: str) -> InspectFacts | None:
    """What `shmstage inspect --dataset` says about this node and the generated dataset."""
    try:
        from shmstage.inspection import inspect_node

        report = inspect_node(dataset=dataset)
    except (ImportError, ShmstageError):
        return None
    findings = tuple(f"{c.name}: {c.detail}" for c in report.checks if c.verdict != "OK")
    fit = next((c.detail for c in report.checks if c.name == "fit"), None)
    return InspectFacts(report.verdict, findings, fit)


def pillow_facts() -> PillowFacts:
    from shmstage.pillow import check

    s = check()
    return PillowFacts(s.flavor, s.version, s.libjpeg_turbo, s.cpu_avx2, s.ok, s.next_step)


def _fstype(path: str) -> str:
    mount = system.mount_of(path)
    return mount.fstype if mount else "unknown"


def _writable_dir(path: str) -> bool:
    """Could we create ``path`` (or write into it, if it exists)?"""
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return False
        probe = parent
    return os.path.isdir(probe) and os.access(probe, os.W_OK | os.X_OK)


def choose_dest(needed: int, workdir: str) -> tuple[str, str | None]:
    """The staging root: shmstage's default when usable, else a private tmpfs dir, else disk; and why."""
    from shmstage.stage import DEFAULT_DEST

    default = os.environ.get("SHMSTAGE_DEST") or DEFAULT_DEST
    if not _writable_dir(default):
        why = f"{default} is not writable by this user"
    else:
        fit = check_fit(needed, default)
        if fit.fits:
            return default, None
        why = f"{default}: {fit.reason}"
    if (
        default.startswith("/dev/shm")
        and _writable_dir("/dev/shm")
        and check_fit(needed, "/dev/shm").fits
    ):
        return tempfile.mkdtemp(prefix="shmstage-demo-", dir="/dev/shm"), why
    why += "; staging to local disk instead (no gain expected)"
    return os.path.join(workdir, "staged"), why


def _shmstage_cmd() -> list[str]:
    return [sys.executable, "-m", "shmstage"]


def _shown(argv: Sequence[str]) -> str:
    """A command line as a user would type it (``shmstage``/``python`` instead of full paths)."""
    out = list(argv)
    if out[:3] == _shmstage_cmd():
        out[:3] = ["shmstage"]
    return " ".join("python" if a == sys.executable else a for a in out)


def train_through_run(
    data_arg: str,
    *,
    label: str,
    stage_spec: str | None,
    steps: int,
    batch_size: int,
    out_dir: str,
    env: dict[str, str],
    log: Callable[[str], None],
) -> tuple[str, TrainResult]:
    """Run the demo trainer under ``shmstage run`` in a subprocess; its measured result."""
    json_out = os.path.join(out_dir, f"train-{label}.json")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(json_out)  # a kept workdir may hold the last run's result
    run_args = ["run"] + (["--stage", stage_spec] if stage_spec else [])
    job = [sys.executable, "-m", "shmstage.demo.train", "--data", data_arg, "--steps", str(steps)]
    job += ["--batch-size", str(batch_size), "--json-out", json_out]
    argv = [*_shmstage_cmd(), *run_args, "--", *job]
    shown = _shown(argv[:-2])  # without --json-out, an implementation detail
    log(f"demo: training on the {label} data: {shown}")
    proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(json_out):
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise ShmstageError(
            f"the {label} training run failed (exit {proc.returncode}): {tail or 'no output'}"
        )
    with open(json_out) as f:
        return shown, TrainResult(**json.load(f))


def _next_steps(
    original: DemoRun,
    staged: DemoRun,
    speedup: float,
    pillow: PillowFacts,
    staging: StagingFacts,
    busy: bool,
) -> list[str]:
    """What a user should do next, read off these measurements."""
    steps = []
    cached = original.cached_share
    if speedup >= 1.10:
        text = (
            f"Staging made training {speedup:.2f}x faster here: stage your own data the same way."
        )
        if busy:
            text += " (The node was busy: re-run to confirm.)"
        steps.append(text)
    elif cached is not None and cached > 0.5:
        steps.append(
            "No gain expected here: the original was already in the page cache (both runs read RAM); "
            "staging pays when data comes from NFS, Lustre or a cold disk: run `shmstage demo` without --warm."
        )
    elif busy:
        steps.append(
            "Other processes were using the CPU: re-run `shmstage demo` when the node is idle."
        )
    else:
        steps.append(
            "Reading was not the limit here (local disk is fast enough for this job); the gain "
            "shows on NFS, Lustre or busy disks, and in later epochs when RAM is short."
        )
    result = staged.result
    if result.stall_share >= 0.10:
        steps.append(
            f"Training still waited for data {result.stall_share:.0%} of each step on the staged copy: "
            f"JPEG decoding on {_workers(result.num_workers)} is the limit; measure worker counts "
            "with `shmstage bench loader --data DIR`."
        )
    if not pillow.ok or pillow.flavor != "pillow-simd":
        steps.append(
            f"Faster decoding: {pillow.next_step}."
            if pillow.next_step
            else "Faster decoding: see docs/pillow-simd.md."
        )
    if staging.fallback:
        steps.append(
            "Make room in /dev/shm: `shmstage inspect`, then `shmstage remount --size ...` (root)."
        )
    steps.append(
        "Your data: `shmstage run --stage /path/to/data -- torchrun --nproc-per-node N train.py "
        "--data {staged}` (docs/quickstart.md)."
    )
    return steps


def _workers(n: int) -> str:
    return f"{n} loader worker" if n == 1 else f"{n} loader workers"


def _busy_note(load: float, cpus: int) -> str | None:
    """A note when other processes competed for the CPU during the runs (timings are then noisy)."""
    # The demo itself keeps about two CPUs busy (the trainer and one loader worker).
    if load <= 1.5 * cpus + 1:
        return None
    return (
        f"the node was busy (load average {load:.1f} on {cpus} CPUs), so images/s are noisy: "
        "compare the data wait per step, or re-run when the node is idle"
    )


def _prepare_dataset(workdir: str, images: int, log: Callable[[str], None]) -> GeneratedDataset:
    """Generate the dataset, or reuse one a previous ``--keep`` run left in this workdir."""
    path = os.path.join(workdir, "dataset")
    marker = os.path.join(workdir, _MARKER)
    with contextlib.suppress(OSError, ValueError, TypeError):
        with open(marker) as f:
            saved = GeneratedDataset(**json.load(f))
        if saved.images == images and saved.path == path and os.path.isdir(path):
            log(f"demo: reusing the dataset in {path}")
            return saved
    if os.path.exists(path):
        if not os.path.exists(marker):  # not ours: never delete someone's data
            raise RefusedError(
                f"{path} already exists and was not made by shmstage demo: "
                "pass another --workdir (or an empty one)"
            )
        shutil.rmtree(path)  # an earlier demo's dataset of another size
    log(f"demo: generating {images:,} synthetic JPEGs in {path}")
    ds = generate(
        path,
        images=images,
        progress=lambda done, total: (
            log(f"demo:   {done:,}/{total:,} images") if done % 500 == 0 else None
        ),
    )
    with open(marker, "w") as f:
        json.dump(dataclasses.asdict(ds), f)
    return ds


def run_demo(
    *,
    images: int = DEFAULT_IMAGES,
    steps: int = DEFAULT_STEPS,
    batch_size: int = DEFAULT_BATCH,
    workdir: str | None = None,
    keep: bool = False,
    cold: bool = True,
    log: Callable[[str], None] = lambda _msg: None,
) -> DemoReport:
    """Generate, stage, train from the original and from the staged copy; clean up unless ``keep``."""
    if images < batch_size:
        raise ShmstageError(
            f"--images must be at least the batch size ({batch_size}); got {images}"
        )
    if steps < 1:
        raise ShmstageError(f"--steps must be at least 1; got {steps}")
    # found, not imported: torch loads in the training jobs, not here (seconds saved)
    missing = [m for m in ("numpy", "PIL", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        raise ShmstageError(f"the demo needs {', '.join(missing)}: pip install 'shmstage[torch]'")

    created = workdir is None
    if workdir is None:
        base = WORKDIR_BASE if _writable_dir(WORKDIR_BASE) else tempfile.gettempdir()
        workdir = tempfile.mkdtemp(prefix="shmstage-demo-", dir=base)
    else:
        workdir = os.path.abspath(workdir)
        created = not os.path.exists(workdir)
        os.makedirs(workdir, exist_ok=True)
    staged_root: str | None = None
    # one name per work directory: a re-run with --keep reuses its staged copy
    staged_name = "shmstage-demo-" + hashlib.sha256(workdir.encode()).hexdigest()[:8]
    owned: list[str] = []  # what this run created (the rest of a given --workdir stays)
    notes: list[str] = []
    try:
        node = node_facts()
        log(f"demo: node: {node.cpus} CPUs, {format_size(node.memory_usable)} RAM usable")
        pillow = pillow_facts()
        dataset = _prepare_dataset(workdir, images, log)
        owned += [dataset.path, os.path.join(workdir, _MARKER)]
        owned += [os.path.join(workdir, f"train-{label}.json") for label in ("original", "staged")]
        log(
            f"demo: inspecting the node and the dataset (shmstage inspect --dataset {dataset.path})"
        )
        inspection = inspect_facts(dataset.path)
        source_fstype = _fstype(dataset.path)
        if source_fstype in MEMORY_BACKED:
            notes.append(
                f"the work directory is on {source_fstype} (RAM), so the original is read from RAM too"
            )
        files = [str(p) for p in Path(dataset.path).rglob("*.jpg")]

        env = dict(os.environ)
        out_dir = workdir
        if cold:
            log("demo: evicting the dataset's pages from the page cache so the original run reads from disk")
            evict_from_page_cache(files)
        cached = cached_share(files)
        shown, original = train_through_run(
            dataset.path,
            label="original",
            stage_spec=None,
            steps=steps,
            batch_size=batch_size,
            out_dir=out_dir,
            env=env,
            log=log,
        )
        original_run = DemoRun("original", shown, cached, original)
        load = os.getloadavg()[0]

        staged_root, fallback = choose_dest(dataset.bytes, workdir)
        if fallback:
            notes.append(f"staged outside the default destination: {fallback}")
        if fallback:  # a directory made for this run only
            owned.append(staged_root)
        log(f"demo: staging {format_size(dataset.bytes)} into {staged_root}")
        from shmstage.stage import stage

        staged_ds = stage(dataset.path, name=staged_name, dest=staged_root)
        seconds = max(staged_ds.seconds, 1e-6)
        staging = StagingFacts(
            dest=str(staged_ds.path),
            dest_fstype=_fstype(str(staged_ds.path)),
            fallback=fallback,
            seconds=staged_ds.seconds,
            bytes=staged_ds.bytes,
            files=staged_ds.files,
            bytes_per_s=staged_ds.bytes / seconds,
        )
        env["SHMSTAGE_DEST"] = staged_root  # `shmstage run` finds the copy just made
        shown, staged = train_through_run(
            "{staged}",
            label="staged",
            stage_spec=f"{dataset.path}={staged_name}",
            steps=steps,
            batch_size=batch_size,
            out_dir=out_dir,
            env=env,
            log=log,
        )
        staged_run = DemoRun(
            "staged",
            shown,
            cached_share([str(p) for p in Path(staging.dest).rglob("*.jpg")]),
            staged,
        )
        speedup = staged.images_per_s / original.images_per_s if original.images_per_s > 0 else 0.0
        busy = _busy_note(max(load, os.getloadavg()[0]), node.cpus)
        if busy:
            notes.append(busy)
        if not node.root:
            notes.append(
                "not root: /dev/shm was used as it is (growing it needs root: shmstage remount)"
            )
        return DemoReport(
            workdir=workdir,
            kept=keep,
            node=dataclasses.replace(
                node, accelerator=None if original.device == "cpu" else original.device_name
            ),
            inspect=inspection,
            pillow=pillow,
            dataset=dataset,
            source_fstype=source_fstype,
            staging=staging,
            cold=cold,
            original=original_run,
            staged=staged_run,
            speedup=speedup,
            notes=tuple(notes),
            next_steps=tuple(
                _next_steps(original_run, staged_run, speedup, pillow, staging, busy is not None)
            ),
        )
    finally:
        if not keep:
            _cleanup(workdir, created, staged_root, staged_name, owned, log)


def _cleanup(
    workdir: str,
    created: bool,
    staged_root: str | None,
    name: str,
    owned: Sequence[str],
    log: Callable[[str], None],
) -> None:
    """Evict the staged copy and remove what this run made (all of the workdir if it made it)."""
    if staged_root is not None:
        from shmstage.stage import evict

        with contextlib.suppress(ShmstageError, OSError):
            evict(name, dest=staged_root)
    for path in [*owned, workdir] if created else owned:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    log("demo: cleaned up (--keep keeps the dataset and the staged copy)")
