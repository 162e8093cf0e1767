"""Whose credentials a read uses: the :class:`Caller` a request comes from (the kernel's word
for it), the switch of this thread's file-system ids to the caller's for a block
(:func:`reading_as`), the process-wide groups and the irreversible drop, and :class:`Share`.

The node service runs as root and publishes as root, but reads a source only as the caller:
every open, walk and stat of a source runs inside ``reading_as(caller)``, so the kernel
checks each with the caller's uid, gid and groups and never with root's override.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from shmstage.errors import PermissionDenied
from shmstage.libc import load_libc

_INVALID = 0xFFFFFFFF  # (uid_t)-1: setfsuid refuses it and only answers the current id


@dataclass(frozen=True)
class Caller:
    """Who asks: uid, gid and supplementary groups as the kernel gave them (SO_PEERCRED,
    SO_PEERGROUPS), and the process that asked (0: unknown)."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    pid: int = 0

    @classmethod
    def of_self(cls) -> Caller:
        """This process as a caller: its effective ids and its groups."""
        return cls(os.geteuid(), os.getegid(), tuple(os.getgroups()), os.getpid())

    @property
    def is_root(self) -> bool:
        return self.uid == 0


@dataclass(frozen=True)
class Share:
    """Who besides the caller may read an object-store copy: the members of group ``gid``,
    or everyone.  The default: the caller alone."""

    gid: int | None = None
    everyone: bool = False


@functools.cache
def _setters() -> tuple[Callable[[int], int], Callable[[int], int]]:
    """setfsuid(2) and setfsgid(2): per thread (the kernel's creds are a task's; glibc does
    not broadcast these as it does setuid), which is what lets one thread read as a caller
    while the others write as root."""
    libc = load_libc()
    out = []
    for name in ("setfsuid", "setfsgid"):
        fn = getattr(libc, name)
        fn.argtypes = [ctypes.c_uint32]
        fn.restype = ctypes.c_int
        out.append(fn)
    return out[0], out[1]


def _switch(setter: Callable[[int], int], want: int, what: str) -> int:
    """Set this thread's fs id to ``want``; returns the previous one.  setfsuid answers the
    previous id whether or not it changed anything, so a second call (idempotent) says what
    is in force: anything but ``want`` fails closed."""
    prev = setter(want) & _INVALID
    now = setter(want) & _INVALID
    if now != want:
        setter(prev)
        raise PermissionDenied(
            f"cannot read as {what} {want}: the service lacks the privilege to switch "
            f"(this thread's fs{what} stays {now})"
        )
    return prev


class reading_as:  # noqa: N801 - used as a function: ``with reading_as(caller):``
    """This thread's file-system uid and gid become ``caller``'s for the ``with`` block, so
    every permission check the kernel makes in it (open, each component of a path, scandir,
    stat's search permission, readlink, getxattr) is the caller's, with the groups this
    process has (:func:`adopt_groups`).  A thread whose fsuid leaves 0 loses CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH, CAP_FOWNER, CAP_CHOWN and the rest of the file capabilities from its
    effective set; back at 0 it has them again.  None or root: nothing changes.

    Nestable: each block puts back what was in force when it began, and a block for the
    ids already in force costs no syscall (a switch costs ~10 us here: the copier enters
    one per batch of files and SourceTree one per call, nested in it).  A class, not a
    generator: cheaper to enter."""

    __slots__ = ("caller", "prev")

    def __init__(self, caller: Caller | None) -> None:
        self.caller = None if caller is None or caller.is_root else caller
        self.prev: tuple[int, int] | None = None

    def __enter__(self) -> None:
        caller = self.caller
        if caller is None:
            return
        now = _current()
        want = (caller.uid, caller.gid)
        if now == want:
            return
        setuid, setgid = _setters()
        gid = _switch(setgid, caller.gid, "gid")  # while fsuid is 0: CAP_SETGID holds
        try:
            uid = _switch(setuid, caller.uid, "uid")
        except BaseException:
            setgid(gid)
            raise
        _here.ids = want
        self.prev = (uid, gid)

    def __exit__(self, *exc: object) -> None:
        if self.prev is None:
            return
        uid, gid = self.prev
        self.prev = None
        setuid, setgid = _setters()
        # Not checked twice: a failed switch back leaves the thread with less privilege
        # than it had (its writes fail), never more.
        setuid(uid)
        setgid(gid)
        _here.ids = (uid, gid)


class _Here(threading.local):
    ids: tuple[int, int] | None = None  # this thread's fs ids as set here; None: not asked yet


_here = _Here()


def _current() -> tuple[int, int]:
    """This thread's fs ids: as this module last set them, else asked of the kernel once (a
    thread started inside a block inherits the ids of the thread that started it)."""
    ids = _here.ids
    if ids is None:
        ids = _here.ids = fs_ids()
    return ids


def fs_ids() -> tuple[int, int]:
    """This thread's file-system uid and gid (as setfsuid(-1) answers them)."""
    setuid, setgid = _setters()
    return setuid(_INVALID) & _INVALID, setgid(_INVALID) & _INVALID


def adopt_groups(caller: Caller) -> None:
    """This process's supplementary groups become the caller's (every thread: glibc
    broadcasts setgroups).  For the service's per-request child, before it reads as the
    caller: a file readable through one of the caller's groups is readable then, and only
    then.  Root keeps its privileges otherwise (its euid stays 0)."""
    try:
        os.setgroups(list(caller.groups))
    except OSError as e:
        raise PermissionDenied(
            f"cannot take the groups of uid {caller.uid}: {e.strerror}"
        ) from None


def become(caller: Caller) -> None:
    """Drop to ``caller`` for good: groups, then gid, then uid (real, effective and saved),
    checked afterwards.  For a process that only reads as the caller and must never get
    root back (a checker)."""
    try:
        os.setgroups(list(caller.groups))
        os.setresgid(caller.gid, caller.gid, caller.gid)
        os.setresuid(caller.uid, caller.uid, caller.uid)
    except OSError as e:
        raise PermissionDenied(f"cannot become uid {caller.uid}: {e.strerror}") from None
    if os.getresuid() != (caller.uid,) * 3 or os.getresgid() != (caller.gid,) * 3:
        raise PermissionDenied(f"cannot become uid {caller.uid}: the ids did not all change")
    if caller.uid != 0:
        try:
            os.setuid(0)
        except PermissionError:
            return
        raise PermissionDenied(f"cannot become uid {caller.uid}: root could be taken back")


def is_denied(e: OSError) -> bool:
    """An error that says the credentials in force may not do it."""
    return e.errno in (errno.EACCES, errno.EPERM)


_SYS_FACCESSAT2 = 439  # Linux 5.8+, the same number on every architecture
_AT_EACCESS, _AT_SYMLINK_NOFOLLOW = 0x200, 0x100
_PROBE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@functools.cache
def _has_faccessat2() -> bool:
    """Whether the kernel has faccessat2.  Without it glibc emulates AT_EACCESS from a stat
    and the euid (root's: every file would pass), so :func:`may_read` opens instead."""
    proto = ctypes.CFUNCTYPE(
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_int,
        use_errno=True,
    )  # its own prototype: the library's shared ``syscall`` keeps whatever types others set
    fn = proto(("syscall", load_libc()))
    ok = fn(_SYS_FACCESSAT2, -100, b"/", os.F_OK, _AT_EACCESS)  # AT_FDCWD
    return ok == 0 or ctypes.get_errno() != errno.ENOSYS


def may_read(name: str, dir_fd: int) -> bool:
    """Whether this thread's fs ids may open ``name`` (in directory ``dir_fd``, not followed
    if a symlink) for reading: faccessat2(AT_EACCESS) under the switched fsuid (0.8 us per
    file here; an open and close costs 2 us), else an open and close."""
    if _has_faccessat2():
        return os.access(name, os.R_OK, dir_fd=dir_fd, effective_ids=True, follow_symlinks=False)
    try:
        os.close(os.open(name, _PROBE, dir_fd=dir_fd))
    except OSError as e:
        if is_denied(e):
            return False
        raise
    return True
