"""The demo's results: typed facts and measurements, the payback arithmetic, and the next
steps a user should take, read off the measurements."""

from __future__ import annotations

from dataclasses import dataclass

from shmstage.demo.dataset import GeneratedDataset


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
    first_step_at: float = 0.0  # CLOCK_BOOTTIME s when the first step ended (callers time from it)


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
    label: str  # "original" | "staged" | "no-wait"
    command: str  # the shmstage run command line, as a user would type it
    cached_share: float | None  # share of the data in the page cache just before the run
    result: TrainResult  # what the training job measured
    # seconds until the first training step ended, from starting `shmstage run` (staged:
    # from starting `shmstage stage`, so the staging counts): what the GPU waited
    first_step_s: float | None = None


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
    nowait: DemoRun | None  # `run --no-wait`: training while the copy was made; None: not run
    speedup: float  # staged images/s / original images/s
    payback: Payback  # after how many epochs the staging time is won back
    notes: tuple[str, ...]  # what was skipped or changed, and why
    next_steps: tuple[str, ...]  # what to do next, from these measurements


def payback(images: int, original: TrainResult, staged: TrainResult, staging_s: float) -> Payback:
    """Epoch times at the two measured rates, and after how many epochs staging has paid for itself."""
    orig_s = images / original.images_per_s if original.images_per_s > 0 else float("inf")
    staged_s = images / staged.images_per_s if staged.images_per_s > 0 else float("inf")
    saved = orig_s - staged_s
    epochs = staging_s / saved if saved > 0 and saved != float("inf") else None
    return Payback(images, orig_s, staged_s, staging_s, epochs)


def suggest_next_steps(
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


def busy_note(load: float, cpus: int) -> str | None:
    """A note when other processes competed for the CPU during the runs (timings are then noisy)."""
    # The demo itself keeps about two CPUs busy (the trainer and one loader worker).
    if load <= 1.5 * cpus + 1:
        return None
    return (
        f"the node was busy (load average {load:.1f} on {cpus} CPUs), so images/s are noisy: "
        "compare the data wait per step, or re-run when the node is idle"
    )
