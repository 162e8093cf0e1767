"""Tar archives as sources: a checking pass, then a safe extraction into the partial tree.

Every member is checked before a byte is written: no absolute paths, no
``..``, no device files or FIFOs, no member written through a symlink, no
hard link to anything but an earlier file of the archive, no symlink whose
target leaves the tree.  (The extracted tree is walked again afterwards, which
catches links that only escape in combination, like ``a -> .`` and ``b -> a/..``.)
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shmstage.errors import RefusedError, ShmstageError
from shmstage.stage.plan import FILE_MODE_MASK, page_bytes

if TYPE_CHECKING:
    import tarfile

SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
_BUF = 1 << 20


def is_archive(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(SUFFIXES)


@dataclass(frozen=True)
class Member:
    name: str  # normalised relative path ("." for the root)
    kind: str  # "d", "f", "l", "h"
    size: int
    mtime_ns: int
    mode: int
    extra: str | None  # link target (l) or the earlier file (h)
    offset: int  # data offset in an uncompressed archive, -1 when it must be read through tarfile


@dataclass(frozen=True)
class Archive:
    path: str
    members: list[Member]
    bytes: int
    files: int

    @property
    def page_bytes(self) -> int:
        return page_bytes(m.size for m in self.members if m.kind == "f")


class UnsafeArchive(RefusedError):
    """A member would escape the tree or create something we refuse to create."""


def _normalise(name: str) -> str | None:
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return None
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        return None
    return "/".join(parts) or "."


def _open(path: str, stream: bool = False) -> tarfile.TarFile:
    import tarfile  # only for archive sources: keeps `shmstage stage DIR` quick to start

    try:
        return tarfile.open(path, "r|*" if stream else "r:*")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ShmstageError(f"cannot read tar archive {path}: {e}") from None


def scan(path: str) -> Archive:
    """Read every header and check it; raises UnsafeArchive naming the first bad member."""
    members: list[Member] = []
    links: set[str] = set()
    files: set[str] = set()
    total = nfiles = 0
    plain = not path.lower().endswith((".gz", ".tgz", ".bz2", ".xz"))

    import tarfile

    def refuse(m: tarfile.TarInfo, why: str) -> UnsafeArchive:
        return UnsafeArchive(
            f"unsafe tar archive {path}: member {m.name!r} {why}; nothing was extracted"
        )

    with _open(path) as tf:
        try:
            for m in tf:
                rel = _normalise(m.name)
                if rel is None:
                    raise refuse(m, "has an absolute path or '..'")
                parent = rel
                while parent not in ("", "."):
                    parent = posixpath.dirname(parent)
                    if parent in links:
                        raise refuse(m, f"would be written through the symlink {parent!r}")
                mtime_ns = int(round(float(m.mtime) * 1e9))
                if m.isdir():
                    members.append(Member(rel, "d", 0, mtime_ns, m.mode & 0o7777, None, -1))
                elif m.isreg():
                    if rel == ".":
                        raise refuse(m, "is a file at the root")
                    offset = m.offset_data if plain and not m.issparse() else -1
                    members.append(
                        Member(rel, "f", m.size, mtime_ns, m.mode & FILE_MODE_MASK, None, offset)
                    )
                    files.add(rel)
                    links.discard(rel)
                    total += m.size
                    nfiles += 1
                elif m.issym():
                    target = m.linkname
                    if os.path.isabs(target) or posixpath.normpath(
                        posixpath.join(posixpath.dirname(rel), target)
                    ).startswith(".."):
                        raise refuse(m, f"is a symlink that points outside the tree ({target})")
                    members.append(Member(rel, "l", 0, mtime_ns, 0o777, target, -1))
                    links.add(rel)
                elif m.islnk():
                    target = _normalise(m.linkname)
                    if target is None or target not in files:
                        raise refuse(
                            m,
                            f"is a hard link to {m.linkname!r}, which is not an earlier file in the archive",
                        )
                    members.append(
                        Member(rel, "h", 0, mtime_ns, m.mode & FILE_MODE_MASK, target, -1)
                    )
                    files.add(rel)
                    nfiles += 1
                else:
                    raise refuse(m, "is a device file, FIFO or other special file")
        except tarfile.TarError as e:
            raise ShmstageError(f"cannot read tar archive {path}: {e}") from None
    return Archive(path, members, total, nfiles)


def extract(
    archive: Archive, root: str, progress: Callable[[int, int], None] | None = None
) -> None:
    """Extract the checked members into ``root`` (an existing, empty, private directory)."""
    dirs: list[Member] = []
    plain = all(m.offset >= 0 for m in archive.members if m.kind == "f")
    old_umask = os.umask(0)
    try:
        if plain:
            fd = os.open(archive.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                for m in archive.members:
                    _extract_one(m, root, dirs, lambda out, m=m: _copy_range(fd, out, m), progress)
            finally:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        else:
            with _open(archive.path, stream=True) as tf:
                it = iter(archive.members)
                for info in tf:
                    m = next(it)
                    _extract_one(
                        m, root, dirs, lambda out, info=info: _copy_stream(tf, info, out), progress
                    )
            fd = os.open(archive.path, os.O_RDONLY | os.O_CLOEXEC)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    except OSError as e:
        raise ShmstageError(f"cannot extract {archive.path}: {e.strerror}: {e.filename}") from None
    finally:
        os.umask(old_umask)
    for m in reversed(dirs):  # children before parents: setting a child touches the parent's mtime
        path = os.path.join(root, m.name) if m.name != "." else root
        os.chmod(path, m.mode)
        os.utime(path, ns=(m.mtime_ns, m.mtime_ns), follow_symlinks=False)


def _extract_one(
    m: Member,
    root: str,
    dirs: list[Member],
    write: Callable[[int], int],
    progress: Callable[[int, int], None] | None,
) -> None:
    path = os.path.join(root, m.name) if m.name != "." else root
    if m.name != ".":
        _make_parents(root, m.name)
    if m.kind == "d":
        if not os.path.isdir(path) or os.path.islink(path):
            _remove(path)
            os.mkdir(path, 0o700)
        dirs.append(m)
        return
    _remove(path)  # a later member of the same name wins, as with tar(1)
    if m.kind == "f":
        fo = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, m.mode
        )
        try:
            got = write(fo)
            if got != m.size:
                raise ShmstageError(f"tar archive {m.name!r} is truncated; re-create the archive")
            os.utime(fo, ns=(m.mtime_ns, m.mtime_ns))
        finally:
            os.close(fo)
        if progress is not None:
            progress(m.size, 1)
    elif m.kind == "l":
        os.symlink(m.extra or "", path)
        os.utime(path, ns=(m.mtime_ns, m.mtime_ns), follow_symlinks=False)
    elif m.kind == "h":
        os.link(os.path.join(root, m.extra or ""), path, follow_symlinks=False)
        if progress is not None:
            progress(0, 1)


def _make_parents(root: str, rel: str) -> None:
    parent = posixpath.dirname(rel)
    if not parent:
        return
    path = os.path.join(root, parent)
    if os.path.isdir(path) and not os.path.islink(path):
        return
    _make_parents(root, parent)
    _remove(path)
    os.mkdir(path, 0o755)


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        from shmstage.stage.store import _rmtree

        _rmtree(path)
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


def _copy_stream(tf: tarfile.TarFile, info: tarfile.TarInfo, out: int) -> int:
    src = tf.extractfile(info)
    if src is None:
        return 0
    done = 0
    while True:
        chunk = src.read(_BUF)
        if not chunk:
            return done
        view = memoryview(chunk)
        while view:
            n = os.write(out, view)
            view = view[n:]
        done += len(chunk)


def compare(archive_path: str, root: str) -> list[str]:
    """Relative paths of regular members whose bytes differ from the tree at ``root``."""
    differ: dict[str, bool] = {}
    with _open(archive_path, stream=True) as tf:
        for info in tf:
            rel = _normalise(info.name)
            if rel is None or not info.isreg():
                continue
            differ[rel] = not _same(tf, info, os.path.join(root, rel))
    return sorted(rel for rel, bad in differ.items() if bad)


def _same(tf: tarfile.TarFile, info: tarfile.TarInfo, path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        src = tf.extractfile(info)
        if src is None:
            return False
        with os.fdopen(fd, "rb", closefd=False) as staged:
            while True:
                a = src.read(_BUF)
                b = staged.read(len(a) if a else 1)
                if a != b:
                    return False
                if not a:
                    return True
    finally:
        os.close(fd)
