"""Persisting a tmpfs size in fstab: read it, edit our mount point's line as text, show the
diff, and swap the new file in atomically with a backup.  Only :mod:`shmstage.shm` calls
``write_fstab``, after it has remounted.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import stat
import tempfile

from shmstage import system
from shmstage.errors import PermissionDenied, RefusedError, ShmstageError
from shmstage.sizes import parse_size

# fstab is edited as text, line by line: lines for other mount points are
# passed through untouched (bytes included: read and written with
# surrogateescape), and the line for our mount point only gets its options
# field replaced, so its spacing and comments stay as the admin wrote them.


_FIELD = re.compile(r"\S+")


def read_fstab(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "surrogateescape")
    except FileNotFoundError:
        raise RefusedError(
            f"fstab {path} does not exist; pass an existing file with --fstab"
        ) from None
    except PermissionError:
        raise PermissionDenied(f"cannot read {path}: permission denied; run as root") from None
    except IsADirectoryError:
        raise RefusedError(f"fstab {path} is a directory; pass a file with --fstab") from None


def _same_size(value: str, size_option: str) -> bool:
    try:
        return parse_size(value) == parse_size(size_option)  # 64g == 64G == 65536M
    except ShmstageError:
        return False  # e.g. "50%": rewrite it with the resolved size


def _with_size(options: str, size_option: str) -> str:
    sizes = [o.partition("=")[2] for o in options.split(",") if o.startswith("size=")]
    if len(sizes) == 1 and _same_size(sizes[0], size_option) and "nr_blocks=" not in options:
        return options  # already right: leave the admin's spelling alone
    out: list[str] = []
    placed = False
    for opt in options.split(","):
        key = opt.partition("=")[0]
        if key in ("size", "nr_blocks"):  # nr_blocks= is size= in pages: one of them
            if not placed:
                out.append(f"size={size_option}")
                placed = True
            continue
        if opt:
            out.append(opt)
    if not placed:
        out.append(f"size={size_option}")
    return ",".join(out)


def _same_mountpoint(a: str, b: str) -> bool:
    """Same mount point, also through a symlink (``/dev/shm -> /run/shm``)."""
    a, b = (a.rstrip("/") or "/"), (b.rstrip("/") or "/")
    if a == b:
        return True
    if not (os.path.isabs(a) and os.path.isabs(b)):
        return False  # "none", "swap": not paths
    return os.path.realpath(a) == os.path.realpath(b)


def _with_options(options: str, wanted: tuple[tuple[str, str], ...]) -> str:
    """``options`` with each ``key=value`` of ``wanted`` set (replaced in place, else appended)."""
    out = options.split(",")
    for key, value in wanted:
        spots = [i for i, o in enumerate(out) if o.partition("=")[0] == key]
        if spots:
            out[spots[0]] = f"{key}={value}"
            out = [o for i, o in enumerate(out) if i not in spots[1:]]
        else:
            out.append(f"{key}={value}")
    return ",".join(out)


def edit_fstab(
    text: str,
    mountpoint: str,
    size_option: str,
    *,
    fstab: str = "fstab",
    options: tuple[tuple[str, str], ...] = (),
    new_options: str = "defaults",
) -> str:
    """``text`` with the tmpfs line(s) for ``mountpoint`` set to ``size=size_option`` and
    each ``key=value`` in ``options`` (``mode``, ``mpol``).

    Existing lines keep their other options; a missing line is appended as
    ``tmpfs <mountpoint> tmpfs <new_options>,size=<size>[,options] 0 0``."""
    lines = text.split("\n")
    found = False
    for n, line in enumerate(lines):
        body = line.rstrip("\r")
        if not body.strip() or body.lstrip().startswith("#"):
            continue
        fields = [(m.start(), m.end()) for m in _FIELD.finditer(body)]
        if len(fields) < 2:
            continue
        if not _same_mountpoint(system.unescape_mount_field(body[slice(*fields[1])]), mountpoint):
            continue
        fstype = body[slice(*fields[2])] if len(fields) > 2 else "?"
        if fstype != "tmpfs":
            raise RefusedError(
                f"{fstab} line {n + 1} mounts {mountpoint} as {fstype}, not tmpfs; edit that line by hand"
            )
        if len(fields) > 3:
            start, end = fields[3]
            opts = _with_size(body[start:end], size_option)
            opts = _with_options(opts, options) if options else opts
            body = body[:start] + opts + body[end:]
        else:
            opts = _with_options(f"defaults,size={size_option}", options)
            body = body + f"\t{opts}\t0\t0"
        lines[n] = body + line[len(line.rstrip("\r")) :]
        found = True
    if found:
        return "\n".join(lines)
    if text and not text.endswith("\n"):
        text += "\n"
    opts = _with_options(f"{new_options},size={size_option}", options)
    return text + f"tmpfs {system.escape_mount_field(mountpoint)} tmpfs {opts} 0 0\n"


def has_tmpfs_line(text: str, mountpoint: str) -> bool:
    """Whether fstab ``text`` mounts a tmpfs at ``mountpoint`` (also through a symlink)."""
    for line in text.split("\n"):
        body = line.strip()
        if not body or body.startswith("#"):
            continue
        fields = body.split()
        if len(fields) < 3 or fields[2] != "tmpfs":
            continue
        if _same_mountpoint(system.unescape_mount_field(fields[1]), mountpoint):
            return True
    return False


def fstab_diff(before: str, after: str, path: str) -> str:
    def lines(text: str) -> list[str]:
        return [ln if ln.endswith("\n") else ln + "\n" for ln in text.splitlines(keepends=True)]

    return "".join(difflib.unified_diff(lines(before), lines(after), fromfile=path, tofile=path))


def backup_path(fstab: str) -> str:
    return os.path.realpath(fstab) + ".shmstage.bak"


def _write_atomic(path: str, data: bytes, like: os.stat_result) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory, fsync, rename."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, stat.S_IMODE(like.st_mode))
        if os.geteuid() == 0:
            os.chown(tmp, like.st_uid, like.st_gid)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def write_fstab(path: str, text: str) -> str:
    """Replace fstab atomically with ``text``.

    The first change keeps the fstab as it was in ``<fstab>.shmstage.bak``; later changes
    leave that copy alone, so it stays the admin's original (delete it to take a new one).
    Returns the backup path."""
    real = os.path.realpath(path)  # a symlinked fstab stays a symlink
    try:
        st = os.stat(real)
        with open(real, "rb") as f:
            old = f.read()
        backup = backup_path(path)
        if not os.path.lexists(backup):
            _write_atomic(backup, old, st)
        _write_atomic(real, text.encode("utf-8", "surrogateescape"), st)
    except PermissionError:
        raise PermissionDenied(
            f"cannot write {path}: permission denied; run as root (sudo shmstage remount ... --persist)"
        ) from None
    except OSError as e:
        raise ShmstageError(
            f"cannot write {path}: {e.strerror}; fstab was left as it was"
        ) from None
    return backup
