"""The pipelined ring: every node reads its share from SRC and passes pieces around.

NOTE [ring lifecycle]

    reader thread               main thread (gloo)                 writer thread
    -------------               ------------------                 -------------
    take a buffer from pool
    read piece k of own share
    (threads pread segments,
     crc32 per segment)  --q->  for each piece k:
                                  own = q.get()
                                  step s = 0 .. N-2:
                                    isend(cur -> rank+1)
                                    irecv(buf <- rank-1)
                                    wait both (gloo timeout)
                                    cur done -> writer  ------q->  check each segment's crc,
                                    cur = buf                      pwrite what this node needs,
                                  last cur -> writer  ---------q->  finish files (mode, mtime),
                                                                   buffer back to pool
    Every loop waits with a timeout and looks at ``stop``; an error in a thread is passed
    to the main thread as a value and raised there; on any error the main thread sets
    ``stop`` and joins both threads (idempotent).

Memory: SLOTS buffers of one piece each, allocated (and touched) once; that is the
node's bound on bytes in flight.  The reader may run ahead by SLOTS-3 pieces, which also
lets it start before the rendezvous (``prefetch``).  A piece is written after it was
forwarded, so the writer is always the last to use a buffer.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

from shmstage.cluster.plan import CRC, Plan, Segment
from shmstage.cluster.targets import Target, give_owner, unreadable
from shmstage.cluster.waits import POLL, LinkLost, wait_work
from shmstage.errors import ShmstageError
from shmstage.stage.build.copier import SLOW_ENV
from shmstage.stage.sources.beneath import SourceTree, ident
from shmstage.stage.sources.owners import stager_groups

READERS = 8  # threads reading one piece's segments from SRC at once (round trips overlap)
SLOTS = 8  # buffers per node: read ahead up to 5, send + receive 2, writing 1 (+ queued)
_RD = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NOATIME", 0)
_WR = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", 4)
_RANDOM = getattr(os, "POSIX_FADV_RANDOM", 1)
_PAGE = os.sysconf("SC_PAGE_SIZE")


class Damaged(ShmstageError):
    """A piece arrived with bytes that do not match the owner's checksum."""


class Ring:
    """One exchange of ``plan``: ``prefetch`` starts reading this node's share (no torch
    needed yet, so it overlaps the rendezvous), ``run`` exchanges over a gloo group and
    writes into ``targets``."""

    def __init__(self, plan: Plan, rank: int, tree: Any, timeout: float, own: bool) -> None:
        """``tree``: the walked source (walk.Tree): its top and files' idents are what every
        read is checked against."""
        self.plan, self.rank, self.root = plan, rank, tree.root.rstrip("/") + "/"
        idents = tree.idents or {}
        self.idents = [idents.get(rel, 0) for rel, _ in plan.files]
        # The top, opened once and checked against the walk's: each read goes below this
        # directory, never through the path again (its owner could swap it between reads).
        # The writer's own (it opens O_PATH while the readers open files).
        try:
            self.src = SourceTree(tree.root, tree.top)
            self.src_meta = SourceTree(tree.root, tree.top)
        except OSError as e:
            raise unreadable(tree.root, e) from None
        self.timeout, self.own = timeout, own
        # a user's copies keep the source's group where it is one of the user's (sources/owners.py)
        self.groups = None if own else stager_groups()
        self.group: Any = None
        self.targets: dict[int, Target] = {}
        self.tick: Callable[[int, int], None] = lambda b, f: None
        self.keep_crcs = False
        self.n = plan.nodes
        self.stop = threading.Event()
        self.pool: queue.Queue[Any] = queue.Queue()
        longest = max(plan.size(r, k) for r in range(self.n) for k in range(plan.pieces))
        for _ in range(SLOTS):
            buf = bytearray(longest)
            buf[::_PAGE] = bytes(len(range(0, longest, _PAGE)))  # fault pages in now, not mid-ring
            self.pool.put(buf)
        # The reader may fill all buffers but the 3 the ring and the writer need to go on.
        self.ahead: queue.Queue[Any] = queue.Queue(maxsize=SLOTS - 3)
        self.written: queue.Queue[Any] = queue.Queue(maxsize=3)
        # test hook (as the copier's): seconds to sleep after each piece, to land a kill mid-way
        self.slow = float(os.environ.get(SLOW_ENV, "0") or 0)
        self.errors: list[BaseException] = []  # the threads' failures, raised by the main thread
        self.reader: threading.Thread | None = None

    def prefetch(self) -> None:
        """Start reading this node's share (idempotent)."""
        if self.reader is None:
            self.reader = threading.Thread(
                target=self._reader, name="shmstage-ring-read", daemon=True
            )
            self.reader.start()

    def close(self) -> None:
        """Stop the reader (idempotent): a prefetch whose plan was not the one agreed."""
        self.stop.set()
        if self.reader is not None:
            self.reader.join(5)
        if self.reader is None or not self.reader.is_alive():  # never an fd a reader may use
            self.src.close()
        self.src_meta.close()

    # --- main thread -------------------------------------------------------------------

    def run(
        self,
        group: Any,
        targets: dict[int, Target],
        tick: Callable[[int, int], None],
        keep_crcs: bool,
        watch: Callable[[], None] | None = None,
    ) -> None:
        """Exchange the pieces; ``watch``: see :func:`wait_work`."""
        self.group, self.targets, self.tick, self.keep_crcs = group, targets, tick, keep_crcs
        self.watch = watch
        self.prefetch()
        writer = threading.Thread(target=self._writer, name="shmstage-ring-write", daemon=True)
        writer.start()
        reader = self.reader
        try:
            self._ring()
            self._put(self.written, None)  # no more pieces
            while writer.is_alive():
                writer.join(POLL)
                self._raise_from(self.errors)
            self._raise_from(self.errors)
        finally:
            self.stop.set()
            reader.join(5)  # type: ignore[union-attr]
            writer.join(5)
            self._close_fds()
            if not reader.is_alive():  # type: ignore[union-attr]
                self.src.close()
            if not writer.is_alive():
                self.src_meta.close()

    def _ring(self) -> None:
        import torch

        def tensor(buf: bytearray, size: int) -> Any:
            return torch.frombuffer(buf, dtype=torch.uint8, count=size)

        plan, n, me = self.plan, self.n, self.rank
        nxt, prev = (me + 1) % n, (me - 1) % n
        wait = timedelta(seconds=self.timeout)
        tag = 0
        for k in range(plan.pieces):
            cur = self._get(self.ahead)
            share = me
            for s in range(n - 1):
                src_share = (me - s - 1) % n
                buf = self._get(self.pool)
                inbox = tensor(buf, plan.size(src_share, k))
                outbox = tensor(cur, plan.size(share, k))
                try:
                    sent = self.group.send([outbox], nxt, tag)
                    got = self.group.recv([inbox], prev, tag)
                    wait_work(sent, wait, nxt, self.watch)
                    wait_work(got, wait, prev, self.watch)
                except (LinkLost, ShmstageError):  # a signal (Interrupted): as it is
                    raise
                except Exception as e:
                    raise LinkLost(e, None) from None
                tag += 1
                self._put(self.written, (share, k, cur))
                cur, share = buf, src_share
            self._put(self.written, (share, k, cur))

    def _get(self, q: queue.Queue[Any]) -> Any:
        while True:
            self._raise_from(self.errors)
            try:
                return q.get(timeout=POLL)
            except queue.Empty:
                continue

    def _put(self, q: queue.Queue[Any], item: Any) -> None:
        while True:
            self._raise_from(self.errors)
            try:
                q.put(item, timeout=POLL)
                return
            except queue.Full:
                continue

    @staticmethod
    def _raise_from(errors: list[BaseException]) -> None:
        if errors:
            raise errors[0]

    # --- reader thread -----------------------------------------------------------------

    def _reader(self) -> None:
        try:
            with _Preads(READERS) as pool:
                for k in range(self.plan.pieces):
                    buf = None
                    while buf is None and not self.stop.is_set():
                        try:
                            buf = self.pool.get(timeout=POLL)
                        except queue.Empty:
                            continue
                    if buf is None:
                        return
                    self._read_piece(k, buf, pool)
                    while not self.stop.is_set():
                        try:
                            self.ahead.put(buf, timeout=POLL)
                            break
                        except queue.Full:
                            continue
        except BaseException as e:  # handed to the main thread as a value
            self.errors.append(e)

    def _read_piece(self, k: int, buf: Any, pool: _Preads) -> None:
        segs = self.plan.segments(self.rank, k)
        view = memoryview(buf)
        a, b = self.plan.piece_range(self.rank, k)
        data = b - a
        crcs = list(pool.map(lambda s: self._read_segment(s, view), segs))
        tail = b"".join(c.to_bytes(CRC, "little") for c in crcs)
        view[data : data + len(tail)] = tail

    def _read_segment(self, seg: Segment, view: memoryview) -> int:
        rel, size = self.plan.files[seg.file]
        path = self.root + rel
        try:  # never through a directory swapped for a symlink since the walk (the copier's way)
            try:  # never blocks: a FIFO put in the file's place is refused, not waited on
                fd = self.src.open_file(rel, _RD)
            except PermissionError:  # O_NOATIME: owner only
                fd = self.src.open_file(rel, _RD & ~getattr(os, "O_NOATIME", 0))
        except OSError as e:
            raise unreadable(path, e) from None
        try:
            want = self.idents[seg.file]
            if want and ident(os.fstat(fd)) != want:
                raise unreadable(path, OSError(errno.EXDEV, "replaced"))
            # No readahead: past a segment's end lies the next owner's share (read twice).
            os.posix_fadvise(fd, 0, 0, _RANDOM)
            out = view[seg.at : seg.at + seg.length]
            done = 0
            while done < seg.length:
                got = os.preadv(fd, [out[done:]], seg.offset + done)
                if got == 0:
                    break
                done += got
            if done != seg.length or os.fstat(fd).st_size != size:
                raise ShmstageError(
                    f"source file changed during the copy: {path}; re-run when the source is stable"
                )
            os.posix_fadvise(fd, seg.offset, seg.length, _DONTNEED)  # RAM is used once
        finally:
            os.close(fd)
        return zlib.crc32(out)

    # --- writer thread -----------------------------------------------------------------

    def _writer(self) -> None:
        try:
            while True:
                item = None
                while item is None and not self.stop.is_set():
                    try:
                        item = self.written.get(timeout=POLL)
                    except queue.Empty:
                        continue
                    if item is None:
                        return
                if item is None:
                    return
                share, k, buf = item
                try:
                    self._write_piece(share, k, buf)
                finally:
                    self.pool.put(buf)
        except BaseException as e:  # handed to the main thread as a value
            self.errors.append(e)

    def _write_piece(self, share: int, k: int, buf: Any) -> None:
        if self.slow:
            time.sleep(self.slow)
        segs = self.plan.segments(share, k)
        if not segs:
            return
        view = memoryview(buf)
        a, b = self.plan.piece_range(share, k)
        data = b - a
        for i, seg in enumerate(segs):
            t = self.targets.get(seg.file)
            if t is None:
                continue  # a file this node already has
            chunk = view[seg.at : seg.at + seg.length]
            want = int.from_bytes(view[data + CRC * i : data + CRC * (i + 1)], "little")
            if share != self.rank and zlib.crc32(chunk) != want:  # ours: computed just now
                raise Damaged(
                    f"{self.plan.files[seg.file][0]} (bytes {seg.offset}-{seg.offset + seg.length}) "
                    f"arrived from node {share} damaged (checksum mismatch); re-run"
                )
            if self.keep_crcs:
                t.crcs[seg.offset] = want
            if t.fd < 0:
                t.fd = os.open(t.dst, _WR, 0o600)
            done = 0
            while done < seg.length:
                done += os.pwrite(t.fd, chunk[done:], seg.offset + done)
            t.left -= seg.length
            if t.left == 0:
                self._finish(t)
                self.tick(t.size, 1)

    def _finish(self, t: Target) -> None:
        """Owner, mode, then mtime last: a resumed run keeps only files whose mtime matches."""
        give_owner(t, t.fd, self.src_meta, self.own, self.groups)
        os.fchmod(t.fd, t.mode)
        os.utime(t.fd, ns=(t.atime, t.mtime))
        os.close(t.fd)
        t.fd = -1

    def _close_fds(self) -> None:
        for t in self.targets.values():
            if t.fd >= 0:
                os.close(t.fd)
                t.fd = -1


class _Preads:
    """The reader's helper threads: daemons, unlike a ThreadPoolExecutor's, which the
    interpreter joins without a timeout on its way out, so a read that never returns (a
    hung NFS server) would keep a node interrupted by SIGTERM alive."""

    def __init__(self, n: int) -> None:
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.n = n
        for _ in range(n):
            threading.Thread(target=self._work, name="shmstage-ring-pread", daemon=True).start()

    def _work(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:
                return
            fut, fn, arg = item
            try:
                fut.set_result(fn(arg))
            except BaseException as e:  # handed to the caller as a value
                fut.set_exception(e)

    def map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        futs: list[Future[Any]] = []
        for arg in items:
            futs.append(Future())
            self.jobs.put((futs[-1], fn, arg))
        return [f.result() for f in futs]

    def __enter__(self) -> _Preads:
        return self

    def __exit__(self, *exc: object) -> None:
        for _ in range(self.n):  # each ends after what it has queued: nobody waits for it
            self.jobs.put(None)
