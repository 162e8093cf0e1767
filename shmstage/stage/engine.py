"""stage / plan / find / list / verify / evict / gc / lease(_until): the staging engine's public
operations, written once on top of the parts.

DEST may be an ordered list of tiers, fastest first (``/dev/shm/shmstage,/nvme/shmstage``).
``stage`` puts a dataset in the first tier where it fits with its reserve (the cache's
policy, stage/cache/: making room there first with ``make_room`` or a tier's max_size) and
reports why faster tiers were skipped; a dataset already staged in any tier is restaged
there, never copied twice.  Staging into the chosen store is stage/staging.py; ``find``,
``list_staged``, ``evict_report``, ``verify``, ``gc`` and ``lease`` look in every tier.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

from shmstage.errors import CapacityError, RefusedError, ShmstageError
from shmstage.identity import Caller
from shmstage.sizes import format_size
from shmstage.stage import staging, topaccess, verification
from shmstage.stage.build.estimate import Estimate
from shmstage.stage.build.partial import Need
from shmstage.stage.cache import makeroom
from shmstage.stage.cache.makeroom import CachePolicy, Victim
from shmstage.stage.cache.tiers import (
    InTier,
    Placed,
    Plan,
    Skipped,
    after_evicting,
    check_request,
    estimate_for,
    holding,
    joined,
    may_make_room,
    placing_all,
    refusal,
    skip_reason,
    split,
    why_not_ours,
)
from shmstage.stage.sources import kinds as sources
from shmstage.stage.staging import Progress
from shmstage.stage.store import access, catalog, counters, eviction, inflight, leasefor, leases
from shmstage.stage.store.datasets import StagedDataset
from shmstage.stage.store.eviction import EvictReport
from shmstage.stage.store.gc import GcReport
from shmstage.stage.store.gc import gc as gc_one
from shmstage.stage.store.layout import Store
from shmstage.stage.store.names import NAME_RE, check_name, name_for
from shmstage.stage.verification import VerifyReport


def stage(
    src: str | os.PathLike[str],
    *,
    name: str | None = None,
    dest: str | os.PathLike[str] | None = None,
    reserve: int | str | None = None,
    make_room: bool = False,
    policies: Mapping[str, CachePolicy] | None = None,
    **kw: Any,
) -> Placed:
    """Stage ``src`` into the first tier where it fits (see the module docstring); ``kw``
    goes to :func:`shmstage.stage.staging.stage`.  Refuses (CapacityError) before removing
    anything when no tier can take it.

    ``reader`` (an identity.Caller, in ``kw``): every read of the source, the estimate's
    included, runs with the reader's file-system ids (the store is written as this
    process); ``credentials``: an object store's, instead of this process's environment;
    ``share``: who else may read an object-store copy (identity.Share)."""
    reader, credentials = kw.get("reader"), kw.get("credentials")
    tiers, policies, name = check_request(src, name, dest, policies, reader)
    if kw.get("peers") is not None and len(tiers) > 1:
        raise RefusedError(
            "staging with several nodes takes one destination, not a list of tiers: "
            "pass --dest with the tier to fill on every node"
        )
    progress = kw.get("progress")
    waiting = (lambda pid: progress(Progress("waiting", holder=pid))) if progress else None
    with placing_all(tiers, name, waiting) if len(tiers) > 1 else nullcontext():
        home = holding(name, joined(tiers))
        order = [home] if home is not None else list(tiers)
        skipped: list[Skipped] = []
        sized: dict[int, Estimate] = {}
        for tier in order:
            index = tiers.index(tier)
            policy = policies.get(tier)
            not_ours = why_not_ours(tier, name) if tier != home else None  # home: the engine says
            if not_ours is not None:
                if len(order) == 1:
                    raise RefusedError(not_ours)
                skipped.append(Skipped(tier, not_ours))
                continue
            roomy = may_make_room(make_room, policy)
            capped = makeroom.max_bytes(policy, tier) is not None
            evicted: list[Victim] = []
            notes: list[str] = []
            last = "other stagers kept taking the room made"
            # The engine refused after this stage evicted: the room made was not what the
            # plan counted (or another stager took it); evict nothing more for it, so a
            # miscount cannot empty the tier one victim at a time.
            refused: list[str] = []
            for _attempt in range(3):  # a lease or another stager may win a race: plan again
                # held: this stage's claim against max_size, until it is published
                with ExitStack() as held:
                    admit = None
                    if roomy and tier == home:
                        # A restage in place: the engine says what it still writes (only
                        # what changed), and room is made for that, under its lock.
                        admit = _admitter(
                            name, tier, reserve, policy, held, evicted, notes, refused
                        )
                    elif roomy:
                        est = estimate_for(sized, src, tier, reader, credentials)
                        store = Store(tier).open() if capped else Store(tier)
                        with inflight.capping(store) if capped else nullcontext():
                            room = makeroom.plan(est, name, tier, reserve, policy)
                            if not room.fits:
                                # After evicting for it: say what went, not "all 0 evicted"
                                why = refused[0] if refused else room.reason or "does not fit"
                                skipped.append(Skipped(tier, why))
                                break
                            if room.victims and refused:
                                skipped.append(Skipped(tier, refused[0]))
                                break
                            if not _evict(room, tier, evicted, notes):
                                continue  # a victim was leased or busy meanwhile
                            if capped:
                                held.enter_context(inflight.InFlight(store, name, est.page_bytes))
                    try:
                        ds = staging.stage(
                            src, name=name, dest=tier, reserve=reserve, admit=admit, **kw
                        )
                    except makeroom.NoRoom as e:  # evicting all that may go is not enough
                        skipped.append(Skipped(tier, skip_reason(e)))
                        break
                    except CapacityError as e:
                        if len(order) == 1 and not roomy:
                            raise  # one tier: the engine's own words
                        if roomy:
                            last = skip_reason(e)
                            if evicted:
                                refused[:] = [after_evicting(last, evicted)]
                            continue  # another stager took the room first
                        skipped.append(Skipped(tier, skip_reason(e)))
                        break
                counters.add_stage(tier, ds.changed, ds.copied_bytes)
                return Placed(
                    **ds.__dict__, tier=tier, tier_index=index, skipped=tuple(skipped),
                    evicted=tuple(evicted), notes=tuple(notes),
                )  # fmt: skip
            else:  # out of tries: say what was evicted for it, as the other refusals do
                skipped.append(Skipped(tier, refused[0] if refused else last))
    raise refusal(name, skipped)


def _evict(room: makeroom.Room, tier: str, evicted: list[Victim], notes: list[str]) -> bool:
    """Evict ``room.victims``; False when one was kept (leased or busy meanwhile)."""
    removed, kept = makeroom.evict(room, eviction.evict_report)
    evicted += removed
    notes += kept
    if removed:
        counters.add(tier, evictions=len(removed))
    return len(removed) == len(room.victims)


def _admitter(
    name: str,
    tier: str,
    reserve: int | str | None,
    policy: CachePolicy | None,
    held: ExitStack,
    evicted: list[Victim],
    notes: list[str],
    refused: list[str],
) -> Callable[[Need], None]:
    """The engine's ``admit`` for a restage in place: make room for what it still writes
    (the changed files, next to the old version it replaces), and claim against max_size
    the growth of the new version over the old (see makeroom.py NOTE [max_size])."""
    capped = makeroom.max_bytes(policy, tier) is not None

    def admit(need: Need) -> None:
        store = Store(tier)
        for _ in range(3):
            with inflight.capping(store) if capped else nullcontext():
                room = makeroom.plan(need, name, tier, reserve, policy)
                if not room.fits:
                    why = refused[0] if refused else room.reason
                    raise makeroom.NoRoom(f"dataset does not fit: {why}")
                if room.victims and refused:  # see stage(): evict nothing more
                    raise makeroom.NoRoom(f"dataset does not fit: {refused[0]}")
                if not _evict(room, tier, evicted, notes):
                    continue  # a victim was leased or busy meanwhile: plan again
                if capped:
                    grows = need.total - makeroom.size_of(store, name)
                    held.enter_context(inflight.InFlight(store, name, grows))
                return
        raise CapacityError("dataset does not fit: other stagers kept taking the room made")

    return admit


def plan(
    src: str | os.PathLike[str],
    *,
    name: str | None = None,
    dest: str | os.PathLike[str] | None = None,
    reserve: int | str | None = None,
    make_room: bool = False,
    policies: Mapping[str, CachePolicy] | None = None,
    force: bool = False,
    strip_components: int = 0,
    reader: Caller | None = None,
    credentials: Mapping[str, str] | None = None,
) -> Plan:
    """Read-only: where ``stage`` would put ``src`` and what it would evict first (``force``
    and ``strip_components`` as the real run's: a forced restage recopies everything;
    ``reader`` and ``credentials`` as stage's)."""
    tiers, policies, name = check_request(src, name, dest, policies, reader)
    source = sources.location_of(os.fspath(src))
    home = holding(name, joined(tiers))
    if home is not None:  # restaged where it is; the engine copies only what changed
        policy = policies.get(home)
        need = staging.restage_need(
            src,
            name=name,
            dest=home,
            force=force,
            strip_components=strip_components,
            reader=reader,
            credentials=credentials,
        )
        if need is None or need == Need(0, 0, 0, 0):  # current: a no-op, nothing to fit
            return Plan(name, source, home, tiers.index(home), True, 0)
        # The real run's decision: the engine's fit on what changed, and room made for it.
        room = makeroom.plan(
            need, name, home, reserve, policy, evict=may_make_room(make_room, policy)
        )
        if room.fits:
            return Plan(name, source, home, tiers.index(home), True, room.needed, room.victims)
        return Plan(name, source, None, None, True, 0, (), (Skipped(home, room.reason or ""),))
    skipped: list[Skipped] = []
    sized: dict[int, Estimate] = {}
    for tier in tiers:
        not_ours = why_not_ours(tier, name)
        if not_ours is not None:  # the real run's refusal (stage), before any max_size lock
            skipped.append(Skipped(tier, not_ours))
            continue
        policy = policies.get(tier)
        roomy = may_make_room(make_room, policy)
        est = estimate_for(sized, src, tier, reader, credentials)
        room = makeroom.plan(est, name, tier, reserve, policy, evict=roomy)
        if room.fits:
            return Plan(
                name, source, tier, tiers.index(tier), False, room.needed, room.victims,
                tuple(skipped),
            )  # fmt: skip
        skipped.append(Skipped(tier, room.reason or "does not fit"))
    return Plan(name, source, None, None, False, 0, (), tuple(skipped))


def find(
    name_or_source: str | os.PathLike[str], dest: str | os.PathLike[str] | None = None
) -> StagedDataset | None:
    """:func:`shmstage.stage.store.catalog.find` in each tier, fastest first.  As a user,
    another user's object-store copy that is not shared with them is refused, not handed
    out as a path they cannot read."""
    me = Caller.of_self() if os.geteuid() != 0 else None
    key = os.fspath(name_or_source)
    for tier in split(dest):
        found = catalog.find(name_or_source, tier, locate=sources.location_of)
        if found is not None:
            topaccess.check_shared(found.path, found.name, found.source, me)
            topaccess.forget_lapsed(Store(tier), found.name)  # who no longer reaches its source
            return found
        if me is not None and "://" in key:  # its record is as private as its copy
            name = name_for(key)
            topaccess.check_shared(Store(tier).path(name), name, key, me)
    return None


def list_staged(
    dest: str | os.PathLike[str] | None = None, *, unfinished: bool = False
) -> list[InTier]:
    """:func:`shmstage.stage.store.catalog.list_staged` of every tier, each row with its tier."""
    return [
        InTier(**row.__dict__, tier=tier)
        for tier in split(dest)
        for row in catalog.list_staged(tier, unfinished=unfinished)
    ]


def evict_report(
    name: str | None = None, *, dest: str | os.PathLike[str] | None = None, **kw: Any
) -> EvictReport:
    """:func:`eviction.evict_report` in the tier holding ``name``, or in every tier."""
    tiers = split(dest)
    if name is not None:
        check_name(name)
        tier = next((t for t in tiers if _has_any(Store(t), name)), None)
        if tier is None:
            raise ShmstageError(f"{name} is not staged in {joined(tiers)} (see `shmstage list`)")
        reports = [(tier, eviction.evict_report(name, dest=tier, **kw))]
    else:
        reports = [(t, eviction.evict_report(None, dest=t, **kw)) for t in tiers]
    for tier, r in reports:
        if r.evicted and not r.dry_run:
            counters.add(tier, evictions=len(r.evicted))
            for t in tiers:  # its placing lock may sit in another tier than its data
                for n in r.evicted:
                    Store(t).drop_placing(n)
    return EvictReport(
        tuple(n for _, r in reports for n in r.evicted),
        tuple(x for _, r in reports for x in r.in_use),
        tuple(x for _, r in reports for x in r.forced),
        reports[0][1].dry_run,
    )


def evict(
    name: str | None = None, *, dest: str | os.PathLike[str] | None = None, **kw: Any
) -> list[str]:
    return list(evict_report(name, dest=dest, **kw).evicted)


def _has_any(store: Store, name: str) -> bool:
    if not os.path.lexists(store.book):
        return False
    return bool(
        store.read_record(name)
        or store.read_next(name)
        or os.path.lexists(store.path(name))
        or os.path.lexists(store.partial(name))
    )


def verify(name: str, dest: str | os.PathLike[str] | None = None, **kw: Any) -> VerifyReport:
    """:func:`shmstage.stage.verification.verify` in the tier holding ``name`` (``reader``,
    ``credentials`` in ``kw``: --checksum reads the source as the reader)."""
    tiers = split(dest)
    return verification.verify(name, holding(name, joined(tiers)) or tiers[0], **kw)


def grant(name: str, dest: str | os.PathLike[str] | None, uid: int) -> None:
    """Let ``uid`` through the top directory of ``name``'s copy where its source path shut
    them out (store/access.py ``grant``: an ACL entry ``user:uid:r-x``).  Only for a user who
    passed the freshness check as themselves (a ``stage`` with ``reader``, which lets its
    reader in by itself); the files below keep their source's modes.  Taken back at
    the next stage or find of it, by anyone, once ``uid`` no longer passes the source path
    (topaccess.revoke_lapsed); a restage (a changed source) makes everyone prove it again."""
    check_name(name)
    tiers = split(dest)
    tier = holding(name, joined(tiers))
    store = Store(tier) if tier is not None else None
    if store is None or store.published(name) is None:
        raise ShmstageError(f"{name} is not staged in {joined(tiers)} (see `shmstage list`)")
    with store.lock(name, shared=True):
        if access.grant(store.path(name), uid):
            store.share_bookkeeping(name)  # its manifest and record too


def gc(dest: str | os.PathLike[str] | None = None, *, dry_run: bool = False) -> GcReport:
    """:func:`shmstage.stage.store.gc.gc` of every tier, as one report."""
    tiers = split(dest)
    reports = [gc_one(t, dry_run=dry_run) for t in tiers]
    if len(reports) == 1:
        return reports[0]
    return GcReport(
        joined(tiers),
        dry_run,
        tuple(x for r in reports for x in r.removed),
        tuple(x for r in reports for x in r.skipped),
    )


@contextmanager
def lease(
    path_or_name: str | os.PathLike[str], dest: str | os.PathLike[str] | None = None
) -> Iterator[Any]:
    """Hold a lease on a staged dataset for the ``with`` block; yields its ``StagedDataset``.

    ``path_or_name``: a staged path (``DEST/<name>`` or inside it, e.g. what ``staged_path()``
    returned), a dataset name, or the source path it was staged from.
    """
    held = lease_for(path_or_name, dest)
    try:
        yield held.dataset
    finally:
        held.release()


def lease_for(
    path_or_name: str | os.PathLike[str], dest: str | os.PathLike[str] | None
) -> leases.Lease:
    """Resolve ``path_or_name`` like :func:`lease` and acquire; the caller releases."""
    key = os.fspath(path_or_name)
    where = leases.locate(key) if os.sep in key else None
    if where is not None:
        return leases.acquire(where[1], where[0])
    tiers = split(dest)  # DEST may list tiers
    if os.sep not in key and NAME_RE.match(key):
        return leases.acquire(key, holding(key, ",".join(tiers)) or tiers[0])
    found = find(key, ",".join(tiers))
    if found is None:
        raise ShmstageError(f"{key} is not staged in {','.join(tiers)} (see `shmstage list`)")
    return leases.acquire(found.name, os.path.dirname(found.path))


def lease_until(
    path_or_name: str | os.PathLike[str], dest: str | os.PathLike[str] | None, pid: int
) -> StagedDataset:
    """Lease a staged dataset (resolved like :func:`lease`) until process ``pid`` exits,
    from a detached holder process (stage/store/leasefor.py).  This process's user may lease
    for its own processes only (root for any); RefusedError when ``pid`` is not running."""
    start = check_lease_for(pid)  # before the holder forks: pid reuse is seen
    held = lease_for(path_or_name, dest)
    try:
        leasefor.hold_until(held, pid, start)
    finally:
        held.release()
    return held.dataset


def check_lease_for(pid: int) -> int:
    """Refuse (RefusedError) a ``lease_until`` for ``pid`` before staging anything: it is not
    running, or not this user's.  Its start time."""
    return leasefor.target(pid, os.geteuid())


def summary(ds: StagedDataset) -> str:
    """One line for stderr after ``stage``."""
    rate = ds.copied_bytes / ds.seconds if ds.seconds > 0 else 0
    if not ds.changed:
        return f"{ds.name} is up to date ({ds.files} files, {format_size(ds.bytes)}) in {ds.seconds:.2f} s"
    part = f" in RAM, {ds.resident:.0%} of {format_size(ds.total_bytes)}" if ds.total_bytes else ""
    return (
        f"staged {ds.name}: {ds.files} files, {format_size(ds.bytes)}{part} "
        f"({format_size(ds.copied_bytes)} copied) in {ds.seconds:.2f} s ({format_size(rate)}/s)"
    )
