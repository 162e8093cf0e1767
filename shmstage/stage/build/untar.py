"""Extracting a checked tar archive (:mod:`shmstage.stage.sources.tar` scanned it) into
partial/<name>: members in archive order, data by ``sendfile`` from a plain archive or read
through tarfile from a compressed one, directories' modes and times last.  The extracted tree
is walked again afterwards, which catches links that only escape in combination, like
``a -> .`` and ``b -> a/..``.

A member's mode is the archive's word only as far as the archive itself allows: every member
(and the copy's top) is owned by the archive file's owner and group, never setuid, setgid,
sticky, group- or other-writable, and a class that may not read the archive gets no bits.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from shmstage.errors import ShmstageError
from shmstage.identity import Caller, reading_as
from shmstage.stage.sources.base import Tick, Want
from shmstage.stage.sources.tar import BUF, Archive, Member, TarSource, open_archive
from shmstage.stage.sources.tarformat import DamagedArchive, reading
from shmstage.stage.sources.walk import Tree, walk
from shmstage.stage.store import rmtree
from shmstage.stage.store.access import copy_owner

if TYPE_CHECKING:
    import tarfile


def fill(
    src: TarSource,
    wants: Sequence[Want],
    root: str,
    tick: Tick,
    workers: int | None,
    checksum: bool,
    meanwhile: Callable[[], None] | None = None,
) -> Tree:
    """Extract the whole archive into ``root``; the tree it made, as walked."""
    assert src.archive is not None, "listing() first"
    extract(src.archive, root, tick, src.reader)
    with reading_as(src.reader):
        st = os.stat(src.location)
    if [st.st_size, st.st_mtime_ns, st.st_ino] != src.fingerprint:
        raise ShmstageError(
            f"cannot read tar archive {src.location}: it changed while it was being staged; "
            "re-run when it is stable"
        )
    return walk(root)  # also catches links that escape only in combination


def extract(
    archive: Archive,
    root: str,
    progress: Callable[[int, int], None] | None = None,
    reader: Caller | None = None,
) -> None:
    """Extract the checked members into ``root`` (an existing, empty, private directory).
    ``reader``: the archive is opened with the reader's file-system ids (the tree is
    written with ours)."""
    dirs: list[Member] = []
    fmt = archive.format
    with reading_as(reader):
        # the archive as the stager reads it (fill checks afterwards that it is still this one)
        owner = os.stat(archive.path)
    keep = member_mask(owner.st_mode)
    put = _Placer(root, owner, keep)
    plain = all(m.offset >= 0 for m in archive.members if m.kind == "f")
    old_umask = os.umask(0)
    current: list[Member | None] = [None]

    def where() -> str:
        m = current[0]
        return f"in member {m.name!r}" if m is not None else "at its start"

    try:
        if plain:
            with reading_as(reader):
                fd = os.open(archive.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                for m in archive.members:
                    _extract_one(
                        archive.path,
                        m,
                        put,
                        dirs,
                        lambda out, m=m: _copy_range(fd, out, m),
                        progress,
                    )
            finally:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        else:
            wanted = {m.index: m for m in archive.members}
            with reading_as(reader):
                opened = open_archive(archive.path, fmt, stream=True)
            with opened as tf:
                headers = iter(tf)
                index = -1
                while True:
                    with reading(archive.path, fmt, where):
                        info = next(headers, None)
                    if info is None:
                        break
                    index += 1
                    m = wanted.pop(index, None)
                    if m is None:
                        continue  # dropped by --strip-components
                    current[0] = m

                    def write(out: int, info: tarfile.TarInfo = info) -> int:
                        return _copy_stream(
                            tf, info, out, lambda: reading(archive.path, fmt, where)
                        )

                    _extract_one(archive.path, m, put, dirs, write, progress)
            if wanted:
                raise DamagedArchive(
                    f"cannot read tar archive {archive.path}: it ends before member "
                    f"{min(wanted.items())[1].name!r}, which it had when it was checked; it changed "
                    "while it was being staged or is damaged: re-run, or re-download it"
                )
            with reading_as(reader):
                fd = os.open(archive.path, os.O_RDONLY | os.O_CLOEXEC)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise  # the engine says "no space left" and what to do
        raise ShmstageError(f"cannot extract {archive.path}: {e.strerror}: {e.filename}") from None
    finally:
        os.umask(old_umask)
    for m in reversed(dirs):  # children before parents: setting a child touches the parent's mtime
        path = os.path.join(root, m.name) if m.name != "." else root
        os.chmod(path, m.mode & keep)
        os.utime(path, ns=(m.mtime_ns, m.mtime_ns), follow_symlinks=False)
    if not any(m.name == "." for m in dirs):  # the top follows the same rule
        os.chmod(root, stat.S_IMODE(os.lstat(root).st_mode) & keep)
    copy_owner(root, owner)


def member_mask(archive_mode: int) -> int:
    """The bits a member (or the copy's top) may keep, given the archive file's mode: no
    setuid/setgid/sticky, no group or other write, and nothing for a class (group, other)
    that cannot read the archive itself."""
    keep = 0o755
    if not archive_mode & stat.S_IRGRP:
        keep &= ~0o070
    if not archive_mode & stat.S_IROTH:
        keep &= ~0o007
    return keep


class _Placer:
    """Where members go, and whose they are: the archive file's owner and group."""

    def __init__(self, root: str, owner: os.stat_result, keep: int) -> None:
        self.root, self.owner, self.keep = root, owner, keep

    def own(self, path: str | int) -> None:
        copy_owner(path, self.owner)


def _extract_one(
    archive_path: str,
    m: Member,
    put: _Placer,
    dirs: list[Member],
    write: Callable[[int], int],
    progress: Callable[[int, int], None] | None,
) -> None:
    root = put.root
    path = os.path.join(root, m.name) if m.name != "." else root
    if m.name != ".":
        _make_parents(put, m.name)
    if m.kind == "d":
        if not os.path.isdir(path) or os.path.islink(path):
            _remove(path)
            os.mkdir(path, 0o700)
            put.own(path)
        dirs.append(m)
        return
    _remove(path)  # a later member of the same name wins, as with tar(1)
    if m.kind == "f":
        fo = os.open(
            path,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            m.mode & put.keep,
        )
        try:
            put.own(fo)  # no setuid/setgid bit to lose: the mask took them
            got = write(fo)
            if got != m.size:
                raise DamagedArchive(
                    f"cannot read tar archive {archive_path}: member {m.name!r} is shorter than its "
                    f"header says ({got} of {m.size} bytes); it changed while it was being staged "
                    "or is damaged: re-run, or re-download it"
                )
            os.utime(fo, ns=(m.mtime_ns, m.mtime_ns))
        finally:
            os.close(fo)
        if progress is not None:
            progress(m.size, 1)
    elif m.kind == "l":
        os.symlink(m.extra or "", path)
        put.own(path)
        os.utime(path, ns=(m.mtime_ns, m.mtime_ns), follow_symlinks=False)
    elif m.kind == "h":
        os.link(os.path.join(root, m.extra or ""), path, follow_symlinks=False)
        if progress is not None:
            progress(0, 1)


def _make_parents(put: _Placer, rel: str) -> None:
    parent = posixpath.dirname(rel)
    if not parent:
        return
    path = os.path.join(put.root, parent)
    if os.path.isdir(path) and not os.path.islink(path):
        return
    _make_parents(put, parent)
    _remove(path)
    os.mkdir(path, 0o755 & put.keep)
    put.own(path)


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        rmtree(path)
    else:
        os.unlink(path)


def _copy_range(fd: int, out: int, m: Member) -> int:
    done = 0
    while done < m.size:
        n = os.sendfile(out, fd, m.offset + done, m.size - done)
        if n == 0:
            break
        done += n
    return done


def _copy_stream(
    tf: tarfile.TarFile,
    info: tarfile.TarInfo,
    out: int,
    reading: Callable[[], AbstractContextManager[None]],
) -> int:
    src = tf.extractfile(info)
    if src is None:
        return 0
    done = 0
    while True:
        with reading():  # read errors are the archive's; write errors (ENOSPC) are ours
            chunk = src.read(BUF)
        if not chunk:
            return done
        view = memoryview(chunk)
        while view:
            n = os.write(out, view)
            view = view[n:]
        done += len(chunk)
