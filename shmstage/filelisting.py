"""Where ``DatasetFiles`` (datasetfiles.py) finds a path's files when no view lists them, and
which copy a path is in: the staged copy a path lies in (a subdirectory, a symlink), and the
walk of a plain directory or of a copy all in RAM."""

from __future__ import annotations

import os
import stat
import warnings
from contextlib import suppress

from shmstage.errors import ShmstageError, ShmstageWarning

__all__ = ["copy_of", "walk"]


def copy_of(path: str) -> tuple[str, str, str]:
    """(DEST, name, the path below DEST/<name> or ".") of a staged copy that ``path`` is or
    lies in (through symlinks too; the copy may not exist yet while a view lists it), else
    (parent, basename, ".") for a plain directory."""
    from shmstage.stage.store.leases import locate  # the store's rule for "inside a copy"

    where = locate(path)
    if where is not None:
        top = os.path.join(*where)
        for candidate in (path, os.path.realpath(path)):
            if candidate == top or candidate.startswith(top + "/"):
                return where[0], where[1], os.path.relpath(candidate, top)
    return (*os.path.split(path), ".")


def walk(top: str) -> tuple[tuple[str, ...], list[int]]:
    """Every regular file below ``top``, sorted by relative path.  Symlinks are not followed,
    as the stager lists a copy (views, manifests): the names are the same whether the copy is
    whole, partial or live.  Skipping them is said once (ImageFolder would follow them)."""
    if not os.path.isdir(top):
        raise ShmstageError(
            f"{top} is not a directory, nor in a staged dataset (DEST/NAME) being copied"
        )
    found: list[tuple[str, int]] = []
    links = 0

    def fail(e: OSError) -> None:
        raise ShmstageError(f"cannot list {e.filename}: {e.strerror}")

    for root, dirs, files in os.walk(top, onerror=fail):
        for f in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            full = os.path.join(root, f)
            with suppress(FileNotFoundError):
                st = os.lstat(full)
                if stat.S_ISREG(st.st_mode):
                    found.append((os.path.relpath(full, top), st.st_size))
                elif stat.S_ISLNK(st.st_mode):
                    links += 1
    if links:
        warnings.warn(
            f"{top}: {links} symlink(s) not followed (DatasetFiles reads regular files "
            "only, as a staged copy lists them; ImageFolder would follow them)",
            ShmstageWarning,
            stacklevel=3,
        )
    found.sort()
    return tuple(n for n, _ in found), [s for _, s in found]
