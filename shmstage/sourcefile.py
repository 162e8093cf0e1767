"""``SourceFile``: a file of a dataset's source read in place by ``DatasetFiles`` (a file not
in RAM), streamed and checked after every read, so a file rewritten while it is read is an
error and never part of one version followed by part of another."""

from __future__ import annotations

import io
import os
from contextlib import suppress
from typing import Any

from shmstage.errors import ShmstageError

__all__ = ["SourceFile"]


class SourceFile(io.RawIOBase):
    """A source file as listed, read in place: after every read its fd's identity, size,
    mtime and ctime (any write changes ctime, even one that puts the mtime back) and its
    path's identity are compared with what they were when it was opened; a difference, or
    an end before the listed size, raises ``changed`` (at the latest at EOF) instead of
    giving part of one version and part of another."""

    def __init__(self, fd: int, path: str, st: os.stat_result, count: Any, changed: Exception):
        super().__init__()
        self._fd, self._path, self._count, self._changed = fd, path, count, changed
        self._want = _identity(st)
        self._left = st.st_size

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def readinto(self, buffer: Any) -> int:
        if self._left <= 0:
            self._check(path_too=True)
            return 0
        view = memoryview(buffer).cast("B")[: min(len(buffer), self._left)]
        try:
            n = os.readv(self._fd, [view])
        except OSError as e:
            raise ShmstageError(f"cannot read {self._path}: {e.strerror}") from None
        if n == 0:  # shorter than listed: it changed
            raise self._changed
        self._left -= n
        self._check(path_too=self._left == 0)
        self._count(n)
        return n

    def readall(self) -> bytes:
        # In big reads (RawIOBase's would read 8 KiB at a time), into one buffer.
        buf = bytearray(max(self._left, 0))
        view, got = memoryview(buf), 0
        while got < len(buf):
            got += self.readinto(view[got : got + (1 << 22)])
        if not buf:
            self._check(path_too=True)  # the last read checked it otherwise
        return bytes(buf)

    def _check(self, path_too: bool) -> None:
        try:
            ok = _identity(os.fstat(self._fd)) == self._want
            if ok and path_too:
                st = os.stat(self._path, follow_symlinks=False)
                ok = (st.st_dev, st.st_ino) == self._want[:2]
        except OSError:
            ok = False
        if not ok:
            raise self._changed

    def close(self) -> None:
        if not self.closed:
            with suppress(OSError):
                os.close(self._fd)
        super().close()


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
