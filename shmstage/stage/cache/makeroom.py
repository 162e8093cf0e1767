"""Make room in one tier: pick least-recently-used datasets no live job leases, and evict them.

``plan`` is read-only: it sizes the new dataset with the one estimator (estimate.py), takes
the other live stagers' reservations off the free space (reserve.py) and adds victims in
LRU order until the capacity rule (capacity.check_fit) and the tier's ``max_size`` both
pass; when even every unleased dataset is not enough it says so and nothing is removed.
``evict`` removes the chosen victims through ``store.eviction.evict_report`` by name, which takes
each dataset's lock and its lease file exclusively first: a dataset a job leased after the
plan chose it, or one being staged right now, is refused there and kept (see NOTE [races]).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from shmstage import system
from shmstage.capacity import check_fit
from shmstage.errors import CapacityError, RefusedError, ShmstageError
from shmstage.sizes import SizeError, format_size, is_percent, parse_size
from shmstage.stage.build.estimate import Estimate, estimate
from shmstage.stage.build.partial import Need
from shmstage.stage.store import Store, leases
from shmstage.stage.store.inflight import in_flight
from shmstage.stage.store.reserve import pending

POLICIES = ("lru",)

# NOTE [races]: make-room against stagers and jobs.
#
#   plan (read-only) -> evict victim 1 .. k (each: lock, lease LOCK_EX|NB, remove)
#                    -> staging.stage (Claim.reserve: the binding fit check)
#
# * A job leases a victim after the plan chose it: evict_report takes the lease file
#   exclusively and refuses (leases.InUse); the victim stays and the caller plans again.
# * A victim is being restaged: its lock is held, evict_report refuses (Busy); it stays.
# * Another stager takes the freed space first: staging.stage's reservation check fails
#   with CapacityError before a byte is written; the caller plans again (or moves on).
# A dataset leased at any instant before its removal is never removed.
#
# NOTE [max_size]: concurrent stagers against a tier's cache.max_size.
#
#   capping (flock of inflight/.capping) { plan: cached + in flight + this one <= max_size
#                                  -> evict -> InFlight(what this stage adds) }
#   -> staging.stage ... publish -> InFlight closed
#
# Planning and claiming are one step under the tier's flock, so a second stager counts the
# first one's dataset before it is published (cached_bytes sees only published ones); from
# the publish until its claim is closed a dataset counts twice, never zero times.  A claim
# is flocked for its stager's life: a dead stager's claim counts nothing and is removed.


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
    # Removing it gives RAM back under this stager's memory cgroup limit too, not only free
    # space: its pages were written from that cgroup or one below it (system.charged_to).
    charged: bool = False  # staged from this stager's memory cgroup (its RAM counts as freed)


@dataclass(frozen=True)
class Room:
    """The verdict for one tier: ``fits`` after removing ``victims`` (in this order)."""

    tier: str
    fits: bool
    needed: int  # bytes the new dataset (or a restage's changes) takes there
    victims: tuple[Victim, ...] = ()
    reason: str | None = None  # why it does not fit (even after evicting what may go)


class NoRoom(CapacityError):
    """Even evicting every dataset that may go is not enough: final for the tier (no race
    to retry), and nothing was removed."""


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
    where = tier
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    return system.disk_usage(where).total


def size_of(store: Store, name: str) -> int:
    """What DEST/<name> takes on its tier, by the one estimator."""
    return estimate(store.path(name), store.dest).page_bytes


def candidates(store: Store, keep: str | None = None) -> list[Victim]:
    """Published datasets of the tier that no job leases now, least recently used first."""
    out: list[Victim] = []
    if not os.path.lexists(store.book):
        return out
    mine = system.memory_cgroup_id()
    for n in store.names():
        r = store.published(n)
        if r is None or n == keep or leases.holders(n, store.dest):
            continue
        used = max(r.last_used, r.staged_at)
        charged = system.charged_to(r.memcg, mine)
        out.append(Victim(n, store.dest, size_of(store, n), used, charged))
    out.sort(key=lambda v: (v.last_used, v.name))
    return out


def cached_bytes(store: Store, exclude: str | None = None) -> int:
    """What the tier's published datasets take together (for ``max_size``)."""
    if not os.path.lexists(store.book):
        return 0
    return sum(
        size_of(store, n) for n in store.names() if n != exclude and store.published(n) is not None
    )


def need_of(est: Estimate) -> Need:
    """A first copy needs all of it."""
    return Need(est.page_bytes, est.inodes, 0, est.page_bytes)


def plan(
    what: Estimate | Need,
    name: str,
    tier: str,
    reserve: int | str | None,
    policy: CachePolicy | None = None,
    *,
    evict: bool = True,
) -> Room:
    """Can ``what`` (a new dataset's estimate, or what restaging ``name`` in place still
    writes: staging.restage_need) go into ``tier``, and which datasets must go first?  The
    fit is the engine's, on what is written; ``max_size`` counts the whole new version
    (a restage's old version leaves), the other datasets and the stages in flight.
    ``evict=False``: only say whether it fits as things are (still honouring ``max_size``)."""
    need = what if isinstance(what, Need) else need_of(what)
    store = Store(tier)
    others = pending(store.book) if os.path.lexists(store.book) else 0
    cap = max_bytes(policy, tier)
    if cap is not None and need.total > cap:
        return Room(
            tier, False, need.bytes,
            reason=f"{name} ({format_size(need.total)}) is larger than the cache's "
            f"max_size ({format_size(cap)})",
        )  # fmt: skip
    flying = in_flight(store, exclude=name) if cap is not None else 0
    cached = cached_bytes(store, exclude=name) + flying if cap is not None else 0
    pool = candidates(store, keep=name) if evict else []
    freed = 0
    charged = 0  # of freed: what is charged to this stager's memory cgroup (Victim.charged)
    chosen: list[Victim] = []
    while True:
        fit = check_fit(
            need.bytes, tier, reserve, inodes=need.inodes, pending=others,
            freed=need.freed + freed, charged=need.freed + charged,
        )  # fmt: skip
        over = cap is not None and cached - freed + need.total > cap
        if fit.fits and not over:
            return Room(tier, True, need.bytes, tuple(chosen))
        if not pool:
            break
        v = pool.pop(0)
        chosen.append(v)
        freed += v.bytes
        charged += v.bytes if v.charged else 0
    busy = f", {format_size(flying)} of it by stages in progress" if flying else ""
    why = (
        f"the cache's max_size is {format_size(cap)} and {format_size(cached - freed)} of it "
        f"is held{busy}"
        if fit.fits
        else (fit.reason or "it does not fit")
    )
    if evict:
        leased = _leased_count(store, name)
        why += (
            f" (even after evicting all {len(chosen)} unleased dataset(s), "
            f"{format_size(freed)}; {leased} more leased by running jobs)"
        )
    return Room(tier, False, need.bytes, reason=why)


def _leased_count(store: Store, keep: str) -> int:
    if not os.path.lexists(store.book):
        return 0
    return sum(1 for n in store.names() if n != keep and leases.holders(n, store.dest))


def evict(room: Room, remove: Callable[..., object]) -> tuple[list[Victim], list[str]]:
    """Remove ``room.victims`` in order with ``remove(name, dest=tier)`` (store.eviction.evict_report);
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
