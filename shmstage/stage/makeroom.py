"""Make room in one tier: pick least-recently-used datasets no live job leases, and evict them.

``plan`` is read-only: it sizes the new dataset with the one estimator (estimate.py), takes
the other live stagers' reservations off the free space (reserve.py) and adds victims in
LRU order until the capacity rule (capacity.check_fit) and the tier's ``max_size`` both
pass; when even every unleased dataset is not enough it says so and nothing is removed.
``evict`` removes the chosen victims through ``engine.evict_report`` by name, which takes
each dataset's lock and its lease file exclusively first: a dataset a job leased after the
plan chose it, or one being staged right now, is refused there and kept (see NOTE [races]).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from shmstage.capacity import check_fit
from shmstage.errors import RefusedError, ShmstageError
from shmstage.sizes import SizeError, format_size, is_percent, parse_size
from shmstage.stage import leases
from shmstage.stage.estimate import Estimate, estimate
from shmstage.stage.reserve import pending
from shmstage.stage.store import Store

POLICIES = ("lru",)

# NOTE [races]: make-room against stagers and jobs.
#
#   plan (read-only) -> evict victim 1 .. k (each: lock, lease LOCK_EX|NB, remove)
#                    -> engine.stage (Claim.reserve: the binding fit check)
#
# * A job leases a victim after the plan chose it: evict_report takes the lease file
#   exclusively and refuses (leases.InUse); the victim stays and the caller plans again.
# * A victim is being restaged: its lock is held, evict_report refuses (Busy); it stays.
# * Another stager takes the freed space first: engine.stage's reservation check fails
#   with CapacityError before a byte is written; the caller plans again (or moves on).
# A dataset leased at any instant before its removal is never removed.


@dataclass(frozen=True)
class CachePolicy:
    """A tier's cache settings (config ``cache: {max_size: 60%, policy: lru}``)."""

    max_size: int | str | None = None  # bytes, or "60%" of the tier's file system; None: no cap
    policy: str = "lru"


@dataclass(frozen=True)
class Victim:
    """A dataset make-room would remove (or removed)."""

    name: str
    tier: str
    bytes: int  # what it takes on the tier (whole pages), i.e. what removing it frees
    last_used: float  # epoch seconds


@dataclass(frozen=True)
class Room:
    """The verdict for one tier: ``fits`` after removing ``victims`` (in this order)."""

    tier: str
    fits: bool
    needed: int  # bytes the new dataset takes there
    victims: tuple[Victim, ...] = ()
    reason: str | None = None  # why it does not fit (even after evicting what may go)


def max_bytes(policy: CachePolicy | None, tier: str) -> int | None:
    """The tier's ``max_size`` in bytes (a percentage is of its file system's size)."""
    if policy is None or policy.max_size is None:
        return None
    if isinstance(policy.max_size, int):
        return policy.max_size
    try:
        if is_percent(policy.max_size):
            return parse_size(policy.max_size, percent_of=_fs_total(tier))
        return parse_size(policy.max_size)
    except SizeError as e:
        raise RefusedError(f"invalid cache max_size {policy.max_size!r}: {e}") from None


def _fs_total(tier: str) -> int:
    from shmstage import system

    where = tier
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    return system.disk_usage(where).total


def size_of(store: Store, name: str) -> int:
    """What DEST/<name> takes on its tier, by the one estimator."""
    return estimate(store.path(name), store.dest).page_bytes


def candidates(store: Store, keep: str | None = None) -> list[Victim]:
    """Published datasets of the tier that no job leases now, least recently used first."""
    out = []
    if not os.path.lexists(store.book):
        return out
    for n in store.names():
        r = store.published(n)
        if r is None or n == keep or leases.holders(n, store.dest):
            continue
        out.append(Victim(n, store.dest, size_of(store, n), max(r.last_used, r.staged_at)))
    out.sort(key=lambda v: (v.last_used, v.name))
    return out


def cached_bytes(store: Store, exclude: str | None = None) -> int:
    """What the tier's published datasets take together (for ``max_size``)."""
    if not os.path.lexists(store.book):
        return 0
    return sum(
        size_of(store, n) for n in store.names() if n != exclude and store.published(n) is not None
    )


def plan(
    est: Estimate,
    name: str,
    tier: str,
    reserve: int | str | None,
    policy: CachePolicy | None = None,
    *,
    evict: bool = True,
) -> Room:
    """Can ``est`` (staged as ``name``) go into ``tier``, and which datasets must go first?
    ``evict=False``: only say whether it fits as things are (still honouring ``max_size``)."""
    store = Store(tier)
    others = pending(store.book) if os.path.lexists(store.book) else 0
    cap = max_bytes(policy, tier)
    if cap is not None and est.page_bytes > cap:
        return Room(
            tier, False, est.page_bytes,
            reason=f"{name} ({format_size(est.page_bytes)}) is larger than the cache's "
            f"max_size ({format_size(cap)})",
        )  # fmt: skip
    cached = cached_bytes(store, exclude=name) if cap is not None else 0
    pool = candidates(store, keep=name) if evict else []
    freed = 0
    chosen: list[Victim] = []
    while True:
        fit = check_fit(
            est.page_bytes, tier, reserve, inodes=est.inodes, pending=others, freed=freed
        )
        over = cap is not None and cached - freed + est.page_bytes > cap
        if fit.fits and not over:
            return Room(tier, True, est.page_bytes, tuple(chosen))
        if not pool:
            break
        v = pool.pop(0)
        chosen.append(v)
        freed += v.bytes
    why = (
        f"the cache's max_size is {format_size(cap)} and {format_size(cached - freed)} of it is held"
        if fit.fits
        else (fit.reason or "it does not fit")
    )
    if evict:
        leased = _leased_count(store, name)
        why += (
            f" (even after evicting all {len(chosen)} unleased dataset(s), "
            f"{format_size(freed)}; {leased} more leased by running jobs)"
        )
    return Room(tier, False, est.page_bytes, reason=why)


def _leased_count(store: Store, keep: str) -> int:
    if not os.path.lexists(store.book):
        return 0
    return sum(1 for n in store.names() if n != keep and leases.holders(n, store.dest))


def evict(room: Room, remove: Callable[..., object]) -> tuple[list[Victim], list[str]]:
    """Remove ``room.victims`` in order with ``remove(name, dest=tier)`` (engine.evict_report);
    returns (removed, notes on the ones that were kept: leased or busy meanwhile)."""
    removed: list[Victim] = []
    notes: list[str] = []
    for v in room.victims:
        try:
            remove(v.name, dest=v.tier)
        except leases.InUse as e:
            notes.append(f"kept {v.name}: leased meanwhile by {leases.describe(e.holders)}")
            continue
        except ShmstageError as e:  # being staged (Busy), or already gone
            if Store(v.tier).published(v.name) is not None:
                notes.append(f"kept {v.name}: {e}")
            continue  # gone: another make-room or evict removed it first
        removed.append(v)
    return removed, notes
