"""``shmstage demo``: the whole flow on a synthetic dataset, measured.

Generates a JPEG dataset on disk, stages it, and trains a tiny CNN twice through
``shmstage run`` (once reading the original, once the staged copy), so a new user
sees what staging and the loader settings do on their own node in about a minute.
As root the original is read through a cgroup read throttle (``--slow-source``), so a
fast local disk stands in for network storage, where staging pays.
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
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from shmstage import system
from shmstage.bench.stage import Throttle, blkio_throttle
from shmstage.capacity import MEMORY_BACKED, check_fit
from shmstage.demo.dataset import GeneratedDataset, generate
from shmstage.errors import RefusedError, ShmstageError
from shmstage.sizes import format_size

DEFAULT_IMAGES = 1200  # ~100 MiB; more than one epoch of the default steps, so no epoch restarts
DEFAULT_STEPS = 30
DEFAULT_BATCH = 32
# Reads of the original, in MB/s (10**6 bytes), as root: slow enough that reading limits the
# original run (the staged run trains ~165 images/s of ~90 KB on 2 CPUs, ~15 MB/s), fast enough
# that staging the default ~107 MB takes ~13 s and the whole demo stays near a minute.
DEFAULT_SLOW_SOURCE_MBPS = 8.0
MB = 1_000_000
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
class SlowSource:
    mbps: float  # read throttle on the original in MB/s (10**6 bytes/s); 0: not throttled
    device: str | None  # "MAJ:MIN" of the throttled disk
    cgroup: str | None  # the throttled group (removed when the demo ends)
    reason: str | None  # why the source was not throttled


@dataclass(frozen=True)
class Payback:
    epoch_images: int  # an epoch: every image once
    original_epoch_s: float  # an epoch at the original run's measured images/s
    staged_epoch_s: float  # an epoch at the staged run's measured images/s
    staging_s: float  # the staging time (read through the throttle, if any)
    epochs: float | None  # staging time / time saved per epoch; None: staged was not faster


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
    slow_source: SlowSource  # the read throttle on the original (staging and the original run)
    original: DemoRun  # training read the original
    staged: DemoRun  # training read the staged copy
    speedup: float  # staged images/s / original images/s
    payback: Payback  # after how many epochs the staging time is won back
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


def _run_captured(
    argv: list[str], env: dict[str, str], preexec: Callable[[], None] | None = None
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=preexec,
        )
    except OSError as e:  # the interpreter cannot be run, or the throttle refused the child
        raise ShmstageError(
            f"could not start {argv[0]} ({e.strerror or e}): run the demo as a user who can execute it"
        ) from None
    try:
        out, err = proc.communicate()
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM unwinding): ask the child to stop first, so
        # `shmstage run` can pass SIGTERM on to the trainer; SIGKILL only as a last resort.
        proc.terminate()
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


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
    throttle: Throttle | None = None,
) -> tuple[str, TrainResult]:
    """Run the demo trainer under ``shmstage run`` in a subprocess; its measured result.

    With ``throttle`` the trainer joins its cgroup once started (its loader workers with it).
    """
    json_out = os.path.join(out_dir, f"train-{label}.json")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(json_out)  # a kept workdir may hold the last run's result
    run_args = ["run"] + (["--stage", stage_spec] if stage_spec else [])
    job = [sys.executable, "-m", "shmstage.demo.train", "--data", data_arg, "--steps", str(steps)]
    job += ["--batch-size", str(batch_size)]
    shown = _shown([*_shmstage_cmd(), *run_args, "--", *job])
    job += ["--json-out", json_out]  # implementation details, not shown
    job += ["--join-cgroup", str(throttle.cgroup)] if throttle else []
    argv = [*_shmstage_cmd(), *run_args, "--", *job]
    log(f"demo: training on the {label} data: {shown}")
    proc = _run_captured(argv, env)
    if proc.returncode != 0 or not os.path.exists(json_out):
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise ShmstageError(
            f"the {label} training run failed (exit {proc.returncode}): {tail or 'no output'}"
        )
    with open(json_out) as f:
        return shown, TrainResult(**json.load(f))


def stage_through_cli(
    src: str,
    *,
    name: str,
    dest: str,
    fallback: str | None,
    env: dict[str, str],
    preexec: Callable[[], None] | None = None,
) -> StagingFacts:
    """Stage with ``shmstage stage --json`` in a subprocess (so the read throttle can hold it)."""
    argv = [*_shmstage_cmd(), "stage", src, "--name", name, "--dest", dest, "--json"]
    proc = _run_captured(argv, env, preexec)
    try:
        out = json.loads(proc.stdout) if proc.returncode == 0 else None
        path, seconds, nbytes = out["path"], float(out["seconds"]), int(out["bytes"])
        files = int(out["files"])
    except (ValueError, TypeError, KeyError):
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise ShmstageError(
            f"staging failed (exit {proc.returncode}): {tail or 'no output'}"
        ) from None
    return StagingFacts(
        dest=path,
        dest_fstype=_fstype(path),
        fallback=fallback,
        seconds=seconds,
        bytes=nbytes,
        files=files,
        bytes_per_s=nbytes / max(seconds, 1e-6),
    )


def slow_source_throttle(
    stack: contextlib.ExitStack, path: str, mbps: float | None, cold: bool
) -> tuple[Throttle | None, SlowSource]:
    """Enter the read throttle on the disk under ``path`` (``mbps`` None: the default when possible).

    An asked-for rate that cannot be applied raises; the default falls back to no throttle
    and says why.  The group lives until ``stack`` closes.
    """
    if mbps == 0:
        return None, SlowSource(0.0, None, None, "--slow-source 0")
    if not cold:
        return None, SlowSource(0.0, None, None, "--warm keeps it in the page cache")
    if os.geteuid() != 0:
        return None, SlowSource(0.0, None, None, "not root: a read throttle needs a cgroup")
    rate = DEFAULT_SLOW_SOURCE_MBPS if mbps is None else mbps
    try:
        throttle = stack.enter_context(
            blkio_throttle(path, max(1, round(rate * MB)), name="shmstage-demo")
        )
    except ShmstageError as e:
        if mbps is not None:
            raise
        return None, SlowSource(0.0, None, None, e.message)
    return throttle, SlowSource(rate, throttle.device, str(throttle.cgroup), None)


@contextlib.contextmanager
def _signals_unwind() -> Iterator[None]:
    """SIGTERM/SIGHUP end the demo by unwinding (SystemExit), so cleanup and the cgroup removal run."""
    if threading.current_thread() is not threading.main_thread():  # signal() needs the main thread
        yield
        return

    def unwind(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    old = {sig: signal.signal(sig, unwind) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def payback(images: int, original: TrainResult, staged: TrainResult, staging_s: float) -> Payback:
    """Epoch times at the two measured rates, and after how many epochs staging has paid for itself."""
    orig_s = images / original.images_per_s if original.images_per_s > 0 else float("inf")
    staged_s = images / staged.images_per_s if staged.images_per_s > 0 else float("inf")
    saved = orig_s - staged_s
    epochs = staging_s / saved if saved > 0 and saved != float("inf") else None
    return Payback(images, orig_s, staged_s, staging_s, epochs)


def _next_steps(
    original: DemoRun,
    staged: DemoRun,
    speedup: float,
    pillow: PillowFacts,
    staging: StagingFacts,
    busy: bool,
    slow_mbps: float = 0.0,
) -> list[str]:
    """What a user should do next, read off these measurements (``slow_mbps``: the read throttle)."""
    steps = []
    cached = original.cached_share
    if speedup >= 1.10:
        if slow_mbps:
            text = (
                f"Staging made training {speedup:.2f}x faster reading a source throttled to "
                f"{slow_mbps:g} MB/s: stage data that lives on NFS, Lustre or a busy disk the same way."
            )
        else:
            text = f"Staging made training {speedup:.2f}x faster here: stage your own data the same way."
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
    elif slow_mbps:
        steps.append(
            f"Reading was not the limit here even at {slow_mbps:g} MB/s: training itself (decoding, "
            "the model) was; a slower --slow-source shows where staging starts to pay."
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
    slow_source: float | None = None,
    log: Callable[[str], None] = lambda _msg: None,
) -> DemoReport:
    """Generate, stage, train from the original and from the staged copy; clean up unless ``keep``.

    ``slow_source``: MB/s the original is read at (staging and the original run, in a cgroup);
    None: DEFAULT_SLOW_SOURCE_MBPS when root with a blkio/io controller, else not throttled; 0: off.
    """
    if images < batch_size:
        raise ShmstageError(
            f"--images must be at least the batch size ({batch_size}); got {images}"
        )
    if steps < 1:
        raise ShmstageError(f"--steps must be at least 1; got {steps}")
    if slow_source is not None and slow_source < 0:
        raise RefusedError(f"--slow-source must be MB/s >= 0 (0: off); got {slow_source:g}")
    if slow_source:
        if os.geteuid() != 0:
            raise RefusedError(
                "--slow-source throttles reads with a cgroup, which needs root: "
                "run as root, or pass --slow-source 0"
            )
        if not cold:
            raise RefusedError(
                "--slow-source needs a cold page cache (--warm reads RAM): drop --warm"
            )
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
    # the throttle's cgroup is removed when the stack closes, also on Ctrl-C (KeyboardInterrupt)
    # and SIGTERM/SIGHUP (_signals_unwind)
    with _signals_unwind(), contextlib.ExitStack() as stack:
        try:
            throttle, slow = slow_source_throttle(stack, workdir, slow_source, cold)
            preexec = throttle.enter if throttle else None
            node = node_facts()
            log(f"demo: node: {node.cpus} CPUs, {format_size(node.memory_usable)} RAM usable")
            pillow = pillow_facts()
            dataset = _prepare_dataset(workdir, images, log)
            owned += [dataset.path, os.path.join(workdir, _MARKER)]
            owned += [
                os.path.join(workdir, f"train-{label}.json") for label in ("original", "staged")
            ]
            log(
                f"demo: inspecting the node and the dataset (shmstage inspect --dataset {dataset.path})"
            )
            inspection = inspect_facts(dataset.path)
            source_fstype = _fstype(dataset.path)
            if source_fstype in MEMORY_BACKED:
                notes.append(
                    f"the work directory is on {source_fstype} (RAM), so the original is read from RAM too"
                )
            if throttle:
                log(
                    f"demo: reading the original through a {slow.mbps:g} MB/s read throttle "
                    f"(cgroup {throttle.cgroup}), standing in for network storage"
                )
            else:
                notes.append(
                    f"the source was not throttled ({slow.reason}), so it read at local-disk speed; "
                    "staging pays most when the source is slow (NFS, Lustre, a busy disk)"
                )
            files = [str(p) for p in Path(dataset.path).rglob("*.jpg")]

            env = dict(os.environ)
            out_dir = workdir
            if cold:
                log(
                    "demo: evicting the dataset's pages from the page cache so the original run reads from disk"
                )
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
                throttle=throttle,
            )
            original_run = DemoRun("original", shown, cached, original)
            load = os.getloadavg()[0]

            staged_root, fallback = choose_dest(dataset.bytes, workdir)
            if fallback:
                notes.append(f"staged outside the default destination: {fallback}")
            if fallback:  # a directory made for this run only
                owned.append(staged_root)
            if cold:  # the original run left most of the dataset in the page cache
                evict_from_page_cache(files)
            eta = (
                f" (about {dataset.bytes / (slow.mbps * MB):.0f} s at {slow.mbps:g} MB/s)"
                if throttle
                else ""
            )
            log(f"demo: staging {format_size(dataset.bytes)} into {staged_root}{eta}")
            staging = stage_through_cli(
                dataset.path,
                name=staged_name,
                dest=staged_root,
                fallback=fallback,
                env=env,
                preexec=preexec,
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
            speedup = (
                staged.images_per_s / original.images_per_s if original.images_per_s > 0 else 0.0
            )
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
                slow_source=slow,
                original=original_run,
                staged=staged_run,
                speedup=speedup,
                payback=payback(dataset.images, original, staged, staging.seconds),
                notes=tuple(notes),
                next_steps=tuple(
                    _next_steps(
                        original_run,
                        staged_run,
                        speedup,
                        pillow,
                        staging,
                        busy is not None,
                        slow.mbps,
                    )
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
