"""Bytes jobs read through ``DatasetFiles`` from RAM and from the source: one tiny counter
file per (dataset, user) in ``DEST/.shmstage/served/``, added to by every reading process of
that user (locked read-add-write), summed by ``metrics``, removed by ``gc`` with its dataset.

NOTE [served]: the directory is flat, one file per dataset and user, named ``<name>@<uid>``
(``@`` is never in a dataset name), so it holds at most users x datasets files whatever the
number of jobs, workers, epochs or pid reuse, and a count only ever goes up.  Where every user
may already write beside DEST on the same file system (DEST in /dev/shm, mode 1777) it is
mode 1777 too, so a job of any user may count in root's store: in a sticky directory nobody
can replace or remove another user's file.  Elsewhere (DEST on a tmpfs of its own, or a 0755
parent) it is 0755: a world-writable directory there would let any user fill the store's file
system, so only jobs of the store's owner count.  Nothing another user made is followed,
blocked on or written through: files are opened O_NOFOLLOW|O_NONBLOCK and used only when
fstat says a regular file of the writer's (of the uid in its name, for readers); a counter
another process holds locked is retried at the next flush, never waited for.  Counts are
job-reported: a user can overstate only their own (the file's owner is the uid counted).
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from collections.abc import Collection, Iterator
from contextlib import suppress
from dataclasses import dataclass

SERVED = "served"
DIR_MODE = 0o1777
_WIDTH = 20  # digits per number: the file is always the same size, rewritten in place
_SIZE = 2 * _WIDTH + 2
_MAX = 2**63 - 1  # a count above this is not one we wrote
_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never follow, never block (a FIFO)


@dataclass(frozen=True)
class Served:
    """What one (dataset, user) counter file says."""

    name: str  # the dataset
    uid: int  # the user whose jobs read (the file's owner)
    ram: int  # bytes read from the copy in RAM
    source: int  # bytes read from the source
    path: str


def served_dir(book: str) -> str:
    return os.path.join(book, SERVED)


def make_dir(book: str) -> None:
    """Create ``served/`` beside the bookkeeping (NOTE [served]), or put right the mode of one
    made before; by the store's owner."""
    path = served_dir(book)
    mode = DIR_MODE if _shared(os.path.dirname(book)) else 0o755
    with suppress(FileExistsError):
        os.mkdir(path, mode)
    with suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
                os.fchmod(fd, mode)  # exact mode whatever the umask; 1777 taken back
        finally:
            os.close(fd)


def _shared(dest: str) -> bool:
    """Every user may already create files on DEST's file system next to it: DEST itself,
    or its parent on the same file system, is sticky and world-writable (like /dev/shm)."""
    if _open_to_all(dest):
        return True
    try:
        same = os.stat(dest).st_dev == os.stat(os.path.dirname(dest) or "/").st_dev
    except OSError:
        return False
    return same and _open_to_all(os.path.dirname(dest))


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


def add(book: str, name: str, ram: int, source: int) -> bool:
    """Add to this user's counter of dataset ``name``.  False: not now (another process holds
    it locked), try again later; True: added, or never possible here (no served/ we may use,
    a name planted by someone else): the counts are dropped.  Never blocks, never raises."""
    where = served_dir(book)
    if not _usable(where):
        return True
    path = os.path.join(where, f"{name}@{os.geteuid()}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN, 0o644)
    except FileExistsError:  # ours from an earlier process, or planted: checked below
        try:
            fd = os.open(path, os.O_RDWR | _OPEN)
        except OSError:
            return True
    except OSError:
        return True
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        old = _counts(os.pread(fd, _SIZE, 0)) or (0, 0)
        ram, source = min(old[0] + ram, _MAX), min(old[1] + source, _MAX)
        os.pwrite(fd, f"{ram:0{_WIDTH}d} {source:0{_WIDTH}d}\n".encode(), 0)
        if st.st_size > _SIZE:
            os.ftruncate(fd, _SIZE)
        if stat.S_IMODE(st.st_mode) != 0o644:
            os.fchmod(fd, 0o644)  # readable by metrics whatever the umask
        return True
    except OSError:
        return True
    finally:
        os.close(fd)  # the lock goes with it


def add_at_exit(book: str, name: str, ram: int, source: int) -> None:
    """``add`` for the last time: a counter locked by another process is retried a few
    times, briefly (bounded: a lock held by someone else loses these counts)."""
    for _ in range(20):
        if add(book, name, ram, source):
            return
        time.sleep(0.01)


def _counts(data: bytes) -> tuple[int, int] | None:
    parts = data.split()
    if len(data) != _SIZE or len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    ram, source = int(parts[0]), int(parts[1])
    return (ram, source) if ram <= _MAX and source <= _MAX else None


def _parse(entry: str) -> tuple[str, int] | None:
    """``<name>@<uid>`` with a name that is text (UTF-8) and a uid in its canonical form."""
    name, at, uid = entry.rpartition("@")
    try:
        entry.encode("utf-8")
    except UnicodeEncodeError:
        return None
    if not at or not name or not uid.isdecimal() or not uid.isascii() or str(int(uid)) != uid:
        return None
    return name, int(uid)


def _read(path: str, uid: int) -> tuple[int, int] | None:
    """The counts of a regular file owned by ``uid``.  Read until two reads agree: a pwrite
    may be seen half done by a reader."""
    last = None
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDONLY | _OPEN)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                return None
            data = os.pread(fd, _SIZE + 1, 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        if data == last:
            break
        last = data
    return _counts(last or b"")


def entries(book: str) -> list[str]:
    """Every name in ``served/`` (counters and anything else), sorted."""
    try:
        return sorted(os.listdir(served_dir(book)))
    except OSError:
        return []


def files(book: str, known: Collection[str] | None = None) -> Iterator[Served]:
    """Every valid counter file of the store whose bookkeeping is ``book`` (NOTE [served]);
    with ``known``, only those of these datasets."""
    where = served_dir(book)
    for entry in entries(book):
        who = _parse(entry)
        if who is None or (known is not None and who[0] not in known):
            continue
        path = os.path.join(where, entry)
        counts = _read(path, who[1])
        if counts is not None:
            yield Served(who[0], who[1], counts[0], counts[1], path)


def totals(book: str, known: Collection[str] | None = None) -> dict[str, tuple[int, int]]:
    """Per dataset: (bytes from RAM, bytes from the source), every user's summed."""
    out: dict[str, tuple[int, int]] = {}
    for s in files(book, known):
        ram, source = out.get(s.name, (0, 0))
        out[s.name] = (ram + s.ram, source + s.source)
    return out


def leftovers(book: str, kept: Collection[str]) -> list[str]:
    """What ``gc`` removes from ``served/``: the counters of datasets not in ``kept`` (no
    longer published, no view), and every entry that is not a counter file (a name or
    owner that does not parse, a FIFO, a link: planted by someone)."""
    where = served_dir(book)
    out = []
    for entry in entries(book):
        who = _parse(entry)
        path = os.path.join(where, entry)
        if who is None or who[0] not in kept or _read(path, who[1]) is None:
            out.append(path)
    return out
