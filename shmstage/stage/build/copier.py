"""The parallel copier's parent side: forked worker processes copy (or compare) batches of
files (the worker is copy.py, the pipes' records copypipe.py).

Threads are not enough for many small files (the GIL serialises the per-file Python
work), so the work runs in processes, a few syscalls per file, batched so that one pipe
message moves up to a few hundred files.  Big files are split into chunks that several
workers copy at once.  Long because two drivers share the workers' protocol: :func:`run`
for a list known up front and :class:`Stream` for jobs handed out while a walk goes on.

NOTE [copier lifecycle]

    main process (run)                      worker i (forked)
    ------------------                      -----------------
    build tasks (inherited by fork)
    fork N workers  ----------------------> ignore SIGINT, die with the parent
    send 2N task indices  ---- task pipe -> read 4 bytes: a task index (-1: exit 0)
      a chunk: STREAM there,               STREAM: take a stream slot, then the
      its index in the chunk pipe  -------> next chunk from the chunk pipe (in order)
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
import os
import signal
import struct
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

from shmstage.stage.build.chown import made_here
from shmstage.stage.build.copy import worker
from shmstage.stage.build.copypipe import (
    COMPARE,
    COPY,
    STREAM,
    Feeds,
    Job,
    Results,
    Taken,
    Task,
    Tops,
    check_alive,
    pipes,
    read_exact,
)

# What run and Stream raise on a worker's failure: callers catch copier.CopyFailed.
from shmstage.stage.build.copypipe import CopyFailed as CopyFailed
from shmstage.stage.build.estimate import rounded

BATCH_FILES = 256
BATCH_BYTES = 32 << 20
CHUNK = 64 << 20  # files above 2 chunks are split so several workers share them

# Test hook (docs/staging.md): seconds to sleep per copied file, to land a signal mid-copy.
SLOW_ENV = "SHMSTAGE_TEST_SLOW_COPY"
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def streams(src: str) -> int:
    """Big files (chunks) copied at once from ``src``: one per CPU from a local disk (each is a
    sendfile, a memcpy that keeps a CPU busy; 4 shards of 512 MiB on 2 CPUs: 2 streams 1.0
    s, 8 streams 1.1-3.0 s); no limit from a network file system, where streams wait on
    round trips."""
    from shmstage.system import is_network_fs, mount_of, usable_cpus

    mount = mount_of(src)
    if mount is not None and is_network_fs(mount.fstype):
        return 1 << 16
    return max(1, usable_cpus())


class Place(NamedTuple):
    """Where the workers copy from and to: a source path (its file system sets the streams),
    a directory of the destination (made_here) and the sources' tops opened once."""

    src: str
    dst: str
    tops: Tops | None


def default_workers(src: str | None = None) -> int:
    """Workers for a copy from ``src``: 2 per CPU from a local disk, each with the reads of
    its next files under way (copy.py's _ReadAhead; 50k 2 KiB files, cold, 2 CPUs: 8 workers
    2.29 s, 4 1.97 s); 4 per CPU (8 to 32) from a network file system or an unknown ``src``."""
    from shmstage.system import is_network_fs, mount_of, usable_cpus

    cpus, mount = usable_cpus(), mount_of(src) if src is not None else None
    if mount is None or is_network_fs(mount.fstype):
        return min(32, max(8, 4 * cpus))
    return min(32, max(2, 2 * cpus))


def make_tasks(
    jobs: Sequence[Job], op: int = COPY, chunk: int | None = None
) -> tuple[list[Task], list[int]]:
    """Batches of small files and chunks of big ones; returns (tasks, chunked job indices).

    Chunks go first so the big files start early and the small batches fill the tail.
    Both are dealt round-robin (chunks across files, batches across directories):
    tmpfs serialises writes to one file on its inode lock and file creation in one
    directory on the directory's lock, so workers busy in different places run in
    parallel."""
    chunk = chunk or CHUNK  # read now: tests make it small
    big = 2 * chunk
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
        if size > big:
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
    fds: list[int] = []  # closed at the end: each pipe's ends listed as soon as it exists
    pids: list[int] = []
    alive: set[int] = set()
    results: Results | None = None
    try:
        task_r, task_w, chunk_r, chunk_w, res_r, res_w = pipes(fds, 3)

        def next_task(chunk: bool = False) -> Taken:  # pragma: no cover - child
            idx = struct.unpack("<i", read_exact(chunk_r if chunk else task_r, 4))[0]
            if idx < 0:
                return None if idx == -1 else STREAM
            return (idx, jobs, tasks[idx])

        at = Place(jobs[0][0], os.path.dirname(jobs[0][1]), tops)
        _fork_workers(workers, pids, alive, (task_w, chunk_w, res_r), next_task, res_w, slow, at)
        for fd in (task_r, chunk_r, res_w):
            fds.remove(fd)
            os.close(fd)
        feed = Feeds(task_w, chunk_w, 4)
        chunks = [i for i, t in enumerate(tasks) if t.length >= 0]
        order = [STREAM if t.length >= 0 else i for i, t in enumerate(tasks)]
        feed.add(
            struct.pack(f"<{len(order) + len(pids)}i", *order, *[-1] * len(pids)),
            struct.pack(f"<{len(chunks)}i", *chunks),
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
        for fd in fds:
            os.close(fd)
    return results.mismatches if results is not None else []


# seq, op, jobs offset, jobs span, count, chunk offset, chunk length
_REC = struct.Struct("<iiqqiqq")
_INO = (1 << 64) - 1
_JOB = struct.Struct("<qqqiQQI")  # size, mtime_ns, atime_ns, mode, st_dev, st_ino, len(rel)
_FSENC, _FSERR = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()  # os.fsencode's
_STREAM_REC = _REC.pack(STREAM, 0, 0, 0, 0, 0, 0)


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
        on_task: Callable[[int], None] | None = None,
    ) -> None:
        self.src_prefix, self.dst_prefix = src_prefix, dst_prefix
        self.on_task = on_task  # called with each finished task's number (ondemand.py)
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
            task_r, task_w, chunk_r, chunk_w, res_r, res_w = pipes(self.fds, 3)
            mem, src, dst = self.mem, self.src_prefix, self.dst_prefix

            def next_task(chunk: bool = False) -> Taken:  # pragma: no cover - child
                raw = read_exact(chunk_r if chunk else task_r, _REC.size)
                seq, op, off, span, count, coff, clen = _REC.unpack(raw)
                if seq < 0:
                    return None if seq == -1 else STREAM
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
                (task_w, chunk_w, res_r),
                next_task,
                res_w,
                slow,
                Place(self.src_prefix, self.dst_prefix, self.tops),
            )
            for fd in (task_r, chunk_r, res_w):
                self.fds.remove(fd)
                os.close(fd)
            self.feed = Feeds(task_w, chunk_w, _REC.size)
            self.results = Results(res_r, self.feed, self.alive, self.progress, self._landed)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _landed(self, seq: int) -> None:
        self.landed += self._pages.pop(seq, 0)
        if self.on_task is not None:
            self.on_task(seq)

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
        pack, fixed, append, mark = _JOB.pack, _JOB.size, parts.append, offsets.append
        for job in jobs:  # per file of a million: locals, os.fsencode's encode inline
            rel = job[0][skip:].encode(_FSENC, _FSERR)
            mark(pos)
            who = job[7] if len(job) > 7 else 0
            append(pack(job[2], job[3], job[4], job[5], who >> 64, who & _INO, len(rel)))
            append(rel)
            pos += fixed + len(rel)
        offsets.append(pos)
        os.pwrite(self.mem, b"".join(parts), self.end)
        self.end = pos
        tasks, chunked = make_tasks(jobs)
        for i in chunked:
            create_sized(jobs[i][1], jobs[i][2])
        records, chunks = [], []
        page = self.page
        for t in tasks:
            off, span = offsets[t.first], offsets[t.last] - offsets[t.first]
            if t.length >= 0:
                pages = rounded(t.length, page)
            else:  # -(n // -page): whole pages
                pages = -sum([j[2] // -page for j in jobs[t.first : t.last]]) * page
            self._pages[self.sent] = pages
            self.handed += pages
            rec = _REC.pack(self.sent, t.op, off, span, t.last - t.first, t.offset, t.length)
            if t.length >= 0:
                chunks.append(rec)
                rec = _STREAM_REC
            records.append(rec)
            self.sent += 1
        self.feed.add(b"".join(records), b"".join(chunks))
        self.feed.push()
        self.results.collect(self.sent, 0)
        return [jobs[i] for i in chunked]

    def drain(self) -> None:
        """Wait until every task added so far is done (the workers stay)."""
        while True:
            self.feed.push()
            if self.results.done == self.sent and self.feed.flushed:
                return
            if not self.results.collect(self.sent, 0.2):
                check_alive(self.alive)

    def finish(self) -> None:
        """Wait for every task added, then for the workers to exit; raises CopyFailed on the
        first failure."""
        self.feed.add(_REC.pack(-1, 0, 0, 0, 0, 0, 0) * len(self.pids))
        self.drain()
        for pid in list(self.alive):
            os.waitpid(pid, 0)
            self.alive.discard(pid)


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
    next_task: Callable[[bool], Taken],
    res_w: int,
    slow: float,
    at: Place,
) -> None:
    """Fork ``workers`` processes running :func:`worker` (pids added as they start)."""
    # Signals wait for the workers: a handler raising in fork()'s at-fork hooks is swallowed.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    slots: list[int] = []  # a byte per stream a worker may run (see streams()); closed here after
    try:
        pipes(slots, 1)
        os.write(slots[1], b"s" * min(streams(at.src), workers))
        made = made_here(at.dst)
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
                        code = worker(
                            next_task, res_w, slow, blocked, at.tops, (slots[0], slots[1]), made
                        )
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
