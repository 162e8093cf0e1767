"""The interface every source implements: what a dataset is read from (a local directory, a
tar archive or an object-store prefix).

Each is a :class:`Source`: ``listing`` says what the tree holds (walk.py's entry tuples, and
a change key per file where size+mtime+mode is not one); its files are then filled into
partial/<name>.  The engine's steps (lock, fit, partial, publish, manifest) are written once
above it, in stage/build/ and stage/engine.py; the sources differ only in how they list and
fill:

========== ============================== ====================================== ==============
source      listing                        fill                                   per file
========== ============================== ====================================== ==============
dir         a threaded walk (walk.py)      forked sendfile workers (build/copy.py  yes
                                           via build/fromdir.py), or the cluster
                                           exchange (cluster/)
tar         the archive's checked headers  one streaming extraction               no: whole tree
            (tar.py)                       (build/untar.py)
s3, gs, az  one LIST (s3list.py; gcs.py    GETs from a thread pool, ranged parts  yes
            and azure.py subclass s3.py)   (``Source.fetch``, s3.py)
========== ============================== ====================================== ==============

A source knows nothing of DEST's store or of build/: where build/ writes a kind's files it
looks up its filler by kind (build/partial.py ``filler_of``); the other kinds ``fetch`` their
own.  ``kinds.resolve`` turns what the user typed into a kind and the location the store
records.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

Tick = Callable[[int, int], None]  # (bytes, files) just written


@dataclass(frozen=True)
class Listing:
    """What a source holds: the tree it stages to and what identifies each file's content.

    ``entries`` are walk.py's tuples ``(path, kind, size, mtime_ns, mode, extra)``, "." first
    and parents before children; a directory's mtime of 0 means the source has none (it is
    left as made).  ``keys`` maps each file to its change key (equal keys: same bytes); None
    means the entry's size, mtime and mode are the key.  ``record`` is what the manifest keeps
    besides the entries to tell this version from the next (see ``Source.stamp``)."""

    location: str  # what the store records as the source (a URL without credentials)
    entries: list[tuple]
    keys: dict[str, list[Any]] | None
    bytes: int
    files: int
    atimes: list[int] | None = None  # per entry, where the source keeps access times
    record: dict[str, Any] = field(default_factory=dict)


class Want(NamedTuple):
    """One file to fetch into partial/: ``path`` relative to the tree's root."""

    path: str
    size: int
    mtime_ns: int  # set once the last byte is in (what makes a file count as done)
    mode: int
    key: Any  # its change key from the listing (fetch refuses other content)
    atime_ns: int = -1  # -1: the mtime


class Source:
    """The interface every source implements; the defaults suit a listed, per-file source."""

    kind: str
    location: str
    # Files can be kept one by one: a resume keeps what a killed run fetched and a re-stage
    # hard-links unchanged files.  A source that is not fills the whole tree in ``fetch``.
    incremental = True

    def stamp(self) -> dict[str, Any] | None:
        """Manifest fields that tell, without a listing, that the published copy is current
        (a tar archive's size, mtime and inode); None when only the listing can tell."""
        return None

    def listing(self) -> Listing:
        raise NotImplementedError

    def owner(self, rel: str) -> os.stat_result | None:
        """The source entry whose owner the copy of ``rel`` keeps, or None (copies are ours)."""
        return None

    def group(self, rel: str) -> int | None:
        """The group a user's copy of directory ``rel`` gets (one of the user's), or None."""
        return None

    def fetch(
        self,
        wants: Sequence[Want],
        root: str,
        tick: Tick,
        workers: int | None,
        checksum: bool,
        meanwhile: Callable[[], None] | None = None,
    ) -> Any:
        """Write every wanted file under ``root`` (its directories exist), then set its mode
        and mtime; raise a ShmstageError (nothing half-fetched counts as done) on failure.
        Kinds that build/ fills (a directory, a tar archive) do not implement it; the same
        contract holds for their fillers (build/partial.py ``fill``).
        ``meanwhile()`` is called once while the fetch is under way (the manifest is written
        then).  A source that is not ``incremental`` is handed no ``wants``: it fills the whole
        tree and returns the tree it made (walk.Tree); the others return None."""
        raise NotImplementedError
