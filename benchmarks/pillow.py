"""Stock Pillow vs pillow-simd, side by side, on the same JPEGs and the same operations.

Creates two throwaway venvs (stock Pillow from PyPI; pillow-simd through
``shmstage pillow-simd``), writes a deterministic set of photo-like JPEGs, and runs
decode, resize to 224 (bilinear, bicubic) and a RandomResizedCrop(224) + flip pipeline
in each interpreter. Both interpreters stay running and are interleaved operation by
operation (who goes first alternates) and timed in process CPU time; the table shows
the median images/s and the median of the per-run ratios, so the ratio holds on a noisy
shared machine.

    python benchmarks/pillow.py                   # ~4 min, most of it the pillow-simd build
    python benchmarks/pillow.py --keep /tmp/pb    # keep the venvs; later runs reuse them
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Runs inside each benchmark interpreter: only PIL and the standard library.
WORKER = r"""
import io, math, random, sys, time
from pathlib import Path
from PIL import Image
import PIL

data = [p.read_bytes() for p in sorted(Path(sys.argv[1]).glob("*.jpg"))]
budget = float(sys.argv[2])

def decode(b):
    return Image.open(io.BytesIO(b)).convert("RGB")

decoded = [decode(b) for b in data]

def rrc_flip(b, rng):
    # torchvision's RandomResizedCrop(224, scale=(0.08, 1), ratio=(3/4, 4/3)) with the
    # PIL backend: crop, then bilinear resize; then RandomHorizontalFlip(p=0.5).
    im = decode(b)
    w, h = im.size
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
            break
    else:
        cw, ch, x, y = w, h, 0, 0
    im = im.crop((x, y, x + cw, y + ch)).resize((224, 224), Image.BILINEAR)
    if rng.random() < 0.5:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    return im

def timed(fn, items):
    # Whole passes over the images until the budget is used (at least one pass). CPU time
    # of this process, not wall time: on a shared machine, time spent descheduled while
    # other jobs run is not Pillow's. On an idle machine the two are the same.
    done, start = 0, time.process_time()
    while True:
        for item in items:
            fn(item)
        done += len(items)
        elapsed = time.process_time() - start
        if elapsed >= budget:
            return done / elapsed

OPS = {
    "decode": lambda: timed(decode, data),
    "resize bilinear 224": lambda: timed(lambda im: im.resize((224, 224), Image.BILINEAR), decoded),
    "resize bicubic 224": lambda: timed(lambda im: im.resize((224, 224), Image.BICUBIC), decoded),
    # the same seed every time: both interpreters do exactly the same crops and flips
    "RandomResizedCrop+flip pipeline": lambda: timed(lambda b, rng=random.Random(0): rrc_flip(b, rng), data),
}

# A tiny server: the harness sends one operation name per line and reads back images/s,
# so the two interpreters can be interleaved operation by operation.
print(PIL.__version__, flush=True)
for line in sys.stdin:
    print(OPS[line.strip()](), flush=True)
"""

OPERATIONS = (
    "decode",
    "resize bilinear 224",
    "resize bicubic 224",
    "RandomResizedCrop+flip pipeline",
)


def make_images(dest: Path, count: int, size: tuple[int, int] = (500, 375)) -> int:
    """Deterministic photo-like JPEGs (gradients, shapes, sensor-like noise); returns total bytes."""
    from PIL import Image, ImageDraw, ImageFilter

    dest.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1234)
    w, h = size
    total = 0
    for i in range(count):
        channels = []
        for _ in range(3):
            grad = Image.linear_gradient("L").rotate(rng.uniform(0, 360)).resize(size)
            gain, offset = rng.uniform(0.3, 1.0), rng.randint(0, 80)
            channels.append(grad.point([min(255, int(v * gain + offset)) for v in range(256)]))
        im = Image.merge("RGB", channels)
        draw = ImageDraw.Draw(im)
        for _ in range(rng.randint(6, 14)):
            x, y = rng.randint(-50, w), rng.randint(-50, h)
            box = (x, y, x + rng.randint(20, 220), y + rng.randint(20, 180))
            color = tuple(rng.randint(0, 255) for _ in range(3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=color)
        im = im.filter(ImageFilter.GaussianBlur(rng.uniform(0.8, 2.5)))
        # texture at two scales, like foliage or fabric, then per-pixel sensor noise
        coarse = Image.effect_noise((w // 8, h // 8), 60).resize(size, Image.BICUBIC)
        fine = Image.effect_noise(size, rng.uniform(20, 40))
        texture = Image.merge("RGB", (coarse, fine, Image.blend(coarse, fine, 0.5)))
        im = Image.blend(im, texture, rng.uniform(0.2, 0.35))
        path = dest / f"img{i:04d}.jpg"
        im.save(path, "JPEG", quality=90)
        total += path.stat().st_size
    return total


def make_venv(root: Path, simd: bool, log) -> Path:
    python = root / "bin" / "python"
    if python.exists():
        return python
    log(f"creating {root} ...")
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "pillow"], check=True)
    if simd:
        log("building pillow-simd there with `shmstage pillow-simd` (a few minutes) ...")
        subprocess.run(
            [sys.executable, "-m", "shmstage", "pillow-simd", "--python", str(python)],
            check=True,
            stdout=sys.stderr,
        )
    return python


class Worker:
    """One benchmark interpreter kept running; ``measure(op)`` returns images/s."""

    def __init__(self, python: Path, images: Path, budget: float) -> None:
        self.proc = subprocess.Popen(
            [str(python), "-c", WORKER, str(images), str(budget)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.version = self._read()

    def _read(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"benchmark worker exited with {self.proc.wait()}")
        return line.strip()

    def measure(self, op: str) -> float:
        self.proc.stdin.write(op + "\n")
        self.proc.stdin.flush()
        return float(self._read())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=200, help="number of JPEGs (default 200)")
    parser.add_argument("--runs", type=int, default=9, help="interleaved runs (default 9)")
    parser.add_argument(
        "--budget", type=float, default=0.5, help="CPU seconds per operation per run (default 0.5)"
    )
    parser.add_argument(
        "--keep", type=Path, help="keep venvs and images in this directory (reused when present)"
    )
    parser.add_argument("--json", action="store_true", help="print the medians as JSON")
    args = parser.parse_args()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    work = args.keep or Path(tempfile.mkdtemp(prefix="shmstage-pillow-bench-"))
    try:
        images = work / "images"
        if not images.exists():
            nbytes = make_images(images, args.images)
            log(f"{args.images} JPEGs, 500x375, {nbytes / args.images / 1024:.0f} KiB on average")
        pythons = {
            "Pillow": make_venv(work / "stock", False, log),
            "pillow-simd": make_venv(work / "simd", True, log),
        }
        workers = {name: Worker(python, images, args.budget) for name, python in pythons.items()}
        rates: dict[str, dict[str, list[float]]] = {
            name: {op: [] for op in OPERATIONS} for name in workers
        }
        ratios: dict[str, list[float]] = {op: [] for op in OPERATIONS}
        try:
            for run in range(args.runs):
                # Interleave operation by operation, alternating who goes first, so load
                # from other processes hits both interpreters alike.
                order = list(workers) if run % 2 == 0 else list(reversed(workers))
                for op in OPERATIONS:
                    for name in order:
                        rates[name][op].append(workers[name].measure(op))
                    ratios[op].append(rates["pillow-simd"][op][-1] / rates["Pillow"][op][-1])
                log(f"run {run + 1}/{args.runs} done")
        finally:
            for worker in workers.values():
                worker.close()
        medians = {
            name: {op: statistics.median(v) for op, v in ops.items()} for name, ops in rates.items()
        }
        ratio = {op: statistics.median(v) for op, v in ratios.items()}
        versions = {name: worker.version for name, worker in workers.items()}
        if args.json:
            print(
                json.dumps(
                    {"versions": versions, "images_per_s": medians, "ratio": ratio}, indent=2
                )
            )
            return
        stock, simd = medians["Pillow"], medians["pillow-simd"]
        head = (
            "operation (images per CPU-second, median)",
            f"Pillow {versions['Pillow']}",
            f"pillow-simd {versions['pillow-simd']}",
            "ratio",
        )
        rows = [
            (op, f"{stock[op]:,.0f}", f"{simd[op]:,.0f}", f"{ratio[op]:.2f}x") for op in OPERATIONS
        ]
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join(["---"] + ["---:"] * 3) + "|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
