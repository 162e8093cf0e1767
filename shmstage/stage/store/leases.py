"""Leases: a job says "I am reading this staged dataset" so nobody removes it underneath.

A lease is a shared ``flock`` on ``DEST/.shmstage/leases/<name>.lease``, held for as long
as the job (or the ``with`` block) lives; the kernel drops it when the process dies, so
there are no pid files to go stale.  ``evict``, ``run --cleanup`` and ``prepare`` take the
same lock exclusively (non-blocking) before removing a dataset and refuse when they cannot,
naming the holders they find in /proc/locks, or the process a holder holds it for (marks),
also after that holder died (see ``orphaned``).
No pid is trusted alone: a pid in /proc/locks is a live lock's, and a mark names both
processes by pid and start time (a mark whose processes are not those is ignored).

Long because taking a lease, finding its holders and the marks of holders for others read
the same files under the same rules; apart, each would re-derive them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from shmstage.errors import RefusedError, ShmstageError
from shmstage.stage.store import access
from shmstage.stage.store.checks import check_owner, mkdir_checked
from shmstage.stage.store.datasets import dataset_of
from shmstage.stage.store.layout import Store
from shmstage.stage.store.locks import real_uid, running
from shmstage.stage.store.names import BOOK, NAME_RE
from shmstage.terminal import printable

_COMMAND_CHARS = 120
_PYTHON_FLAGS = ("-I", "-S", "-E", "-s", "-B", "-u", "-O", "-OO", "-P")  # none takes a value


@dataclass(frozen=True)
class Holder:
    """A process holding a lease (from /proc/locks) and its command line; or the process a
    lease is held for (``stage --lease-for PID``, the node service), and who holds it."""

    pid: int
    command: str  # its command line, shortened ("" when hidden or gone)
    via: int = 0  # the process holding the flock for ``pid`` (0: ``pid`` holds it itself)


class InUse(RefusedError):
    """A leased dataset cannot be removed (without ``force``), nor replaced by a copy of
    another source (``replacing``: that source; no ``force`` overrides it)."""

    def __init__(
        self, name: str, holders: tuple[Holder, ...], replacing: str | None = None
    ) -> None:
        if replacing is None:
            line = (
                f"{name} is in use by {describe(holders)}; wait for the job to finish or pass "
                "--force (the job will fail reading files that are gone)"
            )
        else:
            line = (
                f"{name} is in use by {describe(holders)}: replacing it with {replacing} would "
                "change the files under that job; wait for it to finish"
            )
        super().__init__(line)
        self.name = name
        self.holders = holders


def describe(holders: tuple[Holder, ...]) -> str:
    """``pid 1234 (torchrun ...)``, several joined by commas."""
    known = [h for h in holders if h.pid > 0]  # pid 0: locked, but not in our /proc/locks view
    if not known:
        return "another process"
    return ", ".join(_one(h) for h in known)


def _one(h: Holder) -> str:
    text = f"pid {h.pid} ({h.command})" if h.command else f"pid {h.pid}"
    return f"{text} held for it by shmstage (pid {h.via})" if h.via else text


def lease_path(store: Store, name: str) -> str:
    return store.lease_path(name)


def _open(path: str, *, create: bool) -> int | None:
    """An fd on the lease file (read-only is enough for flock); None if it does not exist."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    if create:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        except PermissionError:
            pass  # a reader that may not write DEST: the store created the file at publish
        except FileNotFoundError:
            return None  # no leases/ directory (a store from before leases)
        else:
            # Made 0600; then as the copy's top, like its manifest: only who may read the
            # copy may open it, so lease it (share_bookkeeping keeps it so at a restage).
            dest = os.path.dirname(os.path.dirname(os.path.dirname(path)))  # DEST/.shmstage/leases/
            top = os.path.join(dest, os.path.basename(path).removesuffix(".lease"))
            with suppress(OSError):  # else 0600: the owner's alone until a publish shares it
                access.share_like(fd, access.bookkeeping_access(top))
            return fd
    try:
        return os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ShmstageError(f"cannot open lease file {path}: {e.strerror}") from None


def ensure_file(store: Store, name: str) -> None:
    """Create the lease file, with its copy's access, so readers who cannot write DEST (and
    may read the copy) can lease it."""
    if not os.path.isdir(store.lease_dir):  # a store from before leases
        with suppress(ShmstageError):
            mkdir_checked(store.lease_dir, 0o755)
    try:
        fd = _open(lease_path(store, name), create=True)
    except (OSError, ShmstageError):
        return  # e.g. a read-only DEST: leasing then needs the file to exist already
    if fd is not None:
        os.close(fd)


class Lease:
    """A held shared lease on one published dataset; ``release()`` (or leaving ``with``) drops it."""

    def __init__(self, store: Store, name: str, fd: int, dataset: Any) -> None:
        self.store, self.name, self.dataset = store, name, dataset
        self._fd: int | None = fd
        self._pid = os.getpid()  # who took it: a forked child holds only a copy

    @property
    def held(self) -> bool:
        return self._fd is not None

    def fileno(self) -> int:
        """The fd holding the flock (a holder for another process reopens it)."""
        if self._fd is None:
            raise ValueError("lease released")
        return self._fd

    def release(self) -> None:
        """Let go: unlock, so copies of the fd in forked children (a DataLoader worker, a
        service's request) do not keep it held.  In such a child, only close its copy."""
        if self._fd is None:
            return
        if os.getpid() != self._pid:
            self.close_copy()
            return
        fd, self._fd = self._fd, None
        with suppress(Exception):  # the end of a job is a use too: LRU order (makeroom.py)
            record = self.store.published(self.name)
            if record is not None:
                self.store.touch(record)
        with suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)  # the open file's lock, whoever else has the fd
        os.close(fd)

    def close_copy(self) -> None:
        """Close this process's fd without a release's bookkeeping: the copy a forked child
        inherited (the lease stays held by the parent's)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> Any:
        return self.dataset

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def acquire(name: str, dest: str | os.PathLike[str] | None = None) -> Lease:
    """Take a shared lease on the published dataset ``name`` (waits while an evict removes it)."""
    store = Store(dest)
    not_staged = ShmstageError(f"{name} is not staged in {store.dest} (see `shmstage list`)")
    if not os.path.lexists(store.book):
        raise not_staged
    store.open(create=False)
    path = lease_path(store, name)
    while True:
        if store.published(name) is None:
            raise not_staged
        ensure_file(store, name)  # best effort: a reader who may not write DEST just opens it
        fd = _open(path, create=False)
        if fd is None:
            raise ShmstageError(
                f"cannot lease {name}: {path} is missing and cannot be created; "
                f"re-stage it (`shmstage stage --name {name} ...`) so it gets a lease file"
            )
        try:
            st = os.fstat(fd)
            check_owner(path, st)
            _lock_shared(fd, name, path)
            try:
                now = os.lstat(path)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)
                continue  # evicted (lease file unlinked) while we waited: look again
            record = store.published(name)
            if record is None:
                raise not_staged
        except BaseException:
            os.close(fd)
            raise
        return Lease(store, name, fd, dataset_of(store.touch(record), store))


LEASE_WAIT = 30.0  # seconds a lease waits for an exclusive hold (an evict's) to end


def _lock_shared(fd: int, name: str, path: str) -> None:
    """LOCK_SH on the lease file.  Exclusive holds are an evict's, only while it removes the
    copy; anyone who may read the copy may open this file, so a hold that outlasts
    LEASE_WAIT is refused with who holds it rather than waited on for ever."""
    deadline = time.monotonic() + LEASE_WAIT
    pause = 0.01
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                st = os.fstat(fd)
                raise RefusedError(
                    f"cannot lease {name}: {path} has been held exclusively for "
                    f"{LEASE_WAIT:.0f} s by {describe(holders_of(st.st_dev, st.st_ino))}; "
                    "try again once it lets go"
                ) from None
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def locate(path_or_name: str | os.PathLike[str]) -> tuple[str, str] | None:
    """(DEST, name) when ``path_or_name`` is DEST/<name> or a path inside it, else None."""
    path = os.path.abspath(os.fspath(path_or_name))
    for candidate in dict.fromkeys((path, os.path.realpath(path))):
        p = candidate
        while True:
            parent = os.path.dirname(p)
            if parent == p:
                break
            base = os.path.basename(p)
            if NAME_RE.match(base) and os.path.isdir(os.path.join(parent, BOOK, "meta")):
                return parent, base
            p = parent
    return None


def try_exclusive(store: Store, name: str) -> tuple[int | None, tuple[Holder, ...]]:
    """Lock the lease file exclusively without waiting: (fd, ()) on success, (None, holders)
    when a job holds it.  (None, ()) when there is no lease file: nobody can hold a lease."""
    path = lease_path(store, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, ()
    except OSError as e:
        raise ShmstageError(f"cannot open lease file {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        st = os.fstat(fd)
        os.close(fd)
        found = on_behalf(store, name, holders_of(st.st_dev, st.st_ino))
        found = _joined(found, orphaned(store, name))
        return None, found or (Holder(0, ""),)
    left = orphaned(store, name)
    if left:  # held for a live process by a holder that died: still a lease
        os.close(fd)
        return None, left
    return fd, ()


@contextmanager
def unleased(store: Store, name: str, replacing: str) -> Iterator[None]:
    """Hold ``name``'s lease file exclusively for the block (a new lease waits for it), or
    raise InUse when a job holds a lease: a leased dataset is never replaced by a copy of
    another source (``replacing``), whoever asks, --force or not (the job would read other
    files; a forced recopy of the same source, or evict --force, is not this)."""
    fd, found = try_exclusive(store, name)
    if found:
        raise InUse(name, found, replacing=replacing)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def holders(name: str, dest: str | os.PathLike[str] | None = None) -> tuple[Holder, ...]:
    """Who holds a lease on ``name`` right now (empty when nobody does)."""
    store = Store(dest)
    try:
        st = os.lstat(lease_path(store, name))
    except OSError:
        return ()
    found = on_behalf(store, name, holders_of(st.st_dev, st.st_ino))
    return _joined(found, orphaned(store, name))


def _joined(a: tuple[Holder, ...], b: tuple[Holder, ...]) -> tuple[Holder, ...]:
    return a + tuple(h for h in b if h.pid not in {x.pid for x in a})


def holders_of(dev: int, ino: int) -> tuple[Holder, ...]:
    """Processes holding a lock on the file (dev, ino), read from /proc/locks.

    Lines look like ``3: FLOCK  ADVISORY  READ  1234 00:2f:5678 0 EOF``, with the device's
    major:minor in hex; ``3: -> FLOCK ...`` lines are waiters, not holders."""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    pids: list[int] = []
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return ()
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] == "->":
            continue
        if fields[5] == want or _same_id(fields[5], want):
            try:
                pid = int(fields[4])
            except ValueError:
                continue
            if pid not in pids:
                pids.append(pid)
    return tuple(Holder(pid, command_of(pid)) for pid in pids)


def _same_id(field: str, want: str) -> bool:
    # Some kernels print the major and minor without zero padding.
    try:
        a = [int(x, 16) for x in field.split(":")[:2]] + [int(field.split(":")[2])]
        b = [int(x, 16) for x in want.split(":")[:2]] + [int(want.split(":")[2])]
    except (ValueError, IndexError):
        return False
    return a == b


def command_of(pid: int) -> str:
    """The command line of ``pid``, shortened; "" when it is gone or hidden."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    argv = [printable(a.decode(errors="replace")) for a in raw.split(b"\0") if a]
    if len(argv) > 1 and os.path.basename(argv[0]).startswith("python"):
        script = argv[1:]
        while script and script[0] in _PYTHON_FLAGS:
            script = script[1:]
        if script and script[0][:1] != "-":
            argv = script  # `python /usr/bin/torchrun ...` reads better as `torchrun ...`
    if argv:
        argv[0] = os.path.basename(argv[0])
    text = " ".join(argv)
    return text if len(text) <= _COMMAND_CHARS else text[: _COMMAND_CHARS - 4].rstrip() + " ..."


def unlink_locked(store: Store, name: str) -> None:
    """Remove the lease file of a dataset that is gone (call while holding it exclusively)."""
    for path in [lease_path(store, name), *(m.path for m in marks(store, name))]:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM):
                raise


# --- leases held for another process --------------------------------------------------------
#
# `stage --lease-for PID` leaves a detached holder process, and the node service holds
# leases in its own process: /proc/locks names the holder, not the job.  The holder leaves
# a mark beside the lease file, leases/.<name>@<holder pid>-<start>@<pid>-<start> (an
# empty file: a dataset name never starts with '.' or holds '@'), and evict, list and gc
# name the process it holds for.  A mark that cannot be written (a store the holder may not
# write) only names the holder.  A mark whose holder died (a SIGKILLed service, a killed
# holder) while the process it names still runs is a lease by itself (``orphaned``): the job
# still reads the copy, and a restarted service takes the flock again; gc removes a mark
# once the process it names is gone.


@dataclass(frozen=True)
class Mark:
    path: str
    holder: tuple[int, int]  # pid, start time
    owner: tuple[int, int]  # the process the lease is held for: pid, start time


def mark(store: Store, name: str, holder: tuple[int, int], owner: tuple[int, int]) -> str | None:
    """Say that ``holder`` holds ``name``'s lease for ``owner``; the mark's path, or None
    when it cannot be written (best effort)."""
    path = os.path.join(store.lease_dir, f".{name}@{holder[0]}-{holder[1]}@{owner[0]}-{owner[1]}")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
    except OSError:
        return None
    return path


def unmark(path: str | None) -> None:
    if path is not None:
        with suppress(OSError):
            os.unlink(path)


def marks(store: Store, name: str | None = None) -> list[Mark]:
    """The marks of ``name`` (of every dataset when None)."""
    try:
        entries = os.listdir(store.lease_dir)
    except OSError:
        return []
    out = []
    for entry in entries:
        parts = entry[1:].split("@") if entry[:1] == "." else []
        if len(parts) != 3 or (name is not None and parts[0] != name):
            continue
        try:
            holder, owner = (tuple(int(x) for x in p.split("-")) for p in parts[1:])
        except ValueError:
            continue
        if len(holder) == 2 and len(owner) == 2:
            out.append(Mark(os.path.join(store.lease_dir, entry), holder, owner))  # type: ignore[arg-type]
    return out


def orphaned(store: Store, name: str) -> tuple[Holder, ...]:
    """The processes ``name`` is held for by a mark whose holder is gone while they still
    run.  A mark counts only when root (the service) or the process's own user wrote it: no
    one pins a dataset with another user's process (a real lease needs one of theirs too)."""
    out: list[Holder] = []
    for m in marks(store, name):
        if running(*m.holder) or not running(*m.owner):
            continue  # a live holder's flock speaks for it; a mark of a gone job says nothing
        try:
            writer = os.lstat(m.path).st_uid
        except OSError:
            continue
        if writer != 0 and writer != real_uid(m.owner[0]):
            continue
        if all(h.pid != m.owner[0] for h in out):
            out.append(Holder(m.owner[0], command_of(m.owner[0]), via=m.holder[0]))
    return tuple(out)


def on_behalf(store: Store, name: str, found: tuple[Holder, ...]) -> tuple[Holder, ...]:
    """``found`` (from /proc/locks) with each holder that marked whom it holds for replaced
    by those processes, while holder and owner are both the processes that were marked."""
    every = marks(store, name) if found else []
    if not every:
        return found
    out: list[Holder] = []
    for h in found:
        owners = [m.owner for m in every if m.holder[0] == h.pid and running(*m.holder)]
        owners = [o for o in dict.fromkeys(owners) if running(*o)]
        if not owners:
            out.append(h)
        out += [Holder(pid, command_of(pid), via=h.pid) for pid, _ in owners]
    return tuple(out)
