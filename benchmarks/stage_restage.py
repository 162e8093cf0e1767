"""The engine's own cost on the paths that are not a first copy: a re-stage after a few files
changed, a resume of a killed copy, and a tar archive; code trees compared side by side.

    .venv/bin/python benchmarks/stage_restage.py --runs 5 --tree before=/path/to/old/checkout --tree after=.

Each ``--tree`` is a checkout whose ``shmstage`` package is imported (PYTHONPATH) by a fresh
interpreter per run; the runs of the trees are interleaved.  Source and destinations live in one
tmpfs (as root: mounted in a private mount namespace; otherwise under /dev/shm), so what is
timed is the engine (walk, plan, fit, links, manifest, publish), not a disk.  Steps per run:

- ``first``: the first copy into an empty store (the streaming path).
- ``restage``: 1% of the files rewritten (new size), then ``stage`` again: links the rest.
- ``resume``: a first copy killed (SIGKILL) with half of its files in partial/, then ``stage``
  again, which keeps those and copies the rest.
- ``tar``: an uncompressed tar of the tree staged into an empty store.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

STAGE = (  # staging into one store: stage/staging.py since issue 21, engine.py before it
    "import sys\n"
    "try:\n    import shmstage.stage.staging as e\n"
    "except ImportError:\n    import shmstage.stage.engine as e\n"
    "ds = e.stage(sys.argv[1], dest=sys.argv[2], name='ds'); print(ds.copied_bytes)"
)


def make_tree(root: str, files: int) -> None:
    per_dir = 1000
    for i in range(files):
        d = os.path.join(root, f"d{i // per_dir:04d}")
        if i % per_dir == 0:
            os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i:07d}.bin"), "wb") as f:
            f.write(os.urandom(1024))


def run_stage(tree: str, src: str, dest: str, env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", STAGE, src, dest],
        env={**os.environ, "PYTHONPATH": tree, **(env or {})},
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - t0


def interrupted(tree: str, src: str, dest: str) -> None:
    """A killed first copy, the same every run: SIGKILL at the end of the build
    (SHMSTAGE_TEST_KILL_AT=build), then half of the partial tree's directories emptied,
    as if the kill had come halfway."""
    subprocess.run(
        [sys.executable, "-c", STAGE, src, dest],
        env={**os.environ, "PYTHONPATH": tree, "SHMSTAGE_TEST_KILL_AT": "build"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    part = os.path.join(dest, ".shmstage", "partial", "ds")
    for d in sorted(os.listdir(part))[::2]:
        for f in os.listdir(os.path.join(part, d)):
            os.unlink(os.path.join(part, d, f))


def one_run(trees: dict[str, str], src: str, tarball: str, work: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for label, tree in trees.items():
        dest = os.path.join(work, f"dest-{label}")
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest)
        first = run_stage(tree, src, dest)  # the streaming first copy (vs peers: benchmarks/stage.py)
        changed = sorted(os.listdir(os.path.join(src, "d0000")))[:10]
        for name in changed:  # 1% of a 1000-file directory (and one of the tree's mtimes)
            with open(os.path.join(src, "d0000", name), "ab") as f:
                f.write(b"x")
        r = {"first": first, "restage": run_stage(tree, src, dest)}
        shutil.rmtree(dest)
        os.makedirs(dest)
        interrupted(tree, src, dest)
        r["resume"] = run_stage(tree, src, dest)
        shutil.rmtree(dest)
        os.makedirs(dest)
        r["tar"] = run_stage(tree, tarball, dest)
        shutil.rmtree(dest)
        out[label] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="LABEL=CHECKOUT")
    ap.add_argument("--files", type=int, default=50_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workdir", default=None, help="default: a temporary directory")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    trees = {k: os.path.abspath(v) for k, v in trees.items()}
    if os.geteuid() == 0 and not os.environ.get("_RESTAGE_NS"):  # a tmpfs of our own
        os.environ["_RESTAGE_NS"] = "1"
        here = os.path.abspath(__file__)
        cmd = ["unshare", "--mount", "--propagation", "private", sys.executable, here]
        os.execvp("unshare", cmd + sys.argv[1:])
    work = tempfile.mkdtemp(prefix="shmstage-restage-", dir=args.workdir or "/dev/shm")
    if os.environ.get("_RESTAGE_NS"):
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4G", "tmpfs", work], check=True)
    try:
        src = os.path.join(work, "src")
        make_tree(src, args.files)
        tarball = os.path.join(work, "src.tar")
        with tarfile.open(tarball, "w") as tf:
            tf.add(src, arcname=".")
        runs = [one_run(trees, src, tarball, work) for _ in range(args.runs)]
    finally:
        if os.environ.get("_RESTAGE_NS"):
            subprocess.run(["umount", work], check=False)
        shutil.rmtree(work, ignore_errors=True)
    med = {
        label: {step: statistics.median(r[label][step] for r in runs) for step in runs[0][label]}
        for label in trees
    }
    if args.json:
        print(json.dumps({"runs": runs, "median": med}, indent=1))
        return
    labels = list(trees)
    print(f"{args.files} files x 1 KiB, median of {args.runs} runs (seconds)\n")
    print("| step | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(labels))
    for step in med[labels[0]]:
        print(f"| {step} | " + " | ".join(f"{med[lb][step]:.2f}" for lb in labels) + " |")


if __name__ == "__main__":
    main()
