"""The staging engine: copy a dataset into tmpfs, exactly, atomically, once.

Layout under DEST (default /dev/shm/shmstage, ``$SHMSTAGE_DEST`` overrides)::

    DEST/<name>/                          the published dataset: exactly the source tree,
                                          nothing added (a real directory, replaced in one
                                          renameat2(RENAME_EXCHANGE) on republish)
    DEST/.shmstage/meta/<name>.json       summary: source, bytes, files, staged_at,
                                          last_used, inode of DEST/<name>
    DEST/.shmstage/manifests/<name>.json  every entry (path, kind, size, mtime_ns, mode, link)
    DEST/.shmstage/locks/<name>.lock      flock held while staging or evicting <name>
                                          (locks/, reservations/, placing/: 0700 in a store
                                          root owns, see store.checks.lock_dir_mode)
    DEST/.shmstage/partial/<name>/        the next version being built (0700; resumed after
                                          a crash, removed on any handled failure)
    DEST/.shmstage/trash/                 old versions on their way out
    DEST/.shmstage/leases/<name>.lease    shared flock held by each job reading <name>
                                          (see :mod:`shmstage.stage.store.leases`)
    DEST/.shmstage/leases/.<name>@<holder>@<pid>   a lease held for pid by another process
                                          (``stage --lease-for``, the service): who it is for
    DEST/.shmstage/reservations/<name>    bytes a live stager still has to write, flocked
                                          while it runs (see :mod:`shmstage.stage.store.reserve`)
    DEST/.shmstage/meta/.<name>.used      last used (its mtime; any job may set it to now)
    DEST/.shmstage/inflight/<name>.<id>   what a live stage adds to a tier with max_size
                                          (see :mod:`shmstage.stage.cache.makeroom`)

A dataset is published when DEST/<name> exists and its inode (on DEST's file system,
whatever that device's number is now) matches the one in its meta record; :func:`find` and :func:`list_staged` return only such copies.
Readers need no lock: they see either no dataset or a complete one.

    from shmstage.stage import stage, find
    ds = stage("/nfs/imagenet")            # StagedDataset(path="/dev/shm/shmstage/imagenet", ...)
    find("imagenet") or find("/nfs/imagenet")

DEST may be an ordered list of tiers, ``/dev/shm/shmstage,/local/nvme/shmstage``: ``stage``
takes the first where the dataset fits (see :mod:`shmstage.stage.engine`, :mod:`shmstage.stage.cache.tiers`
and :mod:`shmstage.stage.cache.makeroom`, docs/cache.md).
"""

from __future__ import annotations

from shmstage.stage.cache.tiers import InTier, Placed, Plan, Skipped, split

# DEST may list tiers (fastest first): these look in, and choose among, all of them.
from shmstage.stage.engine import (
    check_lease_for,
    evict,
    evict_report,
    find,
    gc,
    lease,
    lease_until,
    list_staged,
    plan,
    stage,
    summary,
    verify,
)
from shmstage.stage.signals import Interrupted
from shmstage.stage.staging import Progress
from shmstage.stage.store import DEFAULT_DEST, resolve_dest
from shmstage.stage.store.datasets import Listed, StagedDataset
from shmstage.stage.store.eviction import EvictReport, Leased
from shmstage.stage.store.gc import GcReport, Leftover
from shmstage.stage.store.leases import Holder, InUse, describe, holders
from shmstage.stage.verification import Difference, VerifyReport

__all__ = [
    "DEFAULT_DEST",
    "Difference",
    "EvictReport",
    "GcReport",
    "Holder",
    "InTier",
    "Placed",
    "Plan",
    "Skipped",
    "InUse",
    "Interrupted",
    "Leased",
    "Listed",
    "Leftover",
    "check_lease_for",
    "describe",
    "Progress",
    "StagedDataset",
    "VerifyReport",
    "evict",
    "evict_report",
    "find",
    "gc",
    "holders",
    "lease",
    "lease_until",
    "list_staged",
    "plan",
    "resolve_dest",
    "split",
    "stage",
    "summary",
    "verify",
]
