"""``evict`` in one store: remove published datasets under their locks, refusing (or, with
``force``, overriding) the leases jobs hold on them; ``all`` also runs gc."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from shmstage.errors import RefusedError, ShmstageError
from shmstage.stage.store import leases, views
from shmstage.stage.store.gc import gc
from shmstage.stage.store.layout import Store
from shmstage.stage.store.leases import Holder
from shmstage.stage.store.names import check_name
from shmstage.stage.store.partial import remove_marker
from shmstage.stage.store.trees import cannot_remove


@dataclass(frozen=True)
class Leased:
    """A dataset jobs hold leases on, and who (see :mod:`shmstage.stage.store.leases`)."""

    name: str
    holders: tuple[Holder, ...]  # the processes holding its lease


@dataclass(frozen=True)
class EvictReport:
    evicted: tuple[str, ...]  # names removed (dry_run: that would be)
    in_use: tuple[Leased, ...] = ()  # skipped: leased by a running job (--all, --older-than)
    forced: tuple[Leased, ...] = ()  # removed anyway (force): these jobs will fail
    dry_run: bool = False  # nothing was removed


def evict(
    name: str | None = None,
    *,
    dest: str | os.PathLike[str] | None = None,
    all: bool = False,
    older_than: float | None = None,
    dry_run: bool = False,
    force: bool = False,
) -> list[str]:
    """Remove staged datasets (one by name, all, or those unused for ``older_than`` seconds);
    returns the names removed.  See :func:`evict_report` for what was skipped."""
    report = evict_report(
        name, dest=dest, all=all, older_than=older_than, dry_run=dry_run, force=force
    )
    return list(report.evicted)


def evict_report(
    name: str | None = None,
    *,
    dest: str | os.PathLike[str] | None = None,
    all: bool = False,
    older_than: float | None = None,
    dry_run: bool = False,
    force: bool = False,
) -> EvictReport:
    """Remove staged datasets.  A dataset a job leases is refused by name (``leases.InUse``)
    and skipped by ``all``/``older_than`` (listed in ``in_use``), unless ``force``.
    ``all`` also runs :func:`shmstage.stage.store.gc.gc`: only the empty skeleton stays."""
    chosen = sum(x for x in (name is not None, bool(all), older_than is not None))
    if chosen != 1:
        raise RefusedError("evict needs exactly one of NAME, --all or --older-than")
    store = Store(dest)
    if not os.path.lexists(store.book):
        if name is not None:
            raise ShmstageError(f"{name} is not staged in {store.dest} (see `shmstage list`)")
        return EvictReport((), dry_run=dry_run)
    store.open(create=False)
    if name is not None:
        check_name(name)
        if not (
            store.read_record(name)
            or store.read_next(name)
            or os.path.lexists(store.path(name))
            or os.path.lexists(store.partial(name))
        ):
            raise ShmstageError(f"{name} is not staged in {store.dest} (see `shmstage list`)")
        targets = [name]
    else:
        now = time.time()
        targets = []
        for n in store.names():
            r = store.read_record(n) or store.read_next(n)
            if r is None:
                continue
            if all or now - max(r.last_used, r.staged_at) >= (older_than or 0):
                targets.append(n)
    evicted: list[str] = []
    in_use: list[Leased] = []
    forced: list[Leased] = []
    for n in targets:
        if dry_run:
            holders = leases.holders(n, store.dest)
            if holders and not force:
                if name is not None:
                    raise leases.InUse(n, holders)
                in_use.append(Leased(n, holders))
            else:
                evicted.append(n)
            continue
        try:
            with store.lock(n, wait=False):
                # With the file in place, a lease taken from now on is seen below, or waits
                # for us and then finds the dataset gone.
                leases.ensure_file(store, n)
                fd, holders = leases.try_exclusive(store, n)
                try:
                    if holders:
                        if not force:
                            raise leases.InUse(n, holders)
                        forced.append(Leased(n, holders))
                    store.check_published(n)
                    try:
                        store.discard(store.path(n))
                        store.discard(store.partial(n))
                    except OSError as e:
                        raise cannot_remove(e, e.filename or store.path(n)) from None
                    remove_marker(os.path.join(store.partial_dir, f".{n}.source"))
                    store.forget(n)
                    views.remove_view(store, n)  # a --partial copy's
                    leases.unlink_locked(store, n)
                    store.drop_lock(n)  # nothing of the dataset is left behind
                    store.drop_placing(n)
                finally:
                    if fd is not None:
                        os.close(fd)
        except leases.InUse as e:
            if name is not None:
                raise
            in_use.append(Leased(n, e.holders))
            continue
        except RefusedError:
            if name is not None:
                raise
            continue  # being staged right now: in use, not ours to remove
        evicted.append(n)
    if all and not dry_run:
        gc(store.dest)  # leftovers of killed runs: partial trees, markers, trash, stale files
    return EvictReport(tuple(evicted), tuple(in_use), tuple(forced), dry_run)
