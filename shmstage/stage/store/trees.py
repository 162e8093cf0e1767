"""Trees under DEST: removing one safely (through directory fds, never a path a tree's owner
could swap, never into a mount inside it), and listing and measuring what is left of one.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from shmstage.errors import PermissionDenied, ShmstageError

T = TypeVar("T")


def cannot_remove(e: OSError, path: str) -> ShmstageError:
    """The one line for a tree ``evict`` or ``gc`` could not remove (rmtree's OSError)."""
    if isinstance(e, MountInside):
        where = os.path.join(path, e.inner) if e.inner else path
        return ShmstageError(
            f"cannot remove {path}: {where} is a mount point inside the dataset: unmount it, "
            "then run gc"
        )
    if isinstance(e, TooDeep):
        return ShmstageError(f"cannot remove {path}: {e.strerror}")
    if e.errno in (errno.EACCES, errno.EPERM):
        return PermissionDenied(
            f"cannot remove {path}: {e.strerror}; it holds files you may not remove: have their "
            "owner or root remove it"
        )
    return ShmstageError(f"cannot remove {path}: {e.strerror}; run this again")


_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SWAPS = 3  # how often an entry may change kind under us, or a directory refill, before we give up


def _take(fd: int) -> None:
    """Make the open directory ``fd`` (inside a tree being removed) ours and 0700, so its
    entries can be removed: a tree root without CAP_DAC_OVERRIDE copied keeps its source's
    owners and modes.  Through the fd: the inode we hold, whatever its name points to now."""
    if os.fstat(fd).st_uid != os.geteuid():
        os.fchown(fd, os.geteuid(), os.getegid())
    os.fchmod(fd, 0o700)


def _in(fd: int, inside: bool, op: Callable[[], T]) -> T:
    """Run ``op`` (an ``*at`` call in the directory ``fd``); on a permission error take ``fd``
    and retry, but only when ``fd`` is part of the tree: the directory holding the tree
    (DEST, trash, the tmpfs root) is never chowned or chmodded."""
    try:
        return op()
    except PermissionError:
        if not inside:
            raise
        _take(fd)
        return op()


def _open_dir(pfd: int, name: str, inside: bool, dev: int | None = None) -> int:
    """Open the directory ``name`` in ``pfd`` for listing, without following a link; take it
    first when we may not read it (a 0000 directory, someone else's), but never one on
    another file system than ``dev`` (a mount inside the tree: left as it is)."""
    try:
        return _in(pfd, inside, lambda: os.open(name, _DIR_OPEN, dir_fd=pfd))
    except PermissionError:
        pass
    path_fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
    try:
        # An O_PATH fd cannot be fchmod'ed; its /proc link is that very inode (what glibc's
        # fchmodat(AT_SYMLINK_NOFOLLOW) does), not a name the tree's owner could swap.
        via = f"/proc/self/fd/{path_fd}"
        st = os.fstat(path_fd)
        if dev is not None and st.st_dev != dev:  # the caller names the mount: no chown
            return os.dup(path_fd)
        try:
            if st.st_uid != os.geteuid():
                os.chown(via, os.geteuid(), os.getegid())
            os.chmod(via, 0o700)
            return os.open(via, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:  # no /proc: not "gone", which would skip it silently
            raise OSError(errno.EACCES, "cannot take it back without /proc", name) from None
    finally:
        os.close(path_fd)


class MountInside(OSError):
    """A directory inside a tree being removed is another mount: never descended into (its
    files are another file system's), and the tree is left for gc once it is unmounted.
    ``inner``: that directory, relative to the tree's top ("" for the top itself)."""

    inner = ""


class TooDeep(OSError):
    """A tree nested deeper than this process may hold directories open (RLIMIT_NOFILE)."""


@dataclass
class _Frame:
    """A directory being emptied: open as ``fd``, the entry ``name`` of ``pfd``."""

    pfd: int
    name: str
    inside: bool
    fd: int
    swaps: int
    entries: list[tuple[str, bool | None]]
    rounds: int = 1  # listings of it so far


_nofile_raised = False


def _more_fds() -> None:
    """Raise this process's soft limit on open files to its hard limit, once: removing a
    tree holds one fd per level of its depth (never a path: see rmtree)."""
    global _nofile_raised
    if _nofile_raised:
        return
    _nofile_raised = True
    with suppress(ValueError, OSError):
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _listing(fd: int) -> list[tuple[str, bool | None]]:
    entries: list[tuple[str, bool | None]] = []
    with os.scandir(fd) as it:
        for entry in it:
            try:
                is_dir: bool | None = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = None  # no d_type here and no search permission yet: stat it later
            entries.append((entry.name, is_dir))
    entries.reverse()  # popped from the end: in listing order
    return entries


def _enter(
    stack: list[_Frame],
    pfd: int,
    name: str,
    inside: bool,
    is_dir: bool | None,
    dev: int | None,
    swaps: int = 0,
) -> None:
    """Remove the entry ``name`` of ``pfd`` when it is not a directory; else open it and push
    it on ``stack`` to be emptied.  ``dev``: the tree's file system (None: the tree's top);
    ``swaps``: how often this entry changed kind under us already."""
    while True:
        if swaps > _SWAPS:
            raise OSError(errno.EBUSY, "it keeps changing while being removed", name)
        try:
            if is_dir is None:
                st = _in(pfd, inside, lambda: os.stat(name, dir_fd=pfd, follow_symlinks=False))
                is_dir = stat.S_ISDIR(st.st_mode)
            if not is_dir:
                try:
                    _in(pfd, inside, lambda: os.unlink(name, dir_fd=pfd))
                except IsADirectoryError:  # made a directory since we looked
                    is_dir, swaps = True, swaps + 1
                    continue
                return
            try:
                fd = _open_dir(pfd, name, inside, dev)
            except OSError as e:
                if e.errno in (errno.ENOTDIR, errno.ELOOP):
                    # swapped for a file or a symlink since we looked: remove that, not its target
                    is_dir, swaps = False, swaps + 1
                    continue
                raise
        except FileNotFoundError:
            return
        try:
            if dev is not None and os.fstat(fd).st_dev != dev:
                e = MountInside(
                    errno.EBUSY, "a mount point inside the dataset: unmount it, then run gc"
                )
                e.inner = os.path.join(*(f.name for f in stack[1:]), name)
                raise e
            entries = _listing(fd)
        except BaseException:
            os.close(fd)
            raise
        stack.append(_Frame(pfd, name, inside, fd, swaps, entries))
        return


def _remove_at(pfd: int, name: str, inside: bool, is_dir: bool | None) -> None:
    """Remove the entry ``name`` of the open directory ``pfd`` and, for a directory, all
    below it; every call relative to an open directory fd (see rmtree).  Iterative (an
    explicit stack of open directories), so a tree of any depth is no RecursionError; never
    descends into another file system (a mount inside the tree: MountInside)."""
    stack: list[_Frame] = []
    try:
        _enter(stack, pfd, name, inside, is_dir, None)
        if not stack:
            return
        dev = os.fstat(stack[0].fd).st_dev
        if dev != os.fstat(pfd).st_dev:
            raise MountInside(errno.EBUSY, "a mount point: unmount it, then run gc")
        while stack:
            top = stack[-1]
            if top.entries:
                child, child_is_dir = top.entries.pop()
                _enter(stack, top.fd, child, True, child_is_dir, dev)
                continue
            try:
                _in(top.pfd, top.inside, partial(os.rmdir, top.name, dir_fd=top.pfd))
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno == errno.ENOTDIR:  # the name now holds a link: our fd does not
                    stack.pop()
                    os.close(top.fd)
                    _enter(stack, top.pfd, top.name, top.inside, False, dev, top.swaps + 1)
                    continue
                if e.errno != errno.ENOTEMPTY:
                    raise
                if top.rounds >= _SWAPS:  # refilled as fast as it is emptied
                    raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), top.name) from None
                top.rounds += 1
                top.entries = _listing(top.fd)
                continue
            stack.pop()
            os.close(top.fd)
    except OSError as e:
        if e.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        raise TooDeep(
            e.errno,
            f"it is nested deeper ({len(stack)} levels) than this process may hold "
            "directories open: raise the open-file limit (ulimit -n), then run gc",
        ) from None
    finally:
        for frame in stack:
            os.close(frame.fd)


def rmtree(path: str) -> None:
    """Remove a tree, including read-only directories (staged trees keep source modes) and,
    for root without CAP_DAC_OVERRIDE, directories its source's owners own.

    Every step is relative to an open directory fd, never a path: the owner of a staged tree
    may still reach it (when it could not be renamed into trash first) and swap a directory
    of it for a symlink while we work; by path, root would follow that link out of the tree.
    Only what is inside the tree is ever chowned or chmodded: never the directory holding it,
    which may be DEST or the tmpfs root itself."""
    parent, name = os.path.split(os.path.normpath(path))
    if name in ("", os.curdir, os.pardir):
        raise ValueError(f"refusing to remove {path!r}")
    try:
        pfd = os.open(parent or os.curdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    _more_fds()
    try:
        _remove_at(pfd, name, False, None)
    except MountInside as e:
        e.filename = (
            os.path.join(path, e.inner) if e.inner else path
        )  # for callers' "{strerror}: {filename}"
        raise
    except TooDeep as e:
        e.filename = path
        raise
    finally:
        os.close(pfd)


def listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:  # missing, or partial/ and trash/ (0700) of a store another user owns
        return []


def tree_size(path: str) -> tuple[int, int]:
    """Bytes and files in a tree so far (regular files' sizes)."""
    size = files = 0
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            size += e.stat(follow_symlinks=False).st_size
                            files += 1
                    except OSError:
                        continue
        except OSError:
            continue
    if os.path.isfile(path) and not os.path.islink(path):
        with suppress(OSError):
            return os.lstat(path).st_size, 1
    return size, files
