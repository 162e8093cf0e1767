"""Holding a lease for another process: ``stage --lease-for PID`` without the node service.

A detached holder process (double fork, its own session, stdio on /dev/null) keeps the
dataset's lease until PID exits, so ``DATA=$(shmstage stage SRC --lease-for $$ -q)``
protects a batch script and the ``$(...)`` returns at once.  PID is known by pid and
start time; the holder (leasewait.py once it holds) waits on a pidfd, or polls /proc
where the kernel has none.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import signal
import sys
import time
import warnings
from contextlib import suppress

from shmstage.errors import RefusedError
from shmstage.stage.store import leases, leasewait
from shmstage.stage.store.locks import real_uid, running, start_time

READY_SECONDS = 30.0  # a holder says it holds the lease well before this


def target(pid: int, uid: int, pidfd: int | None = None) -> int:
    """The start time of process ``pid``, once it is known that ``uid`` may lease for it: its
    owner (real uid) or root.  With ``pidfd`` (opened first), the facts read from /proc are
    that process's: it had not exited when they were read.  RefusedError otherwise."""
    start = start_time(pid)
    owner = real_uid(pid)
    gone = RefusedError(f"cannot lease for pid {pid}: no such process")
    if start is None or owner is None:
        raise gone
    if pidfd is not None:
        if exited(pidfd):
            raise gone
    elif not running(pid, start):  # exited, or its pid reused while we read
        raise gone
    if uid != 0 and owner != uid:
        raise RefusedError(
            f"cannot lease for pid {pid}: it is another user's process (uid {owner}); "
            "lease for a process of your own"
        )
    return start


def pidfd_of(pid: int) -> int | None:
    """A pidfd on ``pid``; None where the kernel (before 5.3) or Python has none.
    ProcessLookupError when there is no such process."""
    try:
        return os.pidfd_open(pid)
    except AttributeError:
        return None
    except OSError as e:
        if e.errno in (errno.ENOSYS, errno.EPERM):  # EPERM: a seccomp filter refusing it
            return None
        raise


def exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (a pidfd turns readable then)."""
    return bool(select.select([pidfd], [], [], 0)[0])


def hold_until(lease: leases.Lease, pid: int, start: int) -> None:
    """Leave a detached process holding ``lease``'s dataset until process ``pid`` (started
    at ``start``) exits; returns once it holds it (``lease`` may then be released).
    RefusedError, nothing held, when ``pid`` is gone (or its pid now names another)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        with warnings.catch_warnings():
            # Python 3.12 warns of fork() beside threads: the child takes no lock another
            # thread may hold (plain os calls), then execs.
            warnings.simplefilter("ignore", DeprecationWarning)
            child = os.fork()
        if child == 0:  # pragma: no cover - the child's lines run in other processes
            try:
                os.close(r)
                os.setsid()  # no terminal, no job control: only PID's exit ends it
                if os.fork() == 0:
                    _holder(lease, pid, start, w)
            finally:
                os._exit(0)
        os.close(w)
        w = -1
        os.waitpid(child, 0)
        answer = _read_all(r)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    if answer != b"ok":
        raise RefusedError(
            answer.decode(errors="replace") or f"cannot lease for pid {pid}: the holder failed"
        )


def _read_all(fd: int) -> bytes:
    out = b""
    deadline = time.monotonic() + READY_SECONDS
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b""
        chunk = os.read(fd, 4096)
        if not chunk:
            return out
        out += chunk


def _holder(lease: leases.Lease, pid: int, start: int, w: int) -> None:  # pragma: no cover
    """The detached holder (a grandchild): take the lease, say so, then become leasewait.py
    (exec: a small process, not a copy of the stager's memory) until ``pid`` exits."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)  # the stager's handlers are not ours
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)  # the caller's $(...) pipe must see end of file when it returns
    os.chdir("/")  # keep no file system busy but the store's
    try:
        pidfd = pidfd_of(pid)
    except OSError:
        os.write(w, f"cannot lease for pid {pid}: no such process".encode())
        return
    keep = {w, lease.fileno(), pidfd}
    for entry in os.listdir("/proc/self/fd"):
        if int(entry) > 2 and int(entry) not in keep:
            with suppress(OSError):
                os.close(int(entry))
    try:
        if start_time(pid) != start or (pidfd is not None and exited(pidfd)):
            os.write(w, f"cannot lease for pid {pid}: it exited".encode())
            return
        # A flock of our own (a new open file of the same lease file): /proc/locks then
        # names this process.  Granted at once: the stager holds the lease meanwhile.
        fd = os.open(f"/proc/self/fd/{lease.fileno()}", os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        os.close(lease.fileno())  # the stager's (the same open file): it releases its own
        me = os.getpid()
        mark = leases.mark(lease.store, lease.name, (me, start_time(me) or 0), (pid, start))
        os.write(w, b"ok")
    except Exception as e:
        with suppress(OSError):
            os.write(w, f"cannot lease for pid {pid}: {e}".encode())
        return
    finally:
        os.close(w)  # the stager reads to end of file
    os.set_inheritable(fd, True)  # Python opens fds close-on-exec (PEP 446)
    if pidfd is not None:
        os.set_inheritable(pidfd, True)
    argv = [
        "--for-pid", str(pid), "--start", str(start),
        "--pidfd", str(-1 if pidfd is None else pidfd), "--mark", mark or "-",
    ]  # fmt: skip
    with suppress(OSError):
        os.execv(sys.executable, [sys.executable, "-I", "-S", leasewait.__file__, *argv])
    leasewait.main(argv)  # no interpreter to run (an embedded Python): wait here
