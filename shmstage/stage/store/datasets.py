"""What callers get for a dataset: the published copy's view, and a ``list`` row.

Built from a store's record (layout.py); the staging engine, leases and the tiers return these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shmstage.stage.store.layout import Record, Store


@dataclass(frozen=True)
class StagedDataset:
    """A complete, published copy of a dataset."""

    name: str
    source: str
    path: str  # DEST/<name>: exactly the source tree
    bytes: int
    files: int
    staged_at: float  # epoch seconds of the last (re)publish
    last_used: float  # epoch seconds of the last stage()/find() that returned it
    changed: bool = False  # this call copied something
    copied_bytes: int = 0
    seconds: float = 0.0  # this call's wall time (list(): the last staging's)
    # ``stage --partial``: the fraction of the dataset's bytes in RAM (bytes/files: that part;
    # total_bytes/total_files: all of it, the rest read from the source by DatasetFiles)
    resident: float = 1.0
    total_bytes: int | None = None
    total_files: int | None = None


@dataclass(frozen=True)
class Listed(StagedDataset):
    """What ``list_staged`` returns: a dataset, and (with ``unfinished``) the leftovers too."""

    # unfinished: path is the partial tree, bytes/files are so far; trash: an old tree
    state: str = "staged"  # "staged", "unfinished" (in progress or killed) or "trash"
    stager_alive: bool = False  # unfinished/trash: a live process owns it
    stager_pid: int | None = None  # that process
    leased_by: tuple[int, ...] = ()  # pids holding a lease (see shmstage.stage.store.leases)


def dataset_of(record: Record, store: Store, **kw: Any) -> StagedDataset:
    """The caller's view of a published record."""
    return StagedDataset(
        name=record.name,
        source=record.source,
        path=store.path(record.name),
        bytes=record.bytes,
        files=record.files,
        staged_at=record.staged_at,
        last_used=record.last_used,
        resident=resident_fraction(record),
        total_bytes=record.total_bytes,
        total_files=record.total_files,
        **kw,
    )


def resident_fraction(record: Record) -> float:
    """The fraction of the dataset's bytes in RAM: 1.0 but for a ``stage --partial`` copy."""
    if record.total_bytes is None:
        return 1.0
    return record.bytes / record.total_bytes if record.total_bytes else 1.0
