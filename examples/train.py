"""Train a tiny classifier from a folder dataset with shmstage's loader helpers.

Runs on a laptop CPU, on one GPU, or under torchrun (gloo on CPU, NCCL on GPU):

    python examples/train.py --make-data /tmp/toy            # write a small .npy dataset
    python examples/train.py --data /tmp/toy --max-steps 20
    shmstage run --stage /tmp/toy -- torchrun --nproc-per-node 2 examples/train.py --data {staged}

The dataset is ``ROOT/<class>/<sample>.npy`` (float arrays, C x H x W) or JPEG/PNG images
(read with Pillow).  Without ``--data`` it reads ``$SHMSTAGE_DATA`` (set by ``shmstage run``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

from shmstage.loader import CudaPrefetcher, make_loader

SUFFIXES = (".npy", ".jpg", ".jpeg", ".png")


class FolderDataset(Dataset):
    """``root/<class>/<file>``: one class per sub-folder, .npy arrays or images."""

    def __init__(self, root: str, image_size: int = 32) -> None:
        self.root = Path(root)
        self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.samples = [
            (f, label)
            for label, c in enumerate(self.classes)
            for f in sorted((self.root / c).iterdir())
            if f.suffix.lower() in SUFFIXES
        ]
        self.image_size = image_size
        if not self.samples:
            raise SystemExit(f"Error: no .npy/.jpg/.png files under {root}/<class>/")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[i]
        if path.suffix == ".npy":
            x = torch.from_numpy(np.load(path).astype(np.float32, copy=False))
        else:
            from PIL import Image

            with Image.open(path) as im:
                im = im.convert("RGB").resize((self.image_size, self.image_size))
                x = torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return x, label


def make_data(root: str, classes: int, per_class: int, size: int, fmt: str) -> None:
    """A learnable toy set: each class has its own mean brightness, plus noise."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        d = Path(root) / f"class{c}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            x = rng.normal(c / classes, 0.1, size=(3, size, size)).astype(np.float32)
            if fmt == "npy":
                np.save(d / f"{i:05d}.npy", x)
            else:
                from PIL import Image

                pixels = (np.clip(x, 0, 1) * 255).astype(np.uint8).transpose(1, 2, 0)
                Image.fromarray(pixels).save(d / f"{i:05d}.jpg", quality=90)
    print(f"wrote {classes * per_class} samples ({fmt}) under {root}")


class TinyNet(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="dataset folder (default: $SHMSTAGE_DATA)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="stop after N steps (0: no limit)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0, help="base seed; rank r uses seed + r")
    p.add_argument("--workers", type=int, help="loader workers per rank (default: make_loader's)")
    p.add_argument("--no-amp", dest="amp", action="store_false", help="train in float32")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--image-size", type=int, default=32, help="image side for JPEG/PNG data")
    p.add_argument("--make-data", metavar="DIR", help="write a toy dataset to DIR and exit")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--per-class", type=int, default=64)
    p.add_argument("--format", choices=("npy", "jpeg"), default="npy")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_data:
        make_data(args.make_data, args.classes, args.per_class, args.image_size, args.format)
        return 0
    data = args.data or os.environ.get("SHMSTAGE_DATA")
    if not data:
        print(
            "Error: no dataset: pass --data DIR or run under `shmstage run --stage DIR`",
            file=sys.stderr,
        )
        return 2

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    # Seed per rank, so no two ranks draw the same "random" augmentations (with num_workers=0
    # they are drawn here; make_loader's workers add the rank to torch's seed themselves).
    # The model's initial weights need no common seed: DDP copies rank 0's to every rank.
    seed = args.seed + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    dataset = FolderDataset(data, args.image_size)
    sampler = DistributedSampler(dataset, shuffle=True) if distributed else None
    overrides = {} if args.workers is None else {"num_workers": args.workers}
    loader = make_loader(
        dataset,
        args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        drop_last=True,
        **overrides,
    )
    print(
        f"rank {rank}: data={data} samples={len(dataset)} num_workers={loader.num_workers} "
        f"pin_memory={loader.pin_memory} device={device} seed={seed}",
        flush=True,
    )

    model: nn.Module = TinyNet(len(dataset.classes)).to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None
        )
    if args.compile:
        model = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # bf16 autocast on CPU and on GPUs that have it; fp16 (with a GradScaler) otherwise
    use_bf16 = device.type == "cpu" or torch.cuda.is_bf16_supported()
    amp_dtype = torch.bfloat16 if use_bf16 else torch.float16
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp and not use_bf16)

    # One prefetcher for the whole run, iterated every epoch: it keeps one side stream
    # (a prefetcher per epoch would make a new stream each time).
    prefetcher = CudaPrefetcher(loader, device)
    step, loss_value, start = 0, float("nan"), time.perf_counter()
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in prefetcher:
            autocast = (
                torch.autocast(device.type, dtype=amp_dtype)
                if args.amp
                else contextlib.nullcontext()
            )
            with autocast:
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            step += 1
            if step % 10 == 0 or step == 1:
                loss_value = loss.item()
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {loss_value:.4f}", flush=True)
            if args.max_steps and step >= args.max_steps:
                break
        if args.max_steps and step >= args.max_steps:
            break
    loss_value = loss.item() if step else loss_value
    if rank == 0:
        took = time.perf_counter() - start
        print(f"done: {step} steps in {took:.1f}s, last loss {loss_value:.4f}", flush=True)
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
