"""Loader settings benchmark: throughput and data-stall share per (workers, pin_memory).

Each setting feeds a synthetic training step of fixed length (``sleep`` stands
in for GPU compute, which leaves the CPU free; ``busy`` spins one core, like
CPU-bound compute) and records how much of every step is spent waiting for the
next batch: the data-stall share of DS-Analyzer (Mohan et al., VLDB 2021).
The recommendation is the fewest workers within 5% of the best throughput.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shmstage import system
from shmstage.errors import RefusedError, ShmstageError

NEAR_BEST = 0.95  # "as good as the best": within 5% of its throughput
STALL_OK = 0.10  # a step that waits less than 10% for data is compute-bound
COMPUTE_MODES = ("sleep", "busy")


@dataclass(frozen=True)
class LoaderMeasurement:
    workers: int  # DataLoader num_workers (0: load in the training process)
    pin_memory: bool  # pinned host memory (only with an accelerator)
    samples_per_s: float  # samples trained per second over the measured steps
    stall_share: float  # time waiting for the batch / step time, over the measured steps
    wait_ms: float  # mean wait for a batch per step
    step_ms: float  # mean step time (wait + compute)
    startup_s: float  # iter() to the first batch: worker start-up and the first batch


@dataclass(frozen=True)
class LoaderBenchReport:
    data: str  # the dataset folder measured
    dataset_samples: int  # images found in it
    transform: str  # "imagenet" or "none"
    batch_size: int
    steps: int  # measured steps per setting
    warmup_steps: int  # unmeasured steps before them
    compute_ms: float  # length of the synthetic training step
    compute_mode: str  # "sleep" (CPU free, like GPU compute) or "busy" (spins one core)
    device: str  # "cpu" or "cuda": where batches are copied to
    usable_cpus: int  # CPUs this process may use (affinity and cgroup quota)
    results: tuple[LoaderMeasurement, ...]  # one per setting, in worker order
    recommended: LoaderMeasurement | None  # the setting to use (one of results)
    reason: str  # why it was chosen, and what to do when every setting stalls
    notes: tuple[str, ...]  # settings skipped, and why


def default_workers(cpus: int | None = None) -> list[int]:
    """0, 1, 2, 4, ... up to the usable CPUs, and the CPU count itself."""
    cpus = cpus or system.usable_cpus()
    counts = [0, 1]
    while counts[-1] * 2 <= cpus:
        counts.append(counts[-1] * 2)
    if counts[-1] != cpus:
        counts.append(cpus)
    return counts


def recommend(
    results: Sequence[LoaderMeasurement], cpus: int | None = None
) -> tuple[LoaderMeasurement | None, str]:
    """The fewest workers within 5% of the best throughput, and why (``cpus``: usable CPUs)."""
    if not results:
        return None, "nothing was measured"
    best = max(r.samples_per_s for r in results)
    near = sorted(
        (r for r in results if r.samples_per_s >= NEAR_BEST * best),
        key=lambda r: (r.workers, -r.samples_per_s),
    )
    calm = [r for r in near if r.stall_share < STALL_OK]
    if calm:
        pick = calm[0]
        return pick, (
            f"fewest workers within 5% of the best throughput ({best:.0f} samples/s) "
            f"with a data stall under {STALL_OK:.0%}"
        )
    pick = near[0]
    least_stall = min(r.stall_share for r in results)
    if pick.workers == max(r.workers for r in results):
        why = (
            f"throughput still grows with workers, but with {_workers(pick.workers)} "
            f"{least_stall:.0%} of each step is still spent waiting for data: give this rank more "
            "CPUs, use pillow-simd, or lighten the transform"
        )
        if cpus is None or pick.workers < cpus:
            why += f" (or try more than {_workers(pick.workers)} with --workers)"
    else:
        why = (
            f"more workers do not help: every setting waits at least {least_stall:.0%} of each step "
            "for data, so decoding (CPU) or reading (storage) is the limit: use pillow-simd, "
            "lighten the transform, or stage the data if it is not staged yet"
        )
    return pick, f"data-bound: {why}; this is the fewest workers within 5% of the best throughput"


def _workers(n: int) -> str:
    return f"{n} worker" if n == 1 else f"{n} workers"


def _accelerator() -> str | None:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return None


def _compute(seconds: float, mode: str) -> None:
    if seconds <= 0:
        return
    if mode == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _to_device(batch, device: str | None):  # noqa: ANN001, ANN202 (any nested batch)
    if device is None:
        return batch
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    return batch


def measure(
    dataset,  # noqa: ANN001 (any map-style dataset)
    *,
    workers: int,
    pin_memory: bool,
    batch_size: int,
    steps: int,
    warmup: int,
    compute_s: float,
    compute_mode: str,
    device: str | None,
) -> LoaderMeasurement:
    """Time ``warmup + steps`` training steps fed by ``make_loader`` with one setting."""
    from shmstage.loader import make_loader

    loader = make_loader(
        dataset,
        batch_size,
        num_workers=workers,
        pin_memory=pin_memory,
        shuffle=True,
        drop_last=len(dataset) >= batch_size,
        # steady state of one setting: workers kept across epochs (the dataset does not change)
        persistent_workers=True,
    )
    start = time.perf_counter()
    batches = iter(loader)
    startup = None
    wait = total = 0.0
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:  # a new epoch: its start-up counts as waiting
            batches = iter(loader)
            batch = next(batches)
        _to_device(batch, device)
        t1 = time.perf_counter()
        if startup is None:
            startup = t1 - start
        _compute(compute_s, compute_mode)
        if device is not None:
            import torch

            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if step >= warmup:
            wait += t1 - t0
            total += t2 - t0
    del batches, loader  # shuts the workers down before the next setting starts its own
    gc.collect()
    samples = steps * batch_size
    return LoaderMeasurement(
        workers=workers,
        pin_memory=pin_memory,
        samples_per_s=samples / total if total > 0 else 0.0,
        stall_share=wait / total if total > 0 else 0.0,
        wait_ms=wait / steps * 1000,
        step_ms=total / steps * 1000,
        startup_s=startup or 0.0,
    )


def run_loader_benchmark(
    data: str | os.PathLike[str],
    *,
    transform: str = "imagenet",
    batch_size: int = 32,
    workers: Sequence[int] | None = None,
    pin: bool | None = None,
    steps: int = 20,
    warmup: int = 2,
    compute_ms: float = 50.0,
    compute_mode: str = "sleep",
    progress: Callable[[str], None] | None = None,
) -> LoaderBenchReport:
    """Measure every worker count in ``workers`` (default 0, 1, 2, 4 ... CPUs) and recommend one.

    ``pin=None`` pins host memory when an accelerator is present; pinning on a
    machine without one is skipped (and noted), as it would only cost time.
    """
    if batch_size < 1 or steps < 1 or warmup < 0:
        raise RefusedError(f"batch size and steps must be at least 1 (got {batch_size}, {steps})")
    if compute_ms < 0:
        raise RefusedError(f"compute time must be 0 or more milliseconds (got {compute_ms})")
    if compute_mode not in COMPUTE_MODES:
        raise RefusedError(
            f"unknown compute mode {compute_mode!r}; use one of: {', '.join(COMPUTE_MODES)}"
        )
    counts = sorted(set(workers)) if workers else default_workers()
    if any(w < 0 for w in counts):
        raise RefusedError("worker counts must be 0 or more")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ShmstageError(
            "the loader benchmark needs torch: pip install 'shmstage[torch]'"
        ) from None
    from shmstage.demo.dataset import ImageFolder, make_transform

    dataset = ImageFolder(data, make_transform(transform))
    device = _accelerator()
    notes: list[str] = []
    if pin and device is None:
        notes.append(
            "pin_memory skipped: no accelerator (pinned memory only speeds up copies to a GPU)"
        )
    pin_memory = bool(device is not None if pin is None else pin and device is not None)
    results = []
    for n, count in enumerate(counts, 1):
        r = measure(
            dataset,
            workers=count,
            pin_memory=pin_memory,
            batch_size=batch_size,
            steps=steps,
            warmup=warmup,
            compute_s=compute_ms / 1000,
            compute_mode=compute_mode,
            device=device,
        )
        results.append(r)
        if progress is not None:
            progress(
                f"[{n}/{len(counts)}] workers={count} pin_memory={'on' if pin_memory else 'off'}: "
                f"{r.samples_per_s:.0f} samples/s, data stall {r.stall_share:.0%}"
            )
    best, reason = recommend(results, system.usable_cpus())
    return LoaderBenchReport(
        data=os.fspath(data),
        dataset_samples=len(dataset),
        transform=transform,
        batch_size=batch_size,
        steps=steps,
        warmup_steps=warmup,
        compute_ms=compute_ms,
        compute_mode=compute_mode,
        device=device or "cpu",
        usable_cpus=system.usable_cpus(),
        results=tuple(results),
        recommended=best,
        reason=reason,
        notes=tuple(notes),
    )


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ShmstageError("--plot needs matplotlib: pip install 'shmstage[plot]'") from None


def plot(report: LoaderBenchReport, path: str | os.PathLike[str]) -> None:
    """A PNG of throughput (and data-stall share) against the number of workers."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    xs = [r.workers for r in report.results]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(xs, [r.samples_per_s for r in report.results], marker="o", label="throughput")
    ax.set_xlabel("DataLoader workers")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    ax.set_xticks(xs)
    stall = ax.twinx()
    stall.plot(
        xs,
        [100 * r.stall_share for r in report.results],
        marker="s",
        color="tab:red",
        label="data stall",
    )
    stall.set_ylabel("data stall (% of step)")
    stall.set_ylim(0, 100)
    if report.recommended is not None:
        ax.axvline(
            report.recommended.workers, color="tab:green", linestyle="--", label="recommended"
        )
    ax.set_title(
        f"{report.transform} transform, batch {report.batch_size}, {report.compute_ms:g} ms {report.compute_mode} step"
    )
    handles = ax.get_legend_handles_labels()[0] + stall.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="lower right")
    fig.tight_layout()
    try:
        fig.savefig(os.fspath(path), format="png")
    except OSError as e:
        raise ShmstageError(f"cannot write the plot to {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
