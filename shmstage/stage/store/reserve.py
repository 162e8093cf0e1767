"""Store-wide space reservations, so that concurrent stagers of different datasets cannot
both pass the fit check and then run the destination (and its reserve) out of space.

Each live stager holds ``DEST/.shmstage/reservations/<name>``, flocked for as long as it
runs, holding the bytes it still has to write (lowered as the copy proceeds).  The fit
check runs under a flock of ``reservations/.fitting`` (owner only) and takes the live others' outstanding bytes off
the free space.  A stager that dies loses its flock with its life, so its file no longer
counts (``gc`` removes the file later).  Reservations are per DEST: two
DESTs on one tmpfs do not see each other's (docs/staging.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Callable
from types import TracebackType

from shmstage.errors import ShmstageError
from shmstage.stage.store.checks import lock_dir_checked, lock_dir_mode

DIRNAME = "reservations"  # 0700 in root's store: see checks.lock_dir_mode
FITTING = ".fitting"  # reservations/.fitting: the store-wide lock of the fit check
_WIDTH = 20  # fixed-width numbers: one pwrite replaces the whole value
_UPDATE_EVERY = 16 << 20  # rewrite the outstanding bytes after this many were written


class Claim:
    """This stager's reservation (a context manager; enter it under the dataset's lock)."""

    def __init__(self, book: str, name: str) -> None:
        self.book = book
        self.dir = os.path.join(book, DIRNAME)
        self.path = os.path.join(self.dir, name)
        self.fd = -1
        self.outstanding = 0
        self._written = self._since = 0

    def __enter__(self) -> Claim:
        return self  # the file is made by the first reserve(): a no-op stage writes nothing

    def _create(self) -> None:
        try:
            lock_dir_checked(self.dir, lock_dir_mode(self.book))
            self.fd = os.open(
                self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
            )
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise  # the engine says "no space left" and what to do
            raise ShmstageError(f"cannot create reservation {self.path}: {e.strerror}") from None
        fcntl.flock(self.fd, fcntl.LOCK_EX)  # the dataset lock is held: only a dead one had it
        os.ftruncate(self.fd, 0)  # a dead stager's value (0 until reserve() stores ours)

    def __exit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1

    def reserve(self, needed: int, check: Callable[[int], None]) -> None:
        """Under the store-wide lock: ``check(pending)`` (raises when ``needed`` does not fit
        next to what the live others still have to write), then claim ``needed`` bytes."""
        if self.fd < 0:
            self._create()
        # A file only the store's owner may open: the directory itself anyone could flock.
        where = os.path.join(self.dir, FITTING)
        try:
            lock = os.open(where, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise ShmstageError(f"cannot lock {where}: {e.strerror}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            check(self._others())
            self._written = self._since = 0
            self._store(needed)
        finally:
            os.close(lock)  # releases the flock

    def counting(self, tick: Callable[[int, int], None]) -> Callable[[int, int], None]:
        """Wrap a copy-progress callback so that the reservation shrinks as bytes land."""

        def counted(b: int, f: int) -> None:
            self._since += b
            if self._since >= _UPDATE_EVERY:
                self._written += self._since
                self._since = 0
                self._store(max(0, self.outstanding - self._written), keep=True)
            tick(b, f)

        return counted

    def _store(self, value: int, keep: bool = False) -> None:
        if not keep:
            self.outstanding = value
        if self.fd < 0:
            return  # nothing reserved yet: nothing to lower
        os.pwrite(self.fd, str(value).rjust(_WIDTH).encode(), 0)

    def _others(self) -> int:
        """Outstanding bytes of the live stagers other than this one."""
        return _outstanding(self.dir, skip=self.path)


def pending(book: str) -> int:
    """Outstanding bytes of every live stager of this DEST: for planning (tiers, make-room);
    the binding check is :meth:`Claim.reserve`, which takes the store-wide lock."""
    return _outstanding(os.path.join(book, DIRNAME))


def _outstanding(directory: str, skip: str | None = None) -> int:
    total = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for n in names:
        path = os.path.join(directory, n)
        if path == skip or n.startswith("."):  # .fitting: the lock, no claim
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # finished and removed meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held: its stager is alive
                total += _parse(os.pread(fd, _WIDTH, 0))
            # else: nobody holds it, its stager died: it promises nothing
        finally:
            os.close(fd)
    return total


def _parse(raw: bytes) -> int:
    try:
        return max(0, int(raw.decode().strip() or 0))
    except ValueError:
        return 0
