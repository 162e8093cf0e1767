"""Storage tiers: DEST may be an ordered list, fastest first (``/dev/shm/shmstage,/nvme/shmstage``).

A layer around the single-DEST engine: ``stage`` puts a dataset in the first tier where it
fits with its reserve (making room there first with ``make_room`` or a tier's cache policy,
see makeroom.py) and reports why faster tiers were skipped; a dataset already staged in
any tier is restaged there, never copied twice.  ``find``, ``list_staged``, ``evict_report``,
``verify`` and ``gc`` look in every tier.  With one tier each is the engine's own function.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from shmstage.errors import CapacityError, RefusedError, ShmstageError
from shmstage.stage import counters, engine, makeroom
from shmstage.stage.build.estimate import Estimate, estimate, page_size
from shmstage.stage.build.partial import Need
from shmstage.stage.gc import GcReport
from shmstage.stage.gc import gc as gc_one
from shmstage.stage.makeroom import CachePolicy, Victim
from shmstage.stage.sources import kinds as sources
from shmstage.stage.store import (
    DEFAULT_DEST,
    Store,
    check_name,
    managed_by,
    name_for,
    resolve_dest,
)

SEP = ","


def split(dest: str | os.PathLike[str] | None = None) -> tuple[str, ...]:
    """The tiers of ``dest`` (else ``$SHMSTAGE_DEST``, else /dev/shm/shmstage): absolute
    paths, fastest first, each once."""
    raw = os.fspath(dest) if dest is not None else os.environ.get("SHMSTAGE_DEST") or DEFAULT_DEST
    parts = [p.strip() for p in raw.split(SEP)]
    if not all(parts):
        raise RefusedError(
            f"invalid destination {raw!r}: an empty tier; list tiers fastest first, "
            "separated by commas, e.g. /dev/shm/shmstage,/local/nvme/shmstage"
        )
    # One tier named twice (a symlinked parent, a bind mount: /run/shm and /dev/shm) is
    # one tier: its placing lock would otherwise be taken twice, by one stager from itself.
    unique: dict[tuple[int, int, str], str] = {}
    for p in parts:
        unique.setdefault(identity(resolve_dest(p)), resolve_dest(p))
    return tuple(unique.values())


def identity(path: str) -> tuple[int, int, str]:
    """What ``path`` is whatever it is called: (st_dev, st_ino) of its nearest existing
    directory and the rest of the path below it.  Two aliases of one tier get the same."""
    rest: list[str] = []
    here = path
    while True:
        try:
            st = os.stat(here)
        except OSError:
            parent = os.path.dirname(here)
            if parent == here:
                return (0, 0, path)
            rest.append(os.path.basename(here))
            here = parent
            continue
        return (st.st_dev, st.st_ino, "/".join(reversed(rest)))


def joined(tiers: tuple[str, ...]) -> str:
    return SEP.join(tiers)


def holding(name: str, dest: str | os.PathLike[str] | None = None) -> str | None:
    """The tier where ``name`` is published (or being republished), fastest first."""
    for tier in split(dest):
        store = Store(tier)
        if not os.path.lexists(store.book):
            continue
        if store.published(name) is not None or store.read_next(name) is not None:
            return tier
    return None


def tier_of(ds: engine.StagedDataset) -> str:
    """The tier a staged dataset lives in (its path is TIER/<name>)."""
    return os.path.dirname(ds.path)


# --- results -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Skipped:
    """A faster tier ``stage`` did not use, and why."""

    tier: str
    reason: str


@dataclass(frozen=True)
class Placed(engine.StagedDataset):
    """What ``stage`` returns: the dataset, the tier it is in and how it got there."""

    tier: str = ""
    tier_index: int = 0  # 0: the fastest
    skipped: tuple[Skipped, ...] = ()  # faster tiers passed over
    evicted: tuple[Victim, ...] = ()  # removed to make room
    notes: tuple[str, ...] = ()  # e.g. a victim kept because a job leased it meanwhile


@dataclass(frozen=True)
class Plan:
    """What ``stage --dry-run`` would do: the tier, and what it would evict there first."""

    name: str
    source: str
    tier: str | None  # None: no tier can take it
    tier_index: int | None
    already_staged: bool  # restaged in place (no second copy)
    needed: int  # bytes it takes in that tier
    evict: tuple[Victim, ...] = ()
    skipped: tuple[Skipped, ...] = ()


@dataclass(frozen=True)
class InTier(engine.Listed):
    """A ``list`` row, and the tier it is in."""

    tier: str = ""


# --- stage -------------------------------------------------------------------------------


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
    goes to :func:`shmstage.stage.engine.stage`.  Refuses (CapacityError) before removing
    anything when no tier can take it."""
    tiers, policies, name = _request(src, name, dest, policies)
    if kw.get("peers") is not None and len(tiers) > 1:
        raise RefusedError(
            "staging with several nodes takes one destination, not a list of tiers: "
            "pass --dest with the tier to fill on every node"
        )
    progress = kw.get("progress")
    waiting = (lambda pid: progress(engine.Progress("waiting", holder=pid))) if progress else None
    with _placing_all(tiers, name, waiting) if len(tiers) > 1 else nullcontext():
        home = holding(name, joined(tiers))
        order = [home] if home is not None else list(tiers)
        skipped: list[Skipped] = []
        sized: dict[int, Estimate] = {}
        for tier in order:
            index = tiers.index(tier)
            policy = policies.get(tier)
            not_ours = _not_ours(tier, name) if tier != home else None  # home: the engine says
            if not_ours is not None:
                if len(order) == 1:
                    raise RefusedError(not_ours)
                skipped.append(Skipped(tier, not_ours))
                continue
            roomy = _roomy(make_room, policy)
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
                        est = _sized(sized, src, tier)
                        store = Store(tier).open() if capped else Store(tier)
                        with makeroom.capping(store) if capped else nullcontext():
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
                                held.enter_context(makeroom.InFlight(store, name, est.page_bytes))
                    try:
                        ds = engine.stage(
                            src, name=name, dest=tier, reserve=reserve, admit=admit, **kw
                        )
                    except makeroom.NoRoom as e:  # evicting all that may go is not enough
                        skipped.append(Skipped(tier, _reason(e)))
                        break
                    except CapacityError as e:
                        if len(order) == 1 and not roomy:
                            raise  # one tier: the engine's own words
                        if roomy:
                            last = _reason(e)
                            if evicted:
                                refused[:] = [_after_evicting(last, evicted)]
                            continue  # another stager took the room first
                        skipped.append(Skipped(tier, _reason(e)))
                        break
                if ds.changed:
                    counters.add(tier, misses=1, copied_bytes=ds.copied_bytes)
                else:
                    counters.add(tier, hits=1)
                return Placed(
                    **ds.__dict__, tier=tier, tier_index=index, skipped=tuple(skipped),
                    evicted=tuple(evicted), notes=tuple(notes),
                )  # fmt: skip
            else:  # out of tries: say what was evicted for it, as the other refusals do
                skipped.append(Skipped(tier, refused[0] if refused else last))
    raise refusal(name, skipped)


def _not_ours(tier: str, name: str) -> str | None:
    """The one line when ``tier``'s store is someone else's that this user may not write
    (root's): a new dataset cannot go there.  Checked before anything locks in it (the
    max_size lock is owner-only), so the answer is this line, with or without max_size,
    dry run or not; None when it is ours or not made yet (the engine then says the rest)."""
    store = Store(tier)
    try:
        owner = os.lstat(store.book).st_uid
    except OSError:
        # Not made yet: may we make it?  (A root-made path to a tier, e.g. a disk's mount.)
        here = store.book
        while not os.path.lexists(here) and os.path.dirname(here) != here:
            here = os.path.dirname(here)
        if os.access(here, os.W_OK | os.X_OK, effective_ids=True):
            return None
        return f"cannot create {store.dest}: {here} is not yours to write: pick a --dest you can write to"
    if owner == os.geteuid() or store.writable():
        return None
    return f"{name} is not staged in {store.dest}; {managed_by(store.dest, owner)}"  # the engine's


def refusal(name: str, skipped: list[Skipped] | tuple[Skipped, ...]) -> RefusedError:
    """Why no tier took ``name``: the one error ``stage`` and ``stage --dry-run`` give."""
    if skipped and all(s.reason == _not_ours(s.tier, name) for s in skipped):
        if len(skipped) == 1:  # not a question of room
            return RefusedError(skipped[0].reason)
        detail = "; ".join(f"{s.tier}: {s.reason}" for s in skipped)
        return RefusedError(f"{name} cannot be staged in any tier: {detail}")
    if len(skipped) == 1:
        return CapacityError(f"dataset does not fit: {skipped[0].reason}")  # the engine's words
    detail = "; ".join(f"{s.tier}: {s.reason}" for s in skipped)
    return CapacityError(f"{name} does not fit in any tier: {detail}")


def _evict(room: makeroom.Room, tier: str, evicted: list[Victim], notes: list[str]) -> bool:
    """Evict ``room.victims``; False when one was kept (leased or busy meanwhile)."""
    removed, kept = makeroom.evict(room, engine.evict_report)
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
            with makeroom.capping(store) if capped else nullcontext():
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
                    held.enter_context(makeroom.InFlight(store, name, grows))
                return
        raise CapacityError("dataset does not fit: other stagers kept taking the room made")

    return admit


def _after_evicting(reason: str, evicted: list[Victim]) -> str:
    names = ", ".join(v.name for v in evicted)
    return f"{reason} (after evicting {names}; not evicting more for it)"


def _reason(e: CapacityError) -> str:
    """The engine's refusal without its "dataset does not fit: " (a tier's skip line)."""
    return str(e).removeprefix("dataset does not fit: ")


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
) -> Plan:
    """Read-only: where ``stage`` would put ``src`` and what it would evict first (``force``
    and ``strip_components`` as the real run's: a forced restage recopies everything)."""
    tiers, policies, name = _request(src, name, dest, policies)
    source = sources.location_of(os.fspath(src))
    home = holding(name, joined(tiers))
    if home is not None:  # restaged where it is; the engine copies only what changed
        policy = policies.get(home)
        need = engine.restage_need(
            src, name=name, dest=home, force=force, strip_components=strip_components
        )
        if need is None or need == Need(0, 0, 0, 0):  # current: a no-op, nothing to fit
            return Plan(name, source, home, tiers.index(home), True, 0)
        # The real run's decision: the engine's fit on what changed, and room made for it.
        room = makeroom.plan(need, name, home, reserve, policy, evict=_roomy(make_room, policy))
        if room.fits:
            return Plan(name, source, home, tiers.index(home), True, room.needed, room.victims)
        return Plan(name, source, None, None, True, 0, (), (Skipped(home, room.reason or ""),))
    skipped: list[Skipped] = []
    sized: dict[int, Estimate] = {}
    for tier in tiers:
        not_ours = _not_ours(tier, name)
        if not_ours is not None:  # the real run's refusal (stage), before any max_size lock
            skipped.append(Skipped(tier, not_ours))
            continue
        policy = policies.get(tier)
        roomy = _roomy(make_room, policy)
        est = _sized(sized, src, tier)
        room = makeroom.plan(est, name, tier, reserve, policy, evict=roomy)
        if room.fits:
            return Plan(
                name, source, tier, tiers.index(tier), False, room.needed, room.victims,
                tuple(skipped),
            )  # fmt: skip
        skipped.append(Skipped(tier, room.reason or "does not fit"))
    return Plan(name, source, None, None, False, 0, (), tuple(skipped))


def _request(
    src: str | os.PathLike[str],
    name: str | None,
    dest: str | os.PathLike[str] | None,
    policies: Mapping[str, CachePolicy] | None,
) -> tuple[tuple[str, ...], dict[str, CachePolicy], str]:
    """Check a stage request: (tiers, policies by tier path, dataset name)."""
    tiers = split(dest)
    _kind, source = sources.resolve(os.fspath(src))  # a path that exists, or an s3:// URL
    name = check_name(name) if name is not None else name_for(source)
    return tiers, {resolve_dest(k): v for k, v in (policies or {}).items()}, name


def _roomy(make_room: bool, policy: CachePolicy | None) -> bool:
    """May staging evict in this tier: --make-room, or the tier's cache has a max_size."""
    return make_room or (policy is not None and policy.max_size is not None)


def _sized(cache: dict[int, Estimate], src: str | os.PathLike[str], tier: str) -> Estimate:
    """The new dataset's estimate for ``tier`` (one walk per page size, not per tier)."""
    page = page_size(tier)
    if page not in cache:
        cache[page] = estimate(src, tier)
    return cache[page]


@contextmanager
def _placing_all(
    tiers: tuple[str, ...], name: str, on_wait: Callable[[int | None], None] | None = None
) -> Iterator[None]:
    """Hold ``name``'s placing lock in every tier, taken in one order (by the tier's
    identity, not its name: two aliases of one tier sort alike, and are locked once)
    whatever order the caller lists them in: ``--dest A,B`` and ``--dest B,A`` (or ``A,B``
    and ``B,C``) then exclude each other without deadlock, so the dataset lands in one tier.

    A tier's store is made here only when no earlier tier has one (the tier it goes to
    first, as with one DEST); a later tier is locked only when its store exists (locking never creates a store: a user's fallback tier would become
    theirs, an unmounted disk's mount point would get a .shmstage tree).  A store that
    another stager makes meanwhile is seen after locking: then all is locked again, in order."""
    with ExitStack() as stack:
        while True:
            first: ShmstageError | None = None
            stores: dict[tuple[int, int, str], Store] = {}
            seen: set[tuple[int, int, str]] = set()
            made = False
            for tier in tiers:
                store = Store(tier)
                exists = os.path.isdir(store.book)
                if not exists and made:
                    continue
                try:
                    store.open(create=not exists)
                except ShmstageError as e:  # a tier we cannot write (not mounted, not ours):
                    first = first or e  # it cannot take the dataset either; the others lock
                    seen.add(identity(tier))
                    continue
                made = True
                # Opened, so the identity is the tier directory's own (stable from now on).
                seen.add(identity(store.dest))
                stores.setdefault(identity(store.dest), store)
            held = 0
            for key in sorted(stores):
                try:
                    stack.enter_context(stores[key].placing(name, on_wait))
                    held += 1
                except ShmstageError as e:
                    first = first or e
            if all(identity(t) in seen for t in tiers if os.path.isdir(Store(t).book)):
                break
            stack.close()  # a store was made meanwhile: lock it too, in the one order
        if not held and first is not None:
            raise first
        yield


# --- find / list / evict / verify / gc across tiers ---------------------------------------


def find(
    name_or_source: str | os.PathLike[str], dest: str | os.PathLike[str] | None = None
) -> engine.StagedDataset | None:
    """:func:`engine.find` in each tier, fastest first."""
    for tier in split(dest):
        found = engine.find(name_or_source, tier)
        if found is not None:
            return found
    return None


def list_staged(
    dest: str | os.PathLike[str] | None = None, *, unfinished: bool = False
) -> list[InTier]:
    """:func:`engine.list_staged` of every tier, each row with its tier."""
    return [
        InTier(**row.__dict__, tier=tier)
        for tier in split(dest)
        for row in engine.list_staged(tier, unfinished=unfinished)
    ]


def evict_report(
    name: str | None = None, *, dest: str | os.PathLike[str] | None = None, **kw: Any
) -> engine.EvictReport:
    """:func:`engine.evict_report` in the tier holding ``name``, or in every tier."""
    tiers = split(dest)
    if name is not None:
        check_name(name)
        tier = next((t for t in tiers if _has_any(Store(t), name)), None)
        if tier is None:
            raise ShmstageError(f"{name} is not staged in {joined(tiers)} (see `shmstage list`)")
        reports = [(tier, engine.evict_report(name, dest=tier, **kw))]
    else:
        reports = [(t, engine.evict_report(None, dest=t, **kw)) for t in tiers]
    for tier, r in reports:
        if r.evicted and not r.dry_run:
            counters.add(tier, evictions=len(r.evicted))
            for t in tiers:  # its placing lock may sit in another tier than its data
                for n in r.evicted:
                    Store(t).drop_placing(n)
    return engine.EvictReport(
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


def verify(name: str, dest: str | os.PathLike[str] | None = None, **kw: Any) -> engine.VerifyReport:
    """:func:`engine.verify` in the tier holding ``name``."""
    tiers = split(dest)
    return engine.verify(name, holding(name, joined(tiers)) or tiers[0], **kw)


def gc(dest: str | os.PathLike[str] | None = None, *, dry_run: bool = False) -> GcReport:
    """:func:`shmstage.stage.gc.gc` of every tier, as one report."""
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


def configured(
    dest: str | os.PathLike[str] | None, config_path: str | os.PathLike[str] | None = None
) -> tuple[str, dict[str, CachePolicy]]:
    """Where to stage and each tier's cache policy: ``dest`` (else ``$SHMSTAGE_DEST``, else
    the node config's ``dest``, else /dev/shm/shmstage), with the config's ``cache`` settings
    for the tiers it names."""
    from shmstage.config import node_tiers

    tiers = node_tiers(config_path)
    if dest is None and not os.environ.get("SHMSTAGE_DEST") and tiers:
        dest = joined(tuple(t.path for t in tiers))
    policies = {t.path: CachePolicy(t.max_size, t.policy) for t in tiers if t.max_size is not None}
    return joined(split(dest)), policies
