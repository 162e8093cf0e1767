"""Persistent counters of one DEST (a tier): stage hits and misses, bytes copied, evictions.

They live in ``DEST/.shmstage/counters.json`` and survive restarts, so Prometheus sees
monotonic counters.  Every update is a read-modify-write under a flock of ``locks/.counters`` and
lands by atomic rename, so concurrent stagers never lose an increment and a reader never
sees half a file.  Best effort: a caller that may not write DEST counts nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import suppress
from dataclasses import dataclass

from shmstage.stage.store.layout import Store

FILENAME = "counters.json"
LOCKNAME = ".counters"  # DEST/.shmstage/locks/.counters: held while updating them


@dataclass(frozen=True)
class Counters:
    hits: int = 0  # stage found the dataset already staged and current
    misses: int = 0  # stage had to copy (all of it, or what changed)
    copied_bytes: int = 0  # bytes those stages copied
    evictions: int = 0  # datasets removed by evict or make-room


def read(dest: str | os.PathLike[str]) -> Counters:
    """The counters of ``dest`` (zeros when it has none yet)."""
    path = os.path.join(Store(dest).book, FILENAME)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return Counters()
    if not isinstance(data, dict):
        return Counters()
    values = {
        k: int(data[k])
        for k in Counters.__dataclass_fields__
        if isinstance(data.get(k), int) and data[k] >= 0
    }
    return Counters(**values)


def add_stage(dest: str | os.PathLike[str], changed: bool, copied_bytes: int) -> None:
    """Count one stage into ``dest``: a miss and the bytes it copied, or a hit (current)."""
    if changed:
        add(dest, misses=1, copied_bytes=copied_bytes)
    else:
        add(dest, hits=1)


def add(dest: str | os.PathLike[str], **increments: int) -> None:
    """Add ``increments`` (e.g. ``hits=1``) to the counters of ``dest``, atomically."""
    unknown = set(increments) - set(Counters.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown counters {sorted(unknown)}")
    book = Store(dest).book
    if not os.path.isdir(book):
        return
    if not os.access(book, os.W_OK):
        return  # a reader who may not write DEST
    # A file only the store's owner may open (not DEST/.shmstage itself, which anyone may
    # open and flock: every stager would wait on them for ever).
    try:
        lock = os.open(
            os.path.join(book, "locks", LOCKNAME),
            os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
    except OSError:
        return  # best effort: no locks/ directory (yet), or a full tmpfs
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = read(dest).__dict__
        new = {k: now[k] + increments.get(k, 0) for k in now}
        path = os.path.join(book, FILENAME)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(new, f)
            os.chmod(tmp, 0o644)
            os.rename(tmp, path)
        except OSError:
            with suppress(OSError):
                os.unlink(tmp)
    finally:
        os.close(lock)
