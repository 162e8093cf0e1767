"""The floor of a copy into tmpfs: parallel `cat` (reads only) vs a bare copy loop vs `shmstage stage`.

    .venv/bin/python benchmarks/copy_floor.py /var/tmp/shmstage-bench/shards-4x536870912 --runs 5

As root: each run starts with a dropped page cache and copies into a tmpfs mounted in a private
mount namespace (never /dev/shm).  `bare` is the least any copy of these files into tmpfs does:
one process per CPU, each file opened once and sent with sendfile(2) in 8 MiB steps (the
source's pages dropped behind it), no walk, no checks, no interpreter start-up.  When `cat`
reads the disk faster than `bare` can write tmpfs pages, no copier reaches `cat`: the copy is
bound by the CPUs filling new pages, which `cat` (it discards what it reads) never does.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEP = 8 << 20


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def bare(src: Path, dest: Path, procs: int) -> None:
    """One forked process per CPU, files dealt round-robin, sendfile in STEP pieces."""
    files = sorted(p.name for p in src.iterdir() if p.is_file())
    pids = []
    for k in range(procs):
        pid = os.fork()
        if pid == 0:  # the child copies its share and exits at once
            for name in files[k::procs]:
                fi = os.open(src / name, os.O_RDONLY)
                fo = os.open(dest / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                size, off = os.fstat(fi).st_size, 0
                os.posix_fadvise(fi, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                while off < size:
                    n = os.sendfile(fo, fi, off, min(STEP, size - off))
                    os.posix_fadvise(fi, off, n, os.POSIX_FADV_DONTNEED)
                    off += n
                os.close(fo)
                os.close(fi)
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)


def timed(tool: str, src: Path, dest: Path, procs: int) -> float:
    start = time.perf_counter()
    if tool == "cat":
        script = 'find "$1" -type f -print0 | xargs -0 -r -P 8 -n 1 cat > /dev/null'
        subprocess.run(["bash", "-c", script, "bash", str(src)], check=True)
    elif tool == "bare":
        bare(src, dest, procs)
    else:
        exe = Path(sys.executable).with_name("shmstage")
        argv = [str(exe), "stage", str(src), "--dest", str(dest), "--name", "floor", "-q"]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="a directory of big files on a real disk")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("Error: run as root (drop_caches, a private tmpfs)")
    if not os.environ.get("_COPY_FLOOR_NS"):  # mounts made here vanish with the namespace
        env = {**os.environ, "_COPY_FLOOR_NS": "1"}
        argv = ["unshare", "--mount", "--propagation", "private", sys.executable, *sys.argv]
        return subprocess.run(argv, env=env).returncode
    size = sum(f.stat().st_size for f in args.src.iterdir() if f.is_file())
    mnt = Path("/mnt")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={2 * size + (1 << 30)}", "tmpfs", str(mnt)], check=True)
    procs = len(os.sched_getaffinity(0))
    tools = ("cat", "bare", "shmstage")
    times: dict[str, list[float]] = {t: [] for t in tools}
    for i in range(args.runs):
        for tool in tools[i % 3 :] + tools[: i % 3]:
            dest = mnt / tool
            dest.mkdir()
            drop_caches()
            times[tool].append(timed(tool, args.src, dest, procs))
            shutil.rmtree(dest)
    print(f"{size / 1e9:.2f} GB in {args.src}, {procs} CPUs, median of {args.runs} (cold cache):")
    cat = statistics.median(times["cat"])
    for tool in tools:
        med = statistics.median(times[tool])
        runs = " ".join(f"{t:.2f}" for t in times[tool])
        print(f"  {tool:<9} {med:6.2f} s  {size / med / 1e6:7,.0f} MB/s  {cat / med:5.0%} of cat  ({runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
