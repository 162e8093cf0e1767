"""What a source file is, read from its first bytes (never from its name), and how damage reads.

A tar archive is recognised by its first header (the ``ustar`` magic, or a
valid header checksum for old v7 archives), inside gzip, bzip2 or xz when the
file starts with their magic; zstd, lz4 and other formats are named and refused.
A damaged archive becomes one :class:`DamagedArchive` line naming the offset.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shmstage.errors import RefusedError, ShmstageError

if TYPE_CHECKING:
    import tarfile

BLOCK = 512

# compression -> (magic, name used in messages); tarfile reads these three.
_READABLE = (
    ("gz", b"\x1f\x8b", "gzip"),
    ("bz2", b"BZh", "bzip2"),
    ("xz", b"\xfd7zXZ\x00", "xz"),
)
# Formats Python's tarfile cannot read (or that hold no tar): say what the file is.
_OTHER = (
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file", "decompress it first (`zstd -d FILE`)"),
    (b"\x04\x22\x4d\x18", "an lz4-compressed file", "decompress it first (`lz4 -d FILE`)"),
    (b"\x02\x21\x4c\x18", "an lz4-compressed file", "decompress it first (`lz4 -d FILE`)"),
    (b"PK\x03\x04", "a zip archive", "unzip it and stage the directory"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive", "extract it and stage the directory"),
    (b"Rar!\x1a\x07", "a RAR archive", "extract it and stage the directory"),
    (
        b"\x5d\x00\x00",
        "an lzma-compressed file",
        "re-compress it as .tar.xz or decompress it first",
    ),
)
WHAT_TO_STAGE = "stage a directory or a tar archive (plain, gzip, bzip2 or xz)"


class DamagedArchive(ShmstageError):
    """The archive cannot be read to its end (exit 1): nothing of it is published."""


@dataclass(frozen=True)
class Format:
    """How to read a tar archive: ``compression`` is "" (plain), "gz", "bz2" or "xz"."""

    compression: str

    @property
    def label(self) -> str:
        return {"": "tar", "gz": "gzip", "bz2": "bzip2", "xz": "xz"}[self.compression]


def detect(path: str, shown: str | None = None) -> Format:
    """The format of the tar archive at ``path``; RefusedError saying what it is otherwise.

    A file that starts like a tar header but whose checksum is wrong is a damaged
    archive (ShmstageError, exit 1), not "something else"."""
    shown = shown or path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise ShmstageError(f"cannot read {shown}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedError(
                f"source {shown} is {_file_kind(st.st_mode)}, not a directory or a tar archive; "
                f"{WHAT_TO_STAGE}"
            )
        head = os.pread(fd, BLOCK, 0)
    except OSError as e:
        raise ShmstageError(f"cannot read {shown}: {e.strerror}") from None
    finally:
        os.close(fd)
    if not head:
        raise RefusedError(f"source {shown} is an empty file, not a tar archive; {WHAT_TO_STAGE}")
    for comp, magic, label in _READABLE:
        if head.startswith(magic):
            _check_first_block(_first_block(path, comp, label, shown), shown, f"{label} data")
            return Format(comp)
    for magic, what, todo in _OTHER:
        if head.startswith(magic):
            raise RefusedError(f"source {shown} is {what}, which shmstage cannot read; {todo}")
    _check_first_block(head, shown, "a file")
    return Format("")


def _first_block(path: str, comp: str, label: str, shown: str) -> bytes:
    """The first 512 bytes inside a compressed file (a damaged stream is a damaged archive)."""
    # the decompressors only for a compressed file: keeps `shmstage stage DIR` quick to start
    import bz2
    import gzip
    import lzma
    import zlib

    opener = {"gz": gzip.open, "bz2": bz2.open, "xz": lzma.open}[comp]
    try:
        with opener(path, "rb") as f:
            return f.read(BLOCK)
    except (EOFError, OSError, zlib.error, lzma.LZMAError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise ShmstageError(f"cannot read {shown}: {e.strerror}") from None
        raise DamagedArchive(
            f"cannot read tar archive {shown}: damaged at its start: {why(e, Format(comp))}; "
            "re-download or re-create it"
        ) from None


def _check_first_block(block: bytes, shown: str, what: str) -> None:
    if block.count(0) == len(block) and len(block) == BLOCK:
        return  # an empty archive starts with its end-of-archive block
    if len(block) >= 263 and block[257:262] == b"ustar":
        if not checksum_ok(block):
            raise DamagedArchive(
                f"cannot read tar archive {shown}: damaged at offset 0 (the first member's header "
                "checksum is wrong); re-download or re-create it"
            )
        return
    if len(block) == BLOCK and checksum_ok(block):
        return  # an old (v7) header: no magic, but a valid checksum
    if what == "a file":
        raise RefusedError(f"source {shown} is not a tar archive (unknown data); {WHAT_TO_STAGE}")
    raise RefusedError(f"source {shown} holds {what} that is not a tar archive; {WHAT_TO_STAGE}")


def checksum_ok(block: bytes) -> bool:
    """The header checksum (field at 148, 8 bytes, counted as spaces), as tar(1) checks it."""
    if len(block) != BLOCK:
        return False
    field = block[148:156].split(b"\x00", 1)[0].strip()
    try:
        want = int(field, 8)
    except ValueError:
        return False
    unsigned = sum(block) - sum(block[148:156]) + 8 * 0x20
    signed = unsigned - 2 * sum(b for b in block[:148] + block[156:] if b > 127)
    return want in (unsigned, signed)


def _file_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


def why(e: BaseException, fmt: Format) -> str:
    """What a read error of an archive means, in words."""
    if isinstance(e, EOFError) or str(e) == "unexpected end of data":
        if fmt.compression:
            return f"the {fmt.label} stream ends early (truncated)"
        return "the file ends early (truncated)"
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    if fmt.compression and not type(e).__module__.startswith("tarfile"):
        return f"the {fmt.label} stream is corrupt ({text or type(e).__name__})"
    return text or type(e).__name__


def _read_errors() -> tuple[type[BaseException], ...]:
    # only once an archive is read: keeps `shmstage stage DIR` quick to start
    import lzma
    import tarfile
    import zlib

    # bz2 reports a corrupt stream as OSError, gzip as BadGzipFile (an OSError).
    return (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError)


@contextmanager
def reading(archive: str, fmt: Format, where: Callable[[], str]) -> Iterator[None]:
    """Turn a read error of the archive (not of the tree we write) into one DamagedArchive line."""
    try:
        yield
    except _read_errors() as e:
        if isinstance(e, OSError) and e.errno is not None:  # the file, not its content
            raise ShmstageError(f"cannot read tar archive {archive}: {e.strerror}") from None
        raise DamagedArchive(
            f"cannot read tar archive {archive}: damaged {where()}: {why(e, fmt)}; "
            "re-download or re-create it"
        ) from None


def check_end(
    path: str,
    fmt: Format,
    tf: tarfile.TarFile,
    last: tarfile.TarInfo | None,
    error: BaseException | None,
) -> None:
    """Fail unless the listing ended at an end-of-archive block or at the end of the data.

    GNU tar accepts an archive that simply ends after a member's data (no zero
    blocks); it rejects a bad header ("Skipping to next header") and a header cut
    short ("Unexpected EOF"), which tarfile treats as a quiet end of archive."""
    import tarfile  # only once an archive is read

    if error is None or isinstance(error, (tarfile.EOFHeaderError, tarfile.EmptyHeaderError)):
        return
    after = f"after member {last.name!r}" if last is not None else "before any member"
    of = " of the uncompressed tar" if fmt.compression else ""
    if isinstance(error, tarfile.TruncatedHeaderError):
        reason = "the archive ends inside a header (truncated)"
    else:
        detail = "" if str(error) == "invalid header" else f" ({error})"
        reason = f"invalid header{detail}; GNU tar reports this as 'Skipping to next header'"
    raise DamagedArchive(
        f"cannot read tar archive {path}: damaged at offset {tf.offset}{of} ({after}): {reason}; "
        "re-download or re-create it"
    )
