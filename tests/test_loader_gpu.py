"""CudaPrefetcher on a real GPU: record_stream safety, overlap, values. Skipped without CUDA."""

from __future__ import annotations

import dataclasses
import time

import pytest

torch = pytest.importorskip("torch")

from shmstage.loader import CudaPrefetcher, make_loader  # noqa: E402

pytestmark = pytest.mark.gpu

N = 16 * 1024 * 1024  # floats per batch (64 MiB): one allocator block each
SPIN = 2_000_000_000  # cycles for torch.cuda._sleep: ~1 s on current GPUs


def pinned_batches(count: int) -> list[torch.Tensor]:
    return [torch.full((N,), float(i + 1)).pin_memory() for i in range(count)]


def test_record_stream_poison():
    """Batch k's memory is not reused for batch k+2's copy while queued kernels still read k."""
    p = CudaPrefetcher(pinned_batches(4), device="cuda")
    it = iter(p)
    b0 = next(it)  # batch 1 is being copied on the side stream now
    torch.cuda._sleep(SPIN)  # a long kernel on the consumer stream...
    checksum = b0.sum()  # ...then one that reads batch 0
    del b0  # freed while both kernels are still queued
    next(it)  # enqueues batch 2's copy: without record_stream it may land in batch 0's block
    torch.cuda.synchronize()
    assert checksum.item() == float(N)  # all ones: batch 0 was not overwritten


def test_copy_overlaps_compute():
    """The next batch's copy completes while the consumer stream is still busy with this one."""
    p = CudaPrefetcher(pinned_batches(3), device="cuda")
    it = iter(p)
    next(it)  # batch 1's copy is enqueued on the side stream
    consumer = torch.cuda.current_stream()
    torch.cuda._sleep(SPIN)
    copied = torch.cuda.Event()
    copied.record(p._stream)
    deadline = time.monotonic() + 30
    while not copied.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert copied.query() and not consumer.query()  # copy done, compute still running
    torch.cuda.synchronize()


def test_values_structure_and_one_stream():
    """Nested batches arrive on the GPU with identical values; the side stream is made once."""
    batches = [
        {"x": torch.randn(4, 3).pin_memory(), "y": (torch.arange(4), "tag"), "n": i}
        for i in range(5)
    ]
    p = CudaPrefetcher(batches, device="cuda")
    assert p._stream is None  # made at first use, on the device current then
    streams = []
    for _ in range(2):
        got = list(p)
        streams.append(p._stream)
        assert len(got) == 5
        for g, w in zip(got, batches):
            assert g["x"].is_cuda and torch.equal(g["x"].cpu(), w["x"])
            assert (
                torch.equal(g["y"][0].cpu(), w["y"][0]) and g["y"][1] == "tag" and g["n"] == w["n"]
            )
    assert streams[0] is streams[1] is not None
    assert streams[0].device == torch.device("cuda", torch.cuda.current_device())


def test_device_follows_set_device_after_construction():
    """Built before torch.cuda.set_device(1) (as in a module-level setup): copies go to cuda:1."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    before = torch.cuda.current_device()
    try:
        torch.cuda.set_device(0)
        p = CudaPrefetcher(pinned_small(3))
        torch.cuda.set_device(1)  # what each rank does with LOCAL_RANK
        got = list(p)
        assert [g.device for g in got] == [torch.device("cuda", 1)] * 3
        assert p.device == torch.device("cuda", 1) and p._stream.device == p.device
        assert [float(g[0]) for g in got] == [1.0, 2.0, 3.0]
    finally:
        torch.cuda.set_device(before)


def pinned_small(count: int) -> list[torch.Tensor]:
    return [torch.full((1024,), float(i + 1)).pin_memory() for i in range(count)]


def test_make_loader_pins_on_gpu():
    """With CUDA present make_loader pins host memory and its batches feed the prefetcher."""
    data = torch.utils.data.TensorDataset(torch.arange(64).float())
    dl = make_loader(data, 8, num_workers=1)
    assert dl.pin_memory
    total = sum(float(b[0].sum()) for b in CudaPrefetcher(dl))
    assert total == float(sum(range(64)))


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    meta: dict


class SelfMoving:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device, non_blocking: bool = False) -> SelfMoving:
        return SelfMoving(self.x.to(device, non_blocking=non_blocking))


class Tagged(dict):
    pass


def test_dataclasses_subclasses_and_to_objects_arrive_on_the_gpu():
    """A dataclass, a dict subclass and an object with .to() reach the GPU, types kept, values equal."""
    batches = [
        Tagged(
            s=Sample(torch.full((8,), float(i)).pin_memory(), {"w": torch.ones(2).pin_memory()}),
            g=SelfMoving(torch.arange(4).pin_memory()),
        )
        for i in range(3)
    ]
    got = list(CudaPrefetcher(batches, device="cuda"))
    for i, g in enumerate(got):
        assert type(g) is Tagged and type(g["s"]) is Sample and type(g["g"]) is SelfMoving
        assert g["s"].image.is_cuda and g["s"].meta["w"].is_cuda and g["g"].x.is_cuda
        assert torch.equal(g["s"].image.cpu(), torch.full((8,), float(i)))
        assert torch.equal(g["g"].x.cpu(), torch.arange(4))
