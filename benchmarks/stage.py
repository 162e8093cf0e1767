"""Staging benchmark: `shmstage stage` vs `cp -a`, `rsync -a`, `tar | tar` and parallel `cat`, on four shapes.

    .venv/bin/python benchmarks/stage.py --write-docs           # as root: the table in docs/benchmarks.md
    .venv/bin/python benchmarks/stage.py --scale 0.02 --runs 1  # a quick smoke run

Shapes (generated deterministically on the real disk under --workdir, reused while present):
ImageNet-like (20k files, lognormal around 100 KB, 100 class folders, ~2 GB), shards (4 x 512 MiB),
tiny (50k x 2 KiB), and the ImageNet-like tree read through a 200 MB/s blkio throttle.  As root every
run starts with a dropped page cache and copies into a tmpfs mounted in a private mount namespace;
otherwise pass --dest (a tmpfs directory) and runs start with a warm cache.  The timing and
checking live in shmstage.bench.stage; this script makes the data, the tmpfs and the report.
"""

from __future__ import annotations

import argparse
import compileall
import ctypes
import datetime as dt
import json
import math
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

import shmstage
from shmstage.bench.stage import (
    LABELS,
    PEERS,
    TOOLS,
    BenchError,
    StageBenchResult,
    format_markdown,
    run_stage_benchmark,
)
from shmstage.errors import ShmstageError
from shmstage.sizes import format_size, parse_size
from shmstage.system import disk_usage, memory, mount_of

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
SEED = 20240917


# --- datasets -------------------------------------------------------------------


@dataclass(frozen=True)
class Dataset:
    name: str  # directory name under the work dir
    kind: str  # imagenet | shards | tiny
    files: int
    approx_bytes: int


@dataclass(frozen=True)
class Shape:
    key: str
    title: str
    dataset: Dataset
    throttled: bool


def datasets(scale: float) -> dict[str, Dataset]:
    n_img = max(100, round(20_000 * scale))
    n_tiny = max(100, round(50_000 * scale))
    shard = max(MiB, int(512 * MiB * scale) // 4096 * 4096)
    return {
        "imagenet": Dataset(f"imagenet-{n_img}", "imagenet", n_img, n_img * 100_000),
        "shards": Dataset(f"shards-4x{shard}", "shards", 4, 4 * shard),
        "tiny": Dataset(f"tiny-{n_tiny}", "tiny", n_tiny, n_tiny * 2048),
    }


def shapes(scale: float, throttle_mb: int) -> dict[str, Shape]:
    d = datasets(scale)
    return {
        "imagenet": Shape("imagenet", "ImageNet-like tree", d["imagenet"], False),
        "shards": Shape("shards", "Large shards", d["shards"], False),
        "tiny": Shape("tiny", "Many tiny files", d["tiny"], False),
        "throttled": Shape(
            "throttled",
            f"ImageNet-like tree, disk throttled to {throttle_mb} MB/s",
            d["imagenet"],
            True,
        ),
    }


class _Bytes:
    """Deterministic incompressible content: slices of one seeded random pool."""

    def __init__(self, rng: random.Random, size: int = 16 * MiB) -> None:
        self.pool = rng.getrandbits(size * 8).to_bytes(size, "little")
        self.rng = rng

    def write(self, path: Path, n: int) -> None:
        with open(path, "wb") as f:
            while n > 0:
                start = self.rng.randrange(len(self.pool))
                chunk = self.pool[start : start + min(n, 4 * MiB)]
                f.write(chunk)
                n -= len(chunk)


def generate(ds: Dataset, root: Path) -> None:
    rng = random.Random(f"{SEED}-{ds.name}")
    data = _Bytes(rng)
    root.mkdir(parents=True)
    if ds.kind == "imagenet":
        classes = min(100, ds.files)
        sigma = 0.6  # mean of the lognormal = 100 KB: mu = ln(mean) - sigma^2 / 2
        mu = math.log(100_000) - sigma**2 / 2
        for c in range(classes):
            (root / f"n{c:08d}").mkdir()
        for i in range(ds.files):
            size = int(min(4 * MiB, max(2048, rng.lognormvariate(mu, sigma))))
            c = i % classes
            data.write(root / f"n{c:08d}" / f"n{c:08d}_{i:06d}.JPEG", size)
    elif ds.kind == "shards":
        size = ds.approx_bytes // ds.files
        for i in range(ds.files):
            data.write(root / f"train-{i:05d}-of-{ds.files:05d}.tar", size)
    else:
        dirs = max(1, ds.files // 500)
        for d in range(dirs):
            (root / f"d{d:03d}").mkdir()
        for i in range(ds.files):
            data.write(root / f"d{i % dirs:03d}" / f"s{i:06d}.json", 2048)


def ensure_dataset(ds: Dataset, workdir: Path) -> Path:
    """The dataset's directory, generated unless a complete copy is already there."""
    path = workdir / ds.name
    marker = workdir / f"{ds.name}.done"  # beside the tree, never inside it
    if path.is_dir() and marker.exists():
        return path
    free = disk_usage(workdir).free
    if free < ds.approx_bytes * 1.3 + 512 * MiB:
        raise SystemExit(
            f"Error: {workdir} has {format_size(free)} free; {ds.name} needs about "
            f"{format_size(ds.approx_bytes)}: free space or pass --workdir elsewhere"
        )
    partial = workdir / f"{ds.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    log(f"generating {ds.name} (~{format_size(ds.approx_bytes)}, {ds.files} files) in {workdir}")
    start = time.monotonic()
    generate(ds, partial)
    os.sync()
    partial.rename(path)
    marker.write_text(json.dumps(asdict(ds)) + "\n")
    log(f"generated {ds.name} in {time.monotonic() - start:.0f} s")
    return path


# --- the tmpfs ------------------------------------------------------------------

CLONE_NEWNS = 0x00020000
MS_REC = 16384
MS_PRIVATE = 1 << 18


def enter_private_mount_namespace() -> None:
    """Mounts made from now on are invisible to the rest of the machine and die with this process."""
    libc = ctypes.CDLL(None, use_errno=True)
    if (
        libc.unshare(CLONE_NEWNS) != 0
        or libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0
    ):
        raise SystemExit(
            f"Error: cannot enter a private mount namespace: {os.strerror(ctypes.get_errno())}"
        )


def mount_tmpfs(path: Path, size: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(path)], check=True
    )


# --- report ---------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    text: str
    met: bool


def targets(shape: Shape, r: StageBenchResult, throttle_mb: int) -> list[Target]:
    names = {t.tool for t in r.tools}
    if "shmstage" not in names:
        return []
    out = []
    peers = [p for p in PEERS if p in names]
    if peers:
        worst = min(peers, key=lambda p: r.get(p).vs_shmstage or 0)
        out.append(
            Target(
                f"beats every peer (closest: {LABELS[worst]} at {r.get(worst).vs_shmstage:.2f}×)",
                all((r.get(p).vs_shmstage or 0) > 1 for p in peers),
            )
        )
    if shape.key == "imagenet" and "rsync" in names:
        v = r.get("rsync").vs_shmstage or 0
        out.append(Target(f"≥ 2× rsync -a ({v:.2f}×)", v >= 2))
    if "cat" in names:  # every shape (issue 20, item 30)
        v = r.get("cat").vs_shmstage or 0  # cat's time / shmstage's: the share of cat's reading
        out.append(Target(f"≥ 90% of what parallel cat reads ({v:.0%})", v >= 0.9))
    if shape.key == "shards" and "cp" in names:
        v = r.get("cp").vs_shmstage or 0
        out.append(Target(f"≥ 2× cp -a ({v:.2f}×)", v >= 2))
    if shape.throttled:
        mbs = r.get("shmstage").mb_per_s
        out.append(
            Target(
                f"≥ 95% of the {throttle_mb} MB/s throttle ({mbs:.1f} MB/s = {mbs / throttle_mb:.2%})",
                mbs >= 0.95 * throttle_mb,
            )
        )
    return out


def machine() -> str:
    mem = memory().total / (1 << 30)
    disk = "disk"
    try:
        st = os.stat("/var/tmp")
        node = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
        disk = f"{'virtio' if 'virtio' in str(node) else 'block'} disk ({node.name})"
    except OSError:
        pass
    return (
        f"{os.cpu_count()} vCPU, {mem:.0f} GiB RAM, {disk}, Linux {platform.release()}; "
        "shared with other jobs, so timings are noisy"
    )


def render(
    results: list[tuple[Shape, StageBenchResult]], args: argparse.Namespace, cold: bool
) -> str:
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = ".venv/bin/python benchmarks/stage.py" + "".join(
        f" {shlex.quote(a)}" for a in sys.argv[1:]
    )
    lines = [
        f"Command (as root): `{cmd}`  ",
        f"Date: {when}. Machine: {machine()}.  ",
        f"Each tool ran {args.runs}× per shape, interleaved; the table gives the median. "
        + (
            "The page cache was dropped before every run; "
            if cold
            else "The source was in the page cache; "
        )
        + "the destination is a tmpfs. MB = 10⁶ bytes. "
        "*shmstage speedup* = the tool's median time / shmstage's (> 1: shmstage is faster); "
        "`cat` only reads (to /dev/null): the reference for reading, not a peer (nor the disk's own "
        "limit: fewer, bigger reads can beat it on big files). "
        "shmstage runs with its bytecode compiled, as an installed package does.",
        "",
    ]
    summary = []
    for shape, r in results:
        if isinstance(r, str):
            lines += [f"### {shape.title}", "", f"Failed: {r}", ""]
            summary.append(False)
            continue
        lines.append(f"### {shape.title}: {r.files:,} files, {r.bytes / 1e9:.2f} GB")
        lines.append("")
        lines.append(format_markdown(r))
        lines.append("")
        for t in targets(shape, r, args.throttle):
            mark = "met" if t.met else "**missed**"
            lines.append(f"- {t.text}: {mark}")
            summary.append(t.met)
        lines.append("")
    if summary:
        lines.append(f"Targets met: {sum(summary)} of {len(summary)}.")
    return "\n".join(lines).rstrip() + "\n"


def write_docs(path: Path, body: str) -> None:
    text = path.read_text()
    head = "## Staging\n"
    start = text.index(head) + len(head)
    end = text.find("\n## ", start)
    end = len(text) if end < 0 else end + 1
    section = f"\n_(benchmarks/stage.py)_\n\n{body}\n"
    path.write_text(text[:start] + section + text[end:])


def usage(msg: str) -> NoReturn:
    print(f"Error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- main -----------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--runs", type=int, default=5, help="timed runs per tool and shape (median; default 5)"
    )
    p.add_argument(
        "--shapes",
        default="imagenet,shards,tiny,throttled",
        help="comma-separated shapes: imagenet, shards, tiny, throttled",
    )
    p.add_argument(
        "--tools",
        default=",".join(TOOLS),
        help=f"comma-separated tools (default {','.join(TOOLS)})",
    )
    p.add_argument(
        "--scale", type=float, default=1.0, help="scale every dataset (0.02 for a quick run)"
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path("/var/tmp/shmstage-bench"),
        help="where datasets are generated: a real disk, not tmpfs (default /var/tmp/shmstage-bench)",
    )
    p.add_argument(
        "--dest",
        type=Path,
        help="copy into this directory instead of a private tmpfs (needed without root)",
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the generated datasets for the next run"
    )
    p.add_argument(
        "--json", type=Path, metavar="PATH", help="also write all results as JSON to PATH"
    )
    p.add_argument(
        "--throttle",
        type=int,
        default=200,
        help="read throttle for the throttled shape, MB/s (default 200)",
    )
    p.add_argument("--workers", type=int, help="pass --workers N to shmstage stage")
    p.add_argument(
        "--baseline",
        type=Path,
        metavar="CHECKOUT",
        help="also time the shmstage of another checkout (tool 'baseline': before/after side by "
        "side), e.g. `git worktree add /tmp/before REV`",
    )
    p.add_argument(
        "--warm", action="store_true", help="keep the page cache warm instead of dropping it (root)"
    )
    p.add_argument(
        "--write-docs",
        nargs="?",
        const=REPO / "docs" / "benchmarks.md",
        type=Path,
        metavar="PATH",
        help="write the tables into the Staging section of docs/benchmarks.md (or PATH)",
    )
    return p.parse_args(argv)


def as_installed(pycache: Path, baseline: Path | None = None) -> None:
    """Run shmstage as an installed package runs: with its modules' bytecode cached (kept in
    ``pycache``, outside the tree).  An editable install under PYTHONDONTWRITEBYTECODE
    compiles every module at every start (~0.06 s of each run here); the peers are binaries."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(pycache)
    sys.pycache_prefix = str(pycache)
    compileall.compile_dir(str(Path(shmstage.__file__).parent), quiet=1)
    if baseline is not None:
        compileall.compile_dir(str(baseline / "shmstage"), quiet=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = os.geteuid() == 0
    all_shapes = shapes(args.scale, args.throttle)
    keys = [k.strip() for k in args.shapes.split(",") if k.strip()]
    tools = tuple(t.strip() for t in args.tools.split(",") if t.strip())
    bad = [k for k in keys if k not in all_shapes]
    if bad or not keys:
        usage(f"unknown shape {', '.join(bad) or '(none)'}: choose from {', '.join(all_shapes)}")
    bad = [t for t in tools if t not in LABELS]
    if bad or not tools:
        usage(f"unknown tool {', '.join(bad) or '(none)'}: choose from {', '.join(TOOLS)}")
    if args.runs < 1:
        usage("--runs must be at least 1")
    if ("baseline" in tools) != (args.baseline is not None):
        usage("--baseline CHECKOUT and the tool 'baseline' go together")
    if args.baseline is not None and not (args.baseline / "shmstage").is_dir():
        usage(f"{args.baseline} has no shmstage package: pass a checkout of this repository")
    if not root and args.dest is None:
        usage("mounting a private tmpfs needs root: run as root or pass --dest DIR (a tmpfs)")
    if "throttled" in keys and (not root or args.warm):
        usage(
            "the throttled shape needs root and a cold cache: run as root without --warm, "
            "or leave it out of --shapes"
        )
    cold = root and not args.warm
    wanted = [all_shapes[k] for k in keys]

    existing = args.workdir.resolve()
    while not existing.exists():
        existing = existing.parent
    where = mount_of(existing)
    if where is not None and where.fstype == "tmpfs":
        usage(f"{args.workdir} is on tmpfs: the datasets must be on a real disk; pass --workdir")
    args.workdir.mkdir(parents=True, exist_ok=True)
    as_installed(args.workdir / "pycache", args.baseline)
    paths = {s.dataset.name: ensure_dataset(s.dataset, args.workdir) for s in wanted}

    results: list[tuple[Shape, StageBenchResult | str]] = []
    mnt = args.workdir / "mnt"
    mounted = False
    try:
        if args.dest is None:
            enter_private_mount_namespace()
            biggest = max(s.dataset.approx_bytes for s in wanted)
            mount_tmpfs(mnt, parse_size("8G") + 2 * biggest)
            mounted = True
        dest = args.dest or mnt
        for shape in wanted:
            log(
                f"{shape.title}: {', '.join(LABELS.get(t, t) for t in tools)}, {args.runs} run(s) each"
            )
            try:
                r = run_stage_benchmark(
                    paths[shape.dataset.name],
                    dest,
                    tools=tools,
                    runs=args.runs,
                    drop_caches=cold,
                    throttle_bps=args.throttle * 1_000_000 if shape.throttled else None,
                    workers=args.workers,
                    progress=lambda m: log("  " + m),
                    baseline=args.baseline,
                )
            except BenchError as e:  # a tool failed: report it, go on with the other shapes
                log(f"{shape.title}: {e}")
                results.append((shape, str(e)))
                continue
            results.append((shape, r))
            print(
                f"\n### {shape.title}: {r.files:,} files, {r.bytes / 1e9:.2f} GB\n\n{format_markdown(r)}\n"
            )
            for t in targets(shape, r, args.throttle):
                print(f"- {t.text}: {'met' if t.met else 'MISSED'}")
            sys.stdout.flush()
    except ShmstageError as e:
        raise SystemExit(f"Error: {e}") from None
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False)
            mnt.rmdir()
        if not args.keep:
            shutil.rmtree(args.workdir / "pycache", ignore_errors=True)
            for s in wanted:
                shutil.rmtree(args.workdir / s.dataset.name, ignore_errors=True)
                (args.workdir / f"{s.dataset.name}.done").unlink(missing_ok=True)
            if args.workdir.is_dir() and not any(args.workdir.iterdir()):
                args.workdir.rmdir()

    body = render(results, args, cold)
    if args.write_docs:
        write_docs(args.write_docs, body)
        log(f"wrote the Staging section of {args.write_docs}")
    if args.json:
        doc = {
            "command": sys.argv,
            "machine": machine(),
            "cold_cache": cold,
            "shapes": {
                s.key: {"error": r}
                if isinstance(r, str)
                else {**asdict(r), "targets": [asdict(t) for t in targets(s, r, args.throttle)]}
                for s, r in results
            },
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if any(isinstance(r, str) for _, r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
