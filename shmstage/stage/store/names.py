"""Where DEST is and what a dataset may be called: the default DEST, the bookkeeping
directory's name, and the checks and defaults for dataset names."""

from __future__ import annotations

import os
import re

from shmstage.errors import RefusedError

DEFAULT_DEST = "/dev/shm/shmstage"
BOOK = ".shmstage"

# \Z, not "$": "$" also matches before a final newline ("ds\n" is not "ds"); no leading
# "-" (it reads as an option on the job's command line) or "." (hidden, "..")
NAME_RE = re.compile(r"^[A-Za-z0-9_+][A-Za-z0-9._+-]{0,199}\Z")


def resolve_dest(dest: str | os.PathLike[str] | None) -> str:
    """``dest``, else ``$SHMSTAGE_DEST``, else /dev/shm/shmstage, as an absolute path
    (of a list of tiers, the first)."""
    chosen = (
        os.fspath(dest) if dest is not None else os.environ.get("SHMSTAGE_DEST") or DEFAULT_DEST
    )
    # A comma separates storage tiers (tiers.py); an operation on one DEST takes the first.
    chosen = chosen.split(",", 1)[0].strip() or DEFAULT_DEST
    return os.path.abspath(os.path.expanduser(chosen))


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name):
        raise RefusedError(
            f"invalid dataset name {name!r}: use letters, digits, '.', '_', '-' or '+' "
            "(at most 200, not starting with '.' or '-')"
        )
    return name


def name_for(source: str) -> str:
    """The default name: the source's base name without an archive suffix, made safe."""
    base = os.path.basename(source.rstrip("/")) or "root"
    for suffix in (".tar.gz", ".tar.bz2", ".tar.xz", ".tgz", ".tar"):
        if base.endswith(suffix) and len(base) > len(suffix):
            base = base[: -len(suffix)]
            break
    base = re.sub(r"[^A-Za-z0-9._+-]", "_", base).lstrip(".-") or "dataset"
    return base[:200]
