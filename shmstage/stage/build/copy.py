"""Copying (or comparing) files' bytes in a forked copier worker: what runs in the child.

Each file is opened below its source's top without following a symlink (beneath.py),
checked against what the walk found, and written with a few syscalls (open, sendfile or
read/write, fstat, futimens, fadvise, close); big files' chunks are written in place by
several workers, at most ``streams()`` big streams at once.  The parent side is
copier.py (NOTE [copier lifecycle]); the records both sides exchange are copypipe.py's.
Long because each kind of task (whole files with their reads queued ahead, a chunk, a
comparison) goes through the one open-and-check path here, private to the worker.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from shmstage.identity import Caller, reading_as
from shmstage.libc import load_libc
from shmstage.stage.build.chown import give_owner
from shmstage.stage.build.copypipe import (
    COPY,
    ERR,
    K_CHANGED,
    K_INTERNAL,
    K_NOTREG,
    K_READ,
    K_REPLACED,
    K_VANISHED,
    K_WRITE,
    MISMATCH,
    OK,
    STREAM,
    Job,
    Taken,
    Task,
    Tops,
    send,
)
from shmstage.stage.sources.beneath import NotRegular, SourceTree, ident
from shmstage.stage.sources.owners import keeps_owner, stager_groups

BUF = 1 << 20
SMALL = 64 << 10  # read whole, write whole; above: sendfile (one copy, no user buffer)
STREAM_MIN = 8 << 20  # a file this big (or a chunk) is a stream: at most streams() at once
_RD = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_NOATIME = getattr(os, "O_NOATIME", 0)
_WR_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_WR_OLD = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", 4)
_SEQUENTIAL = getattr(os, "POSIX_FADV_SEQUENTIAL", 2)
_PR_SET_PDEATHSIG = 1
# A worker's CPU priority below the stager's (nice +5: a third of its weight): the stager's
# walk hands the workers their files and, on 2 CPUs shared with 4 workers, waited for a CPU
# behind them (a 50k-file walk took 1.8-2.1 s with the workers, 0.5 s alone).
NICE = 5


class _Fail(Exception):
    def __init__(self, kind: int, err: int, path: str) -> None:
        self.kind, self.err, self.path = kind, err, path


def worker(
    next_task: Callable[[bool], Taken],
    res_w: int,
    slow: float,
    mask: set[signal.Signals],
    tops: Tops | None = None,
    slots: tuple[int, int] = (-1, -1),
    made: tuple[int, int] | None = None,
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
    with contextlib.suppress(OSError):  # the walk that feeds us must not wait behind us
        os.nice(NICE)
    state = _State()
    state.trees.update(tops or {})
    state.readers = any(tree.reader is not None for tree in state.trees.values())
    state.slots = slots
    state.made = made
    while True:
        got = next_task(False)
        if got is None:
            return 0
        if got == STREAM:  # a chunk: the next one in order, once a stream slot is ours
            state.hold()
            got = next_task(True)
        assert isinstance(got, tuple)
        idx, jobs, task = got
        try:
            nbytes, nfiles = _do_task(jobs, task, state, res_w, idx, slow)
            state.release()
            state.leave_folder(check=state.checks)
        except _Fail as f:
            send(res_w, ERR, idx, 0, 0, f.err, f.kind, f.path)
            return 0
        except Exception as e:  # report, never a traceback from a child
            send(
                res_w,
                ERR,
                idx,
                0,
                0,
                0,
                K_INTERNAL,
                f"{jobs[task.first][0]}: {type(e).__name__}: {e}",
            )
            return 0
        send(res_w, OK, idx, nbytes, nfiles)


class _Folder(NamedTuple):
    """The directory a task's files are in: opened once per task (SourceTree.open_dir), each
    file then one openat of its name, not an openat2 of its whole path."""

    key: str  # its whole path, "/"-terminated
    cut: int  # where the tree's top ends in its files' paths (nested tops differ)
    fd: int
    tree: SourceTree | None
    rel: str  # its path below the top
    path: str  # the path of the file it was opened for (for messages)
    seen: int  # its ident (st_dev, st_ino) when opened


_NO_FOLDER = _Folder("", 0, -1, None, "", "", 0)


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
        self.holding = False  # a slot is ours (see hold)
        self.made: tuple[int, int] | None = None  # a new file's owner, where known (made_here)
        self.folder = _NO_FOLDER  # the directory of the task's files (opened once per task)
        self.checks = False  # a copy task: a directory left must still be at its path
        self.readers = False  # a tree is read as another user (a service's caller)

    def leave_folder(self, check: bool = False) -> None:
        """Close the task's directory: the next task finds its own again by its path (a
        directory swapped since is not read through the one found before).  ``check``: its
        path must still lead (beneath the top, no symlink) to the very directory the task's
        files were opened in, else _Fail K_REPLACED (a directory renamed away and another or
        a symlink put in its place while the task ran: the copy came from a tree the source
        no longer has; a per-file open by path would have failed on the next file)."""
        here, self.folder = self.folder, _NO_FOLDER
        if here.fd < 0:
            return
        os.close(here.fd)
        if check and here.tree is not None:
            try:
                here.tree.stat(here.rel or ".", here.seen)
            except PermissionError:
                raise _Fail(K_READ, errno.EACCES, here.path) from None
            except FileNotFoundError:  # moved away or removed, nothing in its place
                raise _Fail(K_VANISHED, errno.ENOENT, here.path) from None
            except OSError as e:
                raise _Fail(K_REPLACED, e.errno or 0, here.path) from None

    def where(self, job: Job) -> tuple[SourceTree, int, str]:
        """``job``'s source tree, its directory's fd (opened beneath the tree's top without
        following a symlink, once per task) and its name in that directory."""
        path, rel = job[0], job[6]
        folder, _, name = rel.rpartition("/")
        key = path[: len(path) - len(name)]  # the directory's whole path, "/"-terminated
        cut = len(path) - len(rel)  # where the tree's top ends in it (nested tops differ)
        here = self.folder
        if here.key == key and here.cut == cut:
            return here.tree, here.fd, name  # type: ignore[return-value]
        top = path[:cut]
        tree = self.trees.get(top)
        if tree is None:
            tree = self.trees[top] = SourceTree(top)
        self.leave_folder(check=self.checks)
        fd = tree.open_dir(folder)
        try:
            seen = ident(os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        self.folder = _Folder(key, cut, fd, tree, folder, path, seen)
        return tree, fd, name

    def hold(self) -> None:
        """Take one of the streams() slots (for a chunk, before taking the chunk itself).  A
        worker that dies holding one fails the whole copy anyway (the parent sees it exit)."""
        os.read(self.slots[0], 1)
        self.holding = True

    def release(self) -> None:
        if self.holding:
            self.holding = False
            os.write(self.slots[1], b"s")

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Hold a slot while a big file's bytes are pumped (already held for a chunk)."""
        if self.holding:
            yield
            return
        self.hold()
        try:
            yield
        finally:
            self.release()


def _do_task(
    jobs: Sequence[Job], task: Task, state: _State, res_w: int, idx: int, slow: float
) -> tuple[int, int]:  # pragma: no cover - child
    nbytes = nfiles = 0
    state.checks = task.op == COPY
    if task.length >= 0:
        job = jobs[task.first]
        last = task.offset + task.length >= job[2]
        if task.op == COPY:
            _copy_chunk(job, task.offset, task.length, state)
        elif not _same_range(job, task.offset, task.length, state):
            send(res_w, MISMATCH, idx, 0, 0, 0, 0, job[6])
        return task.length, int(last)
    ahead = _ReadAhead(jobs, task.first, task.last, state)
    opened: dict[int, int | _Fail] = {}
    try:
        for i in range(task.first, task.last):
            job = jobs[i]
            if task.op == COPY:
                ahead.past(i)
                if state.readers and i not in opened and _reader_of(job, state) is not None:
                    _open_ahead(jobs, i, task.last, state, opened)
                _copy_file(job, state, opened.pop(i, None))
                if slow:
                    time.sleep(slow)
            elif not _same_range(job, 0, job[2], state):
                send(res_w, MISMATCH, idx, 0, 0, 0, 0, job[6])
            nbytes += job[2]
            nfiles += 1
    finally:
        for fd in opened.values():
            if isinstance(fd, int):
                os.close(fd)
    return nbytes, nfiles


AHEAD = 64  # source files a reader's worker opens in one switch of its file-system ids
READ_AHEAD = 128  # source files whose reads a worker keeps queued ahead of its copy (and...)
READ_AHEAD_BYTES = 16 << 20  # ...at most this much of them: the page cache they fill meanwhile
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", 3)


def _reader_of(job: Job, state: _State) -> Caller | None:  # pragma: no cover - child
    """The reader of the tree ``job`` is read from (None: this process reads it)."""
    tree = state.trees.get(job[0][: len(job[0]) - len(job[6])])
    return tree.reader if tree is not None else None


def _open_ahead(
    jobs: Sequence[Job], first: int, last: int, state: _State, opened: dict[int, int | _Fail]
) -> None:  # pragma: no cover - child
    """Open the sources of the next jobs as their reader in one switch (~10 us) instead of
    one per file; each failure is kept and raised when its file's turn comes, as it would
    have been.  The destination side is written as this process, outside the switch."""
    with reading_as(_reader_of(jobs[first], state)):
        for i in range(first, min(last, first + AHEAD)):
            try:
                opened[i] = _open_src(jobs[i], state, copy=True)
            except _Fail as f:
                opened[i] = f


class _ReadAhead:
    """The reads of the next files of a copy batch, queued before their turn.

    A small file's copy is one read that waits on the disk, and a worker copies one file at
    a time: a few workers keep a few reads in flight where a cold disk (a network block
    device most of all) serves many more.  So a worker asks the kernel for the bytes of the
    next ``READ_AHEAD`` files of its batch (at most ``READ_AHEAD_BYTES``, big files' streams
    never): each is opened as its turn would open it, told POSIX_FADV_WILLNEED (the reads
    are queued, nothing waits) and closed.  Only the page cache remembers it: each file is
    opened again at its turn and checked as before, so what is copied is what the path
    holds then; a hint that fails (a file gone, no fd left) is no hint.  50k 2 KiB files,
    cold, 2-CPU VM, 8 workers: the copy took 3.35 s without and 2.22 s with (median of 4).
    The window is refilled when half of it has been copied: one switch of the reader's
    file-system ids per refill."""

    def __init__(self, jobs: Sequence[Job], first: int, last: int, state: _State) -> None:
        self.jobs, self.last, self.state = jobs, last, state
        self.next = first  # the next job to hint
        self.queued: deque[int] = deque()  # bytes hinted per job not yet copied, in order
        self.bytes = 0

    def past(self, i: int) -> None:  # pragma: no cover - child
        """Job ``i``'s turn has come: forget it, and hint the next files when half the
        window is spent."""
        if self.queued and self.next > i:
            self.bytes -= self.queued.popleft()
        if self.next >= self.last or len(self.queued) > READ_AHEAD // 2:
            return
        self.next = max(self.next, i + 1)
        if self.next >= self.last:
            return
        jobs, state = self.jobs, self.state
        with reading_as(_reader_of(jobs[self.next], state)):
            while self.next < self.last and len(self.queued) < READ_AHEAD:
                if self.queued and self.bytes >= READ_AHEAD_BYTES:
                    break
                job = jobs[self.next]
                self.next += 1
                size = job[2] if 0 < job[2] < STREAM_MIN else 0  # streams: at their turn
                self.queued.append(size)
                self.bytes += size
                if size:
                    _hint(job, state)


def _hint(job: Job, state: _State) -> None:  # pragma: no cover - child
    """Queue the reads of ``job``'s source (opened as :func:`_open_src` would, in its
    directory found beneath its top, never following a symlink), and close it."""
    flags = _RD | os.O_NONBLOCK  # a FIFO put in its place since the walk: no wait
    try:
        tree, at, name = state.where(job)
    except OSError:  # its directory: the file's turn says what is wrong (or it is fine then)
        return
    try:
        fd = tree.open(name, flags | state.noatime, at)
    except PermissionError:
        if not state.noatime:
            return
        try:  # O_NOATIME needs ownership: _open_src learns that at the file's turn
            fd = tree.open(name, flags, at)
        except OSError:
            return
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, _WILLNEED)
    except OSError:
        pass  # a FIFO (ESPIPE) or a file system without readahead
    finally:
        os.close(fd)


def _open_src(job: Job, state: _State, copy: bool = False) -> int:  # pragma: no cover - child
    """The job's source file, opened by its name in its directory (:meth:`_State.where`: found
    below its tree's top without following any symlink), never following a symlink itself
    (``copy``: for :func:`_copy_file`, where a small file is read once, by :func:`_small`)."""
    path = job[0]
    try:
        tree, at, name = state.where(job)
        return tree.open_file(name, _RD | state.noatime, not copy or job[2] > SMALL, at)
    except NotRegular:
        raise _Fail(K_NOTREG, 0, path) from None
    except PermissionError:
        if not state.noatime:
            raise _Fail(K_READ, errno.EACCES, path) from None
        state.noatime = 0  # O_NOATIME needs ownership (or CAP_FOWNER): go without
        return _open_src(job, state, copy)
    except FileNotFoundError:
        raise _Fail(K_VANISHED, errno.ENOENT, path) from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):  # a symlink on the way now
            raise _Fail(K_REPLACED, e.errno, path) from None
        raise _Fail(K_READ, e.errno or 0, path) from None


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
            raise _Fail(K_READ, e.errno or 0, src) from None
        if n == 0:
            return done
        w = 0
        while w < n:
            try:
                w += os.pwrite(fo, view[w:n], offset + done + w)
            except OSError as e:
                raise _Fail(K_WRITE, e.errno or 0, dst) from None
        done += n
    return done


def _which_side(
    fi: int, fo: int, e: OSError, src: str, dst: str
) -> tuple[int, int, str]:  # pragma: no cover - child
    """sendfile does not say which fd failed; ENOSPC/EDQUOT/EFBIG/EROFS are the destination's."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS):
        return K_WRITE, e.errno, dst
    return K_READ, e.errno or 0, src


def _copy_file(
    job: Job, state: _State, opened: int | _Fail | None = None
) -> None:  # pragma: no cover - child
    """Copy one file; ``opened``: its source, opened ahead (:func:`_open_ahead`)."""
    src, dst, size, mtime, atime, mode = job[:6]
    if isinstance(opened, _Fail):
        raise opened
    fi = _open_src(job, state, copy=True) if opened is None else opened
    try:
        try:
            fo = os.open(dst, _WR_NEW, mode)
        except OSError as e:
            raise _Fail(K_WRITE, e.errno or 0, dst) from None
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
            if not _same_file(job, st):
                raise _Fail(K_REPLACED, 0, src)  # read into our private partial/: removed
            if done != size or st.st_size != size or st.st_mtime_ns != mtime:
                raise _Fail(K_CHANGED, 0, src)
            try:
                if not give_owner(fo, st, mode, state.chown, state.groups, state.made):
                    raise _Fail(K_CHANGED, 0, src)  # the walk saw one of our groups: chgrp-ed
                os.utime(fo, ns=(atime, mtime))  # last: the mark of a complete file (resume)
            except OSError as e:
                raise _Fail(K_WRITE, e.errno or 0, dst) from None
        finally:
            os.close(fo)
    finally:
        os.posix_fadvise(fi, 0, 0, _DONTNEED)  # RAM is used once: drop the source's pages
        os.close(fi)


def _small(fi: int, fo: int, size: int, src: str, dst: str) -> int:  # pragma: no cover - child
    """One read, one write: for small files the cheapest path (sendfile costs more per call)."""
    try:
        try:
            data = os.read(fi, size + 1)  # one byte more shows a file that grew
        except BlockingIOError:  # opened O_NONBLOCK (_open_src) and the file system minds
            fcntl.fcntl(fi, fcntl.F_SETFL, fcntl.fcntl(fi, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            data = os.read(fi, size + 1)
    except OSError as e:
        raise _Fail(K_READ, e.errno or 0, src) from None
    try:
        n = os.write(fo, data)  # tmpfs takes it whole; a short write goes on from there
        if n < len(data):
            view = memoryview(data)[n:]
            while view:
                view = view[os.write(fo, view) :]
    except OSError as e:
        raise _Fail(K_WRITE, e.errno or 0, dst) from None
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
            raise _Fail(K_WRITE, e.errno or 0, dst) from None
        try:
            with state.stream():
                done = _pump(fi, fo, offset, length, state, src, dst)
        finally:
            os.close(fo)
        st = os.fstat(fi)
        if not _same_file(job, st):
            raise _Fail(K_REPLACED, 0, src)
        if done != length or st.st_size != size or st.st_mtime_ns != mtime:
            raise _Fail(K_CHANGED, 0, src)
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
        if f.kind in (K_VANISHED, K_CHANGED, K_REPLACED, K_NOTREG):
            return False
        raise
    try:
        try:
            fb = os.open(dst, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise _Fail(K_READ, e.errno or 0, dst) from None
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
