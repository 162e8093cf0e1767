"""Bytes a job read through ``DatasetFiles`` from RAM and from the source: one tiny file per
reading process in ``DEST/.shmstage/served/`` (written by the job, summed by ``metrics``,
the files of dead processes of datasets that are gone removed by ``gc``).

NOTE [served]: the directory is flat, one file per process named ``<name>@<uid>.<pid>``
(``@`` is never in a dataset name).  Where every user may already write beside DEST (DEST in
/dev/shm, mode 1777) it is mode 1777 too, so a job of any user may count in root's store: a
per-dataset directory made by one user could be closed by them to the others, and in a
sticky directory nobody can replace or remove another user's file.  Elsewhere (DEST on a
tmpfs of its own, 0755) it is 0755: a world-writable directory there would let any user fill
the store's file system, so only jobs of the store's owner count (metrics then shows theirs).
A file is created with O_EXCL|O_NOFOLLOW (a name planted by someone else is not written
through) and holds two fixed-width numbers, mode 0644: counts, nothing of what was read.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass

SERVED = "served"
DIR_MODE = 0o1777
_WIDTH = 20  # digits per number: the file is always the same size, rewritten in place
_SIZE = 2 * _WIDTH + 2


@dataclass(frozen=True)
class Served:
    """What one process's file says."""

    name: str  # the dataset
    uid: int
    pid: int
    ram: int  # bytes read from the copy in RAM
    source: int  # bytes read from the source
    path: str


def served_dir(book: str) -> str:
    return os.path.join(book, SERVED)


def make_dir(book: str) -> None:
    """Create ``served/`` beside the bookkeeping (NOTE [served]); by the store's owner."""
    path = served_dir(book)
    dest = os.path.dirname(book)
    mode = DIR_MODE if _open_to_all(dest) or _open_to_all(os.path.dirname(dest)) else 0o755
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, mode)  # exact mode whatever the umask
    finally:
        os.close(fd)


def _open_to_all(path: str) -> bool:
    """Every user may create files in ``path`` (sticky and world-writable, like /dev/shm)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return bool(mode & stat.S_IWOTH and mode & stat.S_ISVTX)


def _usable(path: str) -> bool:
    """``served/`` is a real directory of the store's owner, sticky where others write it."""
    try:
        st = os.lstat(path)
        owner = os.lstat(os.path.dirname(path)).st_uid
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != owner:
        return False
    return bool(st.st_mode & stat.S_ISVTX) or not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


class Writer:
    """This process's counter file for one dataset (NOTE [served]); never raises."""

    def __init__(self, book: str, name: str) -> None:
        self.fd: int | None = None
        where = served_dir(book)
        if not _usable(where):
            return
        path = os.path.join(where, f"{name}@{os.geteuid()}.{os.getpid()}")
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self.fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:  # ours from a process with the same pid long ago, or planted
            with suppress(OSError):
                fd = os.open(path, flags)
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1:
                    self.fd = fd
                else:
                    os.close(fd)
        except OSError:
            pass
        if self.fd is not None:
            with suppress(OSError):
                os.fchmod(self.fd, 0o644)

    def write(self, ram: int, source: int) -> None:
        if self.fd is None:
            return
        text = f"{ram:0{_WIDTH}d} {source:0{_WIDTH}d}\n".encode()
        with suppress(OSError):
            os.pwrite(self.fd, text, 0)

    def close(self) -> None:
        if self.fd is not None:
            with suppress(OSError):
                os.close(self.fd)
            self.fd = None


def _parse(entry: str) -> tuple[str, int, int] | None:
    name, at, rest = entry.rpartition("@")
    uid, dot, pid = rest.partition(".")
    if not at or not dot or not uid.isdigit() or not pid.isdigit():
        return None
    return name, int(uid), int(pid)


def _read(path: str) -> tuple[int, int] | None:
    # Read until two reads agree: a pwrite may be seen half done by a reader.
    last = None
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = os.pread(fd, _SIZE, 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        if data == last:
            break
        last = data
    parts = (last or b"").split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def files(book: str) -> Iterator[Served]:
    """Every readable counter file of the store whose bookkeeping is ``book``."""
    where = served_dir(book)
    try:
        entries = sorted(os.listdir(where))
    except OSError:
        return
    for entry in entries:
        who = _parse(entry)
        path = os.path.join(where, entry)
        counts = _read(path) if who is not None else None
        if who is not None and counts is not None:
            yield Served(who[0], who[1], who[2], counts[0], counts[1], path)


def totals(book: str) -> dict[str, tuple[int, int]]:
    """Per dataset: (bytes from RAM, bytes from the source), every process's summed."""
    out: dict[str, tuple[int, int]] = {}
    for s in files(book):
        ram, source = out.get(s.name, (0, 0))
        out[s.name] = (ram + s.ram, source + s.source)
    return out
