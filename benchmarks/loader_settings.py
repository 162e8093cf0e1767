"""DataLoader settings on this node: samples/s and data-stall share per worker count.

Runs ``shmstage.bench.loader`` (the library behind ``shmstage bench loader``) on a
deterministic synthetic JPEG dataset (the demo's generator), for a GPU-like step (the CPU
sleeps) and a CPU-bound step (the CPU spins), and prints one Markdown table per mode with
the recommendation, for docs/benchmarks.md.

    python benchmarks/loader_settings.py                       # ~2 min on 2 CPUs
    python benchmarks/loader_settings.py --data DIR --compute-ms 120 --batch-size 64
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile

from shmstage import system
from shmstage.bench.loader import run_loader_benchmark
from shmstage.demo.dataset import generate
from shmstage.sizes import format_size


def table(report) -> str:  # noqa: ANN001 (LoaderBenchReport)
    lines = [
        "| workers | pin_memory | samples/s | data stall | wait ms/step | step ms | start-up s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in report.results:
        mark = " **(recommended)**" if r == report.recommended else ""
        lines.append(
            f"| {r.workers}{mark} | {'on' if r.pin_memory else 'off'} | {r.samples_per_s:,.0f} | "
            f"{r.stall_share:.0%} | {r.wait_ms:.1f} | {r.step_ms:.1f} | {r.startup_s:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="ImageFolder-style dataset (default: generate 1,200 JPEGs)")
    parser.add_argument("--images", type=int, default=1200, help="images to generate")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--compute-ms", type=float, default=50.0)
    parser.add_argument("--workers", default=None, help="comma-separated worker counts")
    parser.add_argument("--modes", default="sleep,busy", help="compute modes to run")
    args = parser.parse_args()

    tmp = None
    data = args.data
    if data is None:
        tmp = tempfile.mkdtemp(prefix="shmstage-loader-bench-", dir="/var/tmp")
        ds = generate(os.path.join(tmp, "data"), images=args.images)
        data = ds.path
        print(f"<!-- dataset: {ds.images} JPEGs, {format_size(ds.bytes)} in {data} -->")
    workers = [int(w) for w in args.workers.split(",")] if args.workers else None
    mem = system.memory()
    print(
        f"Machine: {system.usable_cpus()} usable CPUs ({platform.processor() or platform.machine()}), "
        f"{format_size(mem.total)} RAM, Python {platform.python_version()}; shared and noisy "
        f"(load average {os.getloadavg()[0]:.1f} at the start)."
    )
    try:
        for mode in args.modes.split(","):
            report = run_loader_benchmark(
                data,
                batch_size=args.batch_size,
                workers=workers,
                steps=args.steps,
                compute_ms=args.compute_ms,
                compute_mode=mode,
                progress=lambda line: print(line, file=sys.stderr),
            )
            print(
                f"\n`--compute-mode {mode}`, {args.compute_ms:g} ms step, batch {args.batch_size}, "
                f"{args.steps} measured steps per setting, device {report.device}:\n"
            )
            print(table(report))
            print(f"\nRecommendation: {report.reason}.")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
