"""The parallel copier: forked worker processes copy (or compare) batches of files.

Threads are not enough for many small files (the GIL serialises the per-file
Python work), so the work runs in processes, a few syscalls per file
(open, sendfile, fstat, futimens, fadvise, close), batched so that one pipe
message moves up to a few hundred files.  Big files are split into chunks that
several workers copy at once.

NOTE [copier lifecycle]

    main process (run)                      worker i (forked)
    ------------------                      -----------------
    build tasks (inherited by fork)
    fork N workers  ----------------------> ignore SIGINT, die with the parent
    send 2N task indices  ---- task pipe -> read 4 bytes: a task index (-1: exit 0)
    select(result pipe, 0.2 s)              copy/compare the task's files
       OK       -> progress, send next <--- one record per task (<= PIPE_BUF: atomic)
       MISMATCH -> remember (compare)  <--- one record per differing file
       ERROR    -> stop, raise         <--- errno, what failed, which file
       a worker died -> raise
    all done: send -1 per worker, reap
    any exception (ours, SIGTERM, Ctrl-C): SIGKILL every worker, reap, re-raise
    (idempotent; the caller then removes the partial tree)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import signal
import struct
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from shmstage._libc import load_libc
from shmstage.errors import ShmstageError
from shmstage.stage.build.estimate import rounded
from shmstage.stage.sources.beneath import NotRegular, SourceTree, ident
from shmstage.stage.sources.owners import keeps_owner, stager_groups

# A job: (src, dst, size, mtime_ns, atime_ns, mode, rel[, ident]); ``ident`` is the file's
# ``st_dev << 64 | st_ino`` as the walk saw it (0 or absent: not known, not checked)
Job = tuple
COPY, COMPARE = 0, 1

BATCH_FILES = 256
BATCH_BYTES = 32 << 20
CHUNK = 64 << 20  # files above 2 chunks are split so several workers share them
BUF = 1 << 20
SMALL = 64 << 10  # read whole, write whole; above: sendfile (one copy, no user buffer)
STREAM_MIN = 8 << 20  # a file this big (or a chunk) is a stream: at most streams() at once

_OK, _ERR, _MISMATCH = 0, 1, 2
(_K_NONE, _K_READ, _K_WRITE, _K_VANISHED, _K_CHANGED, _K_INTERNAL, _K_REPLACED) = range(7)
_K_NOTREG = 7  # a FIFO or a device in a walked file's place
_HEAD = struct.Struct("<iiqqii i")
_PIPE_BUF = 4096

# Test hook (documented in docs/staging.md): seconds to sleep after each copied
# file, so tests can land a signal mid-copy on a tiny dataset.
SLOW_ENV = "SHMSTAGE_TEST_SLOW_COPY"

_RD = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_NOATIME = getattr(os, "O_NOATIME", 0)
_WR_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_WR_OLD = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", 4)
_SEQUENTIAL = getattr(os, "POSIX_FADV_SEQUENTIAL", 2)
_PR_SET_PDEATHSIG = 1
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def copy_owner(path: str | int, st: os.stat_result) -> None:
    """chown ``path`` (or an fd) to ``st``'s owner and group, best effort: root in a user
    namespace cannot give away to an unmapped uid (EINVAL) or lacks CAP_CHOWN (EPERM); the
    copy then stays root's, and access.restrict_root judges the owner it really has."""
    try:
        if isinstance(path, int):
            os.fchown(path, st.st_uid, st.st_gid)
        else:
            os.chown(path, st.st_uid, st.st_gid, follow_symlinks=False)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EINVAL):
            raise


def copy_group(path: str | int, gid: int) -> None:
    """A user's copy gets its source's group ``gid``, one of :func:`~shmstage.stage.sources.owners.stager_groups`."""
    if isinstance(path, int):
        os.fchown(path, -1, gid)
    else:
        os.chown(path, -1, gid, follow_symlinks=False)


def give_owner(
    fd: int | str, st: os.stat_result, mode: int, own: bool, groups: frozenset[int] | None
) -> bool:
    """The one rule for a copied file's owner and group (every path: the copier, the
    cluster exchange; ``fd`` or a path): root (``own``) gives it its source's owner and group (``st``); a
    user's copy gets the source's group where it is one of ``groups`` (else it keeps the
    stager's, and the walk cleared the group bits of ``mode``).  False: the source's group
    is not one of ours any more though the walk saw one (``mode`` grants the group more
    than others): the source changed since the walk."""
    if own:
        if st.st_uid != os.geteuid() or st.st_gid != os.getegid():
            copy_owner(fd, st)  # (else it is ours already: made in partial/, never setgid)
    elif groups is not None and st.st_gid != os.getegid():
        if st.st_gid in groups:
            copy_group(fd, st.st_gid)
        elif mode & 0o070 & ~((mode & 0o7) << 3):
            return False
    return True


def streams() -> int:
    """Big files (chunks) copied at once: one per CPU.  Each is a sendfile, a memcpy that keeps
    a CPU busy while the disk's readahead runs ahead; more streams than CPUs only split the
    CPUs and the disk's sequential reads (4 shards of 512 MiB on 2 CPUs: 2 streams 1.0 s,
    8 streams 1.1-3.0 s).  Small files have no such limit: they wait on the disk, not a CPU."""
    from shmstage.system import usable_cpus

    return max(1, usable_cpus())


def default_workers() -> int:
    """Copying waits on storage more than on CPUs: more workers than CPUs keep more reads
    in flight (cold disk, NFS); measured on a 2-core VM, 8-16 beat 4 on a cold tree."""
    from shmstage.system import usable_cpus

    return min(32, max(8, 4 * usable_cpus()))


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


def make_tasks(
    jobs: Sequence[Job], op: int = COPY, chunk: int = CHUNK
) -> tuple[list[Task], list[int]]:
    """Batches of small files and chunks of big ones; returns (tasks, chunked job indices).

    Chunks go first so the big files start early and the small batches fill the tail.
    Both are dealt round-robin (chunks across files, batches across directories):
    tmpfs serialises writes to one file on its inode lock and file creation in one
    directory on the directory's lock, so workers busy in different places run in
    parallel."""
    per_file: list[list[Task]] = []
    per_dir: dict[str, list[Task]] = {}
    chunked: list[int] = []
    start, nbytes, where = None, 0, ""

    def close(end: int) -> None:
        per_dir.setdefault(where, []).append(Task(op, start, end))  # type: ignore[arg-type]

    for i, job in enumerate(jobs):
        size = job[2]
        folder = job[6].rpartition("/")[0]
        if start is not None and folder != where:
            close(i)
            start = None
        if size > 2 * chunk:
            chunked.append(i)
            per_file.append(
                [Task(op, i, i + 1, off, min(chunk, size - off)) for off in range(0, size, chunk)]
            )
            if start is not None:
                close(i)
                start = None
            continue
        if start is None:
            start, nbytes, where = i, 0, folder
        nbytes += size
        if i + 1 - start >= BATCH_FILES or nbytes >= BATCH_BYTES:
            close(i + 1)
            start = None
    if start is not None:
        close(len(jobs))
    return _deal(per_file) + _deal(list(per_dir.values())), chunked


def _deal(groups: list[list[Task]]) -> list[Task]:
    """Round-robin: the first of every group, then the second of every group, ..."""
    rounds = max((len(g) for g in groups), default=0)
    return [g[k] for k in range(rounds) for g in groups if k < len(g)]


Tops = dict[str, SourceTree]  # a source's top (the jobs' ``src[:-len(rel)]``), opened once


def compare(jobs: Sequence[Job], workers: int, tops: Tops | None = None) -> list[str]:
    """The paths (``job[6]``) whose bytes differ between source and copy, sorted, each once
    (a chunked file is compared by several workers)."""
    tasks, _ = make_tasks(jobs, COMPARE)
    return sorted(set(run(jobs, tasks, workers, tops=tops)))


def run(
    jobs: Sequence[Job],
    tasks: Sequence[Task],
    workers: int,
    progress: Callable[[int, int], None] | None = None,
    while_running: Callable[[], None] | None = None,
    tops: Tops | None = None,
) -> list[str]:
    """Run ``tasks`` in ``workers`` processes; returns differing paths (compare tasks).

    ``tops``: the sources' tops the caller opened (and checked) once: the workers read
    below these very directories (inherited fds), never reopening a top by its path.

    ``progress(bytes, files)`` is called with increments; ``while_running()`` once,
    right after the workers start.  Raises CopyFailed on the first failure, after
    every worker is gone."""
    if not tasks:
        return []
    workers = max(1, min(workers, len(tasks)))
    slow = float(os.environ.get(SLOW_ENV) or 0)
    task_r, task_w = os.pipe()
    res_r, res_w = os.pipe()
    pids: list[int] = []
    alive: set[int] = set()
    results: Results | None = None
    try:

        def next_task() -> tuple[int, Sequence[Job], Task] | None:  # pragma: no cover - child
            idx = struct.unpack("<i", _read_exact(task_r, 4))[0]
            return None if idx < 0 else (idx, jobs, tasks[idx])

        _fork_workers(workers, pids, alive, (task_w, res_r), next_task, res_w, slow, tops)
        os.close(task_r)
        os.close(res_w)
        task_r = res_w = -1
        feed = _Feeder(task_w, 4)
        feed.add(
            struct.pack(f"<{len(tasks)}i", *range(len(tasks))) + b"\xff\xff\xff\xff" * len(pids)
        )
        feed.push()
        if while_running is not None:
            while_running()  # the workers are busy; the parent's own work overlaps theirs
        results = Results(res_r, feed, alive, progress)
        results.wait(len(tasks))
        feed.finish()
        for pid in alive:
            os.waitpid(pid, 0)
        pids.clear()
    finally:
        _kill_workers(pids, alive)
        for fd in (task_r, task_w, res_r, res_w):
            if fd >= 0:
                os.close(fd)
    return results.mismatches if results is not None else []


# seq, op, jobs offset, jobs span, count, chunk offset, chunk length
_REC = struct.Struct("<iiqqiqq")
_INO = (1 << 64) - 1
_JOB = struct.Struct("<qqqiQQI")  # size, mtime_ns, atime_ns, mode, st_dev, st_ino, len(rel)


class Stream:
    """Copy jobs as they are found: the first copy of a directory overlaps walk and copy.

    Workers start before any job is known.  ``add(jobs)`` appends the jobs to a memfd the
    workers read (so nothing but fixed-size task records crosses the pipe), queues their
    tasks and collects the results so far; ``finish()`` waits for every task.  Jobs are
    ``(src_prefix + rel, dst_prefix + rel, ...)`` as :func:`run` takes them; big files
    must exist (created writable, sized) before their jobs are added.

    Lifecycle: a context manager; ``__exit__`` SIGKILLs and reaps the workers whatever
    happened (after ``finish()`` they have already exited), then closes the fds."""

    def __init__(
        self,
        src_prefix: str,
        dst_prefix: str,
        workers: int,
        progress: Callable[[int, int], None] | None = None,
        page: int = 4096,
        tops: Tops | None = None,
    ) -> None:
        self.src_prefix, self.dst_prefix = src_prefix, dst_prefix
        self.tops = tops
        self.page = page
        self.landed = 0  # what the finished tasks take on the destination (whole pages)
        self.handed = 0  # what all tasks added take there
        self._pages: dict[int, int] = {}  # per task still running
        self.workers = max(1, workers)
        self.progress = progress
        self.pids: list[int] = []
        self.alive: set[int] = set()
        self.fds: list[int] = []
        self.sent = 0  # tasks handed out (the results count those done)
        self.end = 0  # bytes in the memfd

    def __enter__(self) -> Stream:
        try:
            self.mem = os.memfd_create("shmstage-jobs", os.MFD_CLOEXEC)
            self.fds.append(self.mem)
            task_r, task_w = os.pipe()
            self.fds += [task_r, task_w]
            res_r, res_w = os.pipe()
            self.fds += [res_r, res_w]
            mem, src, dst = self.mem, self.src_prefix, self.dst_prefix

            def next_task() -> tuple[int, Sequence[Job], Task] | None:  # pragma: no cover - child
                seq, op, off, span, count, coff, clen = _REC.unpack(_read_exact(task_r, _REC.size))
                if seq < 0:
                    return None
                return (
                    seq,
                    _decode_jobs(os.pread(mem, span, off), count, src, dst),
                    Task(op, 0, count, coff, clen),
                )

            slow = float(os.environ.get(SLOW_ENV) or 0)
            _fork_workers(
                self.workers,
                self.pids,
                self.alive,
                (task_w, res_r),
                next_task,
                res_w,
                slow,
                self.tops,
            )
            for fd in (task_r, res_w):
                self.fds.remove(fd)
                os.close(fd)
            self.feed = _Feeder(task_w, _REC.size)
            self.results = Results(res_r, self.feed, self.alive, self.progress, self._landed)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _landed(self, seq: int) -> None:
        self.landed += self._pages.pop(seq, 0)

    def __exit__(self, *exc: object) -> None:
        _kill_workers(self.pids, self.alive)
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def add(self, jobs: Sequence[Job]) -> list[Job]:
        """Hand ``jobs`` to the workers (chunks of big files first, batches by directory);
        returns the big files among them, created here: the caller sets their mode and
        times once :meth:`finish` returned."""
        if not jobs:
            return []
        offsets = []
        parts = []
        pos = self.end
        skip = len(self.src_prefix)
        for job in jobs:
            rel = os.fsencode(job[0][skip:])
            offsets.append(pos)
            who = job[7] if len(job) > 7 else 0
            rec = _JOB.pack(job[2], job[3], job[4], job[5], who >> 64, who & _INO, len(rel)) + rel
            parts.append(rec)
            pos += len(rec)
        offsets.append(pos)
        os.pwrite(self.mem, b"".join(parts), self.end)
        self.end = pos
        tasks, chunked = make_tasks(jobs)
        for i in chunked:
            create_sized(jobs[i][1], jobs[i][2])
        records = []
        page = self.page
        for t in tasks:
            off, span = offsets[t.first], offsets[t.last] - offsets[t.first]
            sizes = [t.length] if t.length >= 0 else [j[2] for j in jobs[t.first : t.last]]
            self._pages[self.sent] = pages = sum(rounded(n, page) for n in sizes)
            self.handed += pages
            records.append(
                _REC.pack(self.sent, t.op, off, span, t.last - t.first, t.offset, t.length)
            )
            self.sent += 1
        self.feed.add(b"".join(records))
        self.feed.push()
        self.results.collect(self.sent, 0)
        return [jobs[i] for i in chunked]

    def drain(self) -> None:
        """Wait until every task added so far is done (the workers stay)."""
        while True:
            self.feed.push()
            if self.results.done == self.sent and self.feed.pos == len(self.feed.queue):
                return
            if not self.results.collect(self.sent, 0.2):
                _check_alive(self.alive)

    def finish(self) -> None:
        """Wait for every task added, then for the workers to exit; raises CopyFailed on the
        first failure."""
        self.feed.add(_REC.pack(-1, 0, 0, 0, 0, 0, 0) * len(self.pids))
        self.drain()
        for pid in list(self.alive):
            os.waitpid(pid, 0)
            self.alive.discard(pid)

class Results:
    """The one loop that reads the workers' results, for :func:`run` and :class:`Stream`
    (NOTE [copier lifecycle]): a finished task's progress, a compare's differing paths, the
    first failure raised; the task pipe is refilled after each read."""

    def __init__(
        self,
        fd: int,
        feed: _Feeder,
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
            status, seq, nbytes, nfiles, err, kind, text = _read_record(self.fd)
            if status == _ERR:
                raise _failure(err, kind, text)
            if status == _MISMATCH:
                self.mismatches.append(text)
            elif status == _OK:
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
                _check_alive(self.alive)


def _decode_jobs(
    raw: bytes, count: int, src: str, dst: str
) -> list[Job]:  # pragma: no cover - child
    jobs = []
    pos = 0
    for _ in range(count):
        size, mtime, atime, mode, dev, ino, n = _JOB.unpack_from(raw, pos)
        pos += _JOB.size
        rel = os.fsdecode(raw[pos : pos + n])
        pos += n
        jobs.append((src + rel, dst + rel, size, mtime, atime, mode, rel, dev << 64 | ino))
    return jobs


def create_sized(path: str, size: int) -> None:
    """Create a big file for chunked copying: writable by its workers whatever the source's
    mode (set after the copy), and at its final size."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _fork_workers(
    workers: int,
    pids: list[int],
    alive: set[int],
    parent_fds: tuple[int, ...],
    next_task: Callable[[], tuple[int, Sequence[Job], Task] | None],
    res_w: int,
    slow: float,
    tops: Tops | None = None,
) -> None:
    """Fork ``workers`` processes running :func:`_worker` (pids added as they start)."""
    # Signals wait until the workers exist: a handler that raises inside fork()'s
    # at-fork callbacks would be swallowed ("Exception ignored").
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    slots = os.pipe()  # a byte per stream a worker may run (see streams()); closed here after
    os.write(slots[1], b"s" * min(streams(), workers))
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork() in a threaded process; workers only
            # make os.* calls on inherited data, never locks held by other threads.
            warnings.simplefilter("ignore", DeprecationWarning)
            for _ in range(workers):
                pid = os.fork()
                if pid == 0:  # pragma: no cover - runs in the child
                    code = 1
                    try:
                        for fd in parent_fds:
                            os.close(fd)
                        code = _worker(next_task, res_w, slow, blocked, tops, slots)
                    finally:
                        os._exit(code)
                pids.append(pid)
                alive.add(pid)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for fd in slots:
            os.close(fd)


def _kill_workers(pids: list[int], alive: set[int]) -> None:
    """Something went wrong (or nothing, then ``pids`` is empty): SIGKILL and reap the rest."""
    left = [pid for pid in pids if pid in alive]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in left:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    pids.clear()


class _Feeder:
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


def _check_alive(alive: set[int]) -> None:
    for pid in list(alive):
        got, status = os.waitpid(pid, os.WNOHANG)
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


def _read_exact(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise ShmstageError("copy workers exited unexpectedly")
        data += chunk
    return data


def _read_record(fd: int) -> tuple[int, int, int, int, int, int, str]:
    status, task, nbytes, nfiles, err, kind, size = _HEAD.unpack(_read_exact(fd, _HEAD.size))
    text = _read_exact(fd, size).decode("utf-8", "surrogateescape") if size else ""
    return status, task, nbytes, nfiles, err, kind, text


def _send(
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
    _K_READ: "read",
    _K_WRITE: "write",
    _K_VANISHED: "vanished",
    _K_CHANGED: "changed",
    _K_REPLACED: "replaced",
    _K_NOTREG: "not regular",
    _K_INTERNAL: "internal",
}


def _failure(err: int, kind: int, text: str) -> CopyFailed:
    f = Failure(_KINDS.get(kind, "internal"), err, text, os.strerror(err) if err else "")
    if f.kind == "vanished":
        msg = f"source file vanished during the copy: {text}; re-run when the source is stable"
    elif f.kind == "changed":
        msg = f"source file changed during the copy: {text} (its size or mtime differs from the scan); re-run when the source is stable"
    elif f.kind == "replaced":
        msg = (
            f"source file {text} is not the file the scan found: a directory on its path was "
            "replaced (by a symlink or another directory) since; nothing was published: "
            "re-run when the source is stable, and check who can change it"
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


# --- the worker --------------------------------------------------------------------


class _Fail(Exception):
    def __init__(self, kind: int, err: int, path: str) -> None:
        self.kind, self.err, self.path = kind, err, path


def _worker(
    next_task: Callable[[], tuple[int, Sequence[Job], Task] | None],
    res_w: int,
    slow: float,
    mask: set[signal.Signals],
    tops: Tops | None = None,
    slots: tuple[int, int] = (-1, -1),
) -> int:  # pragma: no cover - child
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    parent = os.getppid()
    try:
        libc = load_libc()
        libc.prctl(
            _PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0
        )  # die with the parent, even on SIGKILL
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        return 1
    os.umask(0)  # modes are given exactly at create time
    state = _State()
    state.trees.update(tops or {})
    state.slots = slots
    while True:
        got = next_task()
        if got is None:
            return 0
        idx, jobs, task = got
        try:
            nbytes, nfiles = _do_task(jobs, task, state, res_w, idx, slow)
        except _Fail as f:
            _send(res_w, _ERR, idx, 0, 0, f.err, f.kind, f.path)
            return 0
        except Exception as e:  # report, never a traceback from a child
            _send(
                res_w,
                _ERR,
                idx,
                0,
                0,
                0,
                _K_INTERNAL,
                f"{jobs[task.first][0]}: {type(e).__name__}: {e}",
            )
            return 0
        _send(res_w, _OK, idx, nbytes, nfiles)


class _State:
    def __init__(self) -> None:
        self.noatime = _NOATIME
        self.trees: dict[str, SourceTree] = {}  # per source root: opened once per worker
        self.chown = keeps_owner()
        self.groups = None if self.chown else stager_groups()
        self.sendfile = True
        self.buf = bytearray(BUF)
        self.buf2 = bytearray(BUF)
        self.slots = (-1, -1)  # the stream slots' pipe (read one to start a stream, give it back)

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Hold one of the streams() slots while a big file's bytes are pumped.  A worker
        that dies holding one fails the whole copy anyway (the parent sees it exit)."""
        os.read(self.slots[0], 1)
        try:
            yield
        finally:
            os.write(self.slots[1], b"s")


def _do_task(
    jobs: Sequence[Job], task: Task, state: _State, res_w: int, idx: int, slow: float
) -> tuple[int, int]:  # pragma: no cover - child
    nbytes = nfiles = 0
    if task.length >= 0:
        job = jobs[task.first]
        last = task.offset + task.length >= job[2]
        if task.op == COPY:
            _copy_chunk(job, task.offset, task.length, state)
        elif not _same_range(job, task.offset, task.length, state):
            _send(res_w, _MISMATCH, idx, 0, 0, 0, 0, job[6])
        return task.length, int(last)
    for i in range(task.first, task.last):
        job = jobs[i]
        if task.op == COPY:
            _copy_file(job, state)
            if slow:
                time.sleep(slow)
        elif not _same_range(job, 0, job[2], state):
            _send(res_w, _MISMATCH, idx, 0, 0, 0, 0, job[6])
        nbytes += job[2]
        nfiles += 1
    return nbytes, nfiles


def _open_src(job: Job, state: _State) -> int:  # pragma: no cover - child
    """The job's source file, opened below its tree's root without following any symlink."""
    path, rel = job[0], job[6]
    top = path[: len(path) - len(rel)]
    tree = state.trees.get(top)
    try:
        if tree is None:
            tree = state.trees[top] = SourceTree(top)
        return tree.open_file(rel, _RD | state.noatime)
    except NotRegular:
        raise _Fail(_K_NOTREG, 0, path) from None
    except PermissionError:
        if not state.noatime:
            raise _Fail(_K_READ, errno.EACCES, path) from None
        state.noatime = 0  # O_NOATIME needs ownership (or CAP_FOWNER): go without
        return _open_src(job, state)
    except FileNotFoundError:
        raise _Fail(_K_VANISHED, errno.ENOENT, path) from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):  # a symlink on the way now
            raise _Fail(_K_REPLACED, e.errno, path) from None
        raise _Fail(_K_READ, e.errno or 0, path) from None


def _same_file(job: Job, st: os.stat_result) -> bool:  # pragma: no cover - child
    """What was opened is the file the walk found (when the job says which that was)."""
    return len(job) < 8 or not job[7] or job[7] == ident(st)


def _pump(
    fi: int, fo: int, offset: int, count: int, state: _State, src: str, dst: str
) -> int:  # pragma: no cover - child
    """Copy ``count`` bytes at ``offset``; returns bytes copied (less means the source shrank)."""
    done = 0
    if state.sendfile:
        try:
            if offset:
                os.lseek(fo, offset, os.SEEK_SET)
            while done < count:
                n = os.sendfile(fo, fi, offset + done, count - done)
                if n == 0:
                    return done
                done += n
            return done
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) and done == 0:
                state.sendfile = False  # e.g. a file system without splice support
            else:
                raise _Fail(*_which_side(fi, fo, e, src, dst)) from None
    view = memoryview(state.buf)
    while done < count:
        try:
            n = os.preadv(fi, [view[: min(BUF, count - done)]], offset + done)
        except OSError as e:
            raise _Fail(_K_READ, e.errno or 0, src) from None
        if n == 0:
            return done
        w = 0
        while w < n:
            try:
                w += os.pwrite(fo, view[w:n], offset + done + w)
            except OSError as e:
                raise _Fail(_K_WRITE, e.errno or 0, dst) from None
        done += n
    return done


def _which_side(
    fi: int, fo: int, e: OSError, src: str, dst: str
) -> tuple[int, int, str]:  # pragma: no cover - child
    """sendfile does not say which fd failed; ENOSPC/EDQUOT/EFBIG/EROFS are the destination's."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
        return _K_WRITE, e.errno, dst
    return _K_READ, e.errno or 0, src


def _copy_file(job: Job, state: _State) -> None:  # pragma: no cover - child
    src, dst, size, mtime, atime, mode = job[:6]
    fi = _open_src(job, state)
    try:
        try:
            fo = os.open(dst, _WR_NEW, mode)
        except OSError as e:
            raise _Fail(_K_WRITE, e.errno or 0, dst) from None
        try:
            if size <= SMALL:
                done = _small(fi, fo, size, src, dst)
            elif size < STREAM_MIN:
                if size > BUF:
                    os.posix_fadvise(fi, 0, 0, _SEQUENTIAL)
                done = _pump(fi, fo, 0, size, state, src, dst)
            else:
                os.posix_fadvise(fi, 0, 0, _SEQUENTIAL)
                with state.stream():
                    done = _pump(fi, fo, 0, size, state, src, dst)
            st = os.fstat(fi)
            if not _same_file(job, st):  # read into our private partial/: removed on failure
                raise _Fail(_K_REPLACED, 0, src)
            if done != size or st.st_size != size or st.st_mtime_ns != mtime:
                raise _Fail(_K_CHANGED, 0, src)
            try:
                if not give_owner(fo, st, mode, state.chown, state.groups):
                    raise _Fail(_K_CHANGED, 0, src)  # the walk saw one of our groups: chgrp-ed
                os.utime(fo, ns=(atime, mtime))  # last: the mark of a complete file (resume)
            except OSError as e:
                raise _Fail(_K_WRITE, e.errno or 0, dst) from None
        finally:
            os.close(fo)
    finally:
        os.posix_fadvise(fi, 0, 0, _DONTNEED)  # RAM is used once: drop the source's pages
        os.close(fi)


def _small(fi: int, fo: int, size: int, src: str, dst: str) -> int:  # pragma: no cover - child
    """One read, one write: for small files the cheapest path (sendfile costs more per call)."""
    try:
        data = os.read(fi, size + 1)  # one byte more shows a file that grew
    except OSError as e:
        raise _Fail(_K_READ, e.errno or 0, src) from None
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fo, view) :]
    except OSError as e:
        raise _Fail(_K_WRITE, e.errno or 0, dst) from None
    return len(data)


def _copy_chunk(
    job: Job, offset: int, length: int, state: _State
) -> None:  # pragma: no cover - child
    src, dst, size, mtime = job[:4]
    fi = _open_src(job, state)
    try:
        os.posix_fadvise(fi, offset, length, _SEQUENTIAL)
        try:
            fo = os.open(dst, _WR_OLD)
        except OSError as e:
            raise _Fail(_K_WRITE, e.errno or 0, dst) from None
        try:
            with state.stream():
                done = _pump(fi, fo, offset, length, state, src, dst)
        finally:
            os.close(fo)
        st = os.fstat(fi)
        if not _same_file(job, st):
            raise _Fail(_K_REPLACED, 0, src)
        if done != length or st.st_size != size or st.st_mtime_ns != mtime:
            raise _Fail(_K_CHANGED, 0, src)
    finally:
        os.posix_fadvise(fi, offset, length, _DONTNEED)
        os.close(fi)


def _same_range(
    job: Job, offset: int, length: int, state: _State
) -> bool:  # pragma: no cover - child
    """Byte-compare ``length`` bytes of the source and the staged file (False if either is gone)."""
    dst = job[1]
    try:
        fa = _open_src(job, state)
    except _Fail as f:
        if f.kind in (_K_VANISHED, _K_CHANGED, _K_REPLACED, _K_NOTREG):
            return False
        raise
    try:
        try:
            fb = os.open(dst, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise _Fail(_K_READ, e.errno or 0, dst) from None
        try:
            st = os.fstat(fa)
            if not _same_file(job, st) or st.st_size != os.fstat(fb).st_size:
                return False
            a, b = memoryview(state.buf), memoryview(state.buf2)
            pos, end = offset, offset + length
            while pos < end:
                want = min(BUF, end - pos)
                na = os.preadv(fa, [a[:want]], pos)
                nb = os.preadv(fb, [b[:want]], pos)
                if na != nb or a[:na] != b[:nb]:
                    return False
                if na == 0:
                    return pos >= end
                pos += na
            return True
        finally:
            os.close(fb)
    finally:
        os.posix_fadvise(fa, offset, length, _DONTNEED)
        os.close(fa)
