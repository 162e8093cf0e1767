"""A tar archive as a source: every header read and checked before a byte is written
(:func:`scan`), the archive's size, mtime and inode as its stamp, and :func:`compare` for
verify.  Not incremental: a changed archive is extracted whole (stage/build/untar.py), and an
unchanged one is known by its stamp without reading it again.

The archive's format comes from its content (:mod:`shmstage.stage.sources.tarformat`).
The checks: no absolute paths, no ``..``, no device files or FIFOs, no member written
through a symlink, no hard link to anything but an earlier file of the archive, no symlink
whose target leaves the tree.  A damaged archive (bad header, truncated data or compressed
stream) fails as a whole: Python's tarfile ends a listing quietly at a bad header, so the
scan checks how the listing ended.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shmstage.errors import RefusedError
from shmstage.identity import Caller, is_denied, reading_as
from shmstage.stage.sources.base import Listing, Source
from shmstage.stage.sources.tarformat import DamagedArchive, Format, check_end, detect, reading, why
from shmstage.stage.sources.walk import (
    FILE_MODE_MASK,
    climbs_out,
    page_bytes,
    unreadable_by_reader,
)

if TYPE_CHECKING:
    import tarfile

BUF = 1 << 20  # what one read of a member's data takes


@dataclass(frozen=True)
class Member:
    name: str  # normalised relative path after --strip-components ("." for the root)
    kind: str  # "d", "f", "l", "h"
    size: int
    mtime_ns: int
    mode: int
    extra: str | None  # link target (l) or the earlier file (h)
    offset: int  # data offset in an uncompressed archive, -1 when it must be read through tarfile
    index: int = 0  # position among the archive's headers (members dropped by stripping count)


@dataclass(frozen=True)
class Archive:
    path: str
    members: list[Member]
    bytes: int
    files: int
    format: Format = Format("")
    strip_components: int = 0

    @property
    def page_bytes(self) -> int:
        return page_bytes(m.size for m in self.members if m.kind == "f")

    def entries(self) -> list[tuple]:
        """The members as walk.py's entry tuples, as extracted: the root first (extraction
        creates it when no member names it)."""
        out = [(m.name, m.kind, m.size, m.mtime_ns, m.mode, m.extra) for m in self.members]
        if not any(e[0] == "." for e in out):
            out.insert(0, (".", "d", 0, 0, 0o755, None))
        return out


class UnsafeArchive(RefusedError):
    """A member would escape the tree or create something we refuse to create."""


def _parts(name: str) -> list[str] | None:
    """The path components of a member name; None for absolute paths and ``..``."""
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return None
    parts = [p for p in name.split("/") if p]
    return None if ".." in parts else parts


def _normalise(name: str, strip: int = 0) -> str | None:
    """The member's path in the staged tree ("" when --strip-components drops it)."""
    parts = _parts(name)
    if parts is None:
        return None
    # Like GNU tar, "." counts as a component when stripping ("./top/a" -> "top/a").
    if strip and len(parts) < strip:
        return ""
    return "/".join(p for p in parts[strip:] if p != ".") or "."


def open_archive(path: str, fmt: Format, stream: bool = False, **kw: object) -> tarfile.TarFile:
    import tarfile  # only for archive sources: keeps `shmstage stage DIR` quick to start

    mode = ("r|" if stream else "r:") + fmt.compression
    try:
        return tarfile.open(path, mode, **kw)  # type: ignore[call-overload]
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DamagedArchive(
            f"cannot read tar archive {path}: {why(e, fmt)}; re-download or re-create it"
        ) from None


def scan(path: str, strip_components: int = 0) -> Archive:
    """Read every header and check it; raises UnsafeArchive naming the first bad member,
    DamagedArchive when the archive cannot be read to its proper end."""
    import tarfile  # only for archive sources (see open_archive)

    fmt = detect(path)
    members: list[Member] = []
    links: set[str] = set()
    files: set[str] = set()
    origin: dict[str, str] = {}  # staged path -> the member name it came from
    total = nfiles = 0
    plain = not fmt.compression
    strip = strip_components
    last_error: list[BaseException | None] = [None]

    class Info(tarfile.TarInfo):
        """Remembers why the last header could not be read: tarfile ends the listing quietly."""

        @classmethod
        def frombuf(cls, buf, encoding, errors):  # type: ignore[no-untyped-def]
            try:
                info = super().frombuf(buf, encoding, errors)
            except tarfile.HeaderError as e:
                last_error[0] = e
                raise
            last_error[0] = None
            return info

    def refuse(m: tarfile.TarInfo, why: str) -> UnsafeArchive:
        return UnsafeArchive(
            f"unsafe tar archive {path}: member {m.name!r} {why}; nothing was extracted"
        )

    last: tarfile.TarInfo | None = None
    with open_archive(path, fmt, tarinfo=Info) as tf:

        def where() -> str:
            if last is None:
                return "at offset 0 (in the first member)"
            end = last.offset_data + last.size
            size = os.path.getsize(path)
            if plain and size < end:
                return (
                    f"at offset {size} (in member {last.name!r}, whose data runs to offset {end})"
                )
            if plain and size < tf.offset:
                return f"at offset {size} (after member {last.name!r})"
            of = " of the uncompressed tar" if fmt.compression else ""
            return f"after offset {last.offset}{of} (in or after member {last.name!r})"

        with reading(path, fmt, where):
            for index, m in enumerate(tf):
                last = m
                rel = _normalise(m.name, strip)
                if rel is None:
                    raise refuse(m, "has an absolute path or '..'")
                if rel == "":
                    continue  # fewer components than --strip-components: dropped, as by tar
                if strip and rel == "." and not m.isdir():
                    continue  # tar drops it too: a file cannot become the root
                if strip:  # without stripping, one staged path comes from one member name
                    key = _normalise(m.name) or "."
                    first = origin.setdefault(rel, key)
                    if first != key:
                        both = repr(rel) if rel != "." else "the root"
                        raise UnsafeArchive(
                            f"--strip-components {strip} makes members {first!r} and {key!r} of "
                            f"{path} both {both}; nothing was extracted: use a smaller "
                            "--strip-components"
                        )
                parent = rel
                while parent not in ("", "."):
                    parent = posixpath.dirname(parent)
                    if parent in links:
                        raise refuse(m, f"would be written through the symlink {parent!r}")
                mtime_ns = int(round(float(m.mtime) * 1e9))
                if m.isdir():
                    members.append(Member(rel, "d", 0, mtime_ns, m.mode & 0o7777, None, -1, index))
                    continue
                if rel == ".":
                    raise refuse(m, "is not a directory but names the root")
                if m.isreg():
                    offset = m.offset_data if plain and not m.issparse() else -1
                    members.append(
                        Member(
                            rel, "f", m.size, mtime_ns, m.mode & FILE_MODE_MASK, None, offset, index
                        )
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
                    members.append(Member(rel, "l", 0, mtime_ns, 0o777, target, -1, index))
                    links.add(rel)
                elif m.islnk():
                    target = _normalise(m.linkname, strip)
                    if target is None or target not in files:
                        raise refuse(
                            m,
                            f"is a hard link to {m.linkname!r}, which is not an earlier file in the "
                            "archive" + (" (after --strip-components)" if strip else ""),
                        )
                    members.append(
                        Member(rel, "h", 0, mtime_ns, m.mode & FILE_MODE_MASK, target, -1, index)
                    )
                    files.add(rel)
                    nfiles += 1
                else:
                    raise refuse(m, "is a device file, FIFO or other special file")
            check_end(path, fmt, tf, last, last_error[0])
    # Each link resolved through the archive's other links, from inside the tree: a step
    # above its top is refused even where the rest leads back in (a -> . plus b -> a/../x).
    final = {m.name: m.extra or "" for m in members if m.kind == "l" and m.name in links}
    for rel, target in final.items():
        if climbs_out(rel, target, final.get):
            raise UnsafeArchive(
                f"unsafe tar archive {path}: member {rel!r} is a symlink that climbs out of the "
                f"tree on the way to its target ({target}); nothing was extracted"
            )
    return Archive(path, members, total, nfiles, fmt, strip)


def compare(
    archive_path: str, root: str, strip_components: int = 0, reader: Caller | None = None
) -> list[str]:
    """Relative paths of regular members whose bytes differ from the tree at ``root`` (the
    archive opened with ``reader``'s file-system ids)."""
    with reading_as(reader):
        fmt = detect(archive_path)
        opened = open_archive(archive_path, fmt, stream=True)
    differ: dict[str, bool] = {}
    with (
        opened as tf,
        reading(archive_path, fmt, lambda: "while comparing"),
    ):
        for info in tf:
            rel = _normalise(info.name, strip_components)
            if not rel or rel == "." or not info.isreg():
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
                a = src.read(BUF)
                b = staged.read(len(a) if a else 1)
                if a != b:
                    return False
                if not a:
                    return True
    finally:
        os.close(fd)


class TarSource(Source):
    """A tar archive, listed by its checked headers; build/untar.py extracts it."""

    kind = "tar"
    incremental = False

    def __init__(
        self, location: str, strip_components: int = 0, reader: Caller | None = None
    ) -> None:
        self.location = location
        self.strip = strip_components
        self.reader = reader  # the archive is opened (and stat'ed) with its file-system ids
        self.archive: Archive | None = None
        self.fingerprint: list[int] = []

    def stamp(self) -> dict[str, Any]:
        """The archive's size, mtime and inode.  With a reader, stamp also proves that the
        reader may open the archive for reading: an unchanged archive is handed out on its
        stamp alone."""
        with reading_as(self.reader):
            try:
                st = os.stat(self.location)
                if self.reader is not None:
                    os.close(os.open(self.location, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
            except OSError as e:
                if self.reader is not None and is_denied(e):
                    raise unreadable_by_reader(self.location, e.strerror or "") from None
                raise
        self.fingerprint = [st.st_size, st.st_mtime_ns, st.st_ino]
        return {"archive": self.fingerprint, "strip_components": self.strip}

    def listing(self) -> Listing:
        """The members as they will be extracted (the numbers inspect prints)."""
        record = self.stamp()
        with reading_as(self.reader):
            archive = scan(self.location, self.strip)
        self.archive = archive
        return Listing(
            self.location, archive.entries(), None, archive.bytes, archive.files, record=record
        )
