"""Locks on files that may be unlinked while held (a dataset's lock, its placing lock), and
who is alive: every record that names a process names it by pid and start time."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from shmstage.errors import RefusedError, ShmstageError
from shmstage.stage.store.checks import check_owner, os_error


class Busy(RefusedError):
    """Another process holds the dataset's lock."""


@contextmanager
def lock_file(
    path: str,
    *,
    shared: bool = False,
    wait: bool = True,
    on_wait: Callable[[int | None], None] | None = None,
    busy: Callable[[int | None], ShmstageError] | None = None,
    refused: Callable[[OSError], ShmstageError] | None = None,
) -> Iterator[None]:
    """Hold a flock on ``path`` (created unless ``shared``), writing our pid into it.

    Lock files are unlinked while held (evict, gc), so a waiter may end up holding a file
    that is gone while a newcomer locks a new one: after each flock we check the path still
    names the file we locked and start over if it does not.  ``shared``: read-only, not
    created (no lock when the file does not exist) and no pid written."""
    while True:
        flags = os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            if shared:
                fd = os.open(path, flags | os.O_RDONLY)
            else:
                fd = os.open(path, flags | os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            if not shared:
                raise ShmstageError(
                    f"cannot open lock file {path}: its directory is gone"
                ) from None
            yield
            return
        except PermissionError as e:
            if not shared:
                raise (
                    refused(e) if refused else os_error(e, f"cannot open lock file {path}")
                ) from None
            # A reader in a store whose locks only its owner may open (root's, see
            # checks.lock_dir_mode): publish and removal are atomic renames, the copy is
            # checked against its record, so a reader needs no lock to be handed one.
            yield
            return
        except OSError as e:
            raise (
                refused(e) if refused else os_error(e, f"cannot open lock file {path}")
            ) from None
        try:
            st = os.fstat(fd)
            check_owner(path, st)
            kind = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
            try:
                fcntl.flock(fd, kind | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                if not wait:
                    raise (busy(holder) if busy else Busy(f"{path} is locked")) from None
                if on_wait is not None:
                    on_wait(holder)
                fcntl.flock(fd, kind)
            try:
                now = os.lstat(path)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                continue  # unlinked while we waited: lock the new file
            if not shared:
                # Only says who holds it: a full tmpfs (ENOSPC) must not stop a no-op.
                with suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{me(' ')}\n".encode(), 0)
            yield
            return
        finally:
            os.close(fd)


def drop_unheld(path: str, *, dry_run: bool = False) -> bool:
    """Unlink the lock file ``path`` if nobody holds it (True when it is gone; ``dry_run``:
    would be).  Taken without waiting: a holder or waiter re-checks the path after its
    flock (``lock_file``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            st, now = os.fstat(fd), os.lstat(path)
        except FileNotFoundError:
            return True
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False  # replaced meanwhile: someone else's now
        if dry_run:
            return True
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True
    finally:
        os.close(fd)


# --- who is alive ---------------------------------------------------------------------------
#
# A pid alone is reused (containers start at 1: "being removed by pid 18" forever): every
# record that names a process names it by pid and start time (/proc/PID/stat field 22, in
# clock ticks since boot), and a process is that one only if both match.


def _stat(pid: int) -> tuple[bytes, int] | None:
    """(state, start time): fields 3 and 22 of /proc/PID/stat; None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: the fields after the last ')' are 3...
    try:
        fields = raw[raw.rindex(b")") + 2 :].split()
        return fields[0], int(fields[19])
    except (ValueError, IndexError):
        return None


def activity(pid: int, start: int) -> tuple[bytes, int] | None:
    """(state, CPU ticks used: utime + stime) of the process that started at ``start`` with
    ``pid`` (/proc/PID/stat fields 3, 14, 15); None when it is not there any more."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        fields = raw[raw.rindex(b")") + 2 :].split()
        if int(fields[19]) != start:
            return None
        return fields[0], int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat; None when there is no such process."""
    stat = _stat(pid)
    return stat[1] if stat is not None else None


def running(pid: int, start: int) -> bool:
    """Whether the process that started at ``start`` with ``pid`` still runs: a zombie has
    exited (its pid stays taken until it is reaped, which ``alive`` counts)."""
    stat = _stat(pid)
    return stat is not None and stat[1] == start and stat[0] not in (b"Z", b"X", b"x")


def real_uid(pid: int) -> int | None:
    """The real uid of process ``pid`` (/proc/PID/status), None when there is none."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def me(sep: str = "-") -> str:
    """This process as ``<pid><sep><start time>`` (``<pid>`` where /proc does not say)."""
    pid = os.getpid()
    start = start_time(pid)
    return f"{pid}{sep}{start}" if start is not None else str(pid)


def alive(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` lives and, when ``start`` is known, is the one that started
    then (not a later process given the same pid).  No start: a record of the old format."""
    if start is None:
        return os.path.exists(f"/proc/{pid}")
    return start_time(pid) == start


def trash_owner(entry: str) -> tuple[str, int | None, int | None]:
    """trash/<name>.<pid>-<start>.<ns> -> (name, pid, start); <name>.<pid>.<ns> (the old
    format) -> (name, pid, None)."""
    parts = entry.rsplit(".", 2)
    if len(parts) == 3:
        pid, _, start = parts[1].partition("-")
        if pid.isdigit() and (start.isdigit() or not start):
            return parts[0], int(pid), int(start) if start else None
    return entry, None, None


def _read_pid(fd: int) -> int | None:
    """The pid a lock file names (``<pid> <start>``, or ``<pid>`` in the old format), if that
    process still lives."""
    try:
        fields = os.pread(fd, 64, 0).decode().split()
        pid = int(fields[0]) if fields else 0
        start = int(fields[1]) if len(fields) > 1 else None
    except (OSError, ValueError):
        return None
    return pid if pid > 0 and alive(pid, start) else None
