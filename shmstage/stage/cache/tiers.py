"""Storage tiers: DEST may be an ordered list, fastest first (``/dev/shm/shmstage,/nvme/shmstage``).

The cache's placement policy over several stores: which tiers a DEST names (each once,
whatever it is called), where a dataset already is, which tier is not ours to fill, why a
tier was skipped, the placing locks that make one tier win, and each tier's cache policy
from the node config.  The engine (engine.py) runs it; make-room is makeroom.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from shmstage.errors import CapacityError, RefusedError, ShmstageError
from shmstage.identity import Caller
from shmstage.stage.build.estimate import Estimate, estimate, page_size
from shmstage.stage.cache.makeroom import CachePolicy, Victim
from shmstage.stage.sources import kinds as sources
from shmstage.stage.store.datasets import Listed, StagedDataset
from shmstage.stage.store.layout import Store, managed_by
from shmstage.stage.store.names import DEFAULT_DEST, check_name, name_for, resolve_dest

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


def tier_of(ds: StagedDataset) -> str:
    """The tier a staged dataset lives in (its path is TIER/<name>)."""
    return os.path.dirname(ds.path)


@dataclass(frozen=True)
class Skipped:
    """A faster tier ``stage`` did not use, and why."""

    tier: str
    reason: str


@dataclass(frozen=True)
class Placed(StagedDataset):
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
class InTier(Listed):
    """A ``list`` row, and the tier it is in."""

    tier: str = ""


def why_not_ours(tier: str, name: str) -> str | None:
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
    if skipped and all(s.reason == why_not_ours(s.tier, name) for s in skipped):
        if len(skipped) == 1:  # not a question of room
            return RefusedError(skipped[0].reason)
        detail = "; ".join(f"{s.tier}: {s.reason}" for s in skipped)
        return RefusedError(f"{name} cannot be staged in any tier: {detail}")
    if len(skipped) == 1:
        return CapacityError(f"dataset does not fit: {skipped[0].reason}")  # the engine's words
    detail = "; ".join(f"{s.tier}: {s.reason}" for s in skipped)
    return CapacityError(f"{name} does not fit in any tier: {detail}")


def after_evicting(reason: str, evicted: list[Victim]) -> str:
    names = ", ".join(v.name for v in evicted)
    return f"{reason} (after evicting {names}; not evicting more for it)"


def skip_reason(e: CapacityError) -> str:
    """The engine's refusal without its "dataset does not fit: " (a tier's skip line)."""
    return str(e).removeprefix("dataset does not fit: ")


def check_request(
    src: str | os.PathLike[str],
    name: str | None,
    dest: str | os.PathLike[str] | None,
    policies: Mapping[str, CachePolicy] | None,
    reader: Caller | None = None,
) -> tuple[tuple[str, ...], dict[str, CachePolicy], str]:
    """Check a stage request: (tiers, policies by tier path, dataset name); the source is
    looked up as ``reader``."""
    tiers = split(dest)
    _kind, source = sources.resolve(os.fspath(src), reader)  # a path that exists, or a URL
    name = check_name(name) if name is not None else name_for(source)
    return tiers, {resolve_dest(k): v for k, v in (policies or {}).items()}, name


def may_make_room(make_room: bool, policy: CachePolicy | None) -> bool:
    """May staging evict in this tier: --make-room, or the tier's cache has a max_size."""
    return make_room or (policy is not None and policy.max_size is not None)


def estimate_for(
    cache: dict[int, Estimate],
    src: str | os.PathLike[str],
    tier: str,
    reader: Caller | None = None,
    credentials: Mapping[str, str] | None = None,
) -> Estimate:
    """The new dataset's estimate for ``tier`` (one walk per page size, not per tier), read
    as ``reader`` with ``credentials`` (see engine.stage)."""
    page = page_size(tier)
    if page not in cache:
        cache[page] = estimate(src, tier, reader, credentials)
    return cache[page]


@contextmanager
def placing_all(
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
