"""How a job follows a view (datasetfiles.py): read from one view directory held open (a
view is a directory renamed into place, so a new stager's never mixes with an old one's), its
``landed`` log, whether its stager still makes progress, and files read checked against the
listing."""

from __future__ import annotations

import errno
import io
import os
import stat
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import BinaryIO

from shmstage.demandclient import Counted, Local
from shmstage.errors import ShmstageError
from shmstage.stage.store.layout import Store
from shmstage.stage.store.locks import activity
from shmstage.stage.store.views import (
    FILES,
    LANDED,
    REQUEST,
    FileList,
    View,
    parse_files,
    read_from,
    read_view,
    unpack_landed,
)

# Seconds a stager may go with no sign of progress at all (no answer, no file landed, no CPU
# time used) before the job does without it: a stopped stager (SIGSTOP) at once.
STALL = 10.0

# The job's own listing: names, sizes, mtime_ns (index i = file i).
Listing = tuple[Sequence[str], Sequence[int], Sequence[int]]


def identity(view: View, fd: int) -> tuple[object, ...]:
    """Which view this is: its directory (``fd``; an inode may be reused once a view is
    removed) and what its stager wrote (a new stager is another process)."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, view.kind, view.pid, view.pid_start, view.socket, view.root


def listed_view(dest: str, name: str) -> tuple[View | None, FileList | None, tuple[object, ...]]:
    """The view of DEST/<name>, its file list and its ``identity``, all read from one
    directory (a view that goes away meanwhile was published or replaced: read again)."""
    for _ in range(3):
        got = open_view(dest, name)
        if got is None:
            return None, None, ()
        view, fd = got
        try:
            raw, ident = read_at(fd, FILES), identity(view, fd)
        finally:
            os.close(fd)
        if raw is not None:
            return view, parse_files(raw), ident
    return None, None, ()


def open_view(dest: str, name: str) -> tuple[View, int] | None:
    """The view of DEST/<name> and its directory held open, the same one: a view is a
    directory renamed into place, so the one read is the one open when the name still
    points at it after the read.  None: no view (or none readable)."""
    path = Store(dest).view_path(name)
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        view = read_view(dest, name)
        try:
            same = view is not None and os.stat(path).st_ino == os.fstat(fd).st_ino
        except OSError:
            same = False
        if same:
            return view, fd  # type: ignore[return-value]
        os.close(fd)
        if view is None:
            return None
    return None


def read_at(dir_fd: int, name: str) -> bytes | None:
    """File ``name`` of the directory ``dir_fd``; None when it is gone."""
    fd = open_at(dir_fd, name)
    if fd < 0:
        return None
    try:
        return read_from(fd, 0)
    finally:
        os.close(fd)


def open_at(dir_fd: int, name: str) -> int:
    """File ``name`` of the directory ``dir_fd`` open for reading; -1 when it is gone."""
    try:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return -1


def checked(path: str, want: tuple[int, int], local: Local, *, whole: bool) -> BinaryIO | None:
    """The file at ``path`` when it is the file listed (``want``: size and mtime_ns), else
    None (not there, or another version).  ``whole``: a tree a stager may still write in
    place (a live view's root): read at once, its fstat before and after equal (ctime too,
    which cannot be set back), so no half-written or rewritten file gets through."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None
        raise ShmstageError(f"cannot read {path}: {e.strerror}") from None
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode) or (before.st_size, before.st_mtime_ns) != want:
            os.close(fd)
            return None
        if not whole:
            return io.BufferedReader(Counted(fd, local.count))
        data = read_from(fd, 0)
        after = os.fstat(fd)
        os.close(fd)
    except OSError as e:
        with suppress(OSError):
            os.close(fd)
        raise ShmstageError(f"cannot read {path}: {e.strerror}") from None
    if len(data) != want[0] or changed_since(before, after):
        return None
    local.count(len(data), 0)
    return io.BytesIO(data)


def changed_since(before: os.stat_result, after: os.stat_result) -> bool:
    """Whether a file was written between two fstats (ctime cannot be set back)."""
    return (before.st_size, before.st_mtime_ns, before.st_ctime_ns) != (
        after.st_size,
        after.st_mtime_ns,
        after.st_ctime_ns,
    )


def attach(local: Local, ident: tuple[object, ...]) -> None:
    """Hold ``local.view``'s ``landed`` open when its view is still the listed one
    (``ident``); a view replaced since the listing (a new stager) is followed at the
    first settle, never read with the listing's numbering."""
    local.view_id = ident
    view: View = local.view  # type: ignore[assignment]
    got = open_view(os.path.dirname(view.final), view.name)
    if got is None:
        return
    now, fd = got
    try:
        if identity(now, fd) == ident:
            local.landed_fd = open_at(fd, LANDED)
    finally:
        os.close(fd)


def grow(local: Local) -> None:
    """Read the ``landed`` log's new whole records (``local.lock`` held)."""
    if local.landed_fd < 0:
        return
    try:
        raw = read_from(local.landed_fd, local.landed_at)
    except OSError:
        return
    got = unpack_landed(raw)
    if not got:
        return
    local.landed_at += len(raw) - len(raw) % REQUEST.size  # whole uint32 records
    for index in got:
        if index < len(local.landed):
            local.landed[index] = 1
    local.progress = time.monotonic()
    local.stalled = False


def follow(local: Local, view: View, fd: int, listing: Listing) -> bool:
    """Follow ``view`` (its directory held open as ``fd``, closed here; ``local.cond``
    held).  Another stager's view (a new directory) brings its own list, numbering and
    ``landed`` log, all taken from that directory: two views' numbering never mix.
    False when its list is gone (being removed: look again)."""
    try:
        ident = identity(view, fd)
        if ident == local.view_id:
            local.view = view
            return True
        raw = read_at(fd, FILES)
        if raw is None:
            return False
        landed_fd = open_at(fd, LANDED)
    finally:
        os.close(fd)
    listed = parse_files(raw)
    at = {n: j for j, n in enumerate(listed.names)}
    vmap = []
    for name, size, mtime in zip(*listing, strict=True):
        j = at.get(name, -1)
        if j >= 0 and (listed.sizes[j], listed.mtimes[j]) != (size, mtime):
            j = -1
        vmap.append(j)
    drop(local)
    if local.landed_fd >= 0:
        os.close(local.landed_fd)
    local.view, local.view_id, local.vmap = view, ident, vmap
    local.landed_fd, local.landed_at = landed_fd, 0
    local.landed = bytearray(listed.resident)
    local.answers = {}
    local.published = local.dead = local.stalled = False
    local.progress, local.cpu = time.monotonic(), None
    return True


def stuck(local: Local) -> bool:
    """Whether the live stager is stopped (SIGSTOP, /proc state T/t) or has shown no
    progress at all for ``_STALL`` s: no answer, no file landed, no CPU time used
    (``local.cond`` held).  How long one file may legitimately take is not knowable,
    so only "nothing moves" counts."""
    view = local.view
    if view is None or view.pid_start is None:
        return False
    act = activity(view.pid, view.pid_start)
    if act is None:
        return False  # gone: alive() says so
    state, cpu = act
    if state in (b"T", b"t"):
        return True
    grow(local)
    now = time.monotonic()
    if cpu != local.cpu:
        local.cpu, local.progress = cpu, now
    return now - local.progress > STALL


def drop(local: Local) -> None:
    """Forget the connection and what was asked on it (the asking threads ask again)."""
    if local.sock is not None:
        with suppress(OSError):
            local.sock.close()
        local.sock = None
    local.asked.clear()
