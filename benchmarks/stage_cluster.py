"""Cluster staging benchmark: N nodes staging alone (naive) vs reading the source once.

    sudo .venv/bin/python benchmarks/stage_cluster.py                   # 650 MB, 2 and 4 nodes
    sudo .venv/bin/python benchmarks/stage_cluster.py --size-mb 100     # a quick run

Each "node" is a process in a mount namespace of its own with its own tmpfs at DEST and its
own read-only direct-I/O loop device of one ext4 image mounted at SRC, so no two nodes share
a page cache for the source (as NFS clients do not).  All nodes run in ONE blkio cgroup that
throttles reads of the disk under the image to --mbps (the stand-in for one file server
shared by the cluster).  Source bytes are the sectors read from the loop devices minus what
a mount and a walk alone read (metadata: a fixed cost per node, measured first).  The
dataset is cold (fresh mounts of direct-I/O loop devices, page cache dropped); shmstage's
and torch's own files are loaded once before each run, as they are on a node's local disk.

Root only (mounts, loop devices, cgroups).  The data and image are kept in --workdir.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from shmstage.bench.stage import blkio_throttle

MB = 1_000_000


@dataclass(frozen=True)
class Result:
    nodes: int
    mode: str  # "naive" or "read-once"
    wall: float  # seconds from starting the nodes to the last one done
    staged: float  # the slowest node's own staging time (stage --json "seconds")
    source_bytes: int  # data read from the source by all nodes together (metadata excluded)
    dataset_bytes: int


def make_data(root: Path, size: int, seed: int = 13) -> int:
    """An ImageNet-like tree: 100 class folders, files lognormal around 110 KB."""
    if (root / ".done").exists():
        return int((root / ".done").read_text())
    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(seed)
    total = i = 0
    while total < size:
        n = min(size - total, max(1, int(rng.lognormvariate(11.5, 0.6))))
        d = root / f"n{i % 100:05d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"img{i:07d}.JPEG").write_bytes(os.urandom(n))
        total += n
        i += 1
    (root / ".done").write_text(str(total))
    return total


def make_image(data: Path, image: Path, size: int) -> None:
    if image.exists() and image.stat().st_mtime > (data / ".done").stat().st_mtime:
        return
    mb = int(size * 1.25 / (1 << 20)) + 64
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-d", str(data), "-O", "^has_journal", str(image), f"{mb}M"],
        check=True,
    )


def sectors(devs: list[str]) -> int:
    return 512 * sum(
        int(Path(f"/sys/block/{os.path.basename(d)}/stat").read_text().split()[2]) for d in devs
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def warm_software() -> None:
    """Load shmstage and torch's libraries into the page cache after dropping it: they sit
    on the throttled disk here, while on a cluster they are on each node's own disk, not
    on the file server (cold for torch, they take seconds of the 100 MB/s budget)."""
    subprocess.run(
        [sys.executable, "-c", "import shmstage.cli, shmstage.cluster, torch.distributed"],
        check=True,
    )


def run_nodes(devs, src, dest, tmpfs_size, throttle, cluster: bool, extra: list[str]):
    exe = shutil.which("shmstage", path=os.path.dirname(sys.executable)) or "shmstage"
    port = free_port()
    procs = []
    t0 = time.monotonic()
    for rank, dev in enumerate(devs):
        flags = (
            f"--nodes {len(devs)} --node-rank {rank} --rendezvous 127.0.0.1:{port}"
            if cluster
            else ""
        )
        script = (
            f"mount -o ro,noload {dev} {src} && "
            f"mount -t tmpfs -o size={tmpfs_size} bench {dest} && "
            f"exec {exe} stage {src} --name data --dest {dest} --reserve 0 --json "
            f"{flags} {' '.join(extra)}"
        )
        procs.append(
            subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=throttle.enter,
            )
        )
    staged = 0.0
    for p in procs:
        out, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a node failed ({p.returncode}): {err.strip()}")
        staged = max(staged, json.loads(out)["seconds"])
    return time.monotonic() - t0, staged


def metadata(devs: list[str], src: Path) -> int:
    """What mounting and walking the image costs each node (not data)."""
    before = sectors(devs)
    for dev in devs:
        subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f"mount -o ro,noload {dev} {src} && find {src} -printf '%s %m %T@\\n' >/dev/null"],
            check=True,
        )  # fmt: skip
    return sectors(devs) - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=650)
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mbps", type=int, default=100, help="source read limit, all nodes together")
    ap.add_argument("--workdir", default="/var/tmp/shmstage-bench-cluster")
    ap.add_argument("--modes", nargs="+", default=["naive", "read-once"])
    ap.add_argument("--runs", type=int, default=3, help="runs per mode, interleaved; median")
    ap.add_argument("--json", dest="as_json", action="store_true")
    ap.add_argument("stage_args", nargs="*", help="more `shmstage stage` options (after --)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: mounts, loop devices and a blkio cgroup")
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"data-{a.size_mb}mb"
    size = make_data(data, a.size_mb * MB)
    image = work / f"image-{a.size_mb}mb.ext4"
    make_image(data, image, size)
    src, dest = work / "src", work / "shm"
    src.mkdir(exist_ok=True)
    dest.mkdir(exist_ok=True)
    tmpfs = f"{int(size * 1.2) // (1 << 20) + 64}M"
    results: list[Result] = []
    for n in a.nodes:
        devs = []
        try:
            for _ in range(n):
                devs.append(
                    subprocess.run(
                        ["losetup", "--find", "--show", "--read-only", "--direct-io=on", str(image)],
                        check=True, capture_output=True, text=True,
                    ).stdout.strip()
                )  # fmt: skip
            meta = metadata(devs, src)
            with blkio_throttle(image, a.mbps * MB, name="shmstage-bench-cluster") as throttle:
                for mode in [m for _ in range(a.runs) for m in a.modes]:
                    drop_caches()
                    warm_software()
                    before = sectors(devs)
                    wall, staged = run_nodes(
                        devs, src, dest, tmpfs, throttle, mode == "read-once", a.stage_args
                    )
                    read = sectors(devs) - before - meta
                    results.append(Result(n, mode, wall, staged, read, size))
                    print(
                        f"{n} nodes {mode:9s}: wall {wall:6.1f} s (staging {staged:6.1f} s), "
                        f"source {read / MB:7.0f} MB = {read / size:4.2f}x the dataset",
                        file=sys.stderr,
                    )
        finally:
            for dev in devs:
                subprocess.run(["losetup", "-d", dev], check=False)
    if a.as_json:
        print(json.dumps([asdict(r) for r in results], indent=2))
        return
    bw = a.mbps * MB
    print(f"{size / MB:.0f} MB dataset, source throttled to {a.mbps} MB/s for all nodes together")
    print(
        "| nodes | mode | wall s (median) | runs min-max s | staging s | source MB | x dataset "
        "| model s | wall / naive |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for n in a.nodes:
        naive = None
        for mode in a.modes:
            rs = [r for r in results if r.nodes == n and r.mode == mode]
            wall = statistics.median(r.wall for r in rs)
            staged = statistics.median(r.staged for r in rs)
            read = statistics.median(r.source_bytes for r in rs)
            naive = wall if mode == "naive" else naive
            model = n * size / bw if mode == "naive" else size / bw
            ratio = f"{wall / naive:.2f}" if naive else "-"
            print(
                f"| {n} | {mode} | {wall:.1f} | {min(r.wall for r in rs):.1f}-"
                f"{max(r.wall for r in rs):.1f} | {staged:.1f} | {read / MB:.0f} | "
                f"{read / size:.2f} | {model:.1f} | {ratio} |"
            )


if __name__ == "__main__":
    main()
