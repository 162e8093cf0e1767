"""The floor of a copy into tmpfs: parallel `cat` (reads only) vs a bare copy loop vs `shmstage stage`.

    .venv/bin/python benchmarks/copy_floor.py /var/tmp/shmstage-bench/shards-4x536870912 --runs 5 --procs 2,4,8

As root: each run starts with a dropped page cache and copies into a tmpfs mounted in a private
mount namespace (never /dev/shm).  `bare N` is the least any copy of these files into tmpfs
does: N forked processes (default: one per CPU), each file opened once and sent with
sendfile(2) in 8 MiB steps (the source's pages dropped behind it), no walk, no checks, no
interpreter start-up.  `shmstage empty` stages an empty directory, cold: the fixed cost of a
stage (interpreter, imports, checks, exit), which `shmstage stage` adds to its copy.  The CPU
column is user + system seconds of the tool and its children: a copy that uses well under
all the CPUs for its time waits on the disk, not on filling pages.
"""

from __future__ import annotations

import argparse
import os
import resource
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


def _cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def timed(tool: str, src: Path, dest: Path, empty: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the children) of one run of ``tool``."""
    cpu, start = _cpu(), time.perf_counter()
    if tool == "cat":
        script = 'find "$1" -type f -print0 | xargs -0 -r -P 8 -n 1 cat > /dev/null'
        subprocess.run(["bash", "-c", script, "bash", str(src)], check=True)
    elif tool.startswith("bare"):
        bare(src, dest, int(tool.split()[1]))
    else:
        exe = Path(sys.executable).with_name("shmstage")
        top = empty if tool == "shmstage empty" else src
        argv = [str(exe), "stage", str(top), "--dest", str(dest), "--name", "floor", "-q"]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start, _cpu() - cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="a directory of big files on a real disk")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument(
        "--procs", default="", help="bare loops to time, e.g. 2,4,8 (default: one per CPU)"
    )
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("Error: run as root (drop_caches, a private tmpfs)")
    if not os.environ.get("_COPY_FLOOR_NS"):  # mounts made here vanish with the namespace
        env = {**os.environ, "_COPY_FLOOR_NS": "1"}
        argv = ["unshare", "--mount", "--propagation", "private", sys.executable, *sys.argv]
        return subprocess.run(argv, env=env).returncode
    size = sum(f.stat().st_size for f in args.src.iterdir() if f.is_file())
    mnt = Path("/mnt")
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={2 * size + (1 << 30)}", "tmpfs", str(mnt)],
        check=True,
    )
    cpus = len(os.sched_getaffinity(0))
    procs = [int(n) for n in args.procs.split(",") if n] or [cpus]
    tools = ("cat", *(f"bare {n}" for n in procs), "shmstage", "shmstage empty")
    empty = mnt / "empty-source"  # in the tmpfs: the fixed cost reads no disk but its own start
    empty.mkdir()
    times: dict[str, list[tuple[float, float]]] = {t: [] for t in tools}
    for i in range(args.runs):
        k = i % len(tools)
        for tool in tools[k:] + tools[:k]:
            dest = mnt / "dest"
            dest.mkdir()
            drop_caches()
            times[tool].append(timed(tool, args.src, dest, empty))
            shutil.rmtree(dest)
    print(f"{size / 1e9:.2f} GB in {args.src}, {cpus} CPUs, median of {args.runs} (cold cache):")
    print(f"  {'tool':<15} {'wall':>7}  {'MB/s':>7}  {'vs cat':>6}  {'CPU':>6}  runs (s)")
    cat = statistics.median(w for w, _ in times["cat"])
    for tool in tools:
        med = statistics.median(w for w, _ in times[tool])
        cpu = statistics.median(c for _, c in times[tool])
        runs = " ".join(f"{w:.2f}" for w, _ in times[tool])
        rate = f"{size / med / 1e6:7,.0f}" if tool != "shmstage empty" else f"{'-':>7}"
        print(f"  {tool:<15} {med:6.2f}s  {rate}  {cat / med:6.0%}  {cpu:5.2f}s  {runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
