"""``run_demo``: generate, stage, train from the original and from the staged copy, report,
and clean up (the order and the cleanup guarantees live here)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from shmstage.bench.throttle import Throttle
from shmstage.capacity import MEMORY_BACKED
from shmstage.demo.pagecache import cached_share, evict_from_page_cache
from shmstage.demo.report import (
    DemoReport,
    DemoRun,
    TrainResult,
    busy_note,
    payback,
    suggest_next_steps,
)
from shmstage.demo.steps import (
    MARKER,
    MB,
    choose_dest,
    fstype_of,
    inspect_facts,
    node_facts,
    pillow_facts,
    prepare_dataset,
    run_offers,
    signals_unwind,
    slow_source_throttle,
    stage_through_cli,
    train_through_run,
    writable_dir,
)
from shmstage.errors import RefusedError, ShmstageError
from shmstage.sizes import format_size

DEFAULT_IMAGES = 1200  # ~100 MiB; more than one epoch of the default steps, so no epoch restarts
DEFAULT_STEPS = 30
DEFAULT_BATCH = 32
WORKDIR_BASE = "/var/tmp"  # on disk: /tmp is a tmpfs on many systems, which would hide the gain


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
        base = WORKDIR_BASE if writable_dir(WORKDIR_BASE) else tempfile.gettempdir()
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
    # and SIGTERM/SIGHUP (signals_unwind)
    with signals_unwind(), contextlib.ExitStack() as stack:
        try:
            throttle, slow = slow_source_throttle(stack, workdir, slow_source, cold)
            preexec = throttle.enter if throttle else None
            node = node_facts()
            log(f"demo: node: {node.cpus} CPUs, {format_size(node.memory_usable)} RAM usable")
            pillow = pillow_facts()
            dataset = prepare_dataset(workdir, images, log)
            owned += [dataset.path, os.path.join(workdir, MARKER)]
            owned += [
                os.path.join(workdir, f"train-{label}.json")
                for label in ("original", "staged", "no-wait")
            ]
            log(
                f"demo: inspecting the node and the dataset (shmstage inspect --dataset {dataset.path})"
            )
            inspection = inspect_facts(dataset.path)
            source_fstype = fstype_of(dataset.path)
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
            # every run: the same job, steps and log; env is read at each call (DEST set below)
            train = functools.partial(
                train_through_run, steps=steps, batch_size=batch_size, out_dir=out_dir, env=env,
                log=log,
            )  # fmt: skip
            shown, original, original_first = train(
                dataset.path, label="original", stage_spec=None, throttle=throttle
            )
            original_run = DemoRun("original", shown, cached, original, original_first)
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
            stage_start = time.monotonic()
            staging = stage_through_cli(
                dataset.path,
                name=staged_name,
                dest=staged_root,
                fallback=fallback,
                env=env,
                preexec=preexec,
            )
            stage_wall = time.monotonic() - stage_start
            env["SHMSTAGE_DEST"] = staged_root  # `shmstage run` finds the copy just made
            shown, staged, staged_first = train(
                "{staged}", label="staged", stage_spec=f"{dataset.path}={staged_name}"
            )
            staged_run = DemoRun(
                "staged",
                shown,
                cached_share([str(p) for p in Path(staging.dest).rglob("*.jpg")]),
                staged,
                stage_wall + staged_first,
            )
            nowait_run = None
            # the job reads a live copy through DatasetFiles: both halves of issue 23 needed
            if run_offers("--no-wait", env) and importlib.util.find_spec("shmstage.datasetfiles"):
                nowait_run = _train_while_staging(
                    train, dataset.path, staged_root, staged_name, files, throttle, cold
                )
            else:
                notes.append(
                    "this shmstage has no run --no-wait or no DatasetFiles, so no third run"
                )
            speedup = (
                staged.images_per_s / original.images_per_s if original.images_per_s > 0 else 0.0
            )
            busy = busy_note(max(load, os.getloadavg()[0]), node.cpus)
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
                nowait=nowait_run,
                speedup=speedup,
                payback=payback(dataset.images, original, staged, staging.seconds),
                notes=tuple(notes),
                next_steps=tuple(
                    suggest_next_steps(
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


def _train_while_staging(
    train: Callable[..., tuple[str, TrainResult, float]],
    source: str,
    dest: str,
    name: str,
    files: list[str],
    throttle: Throttle | None,
    cold: bool,
) -> DemoRun:
    """The third run: the copy made afresh by ``run --no-wait`` while the job trains on it."""
    from shmstage.stage import evict

    evict(name, dest=dest)  # else run finds the copy the staged run read
    if cold:
        evict_from_page_cache(files)
    cached = cached_share(files)
    shown, result, first = train(
        "{staged}", label="no-wait", stage_spec=f"{source}={name}", throttle=throttle, no_wait=True
    )
    return DemoRun("no-wait", shown, cached, result, first)


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
