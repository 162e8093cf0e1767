"""What live stages will add to a tier with a cache max_size: their claims on disk.

``DEST/.shmstage/inflight/<name>.<random>``, each flocked for its stager's life, and the
tier's max_size lock ``inflight/.capping``; make-room plans against them (see
shmstage.stage.cache.makeroom, NOTE [max_size]) and gc removes the claims of dead stagers.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from shmstage.errors import ShmstageError
from shmstage.stage.store.layout import Store

IN_FLIGHT = "inflight"  # DEST/.shmstage/inflight/<name>.<random>: what a live stage adds (max_size)
CAPPING = ".capping"  # inflight/.capping: the tier's max_size lock (see capping)


def _in_flight_dir(store: Store, *, create: bool = False) -> str:
    """DEST/.shmstage/inflight/, 0700: a lock file in it can be opened, so flocked, by its
    owner only (a user who could flock the tier's capping lock or a claim could stop every
    stage into the tier, or keep a dead stager's claim counting forever)."""
    where = os.path.join(store.book, IN_FLIGHT)
    if not create:
        return where
    try:
        with suppress(FileExistsError):
            os.mkdir(where, 0o700)
        st = os.lstat(where)
        if not stat.S_ISDIR(st.st_mode):
            raise ShmstageError(f"cannot lock {where}: not a directory")
        if st.st_mode & 0o077 and st.st_uid == os.geteuid():
            os.chmod(where, 0o700)  # made 0755 by an earlier version
    except OSError as e:
        raise ShmstageError(f"cannot lock {where}: {e.strerror}") from None
    return where


@contextmanager
def capping(store: Store) -> Iterator[None]:
    """Hold the tier's max_size lock (inflight/.capping, in the owner-only directory) while
    planning against max_size and claiming what this stage adds."""
    path = os.path.join(_in_flight_dir(store, create=True), CAPPING)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise ShmstageError(f"cannot lock {path}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _claims(store, reap=True)  # only here: a claim is made under this lock
        yield
    finally:
        os.close(fd)


def in_flight(store: Store, exclude: str | None = None) -> int:
    """Bytes the live stages of the tier will add once published (their claims); a dead
    stager's claim counts nothing.  ``exclude``: the dataset being planned, whose whole new
    version the plan counts already (another stager of the same dataset adds nothing more:
    one of them copies it, the other then finds it up to date)."""
    return _claims(store, exclude=exclude)[0]


def reap_claims(store: Store, *, dry_run: bool = False) -> tuple[list[str], bool]:
    """gc: remove the claims of dead stagers (``dry_run``: only list them).  Returns (their
    paths, False when a stager holds the tier's max_size lock now: nothing was looked at)."""
    where = _in_flight_dir(store)
    if not os.path.isdir(where):
        return [], True
    # Created when missing (not by a dry run, which removes nothing): a stager that made
    # it meanwhile could otherwise make a claim under it that looks dead here before its flock.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (0 if dry_run else os.O_CREAT)
    try:
        fd = os.open(os.path.join(where, CAPPING), flags, 0o600)
    except FileNotFoundError:
        fd = -1  # a dry run: it only lists
    except OSError:
        return [], True  # not ours to clean (another user's tier)
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return [], False
        return _claims(store, reap=not dry_run)[1], True
    finally:
        if fd >= 0:
            os.close(fd)


def _claims(
    store: Store, *, reap: bool = False, exclude: str | None = None
) -> tuple[int, list[str]]:
    """Sum the live claims (but ``exclude``'s), and list the dead ones; ``reap``: remove
    those (held under :func:`capping`, where no claim is between its creation and its
    flock)."""
    where = _in_flight_dir(store)
    try:
        entries = os.listdir(where)
    except OSError:
        return 0, []
    total = 0
    dead: list[str] = []
    for entry in entries:
        path = os.path.join(where, entry)
        if entry.startswith("."):
            continue  # the capping lock
        if exclude is not None and entry.rpartition(".")[0] == exclude:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # finished and removed meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held: its stager is alive
                with suppress(ValueError, OSError):
                    total += max(0, int(os.pread(fd, 32, 0).decode().strip() or 0))
                continue
            dead.append(path)  # nobody holds it: its stager died
            if reap:
                with suppress(OSError):
                    os.unlink(path)
        finally:
            os.close(fd)
    return total, dead


class InFlight:
    """What this stage will add to a capped tier, counted by the others' plans until it is
    published and this is closed (take it under :func:`capping`)."""

    def __init__(self, store: Store, name: str, nbytes: int) -> None:
        # A name no other stager can have (a pid is not: containers share the store, each
        # with its own pid 1), made with O_EXCL: a claim is never another's, so flocking it
        # cannot wait on another stager while the tier's max_size lock is held.
        where = _in_flight_dir(store, create=True)
        while True:
            self.path = os.path.join(where, f"{name}.{os.urandom(8).hex()}")
            try:
                self.fd = os.open(
                    self.path,
                    os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,  # only its stager may hold it: held is what keeps it counting
                )
                break
            except FileExistsError:
                continue
            except OSError as e:
                raise ShmstageError(f"cannot create {self.path}: {e.strerror}") from None
        fcntl.flock(self.fd, fcntl.LOCK_EX)  # new: only a scan's instant LOCK_SH can delay it
        try:
            os.pwrite(self.fd, f"{max(0, nbytes)}\n".encode(), 0)
        except OSError as e:
            self.close()
            raise ShmstageError(f"cannot write {self.path}: {e.strerror}") from None

    def close(self) -> None:
        if self.fd < 0:
            return
        with suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> InFlight:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
