"""The training-like job of benchmarks/overlap.py: every file once per epoch, shuffled, in
batches, a fixed compute time (sleep) per batch, reads prefetched by worker threads.

    shmstage run --stage SRC [--no-wait] -- python benchmarks/overlap_job.py --data {staged} \
        --epochs 3 --batch 32 --compute-ms 60 --json-out job.json

It reads through ``shmstage.datasetfiles.DatasetFiles`` when that exists (the API a job uses
while the copy is still running), else with plain ``open()`` under ``--data``.  It writes,
as JSON: its exec time and the time of its first batch and of each epoch's end (CLOCK_BOOTTIME
seconds, the clock of /proc/PID/stat, so the harness can compare them with its own), the bytes
it read per epoch, and, with ``--device``, the sectors read from that block device by then.
``--evict DIR`` drops DIR's files from the page cache after each epoch, so a later epoch that
reads the source reads the disk again (as a source far larger than the page cache would).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path


def now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def exec_time() -> float:
    """When this process started (exec), in CLOCK_BOOTTIME seconds (/proc/self/stat field 22)."""
    stat = Path("/proc/self/stat").read_text()
    ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
    return ticks / os.sysconf("SC_CLK_TCK")


def sectors_read(device: str | None) -> int:
    """Bytes read so far from block ``device`` (``loop3`` or ``/dev/loop3``; None: 0)."""
    if not device:
        return 0
    return 512 * int(Path(f"/sys/block/{Path(device).name}/stat").read_text().split()[2])


def shape_options(ap: argparse.ArgumentParser) -> None:
    """The job's shape: its options, and benchmarks/overlap.py's (which passes them on)."""
    ap.add_argument("--epochs", type=int, default=3, help="epochs to run (default: 3)")
    ap.add_argument("--batch", type=int, default=32, help="files per batch (default: 32)")
    ap.add_argument("--workers", type=int, default=4, help="the job's reader threads (default: 4)")
    ap.add_argument(
        "--prefetch", type=int, default=8, help="batches the job reads ahead (default: 8)"
    )


class PlainFiles:
    """What the job reads without DatasetFiles: the tree under ``root``, opened directly."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.names = sorted(
            os.path.relpath(os.path.join(d, f), root)
            for d, _, files in os.walk(root)
            for f in files
            if not f.startswith(".")
        )

    def open(self, name: str):  # noqa: ANN201 (a binary file)
        return open(os.path.join(self.root, name), "rb")


def dataset(path: str, plain: bool):  # noqa: ANN201 (DatasetFiles | PlainFiles)
    if not plain:
        try:
            from shmstage.datasetfiles import DatasetFiles
        except ImportError:  # before issue 23: only a complete copy can be read
            pass
        else:
            return DatasetFiles(path)
    return PlainFiles(path)


def evict(root: str) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    shape_options(ap)
    ap.add_argument("--compute-ms", type=float, default=50.0, help="sleep per batch")
    ap.add_argument(
        "--ask-ahead",
        type=int,
        default=None,
        help="batches hinted ahead with DatasetFiles.want, as make_loader does "
        "(default: 2 x --prefetch; 0: none)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", help="block device whose read sectors to sample (loop0)")
    ap.add_argument("--evict", metavar="DIR", help="drop DIR from the page cache after each epoch")
    ap.add_argument("--plain", action="store_true", help="open() files, not DatasetFiles")
    ap.add_argument("--json-out", required=True)
    a = ap.parse_args(argv)
    started = exec_time()
    source_at_start = sectors_read(a.device)
    files = dataset(a.data, a.plain)
    names = list(files.names)
    listed = now()

    def read(name: str) -> int:
        n = 0
        with files.open(name) as f:
            while chunk := f.read(1 << 20):
                n += len(chunk)
        return n

    asks = 2 * a.prefetch if a.ask_ahead is None else a.ask_ahead
    want = getattr(files, "want", None) if asks > 0 else None  # a DatasetFiles hint
    first_batch = None
    epochs = []
    wait = 0.0
    compute = a.compute_ms / 1000
    with ThreadPoolExecutor(a.workers) as pool:
        for epoch in range(a.epochs):
            order = names[:]
            random.Random(a.seed * 1000 + epoch).shuffle(order)
            batches = [order[i : i + a.batch] for i in range(0, len(order), a.batch)]
            ahead: deque[list[Future[int]]] = deque()
            if want is not None:  # the first batches now, then one more per batch handed out
                want([n for b in batches[:asks] for n in b])
            nbytes = 0
            start = now()
            for i in range(len(batches)):
                while len(ahead) < a.prefetch and i + len(ahead) < len(batches):
                    k = i + len(ahead)
                    ahead.append([pool.submit(read, n) for n in batches[k]])
                    if want is not None and k + asks < len(batches):
                        want(batches[k + asks])
                t0 = now()
                nbytes += sum(f.result() for f in ahead.popleft())
                t1 = now()
                wait += t1 - t0
                if first_batch is None:
                    first_batch = t1
                time.sleep(compute)  # the "GPU step"
            end = now()
            source = sectors_read(a.device)
            if a.evict:
                evict(a.evict)
            # DatasetFiles counts what it served from RAM and from the source (this process)
            served = getattr(files, "served", None)  # a property: (from RAM, from the source)
            served = list(served() if callable(served) else served) if served else None
            epochs.append(
                {
                    "start": start,
                    "end": end,
                    "bytes": nbytes,
                    "source_bytes": source,
                    "served": served,
                }
            )
    result = {
        "exec": started,
        "listed": listed,
        "first_batch": first_batch,
        "files": len(names),
        "wait_s": wait,
        "epochs": epochs,
        "source_bytes_at_start": source_at_start,
    }
    Path(a.json_out).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
