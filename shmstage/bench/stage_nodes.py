"""Cluster staging speed on a real cluster: every node staging alone against ``stage --nodes``.

    from shmstage.bench.stage_nodes import run_nodes_benchmark
    result = run_nodes_benchmark("/nfs/imagenet", "/dev/shm", spec, runs=3, drop_caches=True)
    result.get("read-once").median_s, result.get("naive").x_dataset   # e.g. 41.0, 3.98

One process per node (``spec`` from :func:`shmstage.cluster.resolve`) runs this together
with the others; their own rendezvous (a store on node 0) only starts runs together and
gathers the figures.  Per run and mode, all nodes leave a barrier and start ``shmstage stage
SRC`` at once: alone (naive) or with ``--nodes`` (read-once, on a port node 0 picks for that
run), each into a fresh name in a scratch store under DEST, checked against SRC and
removed afterwards.  Modes are interleaved, the order rotated each run.  A run's wall time is the slowest node's
time from leaving the barrier to its stage exiting (node clocks need not agree); its source
bytes are the sum over nodes of what each stage process (with its copy workers) made the
kernel read from storage: ``read_bytes`` of /proc/PID/io, taken as ``ru_inblock`` x 512
from wait4(2) so that reaped workers count, or, when SRC is on a block device and that
device read less meanwhile, the device's own count (see docs/bench.md for what that covers).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from shmstage.bench.stage import (
    BenchError,
    TreeSummary,
    default_shmstage_cmd,
    drop_page_cache,
    tree_summary,
)
from shmstage.capacity import check_fit
from shmstage.cluster import ClusterSpec
from shmstage.cluster.rendezvous import PeerLost, Rendezvous
from shmstage.errors import PermissionDenied, RefusedError

MODES: tuple[str, ...] = ("naive", "read-once")
LABELS = {"naive": "naive (each node alone)", "read-once": "read-once (--nodes)"}


@dataclass(frozen=True)
class ModeResult:
    mode: str  # "naive" or "read-once"
    label: str  # for the table
    times: tuple[float, ...]  # per run: seconds from the common start to the last node done
    source_bytes: tuple[int, ...]  # per run: bytes read from storage, summed over nodes
    median_s: float  # median of times
    median_source_bytes: int  # median of source_bytes
    x_dataset: float  # median source bytes / dataset bytes (naive: about N)
    vs_read_once: float | None  # this mode's median time / read-once's: > 1, read-once faster


@dataclass(frozen=True)
class NodesBenchResult:
    source: str
    dest: str  # each node's scratch store was a directory in here, removed afterwards
    nodes: int
    files: int
    bytes: int  # the dataset: regular files' bytes
    runs: int  # per mode
    drop_caches: bool  # every node dropped its page cache before every run
    modes: tuple[ModeResult, ...]  # naive, then read-once

    def get(self, mode: str) -> ModeResult:
        for result in self.modes:
            if result.mode == mode:
                return result
        raise KeyError(mode)


@dataclass(frozen=True)
class _NodeRun:
    seconds: float
    read_bytes: int


def run_nodes_benchmark(
    src: str | os.PathLike[str],
    dest_root: str | os.PathLike[str],
    spec: ClusterSpec,
    runs: int = 3,
    drop_caches: bool = False,
    *,
    shmstage_cmd: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> NodesBenchResult:
    """Run on every node at once; every node returns the same result (all nodes' figures)."""
    source = Path(src).resolve()
    dest = Path(dest_root).resolve()
    if not source.is_dir():
        raise RefusedError(f"{source} is not a directory: give the dataset directory to benchmark")
    if dest == source or source in dest.parents:
        raise RefusedError(
            f"destination {dest} is inside the source {source}: pick a destination outside it"
        )
    if runs < 1:
        raise RefusedError(f"runs must be at least 1, not {runs}")
    if drop_caches and os.geteuid() != 0:
        raise PermissionDenied("dropping the page cache needs root: run as root or without it")
    cmd = list(shmstage_cmd) if shmstage_cmd else default_shmstage_cmd()
    say = progress or (lambda _msg: None)
    summary = tree_summary(source)
    created = not dest.exists()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    reads: dict[str, list[int]] = {m: [] for m in MODES}
    rv = Rendezvous(spec.host, spec.port, spec.nodes, spec.rank, spec.timeout, spec.ports)
    work: Path | None = None
    try:
        rv.connect()
        token = rv.allgather_json("token", secrets.token_hex(4))[0]  # node 0's: one name
        try:
            dest.mkdir(parents=True, exist_ok=True)
            work = dest / f".shmstage-bench-{token}"  # a store of its own, removed at the end
            work.mkdir()
        except OSError as e:
            raise RefusedError(
                f"cannot create a scratch directory in {dest}: {e.strerror}; pick another --dest"
            ) from None
        fit = check_fit(summary.bytes, work)
        if not fit.fits:
            raise RefusedError(
                f"one copy of {source} does not fit in {dest} on node {spec.rank}: {fit.reason}"
            )
        for i in range(runs):
            for mode in MODES[i % 2 :] + MODES[: i % 2]:
                if drop_caches:
                    drop_page_cache()
                _warm_software(cmd)  # also without dropping: another job may have dropped it
                port = _free_port() if spec.rank == 0 and mode == "read-once" else 0
                starts = rv.allgather_json(f"start/{i}/{mode}", port)
                name = f"{mode}-{i}"
                argv = [*cmd, "stage", str(source), "--dest", str(work), "--name", name]
                argv += ["--json", "--quiet"]
                if mode == "read-once":
                    argv += [
                        "--nodes", str(spec.nodes), "--node-rank", str(spec.rank),
                        "--rendezvous", f"{spec.host}:{starts[0]}",
                        "--timeout", f"{spec.timeout:g}", "--inflight", str(spec.inflight),
                    ]  # fmt: skip
                else:  # alone, also in a Slurm step of one task per node (which means --nodes N)
                    argv += ["--nodes", "1"]
                try:
                    mine = _stage_once(argv, work / name, summary, mode, source)
                finally:
                    _remove(name, work)
                done = rv.allgather_json(f"done/{i}/{mode}", [mine.seconds, mine.read_bytes], True)
                times[mode].append(max(d[0] for d in done))
                reads[mode].append(sum(d[1] for d in done))
                say(
                    f"run {i + 1}/{runs}  {mode:<9} {times[mode][-1]:8.2f} s  source "
                    f"{reads[mode][-1] / max(summary.bytes, 1):.2f}x the dataset"
                )
        rv.allgather("end", b"")
    except PeerLost:
        raise
    except BaseException as e:  # tell the others at once (else they wait for --timeout)
        rv.report(str(e) or type(e).__name__)
        raise
    finally:
        rv.close()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        if created:
            with suppress(OSError):  # not empty: someone else put files there
                dest.rmdir()
    return NodesBenchResult(
        source=str(source),
        dest=str(dest),
        nodes=spec.nodes,
        files=summary.files,
        bytes=summary.bytes,
        runs=runs,
        drop_caches=drop_caches,
        modes=tuple(mode_results(times, reads, summary.bytes)),
    )


def mode_results(
    times: dict[str, list[float]], reads: dict[str, list[int]], nbytes: int
) -> list[ModeResult]:
    """Medians per mode, and each mode's time relative to read-once's."""
    base = statistics.median(times["read-once"]) if times.get("read-once") else None
    out = []
    for mode, runs in times.items():
        med = statistics.median(runs)
        read = int(statistics.median(reads[mode]))
        out.append(
            ModeResult(
                mode=mode,
                label=LABELS[mode],
                times=tuple(runs),
                source_bytes=tuple(reads[mode]),
                median_s=med,
                median_source_bytes=read,
                x_dataset=read / nbytes if nbytes else 0.0,
                vs_read_once=med / base if base else None,
            )
        )
    return out


def _stage_once(
    argv: list[str], copy: Path, want: TreeSummary, mode: str, source: Path
) -> _NodeRun:
    """Run one ``shmstage stage``; its wall time and the bytes it (and its workers) read.

    Both counts bound what it read of SRC from above, so the smaller is taken: its own
    (``ru_inblock``) also counts its program files when another process dropped them from
    the page cache since they were warmed; SRC's block device's also counts other readers
    of that device (another "node" of one machine on one disk)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMSTAGE_STAGE_")}
    device = _device_read_bytes(source)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        # wait4, not /proc/PID/io: a reaped child's read_bytes add up in its parent's
        # rusage (ru_inblock, 512-byte units), so the copy workers count too.
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.monotonic() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            lines = err.read().decode(errors="replace").strip().splitlines()
            detail = lines[-1] if lines else f"exit status {proc.returncode}"
            raise BenchError(f"shmstage stage ({mode}) failed: {detail}")
    got = tree_summary(copy)
    if got != want:
        raise BenchError(
            f"shmstage stage ({mode}) made a wrong copy at {copy}: {got.files} files, "
            f"{got.bytes} bytes; the source has {want.files}, {want.bytes}"
        )
    read = usage.ru_inblock * 512
    after = _device_read_bytes(source)
    if device is not None and after is not None:
        read = min(read, after - device)
    return _NodeRun(seconds, read)


def _device_read_bytes(path: Path) -> int | None:
    """Bytes read so far from the block device ``path`` is on (sectors read in its
    /sys/dev/block/MAJ:MIN/stat, 512 bytes each); None where it is on none (NFS, tmpfs)."""
    dev = os.stat(path).st_dev
    try:
        stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
        return 512 * int(stat[2])
    except (OSError, IndexError, ValueError):
        return None


def _remove(name: str, dest: Path) -> None:
    from shmstage.stage import evict

    with suppress(Exception):  # best effort after a failure: the error says what happened
        evict(name, dest=dest, force=True)


def _warm_software(cmd: list[str]) -> None:
    """Load shmstage's and torch's files into the page cache (again) just before a run,
    so the staging processes' read bytes are the dataset's, not their own start-up's."""
    python = cmd[0] if cmd[0].endswith(("python", "python3")) else sys.executable
    subprocess.run(
        [python, "-c", "import shmstage.cli, shmstage.cluster, torch.distributed"],
        check=False,
        capture_output=True,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
