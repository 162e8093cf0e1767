"""What reading a source as the caller costs (issue 22 item 3): staging throughput and a no-op
stage's time, in-process as root vs with ``reader=`` (each read switches this thread's fsuid,
the walk checks every file's read access as the reader), on the ImageNet-like tree of
benchmarks/stage.py (20k files, lognormal around 100 KB, 100 folders) read from a warm page
cache into a tmpfs.

Run as root (it mounts a tmpfs in a private mount namespace of its own):

    python benchmarks/stage_reader.py [--scale 1.0] [--runs 5] [--workdir /var/tmp/shmstage-bench]

Each stage runs in a forked child (the reader's, after adopt_groups, as the node service runs
it); runs alternate between the two modes so that drift on a shared machine hits both.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stage import datasets, ensure_dataset  # noqa: E402 - benchmarks/stage.py's shapes

from shmstage.identity import Caller, adopt_groups  # noqa: E402
from shmstage.libc import load_libc  # noqa: E402
from shmstage.stage import engine  # noqa: E402
from shmstage.stage.sources.walk import walk  # noqa: E402

READER = Caller(4399, 4399, ())


def in_child(fn: Callable[[], Any]) -> Any:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = fn()
        except BaseException as e:  # noqa: BLE001 - said by the parent
            out = e
        with os.fdopen(w, "wb") as f:
            pickle.dump(out, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    out = pickle.loads(data)
    if isinstance(out, BaseException):
        raise out
    return out


def stage_once(src: Path, dest: Path, reader: Caller | None) -> float:
    def run() -> float:
        if reader is not None:
            adopt_groups(reader)
        t0 = time.perf_counter()
        engine.stage(str(src), dest=str(dest), reader=reader)
        return time.perf_counter() - t0

    return in_child(run)


def walk_once(src: Path, reader: Caller | None) -> float:
    """The listing a no-op stage makes (the walk; with a reader, its access checks too)."""
    from shmstage.stage.sources.directory import DirSource

    def run() -> float:
        if reader is not None:
            adopt_groups(reader)
        t0 = time.perf_counter()
        DirSource(str(src), reader=reader).listing()
        return time.perf_counter() - t0

    return in_child(run)


def private_tmpfs(size: str) -> Path:
    libc = load_libc()
    libc.unshare.argtypes = [ctypes.c_int]
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise SystemExit("needs root: unshare(CLONE_NEWNS) failed")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    where = Path(tempfile.mkdtemp(prefix="shmstage-reader-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    return where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the 20k-file tree")
    ap.add_argument("--runs", type=int, default=5, help="stages per mode")
    ap.add_argument("--noops", type=int, default=5, help="no-op stages per mode after each stage")
    ap.add_argument("--workdir", default="/var/tmp/shmstage-bench", help="where the tree lives")
    args = ap.parse_args()
    ds = datasets(args.scale)["imagenet"]
    src = ensure_dataset(ds, Path(args.workdir))
    for dirpath, _dirs, files in os.walk(src):  # a warm page cache: the CPU cost is measured
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                while fh.read(1 << 20):
                    pass
    total = sum(e[2] for e in walk(str(src)).entries if e[1] == "f")
    dest_root = private_tmpfs(f"{int(total * 2.6) + (512 << 20)}")  # one copy per mode
    times: dict[str, list[float]] = {"root": [], "reader": []}
    noop: dict[str, list[float]] = {"root": [], "reader": []}
    walks: dict[str, list[float]] = {"root": [], "reader": []}
    for run in range(args.runs):
        for mode in ("root", "reader") if run % 2 == 0 else ("reader", "root"):
            reader = READER if mode == "reader" else None
            dest = dest_root / mode
            shutil.rmtree(dest, ignore_errors=True)
            times[mode].append(stage_once(src, dest, reader))
        for _ in range(args.noops):  # interleaved: the machine's drift hits both alike
            for mode in ("root", "reader"):
                reader = READER if mode == "reader" else None
                noop[mode].append(stage_once(src, dest_root / mode, reader))
                walks[mode].append(walk_once(src, reader))
        for mode in ("root", "reader"):
            shutil.rmtree(dest_root / mode)
    gb = total / 1e9

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    print(f"{ds.files} files, {gb:.2f} GB, {args.runs} runs per mode, medians:")
    for mode in ("root", "reader"):
        print(
            f"  {mode:6s}: stage {med(times[mode]):6.2f} s ({gb / med(times[mode]):5.2f} GB/s), "
            f"no-op stage {med(noop[mode]) * 1e3:6.1f} ms, walk {med(walks[mode]) * 1e3:6.1f} ms"
        )
    slower = med(times["reader"]) / med(times["root"]) - 1
    print(f"  reader vs root: staging {slower * 100:+.1f} %, no-op "
          f"{(med(noop['reader']) - med(noop['root'])) * 1e3:+.1f} ms, walk "
          f"{(med(walks['reader']) - med(walks['root'])) * 1e3:+.1f} ms")  # fmt: skip
    subprocess.run(["umount", str(dest_root)], check=False)


if __name__ == "__main__":
    main()
