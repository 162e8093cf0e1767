"""What crosses the copier's pipes and how the parent reads it: the task and result records,
the feeder that keeps the task pipe full without blocking, the one loop over the results
(:class:`Results`, for run and Stream alike) and the failures a worker reports.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import signal
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shmstage.errors import ShmstageError
from shmstage.stage.sources.beneath import SourceTree

# A job: (src, dst, size, mtime_ns, atime_ns, mode, rel[, ident]); ``ident`` is the file's
# ``st_dev << 64 | st_ino`` as the walk saw it (0 or absent: not known, not checked)
Job = tuple
COPY, COMPARE = 0, 1
OK, ERR, MISMATCH = 0, 1, 2
(K_NONE, K_READ, K_WRITE, K_VANISHED, K_CHANGED, K_INTERNAL, K_REPLACED) = range(7)
K_NOTREG = 7  # a FIFO or a device in a walked file's place
# In the task pipe, in place of a chunk: "take a stream slot, then the next chunk from the
# chunk pipe".  A slot's holder takes the chunks in the order they were dealt, so each big
# file is read front to back and no two streams start on one file while others wait (a
# worker given a chunk first and a slot after would start chunks out of order: one worker
# that finished a chunk takes the freed slot before the woken waiter runs).
STREAM = -2
_HEAD = struct.Struct("<iiqqii i")
_PIPE_BUF = 4096


@dataclass(frozen=True)
class Failure:
    """What a worker reported: which file, what went wrong."""

    kind: str  # "read", "write", "vanished", "changed", "internal"
    errno: int
    path: str
    detail: str


class CopyFailed(ShmstageError):
    """A worker could not copy a file; ``failure`` says which and why."""

    def __init__(self, message: str, failure: Failure) -> None:
        super().__init__(message)
        self.failure = failure


@dataclass(frozen=True)
class Task:
    op: int
    first: int  # job index
    last: int  # one past the last job (whole files), or first + 1 (a chunk)
    offset: int = 0
    length: int = -1  # -1: whole files


# What a worker's next_task(chunk) gives: a task (index, jobs, task), STREAM, or None (exit).
Taken = tuple[int, Sequence[Job], Task] | int | None
Tops = dict[str, SourceTree]  # a source's top (the jobs' ``src[:-len(rel)]``), opened once


class Results:
    """The one loop that reads the workers' results, for :func:`run` and :class:`Stream`
    (NOTE [copier lifecycle]): a finished task's progress, a compare's differing paths, the
    first failure raised; the task pipe is refilled after each read."""

    def __init__(
        self,
        fd: int,
        feed: Feeds,
        alive: set[int],
        progress: Callable[[int, int], None] | None = None,
        landed: Callable[[int], None] | None = None,
    ) -> None:
        self.fd, self.feed, self.alive = fd, feed, alive
        self.progress = progress
        self.landed = landed  # called with each finished task's number
        self.done = 0  # tasks finished
        self.mismatches: list[str] = []  # compare: paths that differ

    def collect(self, until: int, timeout: float) -> bool:
        """Read the results that are there (waiting up to ``timeout`` for the first) while
        fewer than ``until`` tasks are done; False when none came."""
        got = False
        # (once every task is done, the pipe's only news can be the workers' exit: EOF)
        while self.done < until and select.select([self.fd], [], [], timeout)[0]:
            try:
                status, seq, nbytes, nfiles, err, kind, text = _read_record(self.fd)
            except ShmstageError:  # EOF: every worker is gone; say how the first one went
                check_alive(self.alive, wait=True)
                raise
            if status == ERR:
                raise _failure(err, kind, text)
            if status == MISMATCH:
                self.mismatches.append(text)
            elif status == OK:
                self.done += 1
                if self.landed is not None:
                    self.landed(seq)
                if self.progress is not None:
                    self.progress(nbytes, nfiles)
            got, timeout = True, 0
        if got:
            self.feed.push()
        return got

    def wait(self, until: int) -> None:
        """Until ``until`` tasks are done; a worker's death is noticed within 0.2 s."""
        while self.done < until:
            if not self.collect(until, 0.2):
                check_alive(self.alive)


class Feeder:
    """Fixed-size task records into the task pipe, as many as fit without blocking.

    The pipe is enlarged and written in whole records of at most PIPE_BUF bytes (atomic,
    so a worker's read of one record size always gets one whole record)."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.queue = bytearray()
        self.pos = 0  # bytes of ``queue`` already written
        with contextlib.suppress(OSError, AttributeError):
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
        os.set_blocking(fd, False)

    def add(self, records: bytes) -> None:
        if self.pos > 1 << 20:  # compact now and then (never per write: 1M moves)
            del self.queue[: self.pos]
            self.pos = 0
        self.queue += records

    def push(self) -> None:
        per = _PIPE_BUF // self.size * self.size
        view = memoryview(self.queue)
        try:
            while self.pos < len(self.queue):
                n = min(per, len(self.queue) - self.pos)
                try:
                    os.write(self.fd, view[self.pos : self.pos + n])  # all or nothing: <= PIPE_BUF
                except BlockingIOError:
                    if n == self.size:
                        return
                    per = self.size  # less than PIPE_BUF free: go one record at a time
                    continue
                self.pos += n
        finally:
            view.release()

    def finish(self) -> None:
        os.set_blocking(self.fd, True)
        with memoryview(self.queue) as view:
            while self.pos < len(self.queue):
                self.pos += os.write(
                    self.fd, view[self.pos : self.pos + _PIPE_BUF // self.size * self.size]
                )


class Feeds:
    """The task pipe and the chunk pipe (see STREAM), fed together: chunks first, so a slot's
    holder finds the chunk its STREAM record stands for."""

    def __init__(self, task_fd: int, chunk_fd: int, size: int) -> None:
        self.tasks = Feeder(task_fd, size)
        self.chunks = Feeder(chunk_fd, size)

    def add(self, records: bytes, chunks: bytes = b"") -> None:
        self.chunks.add(chunks)
        self.tasks.add(records)

    def push(self) -> None:
        self.chunks.push()
        self.tasks.push()

    def finish(self) -> None:
        self.chunks.finish()
        self.tasks.finish()

    @property
    def flushed(self) -> bool:
        """Every record added is in its pipe."""
        return all(f.pos == len(f.queue) for f in (self.chunks, self.tasks))


def check_alive(alive: set[int], wait: bool = False) -> None:
    """Raise if a worker died or exited early (``wait``: they are all exiting, reap each)."""
    for pid in list(alive):
        got, status = os.waitpid(pid, 0 if wait else os.WNOHANG)
        if got:
            alive.discard(pid)
            if os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
                raise ShmstageError(
                    f"a copy worker was killed by signal {sig} ({signal.Signals(sig).name}); "
                    "out of memory? check `dmesg` and the reserve"
                )
            if os.WEXITSTATUS(status):  # 0: it took an end marker; its results are in the pipe
                raise ShmstageError(
                    f"a copy worker exited early with status {os.WEXITSTATUS(status)}"
                )


def pipes(fds: list[int], n: int) -> list[int]:
    """``n`` new pipes' (read, write) ends, each listed in ``fds`` as soon as it exists (a
    later one failing, EMFILE, leaves none unlisted for the caller to close)."""
    for _ in range(n):
        fds += os.pipe()
    return fds[-2 * n :]


def read_exact(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise ShmstageError("copy workers exited unexpectedly")
        data += chunk
    return data


def _read_record(fd: int) -> tuple[int, int, int, int, int, int, str]:
    status, task, nbytes, nfiles, err, kind, size = _HEAD.unpack(read_exact(fd, _HEAD.size))
    text = read_exact(fd, size).decode("utf-8", "surrogateescape") if size else ""
    return status, task, nbytes, nfiles, err, kind, text


def send(
    fd: int,
    status: int,
    task: int,
    nbytes: int,
    nfiles: int,
    err: int = 0,
    kind: int = 0,
    text: str = "",
) -> None:
    raw = text.encode("utf-8", "surrogateescape")[: _PIPE_BUF - _HEAD.size]
    os.write(fd, _HEAD.pack(status, task, nbytes, nfiles, err, kind, len(raw)) + raw)


_KINDS = {
    K_READ: "read",
    K_WRITE: "write",
    K_VANISHED: "vanished",
    K_CHANGED: "changed",
    K_REPLACED: "replaced",
    K_NOTREG: "not regular",
    K_INTERNAL: "internal",
}


def _failure(err: int, kind: int, text: str) -> CopyFailed:
    f = Failure(_KINDS.get(kind, "internal"), err, text, os.strerror(err) if err else "")
    if f.kind == "vanished":
        msg = f"source file vanished during the copy: {text}; re-run when the source is stable"
    elif f.kind == "changed":
        msg = f"source file changed during the copy: {text} (its size or mtime differs from the scan); re-run when the source is stable"
    elif f.kind == "replaced":
        msg = (
            f"source file {text} is not the file the scan found: it, or a directory on its "
            "path, was replaced (by another file, a symlink or another directory) since; nothing "
            "was published: re-run when the source is stable, and check who can change it"
        )
    elif f.kind == "not regular":
        msg = (
            f"source file {text} is not a regular file any more (replaced since the scan, by "
            "a named pipe or a device?); nothing was published: re-run when the source is stable"
        )
    elif f.kind == "read":
        msg = f"cannot read source file {text}: {f.detail}"
        if err == errno.EACCES:
            msg += "; stage as a user who can read every file of the source"
    elif f.kind == "write":
        msg = f"cannot write {text}: {f.detail}"
    else:
        msg = f"copy worker failed on {text}"
    return CopyFailed(msg, f)
