"""How much a source takes once staged: the one estimator behind inspect, stage and prepare.

What tmpfs charges (measured on Linux 6.18, see docs/staging.md "Capacity"):
* a regular file: its size rounded up to whole pages (``SC_PAGE_SIZE``; 2 MiB "huge" pages
  when the destination tmpfs is mounted ``huge=always``), once per inode: hard links share it;
* every path costs one inode of the ``nr_inodes`` budget: files, hard links (tmpfs counts
  each link), directories, symlinks;
* a symlink whose target is 128 bytes or longer also takes a page (shorter ones live in the inode);
* a directory takes no pages.
An archive is sized by its extracted members, never by its compressed size.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shmstage.errors import CapacityError
from shmstage.identity import Caller, reading_as
from shmstage.stage.sources import kinds, tarformat

SHORT_SYMLINK = 128  # tmpfs keeps targets shorter than this (with their NUL) inside the inode
_HUGE_DEFAULT = 2 << 20


@dataclass(frozen=True)
class Estimate:
    """What staging ``source`` writes: the numbers every command prints and checks."""

    source: str
    kind: str  # "dir", "tar" or an object store's ("s3", "gs", "az")
    bytes: int  # apparent size of the data (hard links once)
    page_bytes: int  # what it takes on the destination tmpfs (whole pages)
    files: int  # regular file paths (hard links included)
    inodes: int  # paths: files, hard links, directories, symlinks (the root included)
    page_size: int  # the unit page_bytes was rounded to
    unreadable: int = 0  # entries that could not be read (estimate is then a lower bound)


def page_size(dest: str | os.PathLike[str] | None = None) -> int:
    """The unit tmpfs allocates in under ``dest``: the kernel's page size, or the huge
    page size on a tmpfs mounted ``huge=always`` (which backs even small files with one)."""
    page = os.sysconf("SC_PAGE_SIZE")
    if dest is None:
        return page
    from shmstage import system  # psutil: loaded only when a destination is asked about

    where = os.path.abspath(os.fspath(dest))
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    mount = system.mount_of(where)
    if mount is None or mount.fstype != "tmpfs" or mount.option("huge") != "always":
        return page
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return _HUGE_DEFAULT


def rounded(size: int, page: int) -> int:
    return -(-size // page) * page


class _Count:
    """The counting rule, fed either by a walk or by an archive's members."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.bytes = self.page_bytes = self.files = self.inodes = 0

    def file(self, size: int, first: bool = True) -> None:
        self.files += 1
        self.inodes += 1
        if first:
            self.bytes += size
            self.page_bytes += rounded(size, self.page)

    def dir(self) -> None:
        self.inodes += 1

    def symlink(self, target_len: int) -> None:
        self.inodes += 1
        if target_len + 1 > SHORT_SYMLINK:
            self.page_bytes += self.page

    def result(self, source: str, kind: str, unreadable: int = 0) -> Estimate:
        return Estimate(
            source,
            kind,
            self.bytes,
            self.page_bytes,
            self.files,
            self.inodes,
            self.page,
            unreadable,
        )


def of_entries(source: str, entries: Iterable[tuple], page: int, kind: str = "dir") -> Estimate:
    """Size a walked tree (walk.walk's entries) or an archive's members
    (``(name, kind, size, mtime, mode, extra)``: ``f`` file, ``h`` hard link, ``d``, ``l``)."""
    c = _Count(page)
    for e in entries:
        k = e[1]
        if k == "f":
            c.file(e[2])
        elif k == "h":
            c.file(e[2], first=False)
        elif k == "d":
            c.dir()
        elif k == "l":
            c.symlink(len(os.fsencode(e[5] or "")))
    return c.result(source, kind)


def of_archive(archive: Any, page: int) -> Estimate:
    """Size a scanned archive (``sources.tar.scan``) by its members, as extracted."""
    return of_entries(archive.path, archive.entries(), page, "tar")


def estimate(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str] | None = None,
    reader: Caller | None = None,
    credentials: Mapping[str, str] | None = None,
) -> Estimate:
    """Size ``source`` (a directory or a tar archive) as it would be staged under ``dest``.

    A directory is walked with lstat (symlinks are not followed; unreadable entries are
    counted, not fatal); an archive's headers are all read (sources.tar.scan), so a 48 MB
    ``.tar.gz`` is sized by what it extracts to.  ``reader``, ``credentials``: as stage
    reads it (a size is told only to someone who may read the source)."""
    path = os.fspath(source)
    page = page_size(dest)
    if kinds.is_url(path):  # an object-store prefix: one LIST, the tree stage would build
        kind, location = kinds.resolve(path)
        listing = kinds.open_listed(kind, location, reader, credentials).listing()
        return of_entries(location, listing.entries, page, kind)
    with reading_as(reader):
        if os.path.isdir(path):
            return _walk(path, page)
        tarformat.detect(path)  # by content, like stage: refuses what is not a readable tar
        from shmstage.stage.sources.tar import scan  # archives only

        return of_archive(scan(path), page)


def _walk(root: str, page: int) -> Estimate:
    c = _Count(page)
    c.dir()  # the dataset's own directory
    seen: set[tuple[int, int]] = set()
    unreadable = 0
    stack = [root]
    while stack:
        here = stack.pop()
        try:
            it = os.scandir(here)
        except OSError:
            unreadable += 1
            continue
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                    mode = st.st_mode
                    if stat.S_ISDIR(mode):
                        c.dir()
                        stack.append(entry.path)
                    elif stat.S_ISREG(mode):
                        key = (st.st_dev, st.st_ino)
                        first = st.st_nlink < 2 or key not in seen
                        if st.st_nlink > 1:
                            seen.add(key)
                        c.file(st.st_size, first)
                    elif stat.S_ISLNK(mode):
                        c.symlink(len(os.readlink(os.fsencode(entry.path))))
                    # fifos, sockets, devices: stage refuses them; nothing to count
                except OSError:
                    unreadable += 1
    return c.result(root, "dir", unreadable)


def require_fit(
    needed: int,
    entries: int,
    dest: str,
    reserve: int | str | None,
    *,
    pending: int = 0,
    freed: int = 0,
) -> None:
    """Raise CapacityError (nothing written yet) unless ``needed`` bytes and ``entries`` inodes
    + reserve fit under ``dest`` (see :func:`shmstage.capacity.check_fit`)."""
    from shmstage.capacity import check_fit  # node facts: only when something is to be written

    fit = check_fit(needed, dest, reserve, inodes=entries, pending=pending, freed=freed)
    if not fit.fits:
        raise CapacityError(f"dataset does not fit: {fit.reason}")
