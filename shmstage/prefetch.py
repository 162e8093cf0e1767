"""Read ahead of the training loop: ``CudaPrefetcher`` copies each batch to the GPU one batch
ahead on a side stream; ``BackgroundLoader`` runs any iterable in a thread.  Each keeps its
lifecycle NOTE next to its code.  Imported through :mod:`shmstage.loader`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from shmstage.batches import batch_tensors, hides_tensors, move_batch, to_device
from shmstage.errors import ShmstageError

# --- CudaPrefetcher ---------------------------------------------------------

# NOTE [CudaPrefetcher lifecycle]
#
#   first iter(): resolve the device (the current CUDA device *now*, not at __init__: a
#                 prefetcher built before set_device(local_rank) must follow it) and make
#                 one side stream on it for the prefetcher's life (one per epoch leaks).
#
#   __iter__:  copy(b0) on side ──┐
#   next():    consumer.wait_stream(side); b0.record_stream(consumer); copy(b1) on side; yield b0
#   next():    consumer.wait_stream(side); b1.record_stream(consumer); copy(b2) on side; yield b1
#
# b(k+1) is enqueued on the side stream before the consumer launches work on b(k), so the
# host-to-device copy overlaps compute.  wait_stream orders the consumer's kernels after the
# copy.  record_stream is what keeps this safe: b(k) was allocated on the side stream, so
# without it the caching allocator would hand b(k)'s memory to the next copy as soon as the
# Python tensor is freed, while kernels queued on the consumer stream may still read it.
# record_stream makes the allocator wait for the consumer stream's pending work first.
# It needs the tensors (batch_tensors): an object that moves itself but keeps them where
# they cannot be found (hides_tensors) is copied on the consumer stream instead, whose own
# allocations need no record_stream; only that object's copy loses the overlap.


_IN_PRODUCER = threading.local()  # .active: this thread is a BackgroundLoader's producer
_PREFETCHER_IN_BACKGROUND = (
    "BackgroundLoader(CudaPrefetcher(...)) would copy to the GPU from the background "
    "thread, with that thread's device and stream: wrap it the other way round, "
    "CudaPrefetcher(BackgroundLoader(loader))"
)


def _refuse_other_thread(owner: int) -> None:
    """Refuse to iterate a CudaPrefetcher in a BackgroundLoader's producer thread, or in a
    thread other than the one that called ``iter()`` on it: its copies would use that
    thread's current device and stream, with no ordering against the training loop's."""
    if getattr(_IN_PRODUCER, "active", False):
        raise ShmstageError(_PREFETCHER_IN_BACKGROUND)
    if threading.get_ident() != owner:
        raise ShmstageError(
            "a CudaPrefetcher is iterated in the thread that called iter() on it (its copies "
            "use that thread's device and stream): iterate it in the training loop's thread; "
            "to read ahead in a thread, CudaPrefetcher(BackgroundLoader(loader))"
        )


class CudaPrefetcher:
    """Iterate ``loader`` with each batch already on ``device``, copied one batch ahead.

    Tensors anywhere in tuples, lists, mappings, namedtuples and dataclasses are moved, and
    objects with a ``.to()`` method move themselves (``non_blocking`` passed when their
    ``.to`` takes it); other leaves and the container types are kept (see :func:`move_batch`).  Without CUDA (or with ``device="cpu"``) batches pass through
    unchanged; for another device type they are moved with a plain ``.to(device)``.
    ``device=None`` or ``"cuda"`` means the current CUDA device *at the first iteration*, so
    a prefetcher built before ``torch.cuda.set_device(local_rank)`` still copies to this
    rank's GPU.  It is iterated in the thread that called ``iter()`` on it, never in a
    BackgroundLoader's (wrap the other way round: ``CudaPrefetcher(BackgroundLoader(...))``).
    See NOTE [CudaPrefetcher lifecycle].
    """

    def __init__(
        self, loader: Iterable[Any], device: Any = None, non_blocking: bool = True
    ) -> None:
        self.loader = loader
        self.non_blocking = non_blocking
        self._requested = None if device is None else torch.device(device)
        if (
            self._requested is not None
            and self._requested.type == "cuda"
            and not torch.cuda.is_available()
        ):
            raise ShmstageError(
                f"device {device} was asked for but CUDA is not available: "
                "leave device=None to pass batches through on CPU"
            )
        self._device: torch.device | None = None  # resolved at first use
        self._stream: Any = None

    @property
    def device(self) -> torch.device:
        """The device batches are copied to; fixed at the first iteration (or first access)."""
        if self._device is None:
            device = self._requested
            if device is None:
                device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            if device.type == "cuda":
                self._stream = torch.cuda.Stream(device=device)
            self._device = device
        return self._device

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        owner = threading.get_ident()
        _refuse_other_thread(owner)
        return self._epoch(owner)

    def _epoch(self, owner: int) -> Iterator[Any]:
        # each next() checks its thread: iter() ran here, but islice()/a generator may hand
        # the iterator to BackgroundLoader's producer (the isinstance check cannot see it)
        batches = self._batches()
        while True:
            _refuse_other_thread(owner)
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch

    def _batches(self) -> Iterator[Any]:
        device = self.device
        if device.type == "cpu":
            yield from self.loader
        elif self._stream is None:
            for batch in self.loader:
                yield move_batch(batch, lambda t: to_device(t, device, self.non_blocking))
        else:
            yield from self._prefetch()

    def _copy(self, batch: Any) -> Any:
        assert self._stream is not None
        device, consumer = self.device, torch.cuda.current_stream(self.device)

        def move(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) or not hides_tensors(obj):
                return to_device(obj, device, self.non_blocking)
            with torch.cuda.stream(consumer):  # see NOTE [CudaPrefetcher lifecycle]
                return to_device(obj, device, self.non_blocking)

        with torch.cuda.stream(self._stream):
            return move_batch(batch, move)

    def _prefetch(self) -> Iterator[Any]:
        end = object()
        source = iter(self.loader)
        nxt = next(source, end)
        if nxt is end:
            return
        nxt = self._copy(nxt)
        while nxt is not end:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_stream(self._stream)
            batch = nxt
            for t in batch_tensors(batch):
                # not what stayed on the CPU (a PackedSequence's batch_sizes)
                if t.device == self.device:
                    t.record_stream(consumer)
            nxt = next(source, end)
            if nxt is not end:
                nxt = self._copy(nxt)
            yield batch


# --- BackgroundLoader -------------------------------------------------------

# NOTE [ BackgroundLoader lifecycle ]
#
#   consumer thread                          producer thread (daemon, one per epoch)
#   ───────────────                          ────────────────────────────────────────
#   iter(bg): join the previous producer
#             (it was told to stop) ─ start ─▶ it = iter(source)
#   next()  ◀── q.get(timeout) ◀── put ────  for item in it: put(item), retried while not done
#   next()  ◀── _End ──────────────────────  put(_End)                  (normal end)
#   next()  ◀── _Raised(exc) ──────────────  put(_Raised(exc))          (source raised)
#           raise exc (its own traceback)
#   close() ── done.set(); drain q ───────▶  put() sees done, gives up; it.close() runs the
#           join(short timeout); return      generator's `finally` in this thread; exit
#   __del__ ── done.set() only ───────────▶  (same)
#
# - One producer at a time: the next iter() joins the previous epoch's producer before it
#   starts a new one.  With persistent_workers (make_loader's opt-in) iter(DataLoader)
#   returns the same iterator every epoch, so two producers would call its __next__ at
#   once.  The old producer was told to stop; the wait is the rest of the one item it is
#   reading (it cannot be interrupted inside next(source)).
# - close() must not stall a training loop: it sets `done`, drains the queue (waking a
#   producer blocked in put) and joins for at most join_timeout (0.1 s by default); a
#   producer still inside next(source) then finishes on its own and exits.
# - __del__ only sets `done`: it may run in any thread, even the producer's (GC), where
#   taking the queue's lock or joining could deadlock.  The producer notices within _POLL.
# - The queue is bounded (max_prefetch); put() and get() use timeouts and re-check `done`
#   / the thread, so neither side blocks forever on a peer that went away.
# - End and errors travel as private sentinels, so a `None` item is just an item.
# - The producer closes its own iterator: a running generator cannot be closed from
#   another thread ("generator already executing").
# - The producer holds no reference to the epoch object, so dropping it (GC) stops it.
#   close() is idempotent, on the epoch and on the loader.

_POLL = 0.05  # seconds between `done` checks
DEFAULT_JOIN_TIMEOUT = 0.1  # seconds close() waits for the producer before returning


class _End:
    pass


class _Raised:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _put(q: queue.Queue[Any], item: Any, done: threading.Event) -> bool:
    while not done.is_set():
        try:
            q.put(item, timeout=_POLL)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterable[Any], q: queue.Queue[Any], done: threading.Event) -> None:
    it: Iterator[Any] | None = None
    _IN_PRODUCER.active = True  # a CudaPrefetcher refuses to run here
    try:
        it = iter(source)
        for item in it:
            if not _put(q, item, done):
                return
            if done.is_set():  # told to stop: do not start another next(source)
                return
        _put(q, _End, done)
    except BaseException as exc:  # sent across: the consumer re-raises it
        _put(q, _Raised(exc), done)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):  # the consumer has gone; nobody to tell
                close()


class _BackgroundIterator:
    """One epoch of a BackgroundLoader: a producer thread and its queue."""

    def __init__(self, source: Iterable[Any], max_prefetch: int, join_timeout: float) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_prefetch)
        self._done = threading.Event()
        self._finished = False
        self._join_timeout = join_timeout
        self._thread = threading.Thread(
            target=_produce,
            args=(source, self._queue, self._done),
            name="shmstage-background",
            daemon=True,
        )
        self._thread.start()

    def __iter__(self) -> _BackgroundIterator:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()  # producer gone without a word (stopped): end
                    raise StopIteration from None
        if item is _End:
            self.close()
            raise StopIteration
        if isinstance(item, _Raised):
            self.close()
            raise item.exc
        return item

    def close(self) -> None:
        """Tell the producer to stop and wait briefly for it (idempotent, never blocks long).

        A producer still inside ``next(source)`` finishes that item on its own, then runs the
        source's ``finally`` and exits; the next ``iter()`` of the loader waits for it.
        """
        self._finished = True
        self._done.set()
        try:
            while True:  # wake a producer blocked in put()
                self._queue.get_nowait()
        except queue.Empty:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(self._join_timeout)

    def __enter__(self) -> _BackgroundIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # signal only: no lock, no join (see NOTE [ BackgroundLoader lifecycle ])
        done = getattr(self, "_done", None)
        if done is not None:
            done.set()


class BackgroundLoader:
    """Iterate ``iterable`` in a background thread, up to ``max_prefetch`` items ahead.

    Each ``iter()`` stops the previous epoch, waits until its producer thread has exited
    (at most the rest of the item it is reading) and starts one daemon thread, so the
    source is never read by two threads at once.  An exception in the source is re-raised
    in the consumer with its type and traceback; ``None`` items pass through; ``close()``,
    leaving a ``with`` block or dropping the iterator stops the thread and runs the source
    generator's ``finally``; ``close()`` waits at most ``join_timeout`` seconds.
    See NOTE [ BackgroundLoader lifecycle ].
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        max_prefetch: int = 2,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT,
    ) -> None:
        if isinstance(iterable, CudaPrefetcher):
            # Its copies would run in the producer thread, on that thread's current device
            # and stream, not the training loop's: wrong GPU, and no ordering with compute.
            # (Wrapped in islice() or a generator it is refused by the prefetcher itself.)
            raise ShmstageError(_PREFETCHER_IN_BACKGROUND)
        if max_prefetch < 1:
            raise ShmstageError(f"max_prefetch={max_prefetch}: use an integer >= 1")
        if join_timeout < 0:
            raise ShmstageError(f"join_timeout={join_timeout}: use a number of seconds >= 0")
        self.iterable = iterable
        self.max_prefetch = max_prefetch
        self.join_timeout = join_timeout
        self._current: weakref.ref[_BackgroundIterator] | None = None
        # the last producer and its `done` event: strong references to these (not to the
        # epoch, which may be dropped) let iter() and close() reach a producer still running
        self._producer: tuple[threading.Thread, threading.Event] | None = None

    def __iter__(self) -> _BackgroundIterator:
        self.close()
        if self._producer is not None:
            thread, _ = self._producer
            if thread is not threading.current_thread():
                thread.join()  # told to stop; finishing the item it is reading
            self._producer = None
        epoch = _BackgroundIterator(self.iterable, self.max_prefetch, self.join_timeout)
        self._current = weakref.ref(epoch)
        self._producer = (epoch._thread, epoch._done)
        return epoch

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop the current epoch's thread, if any (idempotent; waits at most join_timeout)."""
        epoch = self._current() if self._current is not None else None
        self._current = None
        if epoch is not None:
            epoch.close()
        elif self._producer is not None:  # the epoch was dropped: its producer may live on
            self._producer[1].set()

    def __enter__(self) -> BackgroundLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # No __del__ here: `it = iter(BackgroundLoader(src))` drops the loader at once while the
    # epoch lives on; each epoch stops itself when it is collected.
