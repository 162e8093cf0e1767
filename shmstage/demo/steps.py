"""The demo's steps: node facts, where to stage, the read throttle, the dataset, and running
`shmstage stage` / `shmstage run` as real subprocesses."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from shmstage import system
from shmstage.bench.throttle import Throttle, blkio_throttle
from shmstage.capacity import check_fit
from shmstage.demo.dataset import GeneratedDataset, generate
from shmstage.demo.report import (
    InspectFacts,
    NodeFacts,
    PillowFacts,
    SlowSource,
    StagingFacts,
    TrainResult,
)
from shmstage.errors import KilledBy, RefusedError, ShmstageError

# Reads of the original, in MB/s (10**6 bytes), as root: slow enough that reading limits the
# original run (the staged run trains ~165 images/s of ~90 KB on 2 CPUs, ~15 MB/s), fast enough
# that staging the default ~107 MB takes ~13 s and the whole demo stays near a minute.
DEFAULT_SLOW_SOURCE_MBPS = 8.0
MB = 1_000_000
MARKER = ".shmstage-demo.json"


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


def fstype_of(path: str) -> str:
    mount = system.mount_of(path)
    return mount.fstype if mount else "unknown"


def writable_dir(path: str) -> bool:
    """Could we create ``path`` (or write into it, if it exists)?"""
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return False
        probe = parent
    return os.path.isdir(probe) and os.access(probe, os.W_OK | os.X_OK)


# choose_dest looks it up by this name, so that a test can stand in for the file system.
_writable_dir = writable_dir


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
    no_wait: bool = False,
) -> tuple[str, TrainResult, float]:
    """Run the demo trainer under ``shmstage run`` in a subprocess; its measured result and
    the seconds from starting ``shmstage run`` to the end of the job's first step.

    With ``throttle`` the trainer joins its cgroup once started (its loader workers with it);
    with ``no_wait`` as well, ``run --no-wait`` and all it starts read inside the group (the
    stager's copy is what the throttle is for), and the trainer reads through DatasetFiles.
    """
    json_out = os.path.join(out_dir, f"train-{label}.json")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(json_out)  # a kept workdir may hold the last run's result
    run_args = ["run"] + (["--stage", stage_spec] if stage_spec else [])
    run_args += ["--no-wait"] if no_wait else []
    job = [sys.executable, "-m", "shmstage.demo.train", "--data", data_arg, "--steps", str(steps)]
    job += ["--batch-size", str(batch_size)] + (["--files"] if no_wait else [])
    shown = _shown([*_shmstage_cmd(), *run_args, "--", *job])
    job += ["--json-out", json_out]  # implementation details, not shown
    job += ["--join-cgroup", str(throttle.cgroup)] if throttle and not no_wait else []
    argv = [*_shmstage_cmd(), *run_args, "--", *job]
    log(f"demo: training on the {label} data: {shown}")
    start = time.clock_gettime(time.CLOCK_BOOTTIME)
    proc = _run_captured(argv, env, throttle.enter if throttle and no_wait else None)
    if proc.returncode != 0 or not os.path.exists(json_out):
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise ShmstageError(
            f"the {label} training run failed (exit {proc.returncode}): {tail or 'no output'}"
        )
    with open(json_out) as f:
        result = TrainResult(**json.load(f))
    return shown, result, max(0.0, result.first_step_at - start)


def run_offers(flag: str, env: dict[str, str]) -> bool:
    """Does this shmstage's ``run`` take ``flag`` (e.g. ``--no-wait``)?  Asked of the CLI
    the demo runs, as a user's would be."""
    proc = _run_captured([*_shmstage_cmd(), "run", "--help"], env)
    return proc.returncode == 0 and flag in proc.stdout.split()


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
        dest_fstype=fstype_of(path),
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
def signals_unwind() -> Iterator[None]:
    """SIGTERM/SIGHUP end the demo by unwinding (SystemExit), so cleanup and the cgroup removal run."""
    if threading.current_thread() is not threading.main_thread():  # signal() needs the main thread
        yield
        return

    def unwind(signum: int, _frame: object) -> None:
        raise KilledBy(signum)

    old = {sig: signal.signal(sig, unwind) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def prepare_dataset(workdir: str, images: int, log: Callable[[str], None]) -> GeneratedDataset:
    """Generate the dataset, or reuse one a previous ``--keep`` run left in this workdir."""
    path = os.path.join(workdir, "dataset")
    marker = os.path.join(workdir, MARKER)
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
