"""``gc``: remove what killed and failed runs left under DEST, but nothing a live process owns.

Partial trees, killed stagers' live views and the views of datasets that are gone
(views.py), source markers, ``.<name>.json.new`` manifests, half-written records, lock and
lease files of datasets that are gone, space reservations of dead stagers, records whose tree
is gone, old trees in trash, ``placing/`` locks nobody holds, the max_size claims of dead
stagers, the "held for" marks of lease holders that are gone, and the read counters
(served.py) of datasets that are gone, with anything in served/ that is not a counter.  Each
dataset's leftovers are removed only while holding its lock (taken without waiting: a dataset
being staged is skipped), so gc is safe while others stage.
"""

from __future__ import annotations

import os
from contextlib import suppress
from dataclasses import dataclass

from shmstage.errors import RefusedError
from shmstage.stage.store import inflight, leases, served, views
from shmstage.stage.store.layout import Store
from shmstage.stage.store.locks import Busy, alive, running, trash_owner
from shmstage.stage.store.names import check_name
from shmstage.stage.store.trees import cannot_remove, listdir, rmtree, tree_size


@dataclass(frozen=True)
class Leftover:
    path: str  # absolute
    what: str  # "partial tree", "marker", "manifest", "record", "lock", "lease", "trash", ...
    bytes: int  # data in a tree (0 for bookkeeping files)
    reason: str = ""  # skipped: why


@dataclass(frozen=True)
class GcReport:
    dest: str
    dry_run: bool  # nothing was removed
    removed: tuple[Leftover, ...]  # dry_run: what would be removed
    skipped: tuple[Leftover, ...]  # owned by a live process

    @property
    def bytes(self) -> int:
        return sum(x.bytes for x in self.removed)


def gc(dest: str | os.PathLike[str] | None = None, *, dry_run: bool = False) -> GcReport:
    """Remove leftovers nobody alive owns (see the module docstring)."""
    store = Store(dest)
    if not os.path.lexists(store.book):
        return GcReport(store.dest, dry_run, (), ())
    store.open(create=False)
    removed: list[Leftover] = []
    skipped: list[Leftover] = []
    for name in sorted(_names(store)):
        items = _items(store, name)
        if not items:
            continue
        had_lock = os.path.lexists(store.lock_path(name))
        try:
            with store.lock(name, wait=False):
                if not dry_run:
                    store.recover(name)
                    views.settle(store, name)  # a kill between a copy and its view
                items = _items(store, name)  # after recovery
                published = store.published(name) is not None
                kept = False
                for path, what in items:
                    if published and what in (
                        "record",
                        "manifest",
                        "used",
                        "lease",
                        "lock",
                        "view",
                    ):
                        continue  # the dataset's own bookkeeping
                    if what == "lock":
                        continue  # handled last, below
                    if what == "lease":
                        fd, holders = leases.try_exclusive(store, name)
                        if holders:
                            kept = True
                            skipped.append(
                                Leftover(path, what, 0, f"leased by {leases.describe(holders)}")
                            )
                            continue
                        try:
                            removed.append(Leftover(path, what, 0))
                            if not dry_run:
                                leases.unlink_locked(store, name)
                        finally:
                            if fd is not None:
                                os.close(fd)
                        continue
                    if dry_run and published and what in ("next record", "next manifest"):
                        continue  # a real run finishes this publish instead
                    size = tree_size(path)[0] if what.endswith("tree") else 0
                    removed.append(Leftover(path, what, size))
                    if not dry_run:
                        _remove(path)
                if not published and not kept and (dry_run or not _items(store, name, lock=False)):
                    if had_lock:
                        removed.append(Leftover(store.lock_path(name), "lock", 0))
                    if not dry_run:
                        store.drop_lock(name)
                if dry_run and not had_lock:
                    store.drop_lock(name)  # the one taking the lock just made: change nothing
        except Busy as e:
            for path, what in items:
                if what not in ("record", "manifest", "used", "lease", "lock"):
                    skipped.append(Leftover(path, what, 0, str(e)))
    for entry in listdir(store.trash_dir):
        path = os.path.join(store.trash_dir, entry)
        _, pid, start = trash_owner(entry)
        size = tree_size(path)[0]
        # Our own pid: ours (a removal of this process that failed), or, whatever the start
        # time says, a dead process's (one pid cannot name two live processes): removable.
        if pid is not None and pid != os.getpid() and alive(pid, start):
            skipped.append(Leftover(path, "trash", size, f"being removed by pid {pid}"))
            continue
        removed.append(Leftover(path, "trash", size))
        if not dry_run:
            _remove(path)
    for m in leases.marks(store):  # "held for pid N" marks of processes that are gone
        if not running(*m.owner):  # a zombie reads no more; its holder lets go soon
            removed.append(Leftover(m.path, "lease mark", 0))
            if not dry_run:
                leases.unmark(m.path)
    for entry in store.placing_names():  # the tiers' placing locks: only while a stager places
        path = store.placing_path(entry)
        if not store.drop_placing(entry, dry_run=dry_run):
            skipped.append(Leftover(path, "placing lock", 0, "held by a stager placing it"))
        else:
            removed.append(Leftover(path, "placing lock", 0))
    for path in views.dead_leftovers(store):  # a killed live stager's socket, a half view
        removed.append(Leftover(path, "view leftover", 0))
        if not dry_run:
            _remove(path)
    kept = {n for n in store.names() if store.published(n) is not None}
    kept.update(views.view_names(store))  # a copy being made, a partial one: read too
    for path in served.leftovers(store.book, kept):  # counters of datasets gone, and junk
        if not dry_run:
            try:
                os.unlink(path)
            except OSError:  # another user's, in a store of ours: theirs to keep
                continue
        removed.append(Leftover(path, "read counters", 0))
    dead, looked = inflight.reap_claims(store, dry_run=dry_run)
    removed += [Leftover(path, "max_size claim", 0) for path in dead]
    if not looked:
        path = os.path.join(store.book, inflight.IN_FLIGHT)
        skipped.append(
            Leftover(path, "max_size claims", 0, "a stager is planning against max_size")
        )
    return GcReport(store.dest, dry_run, tuple(removed), tuple(skipped))


def _names(store: Store) -> set[str]:
    """Every name any bookkeeping file or tree refers to."""
    names: set[str] = set(store.names())
    for entry in listdir(store.partial_dir):
        names.add(entry[1 : -len(".source")] if entry.endswith(".source") else entry)
    for entry in listdir(store.manifest_dir):
        names.add(_strip(entry))
    for entry in listdir(store.meta_dir):
        names.add(_strip(entry))
    for entry in listdir(store.lock_dir):
        names.add(entry.removesuffix(".lock"))
    for entry in listdir(store.lease_dir):
        names.add(entry.removesuffix(".lease"))
    names.update(listdir(store.reservation_dir))
    names.update(views.view_names(store))
    out = set()
    for n in names:
        with suppress(RefusedError):
            out.add(check_name(n))
    return out


def _strip(entry: str) -> str:
    """meta/manifest file name -> dataset name."""
    base = entry.lstrip(".")
    for suffix in (".next.json", ".json.new", ".json", ".used"):
        if suffix in base:
            return base[: base.index(suffix)]
    return base


def _items(store: Store, name: str, *, lock: bool = True) -> list[tuple[str, str]]:
    """(path, what) of every file or tree of ``name`` in the bookkeeping (not DEST/<name>)."""
    found: list[tuple[str, str]] = []

    def add(path: str, what: str) -> None:
        if os.path.lexists(path):
            found.append((path, what))

    add(store.partial(name), "partial tree")
    view = views.read_view(store.dest, name)
    if view is not None and view.kind == views.LIVE and not view.alive():
        found.append((view.path, "live view"))  # a killed stager's
    tree = store.path(name)
    if (
        os.path.isdir(tree)
        and not os.path.islink(tree)
        and (store.read_record(name) or store.read_next(name))
        and store.published(name) is None
    ):
        found.append((tree, "unpublished tree"))  # ours (it has a record), matched by none
    add(os.path.join(store.partial_dir, f".{name}.source"), "marker")
    add(store.new_manifest_path(name), "next manifest")
    add(store.next_path(name), "next record")
    for d in (store.meta_dir, store.manifest_dir):
        for entry in listdir(d):
            # half-written JSON: <file>.<pid>.tmp (writes happen under the dataset's lock)
            if entry.endswith(".tmp") and _strip(entry) == name:
                found.append((os.path.join(d, entry), "temporary file"))
    add(store.meta_path(name), "record")
    add(store.manifest_path(name), "manifest")
    add(os.path.join(store.meta_dir, f".{name}.used"), "used")
    add(leases.lease_path(store, name), "lease")
    if view is not None and view.kind == views.PARTIAL:  # kept while its copy is published
        found.append((view.path, "view"))
    for path in (store.view_path(name), views.next_path(store, name)):
        if os.path.lexists(path) and (view is None or view.path != path):
            found.append((path, "stale view"))  # over no tree it describes (a kill's)
    # a stager reserves under the dataset's lock: with the lock ours, its stager is dead
    add(os.path.join(store.reservation_dir, name), "reservation")
    if lock:
        add(store.lock_path(name), "lock")
    return found


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        try:
            rmtree(path)
        except OSError as e:
            raise cannot_remove(e, path) from None
    else:
        with suppress(FileNotFoundError):
            os.unlink(path)
