"""The safety checks on directories under DEST, which may sit in a world-writable sticky
directory such as /dev/shm: ours or root's, no symlink planted, not writable by others;
and the errors a failed write under DEST gives."""

from __future__ import annotations

import errno
import os
import stat

from shmstage.errors import PermissionDenied, RefusedError, ShmstageError


def os_error(e: OSError, what: str) -> ShmstageError:
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(f"{what}: {e.strerror}; pick a --dest you can write to")
    return ShmstageError(f"{what}: {e.strerror}")


def check_owner(path: str, st: os.stat_result) -> None:
    uid = os.geteuid()
    if st.st_uid not in (0, uid):
        raise RefusedError(
            f"{path} is owned by uid {st.st_uid}, not by you or root; refusing to use it "
            "(pick another --dest, e.g. /dev/shm/shmstage-$USER)"
        )


def check_dir(path: str, what: str, *, shared_ok: bool = False) -> os.stat_result:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ShmstageError(f"{what} {path} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise RefusedError(
            f"{what} {path} is a symlink; refusing to follow it (it may have been planted): "
            "remove it or pick another --dest"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise RefusedError(f"{what} {path} is not a directory")
    check_owner(path, st)
    # Others may create entries in a sticky DEST (e.g. --dest /dev/shm) but cannot move ours;
    # every entry we use there is checked on its own.  Bookkeeping must be ours alone.
    writable_by_others = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable_by_others and not (shared_ok and st.st_mode & stat.S_ISVTX):
        raise RefusedError(
            f"{what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            "refusing to use it: chmod go-w it or pick another --dest"
        )
    return st


def mkdir_checked(path: str, mode: int) -> None:
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    except OSError as e:
        raise os_error(e, f"cannot create {path}") from None
    else:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, mode)  # exact mode whatever the umask
        finally:
            os.close(fd)
    check_dir(path, "bookkeeping directory")


def lock_dir_mode(book: str) -> int:
    """The mode of a directory of locks that stagers wait on, in the store whose bookkeeping
    directory is ``book``: 0700 in a store root owns (a user who could open a lock there could
    flock it and hang every stage), 0755 in a user's own store (its readers lock there)."""
    try:
        owner = os.lstat(book).st_uid
    except OSError:
        owner = os.geteuid()  # about to be made by us
    return 0o700 if owner == 0 else 0o755


def lock_dir_checked(path: str, mode: int) -> None:
    """:func:`mkdir_checked`, and a directory of ours made open by an earlier version closed to
    ``mode``."""
    mkdir_checked(path, mode)
    try:
        st = os.lstat(path)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & ~mode:
            os.chmod(path, mode)
    except OSError as e:
        raise os_error(e, f"cannot close {path}") from None


def makedirs_checked(path: str) -> None:
    if os.path.lexists(path):
        return
    parent = os.path.dirname(path)
    if parent != path and not os.path.lexists(parent):
        makedirs_checked(parent)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass  # checked by the caller: a planted entry is refused there
    except OSError as e:
        raise os_error(e, f"cannot create {path}") from None
