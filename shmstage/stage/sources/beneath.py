"""Opening a source below its top without following a symlink on the way.

O_NOFOLLOW covers the last component only: a directory of the source that its owner swaps
for a symlink after the walk would lead a root stager's open of ``d/secret`` into a
directory she cannot read.  Here every component is checked (openat2 where the kernel has
it, one O_NOFOLLOW openat per component where not), and ``ident`` tells whether what was
opened is what the walk found.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import stat
import sys
from collections.abc import Callable

from shmstage.identity import Caller, reading_as
from shmstage.libc import load_libc


def ident(st: os.stat_result) -> int:
    """What tells one file from another for as long as both exist: device and inode."""
    return st.st_dev << 64 | st.st_ino


# The manifest key of a directory source's top as the walk opened it ([st_dev, st_ino]):
# verify --checksum reads the source through that directory only.
SOURCE_TOP = "source_top"


def split_ident(who: int) -> list[int]:
    """An :func:`ident` as JSON keeps it: [st_dev, st_ino]."""
    return [who >> 64, who & ((1 << 64) - 1)]


def join_ident(pair: list[int]) -> int:
    return int(pair[0]) << 64 | int(pair[1])


# openat2(2), Linux 5.6+, the same number on every architecture.  O_NOFOLLOW covers the
# last component only: a directory of the source that its owner swaps for a symlink after
# the walk would lead a root stager's open of "d/secret" into a directory she cannot read.
_SYS_OPENAT2 = 437
_RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x04, 0x08
_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):  # 24 bytes: the size openat2 is told
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_openat2: list[bool] = []  # [] untried or works, [False] ENOSYS: one openat per component
_FSENC, _FSERR = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()  # os.fsencode's


@functools.cache
def _syscall() -> Callable[..., int]:
    """syscall(2) with its argument types fixed once: an open costs ~1 us more than a plain
    os.open (2-core VM), ~1.3 us more when ctypes converts each argument per call."""
    proto = ctypes.CFUNCTYPE(
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_char_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        use_errno=True,
    )
    return proto(("syscall", load_libc()))


class NotRegular(OSError):
    """What :meth:`SourceTree.open_file` opened is no regular file (a FIFO, a device, a
    directory put in the file's place since the walk)."""


class SourceTree:
    """A source directory's top, opened once; every path below it is opened without following
    a symlink in any component (openat2 RESOLVE_NO_SYMLINKS|RESOLVE_BENEATH, or an
    O_NOFOLLOW openat per component on older kernels).  A symlink on the way: OSError ELOOP
    (ENOTDIR from the fallback).

    The path is resolved once, here, and its last component is not followed; ``expect`` (an
    :func:`ident`, 0: none) is the top the walk found: any other directory (the top renamed
    away and a symlink or another directory put in its place since) is OSError EXDEV.  Keep
    one open for as long as the source is read: reopening the top by path lets its owner
    swap it between two opens.

    ``reader``: every open and stat here (the top's included, every component of its path
    searched) runs with the reader's file-system ids (identity.reading_as): the tree holds
    nothing the reader could not open themselves.  A forked copier worker inherits the tree
    and with it the reader."""

    def __init__(self, root: str, expect: int = 0, reader: Caller | None = None) -> None:
        self.root = root
        self.reader = reader if reader is not None and not reader.is_root else None
        with reading_as(self.reader):
            self.fd = os.open(os.path.realpath(root), _DIR)
        self.top = ident(os.fstat(self.fd))
        if expect and self.top != expect:
            os.close(self.fd)
            self.fd = -1
            raise OSError(errno.EXDEV, "the source's top directory was replaced", root)
        # open_how per flags (threads share a tree: one struct each, never rewritten)
        self._hows: dict[int, tuple[_OpenHow, int]] = {}
        self._two = not _openat2 or _openat2[0]  # (a failed first call says ENOSYS)
        self._call = _syscall()
        self._dir = ("", -1)  # the last parent directory lstat() opened, kept for its siblings

    def close(self) -> None:
        if self._dir[1] >= 0:
            os.close(self._dir[1])
        self._dir = ("", -1)
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> SourceTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self, rel: str, flags: int, at: int = -1) -> int:
        """An fd for ``rel`` (relative, ``/``-separated), opened with ``flags``; with ``at``
        (a directory of this tree, :meth:`open_dir`), ``rel`` is one name in it, opened with a
        plain openat (no symlink: O_NOFOLLOW on its only component), cheaper than openat2."""
        if at >= 0:
            if rel in ("", ".", "..") or "/" in rel:
                raise OSError(errno.EXDEV, "not a name in its directory", rel)
            flags |= os.O_NOFOLLOW
            if self.reader is not None:
                with reading_as(self.reader):
                    return os.open(rel, flags, dir_fd=at)
            return os.open(rel, flags, dir_fd=at)
        if self.reader is not None:
            with reading_as(self.reader):
                return self._open(rel, flags)
        return self._open(rel, flags)

    def open_dir(self, rel: str) -> int:
        """A directory below the top (O_PATH; "" is the top), for :meth:`open`'s ``at``: the
        files of one directory opened by name instead of each by its whole path.  Each open
        then finds what the name holds at that moment, in the directory this call found."""
        return self.open(rel or ".", _DIR)

    def _open(self, rel: str, flags: int) -> int:
        if self._two:  # the hot path: one call per file, no Python-level helper
            how = self._hows.get(flags)
            if how is None:
                one = _OpenHow(flags | os.O_NOFOLLOW, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH)
                how = self._hows[flags] = (one, ctypes.addressof(one))
            fd = self._call(_SYS_OPENAT2, self.fd, rel.encode(_FSENC, _FSERR), how[1], 24)
            if fd >= 0:
                return fd
        return self._open_slow(rel, flags)

    def open_file(self, rel: str, flags: int, blocking: bool = True, at: int = -1) -> int:
        """:meth:`open` for a regular file: O_NONBLOCK, so a FIFO or a device put in the file's
        place since the walk never blocks the open (nor a reader waiting on it), then
        NotRegular for anything but a regular file; the fd returned blocks as usual, or with
        ``blocking=False`` keeps O_NONBLOCK (one syscall less per file: local file systems
        ignore it on a regular file; a read that says EAGAIN all the same must clear it)."""
        fd = self.open(rel, flags | os.O_NONBLOCK, at)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotRegular(errno.EINVAL, "not a regular file any more", rel)
            if blocking:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_slow(self, rel: str, flags: int) -> int:
        """openat2 failed (retry, raise, or learn it is missing) or is missing: per component."""
        if self._two:
            for _ in range(8):  # EAGAIN: a rename raced the lookup (RESOLVE_BENEATH's check)
                err = ctypes.get_errno()
                if err == errno.ENOSYS:
                    _openat2[:] = [False]
                    self._two = False
                    break
                if err not in (errno.EAGAIN, errno.EINTR):
                    raise OSError(err, os.strerror(err), rel)
                fd = self._call(
                    _SYS_OPENAT2, self.fd, rel.encode(_FSENC, _FSERR), self._hows[flags][1], 24
                )
                if fd >= 0:
                    return fd
            else:
                raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN), rel)
        parent, _, name = rel.rpartition("/")
        at = self._walk(parent)
        try:
            return os.open(name, flags | os.O_NOFOLLOW, dir_fd=at)
        finally:
            if at != self.fd:
                os.close(at)

    def stat(self, rel: str, expect: int = 0) -> os.stat_result:
        """``rel``'s own stat, from an fd opened beneath the top (thread-safe, unlike
        :meth:`lstat`); ``expect``: the walk's :func:`ident` of it, else OSError EXDEV."""
        fd = self.open(rel, os.O_PATH | os.O_CLOEXEC)  # as the reader (fstat needs no right)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if expect and ident(st) != expect:
            raise OSError(errno.EXDEV, "not the file the scan found", rel)
        return st

    def lstat(self, rel: str) -> os.stat_result:
        """``rel``'s own lstat (the last component may be a symlink; none above it may)."""
        with reading_as(self.reader):  # the parent's search right is the reader's
            return self._lstat(rel)

    def _lstat(self, rel: str) -> os.stat_result:
        if rel in (".", ""):
            return os.fstat(self.fd)
        parent, _, name = rel.rpartition("/")
        if self._dir[0] != parent or self._dir[1] < 0:  # siblings come together: one open each
            fd = self.open(parent, _DIR) if parent else os.dup(self.fd)
            if self._dir[1] >= 0:
                os.close(self._dir[1])
            self._dir = (parent, fd)
        return os.stat(name, dir_fd=self._dir[1], follow_symlinks=False)

    def _walk(self, parent: str) -> int:
        """The fallback: one O_NOFOLLOW openat per directory component."""
        at = self.fd
        for part in parent.split("/") if parent else ():
            if part in ("", ".", ".."):
                if at != self.fd:
                    os.close(at)
                raise OSError(errno.EXDEV, "path leaves the source", parent)
            try:
                nxt = os.open(part, _DIR, dir_fd=at)
            finally:
                if at != self.fd:
                    os.close(at)
            at = nxt
        return at
