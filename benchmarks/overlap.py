"""Train while staging (issue 23): stage-then-run, --no-wait, the source alone, and --partial.

    sudo .venv/bin/python benchmarks/overlap.py --runs 3          # 300 MB at 50 MB/s, ~6 min
    sudo .venv/bin/python benchmarks/overlap.py --size-mb 60 --runs 1   # a quick look

An ImageNet-like tree (files lognormal around 100 KB, benchmarks/stage.py's generator) sits in
an ext4 image on a read-only direct-I/O loop device, mounted afresh for every run (so nothing
of it is in the page cache) and read through a blkio throttle on that loop device (--mbps,
the stand-in for a network file system; only the dataset's reads are throttled).  The job,
benchmarks/overlap_job.py, reads every file once per epoch in a shuffled order, in batches,
with a fixed sleep per batch (the GPU step) and reader threads prefetching ahead, for 3
epochs; after each epoch it drops the source's files from the page cache, as a source far
larger than RAM would be.  Modes, interleaved, --runs each, medians:

  stage    shmstage run --stage SRC -- job            (the whole copy, then the job)
  nowait   shmstage run --stage SRC --no-wait -- job  (the job at once, the copy meanwhile)
  nowait16 the same, the job with 16 reader threads (more demands in flight)
  noask    nowait, the job not hinting the next batches (DatasetFiles.want): demands only
  source   the job reading SRC, no staging
  partial  shmstage run --stage SRC --partial -- job, the tmpfs 1/1.5 of the dataset
  source2  the job reading SRC with partial's compute time (partial's comparison)

The first three share --compute-ms (default: an epoch of compute as long as the copy at the
throttle, --epoch-ratio); partial and source2 share --io-compute-ms (small: reading bound).
Source bytes are sectors read from the loop device during a run, minus what a walk alone reads.
Root only (mounts, a loop device, a cgroup); all mounts are in a private mount namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stage as stage_bench  # noqa: E402  (benchmarks/stage.py: the dataset, the namespace)
from overlap_job import sectors_read, shape_options  # noqa: E402  (the job's own)
from overlap_report import MB, MODES, WIDE, Run, Setup, render, summarize  # noqa: E402

from shmstage.bench.throttle import blkio_throttle  # noqa: E402

JOB = Path(__file__).resolve().parent / "overlap_job.py"
SHMSTAGE = [sys.executable, "-m", "shmstage"]
NAME = "data"


def log(msg: str) -> None:
    stage_bench.log(msg)


def boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            st = os.lstat(os.path.join(d, f))
            out[os.path.relpath(os.path.join(d, f), root)] = (st.st_ino, st.st_size, st.st_ctime_ns)
    return out


class Publish(threading.Thread):
    """Watches for DEST/NAME to appear (the copy's publish); snapshots it then."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.at: float | None = None
        self.first: dict[str, tuple[int, int, int]] | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            if self.path.is_dir():
                self.at = boottime()
                self.first = snapshot(self.path)
                return
            time.sleep(0.01)


def supported() -> tuple[set[str], str | None]:
    """Which modes this shmstage can run, and what is missing."""
    text = subprocess.run([*SHMSTAGE, "run", "--help"], capture_output=True, text=True).stdout
    modes = {"stage", "source", "source2"}
    missing = []
    files = (
        subprocess.run(
            [sys.executable, "-c", "import shmstage.datasetfiles"], capture_output=True
        ).returncode
        == 0
    )
    for mode, flag in (("nowait", "--no-wait"), ("partial", "--partial")):
        if flag in text and files:
            modes.add(mode)
            modes |= {"nowait16", "noask"} if mode == "nowait" else set()
        else:
            missing.append(flag)
    if not files:
        missing.append("shmstage.datasetfiles")
    return modes, (", ".join(missing) + " not in this shmstage") if missing else None


def mount_source(s: Setup) -> None:
    subprocess.run(["mount", "-o", "ro,noload", s.loop, str(s.src)], check=True)


def one_run(mode: str, i: int, s: Setup, throttle, workdir: Path) -> Run:  # noqa: ANN001
    tmpfs = s.size * 2 // 3 if mode == "partial" else int(s.size * 1.2) + 64 * (1 << 20)
    stage_bench.mount_tmpfs(s.dest, tmpfs)
    mount_source(s)
    out = workdir / f"job-{mode}-{i}.json"
    out.unlink(missing_ok=True)
    compute = s.io_compute_ms if mode in ("partial", "source2") else s.compute_ms
    job = [sys.executable, str(JOB), "--epochs", str(s.epochs), "--batch", str(s.batch)]
    job += ["--compute-ms", f"{compute:g}", "--seed", str(i), "--device", Path(s.loop).name]
    workers = WIDE if mode == "nowait16" else s.workers
    job += ["--workers", str(workers), "--prefetch", str(s.prefetch)]
    job += ["--evict", str(s.src), "--json-out", str(out)]
    job += ["--ask-ahead", "0"] if mode == "noask" else []
    if mode in ("source", "source2"):
        argv = [*job, "--data", str(s.src), "--plain"]
    else:
        argv = [*SHMSTAGE, "run", "--stage", str(s.src), "--name", NAME, "--dest", str(s.dest)]
        # partial keeps the default reserve (10% of DEST), as a user's run would; the others
        # fit whole and need none
        argv += ["--no-service"] + ([] if mode == "partial" else ["--reserve", "0"])
        argv += ["--partial"] if mode == "partial" else []
        argv += ["--no-wait"] if mode.startswith("nowait") or mode == "noask" else []
        argv += ["--", *job, "--data", "{staged}"]
    watch = Publish(s.dest / NAME)
    watch.start()
    before = sectors_read(s.loop)
    t0 = boottime()
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, preexec_fn=throttle.enter, timeout=1800
        )
        if proc.returncode != 0:
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
            raise SystemExit(f"Error: {mode} run {i + 1} failed ({proc.returncode}): {tail}")
        read = sectors_read(s.loop) - before
        watch.done.set()
        watch.join()
        r = json.loads(out.read_text())
        resident = stable = None
        if watch.first is not None:
            last = snapshot(s.dest / NAME)
            resident = sum(v[1] for v in last.values())
            stable = last == watch.first
    finally:
        watch.done.set()
        subprocess.run(["umount", str(s.src)], check=False)
        subprocess.run(["umount", str(s.dest)], check=False)
    for n, e in enumerate(r["epochs"]):
        if e["bytes"] != s.size or r["files"] != s.files:
            raise SystemExit(
                f"Error: {mode} run {i + 1} epoch {n + 1} read {r['files']} files, {e['bytes']} "
                f"bytes; the dataset has {s.files}, {s.size}"
            )
    marks = [r["source_bytes_at_start"]] + [e["source_bytes"] for e in r["epochs"]]
    served = None
    if r["epochs"][0]["served"] is not None:  # cumulative: per epoch is the difference
        totals = [(0, 0)] + [tuple(e["served"]) for e in r["epochs"]]
        served = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(totals, totals[1:])]
    return Run(
        mode=mode,
        run=i,
        ttfb=r["first_batch"] - t0,
        startup=r["first_batch"] - r["exec"],
        staging=None if watch.at is None or mode.startswith("source") else watch.at - t0,
        epochs=[e["end"] - e["start"] for e in r["epochs"]],
        total=r["epochs"][-1]["end"] - t0,
        wait=r["wait_s"],
        source_bytes=read - s.metadata,
        epoch_source_bytes=[b - a for a, b in zip(marks, marks[1:])],
        resident_bytes=resident,
        stable=stable,
        served=served,
    )


def walk_metadata(loop: str, src: Path) -> int:
    """Bytes a listing of the freshly mounted tree reads (inodes, directories): not data.
    (The mount's own reads come before a run's count starts.)"""
    subprocess.run(["mount", "-o", "ro,noload", loop, str(src)], check=True)
    before = sectors_read(loop)
    try:
        for d, _, files in os.walk(src):
            for f in files:
                os.lstat(os.path.join(d, f))
    finally:
        subprocess.run(["umount", str(src)], check=True)
    return sectors_read(loop) - before


def make_image(data: Path, image: Path, size: int) -> None:
    if image.exists() and image.stat().st_mtime > data.stat().st_mtime:
        return
    mb = int(size * 1.25 / (1 << 20)) + 64
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-d", str(data), "-O", "^has_journal", str(image), f"{mb}M"],
        check=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=300, help="dataset size (default: 300)")
    ap.add_argument("--mbps", type=int, default=50, help="source read limit (default: 50)")
    ap.add_argument("--runs", type=int, default=3, help="runs per mode, interleaved; median")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    shape_options(ap)  # the job's --epochs, --batch, --workers, --prefetch
    ap.add_argument(
        "--compute-ms",
        type=float,
        help="sleep per batch for stage/nowait/source (default: from --epoch-ratio)",
    )
    ap.add_argument(
        "--epoch-ratio",
        type=float,
        default=1.0,
        help="an epoch of compute / the copy's time at --mbps (default: 1.0)",
    )
    ap.add_argument("--io-compute-ms", type=float, default=2.0, help="partial's and source2's")
    ap.add_argument("--workdir", default="/var/tmp/shmstage-bench-overlap")
    ap.add_argument("--json", metavar="FILE", help="also write every run's figures here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("Error: run as root: mounts, a loop device and a blkio cgroup")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    n = max(20, args.size_mb * MB // 100_000)
    ds = stage_bench.Dataset(f"imagenet-{n}", "imagenet", n, n * 100_000)
    data = stage_bench.ensure_dataset(ds, work)
    files = [os.path.join(d, f) for d, _, fs in os.walk(data) for f in fs]
    size = sum(os.path.getsize(f) for f in files)
    image = work / f"{ds.name}.ext4"
    make_image(data, image, size)
    available, skipped = supported()
    modes = [m for m in args.modes if m in available]
    batches = -(-len(files) // args.batch)
    compute = args.compute_ms
    if compute is None:
        compute = args.epoch_ratio * size / (args.mbps * MB) / batches * 1000
    stage_bench.enter_private_mount_namespace()
    loop = subprocess.run(
        ["losetup", "--find", "--show", "--read-only", "--direct-io=on", str(image)],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    src, dest = work / "src", work / "dest"
    src.mkdir(exist_ok=True)
    dest.mkdir(exist_ok=True)
    runs: list[Run] = []
    try:
        meta = walk_metadata(loop, src)
        setup = Setup(src, dest, loop, size, len(files), meta, compute, args.io_compute_ms,
                      args.batch, args.epochs, args.workers, args.prefetch)  # fmt: skip
        log(
            f"{len(files)} files, {size / MB:.0f} MB on {loop}, {args.mbps} MB/s; compute "
            f"{compute:.1f} ms/batch; metadata {setup.metadata / MB:.1f} MB; modes {modes}"
        )
        mount_source(setup)
        try:
            with blkio_throttle(src, args.mbps * MB, name="shmstage-bench-overlap") as throttle:
                subprocess.run(["umount", str(src)], check=True)
                for i in range(args.runs):
                    for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                        r = one_run(mode, i, setup, throttle, work)
                        runs.append(r)
                        log(
                            f"run {i + 1} {mode:8s} first batch {r.ttfb:6.2f} s, total "
                            f"{r.total:6.2f} s, epochs {' '.join(f'{e:.2f}' for e in r.epochs)}, "
                            f"staging {r.staging or 0:.2f} s, source {r.source_bytes / size:.3f}x"
                        )
        finally:
            subprocess.run(["umount", str(src)], capture_output=True, check=False)
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in runs], indent=1) + "\n")
    print(render(summarize(runs), setup, args, skipped))
    return 0


if __name__ == "__main__":
    shutil.which("mkfs.ext4") or sys.exit("Error: needs mkfs.ext4 (e2fsprogs)")
    sys.exit(main())
