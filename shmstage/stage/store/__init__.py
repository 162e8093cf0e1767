"""Everything on disk under DEST: names and layout, records and manifests, locks, leases,
reservations, max_size claims, counters, access rules and gc.

The lowest part of the staging engine: it imports nothing from the sources, the build, the
cache or the engine.  What the parts above use of the layout is re-exported here.
"""

from __future__ import annotations

from shmstage.stage.store.layout import Record, Store, managed_by
from shmstage.stage.store.locks import Busy, alive, trash_owner
from shmstage.stage.store.names import (
    BOOK,
    DEFAULT_DEST,
    NAME_RE,
    check_name,
    name_for,
    resolve_dest,
)
from shmstage.stage.store.trees import cannot_remove, listdir, rmtree, tree_size

__all__ = [
    "BOOK",
    "DEFAULT_DEST",
    "NAME_RE",
    "Busy",
    "Record",
    "Store",
    "alive",
    "cannot_remove",
    "check_name",
    "listdir",
    "managed_by",
    "name_for",
    "resolve_dest",
    "rmtree",
    "trash_owner",
    "tree_size",
]
