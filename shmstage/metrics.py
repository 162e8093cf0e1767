"""The node cache in Prometheus' text format, for node_exporter's textfile collector.

``collect`` reads every tier (file system size/used/free, each dataset's bytes, files,
last use and leases, and the persistent counters of stage/store/counters.py); ``render`` writes
the exposition format; ``write_textfile`` replaces ``DIR/shmstage.prom`` by atomic rename,
as node_exporter asks, so a scrape never reads half a file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass

from shmstage import system
from shmstage.errors import ShmstageError
from shmstage.stage.cache import makeroom
from shmstage.stage.cache.makeroom import CachePolicy
from shmstage.stage.cache.tiers import split
from shmstage.stage.store import Store, counters, leases, served, views
from shmstage.stage.store.counters import Counters

FILENAME = "shmstage.prom"


@dataclass(frozen=True)
class TierMetrics:
    tier: str  # the tier's directory
    index: int  # 0: the fastest
    fstype: str  # of the file system holding it ("tmpfs", "xfs", ...)
    size: int  # bytes of the tier's file system
    used: int  # bytes used on it (by anything)
    free: int  # bytes free on it
    datasets: int  # published datasets in the tier
    max_size: int | None  # the cache's max_size in bytes, when configured
    counters: Counters  # persistent since the tier was created (stage/store/counters.py)


@dataclass(frozen=True)
class DatasetMetrics:
    tier: str  # the tier it is in
    name: str
    bytes: int  # apparent size of its data
    files: int
    staged_at: float  # epoch seconds of the last (re)stage
    last_used: float  # epoch seconds of the last stage, find or lease (the LRU order)
    leases: int  # processes holding a lease now


@dataclass(frozen=True)
class ServedMetrics:
    tier: str
    name: str  # the dataset (published or not: a copy being made is read too)
    ram: int  # bytes jobs read through DatasetFiles from the copy in RAM
    source: int  # ... and from the source (a copy still running, or a partial one)


@dataclass(frozen=True)
class Metrics:
    tiers: tuple[TierMetrics, ...]  # fastest first
    datasets: tuple[DatasetMetrics, ...]  # published datasets of every tier
    served: tuple[ServedMetrics, ...] = ()  # counted by jobs (stage/store/served.py)


def collect(
    dest: str | os.PathLike[str] | None = None,
    policies: Mapping[str, CachePolicy] | None = None,
) -> Metrics:
    """Read-only: the numbers of every tier of ``dest`` and of each dataset in it."""
    tiers: list[TierMetrics] = []
    datasets: list[DatasetMetrics] = []
    reads: list[ServedMetrics] = []
    for index, tier in enumerate(split(dest)):
        where = tier
        while not os.path.exists(where) and os.path.dirname(where) != where:
            where = os.path.dirname(where)
        usage = system.disk_usage(where)
        mount = system.mount_of(where)
        store = Store(tier)
        rows = []
        if os.path.lexists(store.book):
            for n in store.names():
                r = store.published(n)
                if r is None:
                    continue
                held = len(leases.holders(n, tier))
                rows.append(
                    DatasetMetrics(
                        tier, n, r.bytes, r.files, r.staged_at, max(r.last_used, r.staged_at), held
                    )
                )
        datasets.extend(rows)
        if os.path.lexists(store.book):
            # Only datasets the store knows: names in served/ are made by jobs (NOTE [served])
            known = {r.name for r in rows} | set(views.view_names(store))
            for n, (ram, source) in sorted(served.totals(store.book, known).items()):
                reads.append(ServedMetrics(tier, n, ram, source))
        tiers.append(
            TierMetrics(
                tier,
                index,
                mount.fstype if mount else "unknown",
                usage.total,
                usage.used,
                usage.free,
                len(rows),
                makeroom.max_bytes((policies or {}).get(tier), tier),
                counters.read(tier),
            )
        )
    return Metrics(tuple(tiers), tuple(datasets), tuple(reads))


_HELP = {
    "shmstage_tier_size_bytes": ("gauge", "Size of the file system holding the tier."),
    "shmstage_tier_used_bytes": ("gauge", "Used bytes on the file system holding the tier."),
    "shmstage_tier_free_bytes": ("gauge", "Free bytes on the file system holding the tier."),
    "shmstage_tier_datasets": ("gauge", "Datasets staged in the tier."),
    "shmstage_tier_max_size_bytes": ("gauge", "The tier's cache max_size (where configured)."),
    "shmstage_dataset_bytes": ("gauge", "Bytes of data in a staged dataset."),
    "shmstage_dataset_files": ("gauge", "Files in a staged dataset."),
    "shmstage_dataset_staged_timestamp_seconds": ("gauge", "When the dataset was last (re)staged."),
    "shmstage_dataset_last_used_timestamp_seconds": (
        "gauge",
        "When the dataset was last staged, found or leased (the LRU order).",
    ),
    "shmstage_dataset_leases": ("gauge", "Processes holding a lease on the dataset now."),
    "shmstage_stage_hits_total": ("counter", "Stages that found the dataset already staged."),
    "shmstage_stage_misses_total": ("counter", "Stages that copied (all or what changed)."),
    "shmstage_copied_bytes_total": ("counter", "Bytes copied into the tier by stage."),
    "shmstage_evictions_total": ("counter", "Datasets evicted from the tier (evict, make-room)."),
    "shmstage_served_bytes_total": (
        "counter",
        "Bytes jobs read through DatasetFiles, from the copy in RAM or from the source.",
    ),
}


def render(m: Metrics) -> str:
    """The Prometheus text exposition format (version 0.0.4)."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {k: [] for k in _HELP}
    for t in m.tiers:
        lab = {"tier": t.tier, "index": str(t.index), "fstype": t.fstype}
        samples["shmstage_tier_size_bytes"].append((lab, t.size))
        samples["shmstage_tier_used_bytes"].append((lab, t.used))
        samples["shmstage_tier_free_bytes"].append((lab, t.free))
        samples["shmstage_tier_datasets"].append((lab, t.datasets))
        if t.max_size is not None:
            samples["shmstage_tier_max_size_bytes"].append((lab, t.max_size))
        short = {"tier": t.tier}
        samples["shmstage_stage_hits_total"].append((short, t.counters.hits))
        samples["shmstage_stage_misses_total"].append((short, t.counters.misses))
        samples["shmstage_copied_bytes_total"].append((short, t.counters.copied_bytes))
        samples["shmstage_evictions_total"].append((short, t.counters.evictions))
    for d in m.datasets:
        lab = {"tier": d.tier, "name": d.name}
        samples["shmstage_dataset_bytes"].append((lab, d.bytes))
        samples["shmstage_dataset_files"].append((lab, d.files))
        samples["shmstage_dataset_staged_timestamp_seconds"].append((lab, d.staged_at))
        samples["shmstage_dataset_last_used_timestamp_seconds"].append((lab, d.last_used))
        samples["shmstage_dataset_leases"].append((lab, d.leases))
    for r in m.served:
        for where, value in (("ram", r.ram), ("source", r.source)):
            lab = {"tier": r.tier, "dataset": r.name, "from": where}
            samples["shmstage_served_bytes_total"].append((lab, value))
    lines = []
    for name, (kind, text) in _HELP.items():
        if not samples[name]:
            continue
        lines.append(f"# HELP {name} {text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples[name]:
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{inner}}} {_number(value)}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def write_textfile(directory: str | os.PathLike[str], text: str, filename: str = FILENAME) -> str:
    """Replace ``directory/filename`` with ``text`` in one rename; returns its path.  The
    temporary file starts with a dot and lacks ``.prom``: the collector never reads it."""
    where = os.fspath(directory)
    if not os.path.isdir(where):
        raise ShmstageError(
            f"textfile directory {where} does not exist; create it, or pass the directory "
            "node_exporter reads (its --collector.textfile.directory)"
        )
    path = os.path.join(where, filename)
    tmp = os.path.join(where, f".{filename}.{os.getpid()}.{time.monotonic_ns()}")
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # node_exporter runs as its own user
        os.rename(tmp, path)
    except OSError as e:
        with suppress(OSError):
            os.unlink(tmp)
        raise ShmstageError(f"cannot write {path}: {e.strerror}") from None
    return path
