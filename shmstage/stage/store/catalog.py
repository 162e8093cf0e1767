"""What one store holds, read without a lock: a published dataset by name or source, and
every dataset (with ``unfinished``, also partial trees and trash) for ``list``."""

from __future__ import annotations

import os
from collections.abc import Callable

from shmstage.errors import RefusedError
from shmstage.stage.store import leases
from shmstage.stage.store.datasets import Listed, StagedDataset, dataset_of
from shmstage.stage.store.layout import Store
from shmstage.stage.store.locks import alive, trash_owner
from shmstage.stage.store.names import check_name
from shmstage.stage.store.partial import read_marker
from shmstage.stage.store.trees import listdir, tree_size


def find(
    name_or_source: str | os.PathLike[str],
    dest: str | os.PathLike[str] | None = None,
    *,
    locate: Callable[[str], str],
) -> StagedDataset | None:
    """The complete published copy of a dataset, by name or by source path; None if not staged.
    ``locate`` turns a source path or URL into the one its record holds (the sources' own
    ``location_of``: a store knows nothing of sources)."""
    key = os.fspath(name_or_source)
    store = Store(dest)
    if not os.path.lexists(store.book):
        return None
    store.open(create=False)
    record = None
    if "/" not in key:
        try:
            record = store.published(check_name(key))
        except RefusedError:
            record = None
    if record is None and (os.sep in key or os.path.exists(key)):
        source = locate(key)
        for n in store.names():
            r = store.published(n)
            if r is not None and r.source == source:
                record = r
                break
    if record is None:
        return None
    return dataset_of(store.touch(record), store)


def list_staged(
    dest: str | os.PathLike[str] | None = None, *, unfinished: bool = False
) -> list[Listed]:
    """Every complete published dataset under DEST, by name; with ``unfinished``, also the
    partial copies (in progress or left by a killed run) and old trees still in trash."""
    store = Store(dest)
    if not os.path.lexists(store.book):
        return []
    store.open(create=False)
    out = []
    for n in store.names():
        r = store.published(n)
        if r is not None:
            leased = tuple(h.pid for h in leases.holders(n, store.dest))
            out.append(Listed(**dataset_of(r, store, seconds=r.seconds).__dict__, leased_by=leased))
    if unfinished:
        out.extend(_leftovers(store))
    return out


def _leftovers(store: Store) -> list[Listed]:
    out = []
    for entry in listdir(store.partial_dir):
        path = os.path.join(store.partial_dir, entry)
        if entry.startswith(".") or not os.path.isdir(path) or os.path.islink(path):
            continue
        source = read_marker(os.path.join(store.partial_dir, f".{entry}.source")) or ""
        pids = _lock_holders(store, entry)
        size, files = tree_size(path)
        out.append(
            Listed(
                entry, source, path, size, files, 0.0, 0.0, state="unfinished",
                stager_alive=bool(pids), stager_pid=pids[0] if pids else None,
            )
        )  # fmt: skip
    for entry in listdir(store.trash_dir):
        path = os.path.join(store.trash_dir, entry)
        name, pid, start = trash_owner(entry)
        size, files = tree_size(path)
        live = pid is not None and alive(pid, start)
        out.append(
            Listed(
                name, "", path, size, files, 0.0, 0.0, state="trash",
                stager_alive=live, stager_pid=pid if live else None,
            )
        )  # fmt: skip
    return out


def _lock_holders(store: Store, name: str) -> tuple[int, ...]:
    """Pids holding the dataset's lock (a live stager or evict), from /proc/locks."""
    try:
        st = os.lstat(store.lock_path(name))
    except OSError:
        return ()
    return tuple(h.pid for h in leases.holders_of(st.st_dev, st.st_ino))
