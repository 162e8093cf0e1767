"""The demo's training job: a tiny CNN fed by ``make_loader``, timing how long each step waits for data.

Run it the way a user runs their own script, under ``shmstage run``::

    shmstage run --stage /data/imgs -- python -m shmstage.demo.train --data {staged} --steps 30

It writes images/s and the data-stall share (time spent waiting for the next
batch / step time, after a few warm-up steps) as JSON to ``--json-out``.
``--join-cgroup`` moves it into a cgroup (the demo's read throttle) once torch is loaded,
so only the data reads are throttled, not the start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from shmstage.demo import TrainResult


def tiny_cnn(classes: int):  # -> torch.nn.Module
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 16, kernel_size=5, stride=4, padding=2),
        nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, kernel_size=3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, classes),
    )


def train(
    data: str,
    *,
    steps: int,
    batch_size: int = 32,
    warmup: int = 3,
    image_size: int = 224,
    join_cgroup: str | None = None,
    files: bool = False,
) -> TrainResult:
    import torch

    from shmstage.demo.dataset import ImageFolder, ImagenetTrain
    from shmstage.loader import make_loader

    # The main process stands in for the GPU: one core computes, the loader's
    # workers get the rest (as on a GPU node, where the CPU only feeds data).
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if files:  # `run --no-wait`: the copy is still landing; read what has landed from RAM
        from shmstage.loader import DatasetFiles

        dataset = ImageFolder(data, ImagenetTrain(image_size), files=DatasetFiles(data))
    else:
        dataset = ImageFolder(data, ImagenetTrain(image_size))
    # The dataset never changes between epochs: keep the workers (make_loader's default
    # restarts them each epoch, which the stall share would then count).
    loader = make_loader(
        dataset,
        batch_size,
        shuffle=True,
        drop_last=len(dataset) >= batch_size,
        persistent_workers=True,
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = tiny_cnn(len(dataset.classes)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    if join_cgroup:  # now, not at exec: reading torch's libraries through a throttle takes minutes
        _page_in_compute(model, len(dataset.classes), batch_size, image_size, device)
        Path(join_cgroup, "cgroup.procs").write_text(f"{os.getpid()}\n")
    batches = iter(loader)  # the loader's workers fork here, inside the group
    wait = busy = 0.0
    images = 0
    losses: list[float] = []
    first_step_at = 0.0
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        try:
            x, y = next(batches)
        except StopIteration:  # a new epoch; its start-up is part of the wait
            batches = iter(loader)
            x, y = next(batches)
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        t1 = time.perf_counter()
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # .item() waits for the device, so the step is really done
        t2 = time.perf_counter()
        if step == 0:  # the caller times "until the first step" from its own start
            first_step_at = time.clock_gettime(time.CLOCK_BOOTTIME)
        if step >= warmup:  # the first batches pay for worker start-up
            wait += t1 - t0
            busy += t2 - t0
            images += len(y)
    return TrainResult(
        data=data,
        steps=steps,
        warmup_steps=warmup,
        batch_size=batch_size,
        images=images,
        seconds=busy,
        wait_seconds=wait,
        images_per_s=images / busy if busy > 0 else 0.0,
        stall_share=wait / busy if busy > 0 else 0.0,
        num_workers=loader.num_workers,
        pin_memory=bool(loader.pin_memory),
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        loss_first=losses[0],
        loss_last=losses[-1],
        first_step_at=first_step_at,
    )


def _page_in_compute(model, classes: int, batch_size: int, size: int, device) -> None:  # noqa: ANN001
    """Two steps of a throwaway copy on random data, so torch's kernels are paged in from disk
    now and not through the read throttle the job joins next (their first use faults in
    hundreds of MB).  Own generator: the job's random stream stays as without the throttle."""
    import copy

    import torch

    scratch = copy.deepcopy(model)
    optimizer = torch.optim.SGD(scratch.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch_size, 3, size, size, generator=gen).to(device)
    y = torch.randint(0, classes, (batch_size,), generator=gen).to(device)
    for _ in range(2):  # the second step takes the momentum path
        loss = torch.nn.functional.cross_entropy(scratch(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shmstage.demo.train", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--data",
        default=os.environ.get("SHMSTAGE_DATA"),
        help="ImageFolder-style dataset root (default: $SHMSTAGE_DATA)",
    )
    parser.add_argument(
        "--steps", type=int, default=30, help="measured training steps (default: 30)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured first steps (default: 3)")
    parser.add_argument("--batch-size", type=int, default=32, help="images per step (default: 32)")
    parser.add_argument("--image-size", type=int, default=224, help="crop size (default: 224)")
    parser.add_argument("--json-out", help="write the result as JSON to this file")
    parser.add_argument(
        "--join-cgroup",
        metavar="DIR",
        help="move into this cgroup (a read throttle) before the first batch, after start-up",
    )
    parser.add_argument(
        "--files",
        action="store_true",
        help="read through shmstage.loader.DatasetFiles (a copy still being staged: run --no-wait)",
    )
    args = parser.parse_args(argv)
    if not args.data:
        parser.error("--data is required (or set SHMSTAGE_DATA)")
    if args.steps < 1 or args.warmup < 0 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be at least 1, --warmup at least 0")
    from shmstage.errors import ShmstageError

    try:
        result = train(
            args.data,
            steps=args.steps,
            batch_size=args.batch_size,
            warmup=args.warmup,
            image_size=args.image_size,
            join_cgroup=args.join_cgroup,
            files=args.files,
        )
    except ShmstageError as e:
        print(f"Error: {e}", file=sys.stderr)
        return e.exit_code
    text = json.dumps(asdict(result), indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    workers = f"{result.num_workers} loader worker" + ("" if result.num_workers == 1 else "s")
    print(
        f"{result.images_per_s:.0f} images/s, data stall {result.stall_share:.0%} "
        f"({workers}, pin_memory={result.pin_memory}) reading {result.data}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
