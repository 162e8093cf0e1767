"""``stage --partial``: a directory larger than its tier keeps the largest part that fits (after
the reserve and the cache's max_size) in RAM, the same part for as long as its files do not
change, published as a dataset whose record says partial, with a view of kind "partial"
listing every file (store/views.py); ``DatasetFiles`` reads the rest from the source.

A dataset that fits is staged exactly as without --partial.  A partial stage evicts nothing:
it takes the room that is free (make-room would trade whole datasets for a fraction of one).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Mapping
from dataclasses import astuple, dataclass, replace
from typing import Any

from shmstage.capacity import check_fit
from shmstage.errors import CapacityError, RefusedError, ShmstageError
from shmstage.stage import engine, staging
from shmstage.stage.build import estimate
from shmstage.stage.build.estimate import page_size, rounded
from shmstage.stage.cache import makeroom
from shmstage.stage.cache.makeroom import CachePolicy
from shmstage.stage.cache.tiers import (
    Placed,
    check_request,
    holding,
    joined,
    refusal,
    split,
    why_not_ours,
)
from shmstage.stage.sources import kinds as sources
from shmstage.stage.sources.base import Listing
from shmstage.stage.store import counters, inflight
from shmstage.stage.store.layout import Record, Store
from shmstage.stage.store.reserve import pending
from shmstage.stage.store.views import PARTIAL, read_view, remove_view, write_view

_SLACK_PAGES = 16  # kept free beyond the reserve: rounding
_TRIES = 5  # choices made again after another stager took the room (then: its refusal)
_POLL = 0.05
_PLACING = ("dest", "make_room", "policies")  # engine.stage's own arguments, not staging.stage's
OFFER = "or keep the part that fits in RAM with --partial; jobs read the rest from the source"


def stage(src: str | os.PathLike[str], **kw: Any) -> Placed:
    """:func:`engine.stage` (``kw``: its arguments) when ``src`` fits a tier (with
    ``make_room``: after evicting); else its largest part that fits into the tier that holds
    it, or the fastest, with the rest read from the source (see the module docstring)."""
    reader = kw.get("reader")
    tiers, policies, name = check_request(
        src, kw.get("name"), kw.get("dest"), kw.get("policies"), reader
    )
    kw.update(name=name, policies=policies)
    kind, source = sources.resolve(os.fspath(src), reader)
    if kind != "dir":
        what = "a tar archive" if kind == "tar" else "an object-store prefix"
        raise RefusedError(
            f"--partial stages directories, and {src} is {what}: stage it without --partial "
            "(to a tier large enough, e.g. local NVMe with --dest), or unpack it first"
        )
    if kw.get("peers") is not None:
        raise RefusedError("--partial stages on one node: drop --nodes, or stage each node alone")
    plan = engine.plan(
        src, name=name, dest=kw.get("dest"), reserve=kw.get("reserve"),
        make_room=bool(kw.get("make_room")), policies=policies, force=bool(kw.get("force")),
        reader=reader, credentials=kw.get("credentials"),
    )  # fmt: skip
    if plan.tier is not None:  # it fits: exactly what stage does without --partial
        try:
            return engine.stage(src, **kw)
        except CapacityError:
            pass  # the plan's estimate fit, the copy's count did not (nothing was kept)
    else:
        why = refusal(name, plan.skipped)
        if not isinstance(why, CapacityError):
            raise why  # not a question of room
    tier = _tier(tiers, name)
    book = Store(tier).book
    copy = {k: v for k, v in kw.items() if k not in _PLACING}  # staging.stage's arguments
    for attempt in range(_TRIES):
        subset = Subset(source, kw.get("reserve"), policies.get(tier))
        try:
            ds = staging.stage(src, dest=tier, subset=subset, **copy)
            break
        except CapacityError:
            # Another stager claimed room after our choice (two --partial at once): wait
            # for it to finish, then choose again against what it left (nothing was written).
            if attempt + 1 == _TRIES or not pending(book):
                raise
            _await_claims(book)
    counters.add_stage(tier, ds.changed, ds.copied_bytes)
    return Placed(**ds.__dict__, tier=tier, tier_index=tiers.index(tier))


def offer(
    e: CapacityError,
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str] | None = None,
    reserve: int | str | None = None,
) -> CapacityError:
    """``e``, a stage's refusal for room, also saying that ``--partial`` would keep the part
    that fits, where :func:`stage` would keep some of ``src``: a directory, and a tier with
    room beyond its reserve (the caller knows the rest: no --partial, --nodes or --no-wait)."""
    try:
        kind, _ = sources.resolve(os.fspath(src), None)
        room = any(
            check_fit((_SLACK_PAGES + 1) * page_size(tier), tier, reserve).fits
            for tier in split(dest)
        )
    except ShmstageError:  # the source gone or unreadable since: the refusal as it was
        return e
    if kind != "dir" or not room:
        return e
    return CapacityError(e.message, hint=f"{e.hint}; {OFFER}" if e.hint else OFFER)


@dataclass(frozen=True)
class PartialPlan:
    """What ``stage --partial`` would keep in RAM of a directory that does not fit
    (``stage --partial --dry-run``)."""

    tier: str
    bytes: int  # in RAM
    files: int
    total_bytes: int  # the whole dataset
    total_files: int


def preview(
    src: str | os.PathLike[str],
    *,
    name: str | None = None,
    dest: str | os.PathLike[str] | None = None,
    reserve: int | str | None = None,
    policies: Mapping[str, CachePolicy] | None = None,
) -> PartialPlan:
    """Read-only: the part :func:`stage` would keep of ``src`` (a directory that fits no
    tier), chosen as a real run chooses it now (its walk included)."""
    tiers, policies, name = check_request(src, name, dest, policies, None)
    kind, source = sources.resolve(os.fspath(src), None)
    if kind != "dir":
        raise RefusedError(f"--partial stages directories, and {src} is not one")
    tier = _tier(tiers, name)
    listing = sources.open_source(kind, source, 0, None, None, None).listing()
    part = Subset(source, reserve, policies.get(tier)).select(listing, Store(tier), name)
    return PartialPlan(tier, part.bytes, part.files, listing.bytes, listing.files)


def _await_claims(book: str) -> None:
    """Until no live stager of this store claims room (a wait on the others' copies)."""
    while pending(book):
        time.sleep(_POLL)


def _tier(tiers: tuple[str, ...], name: str) -> str:
    """The tier a partial copy goes to: the one holding it, else the fastest that may."""
    home = holding(name, joined(tiers))
    return home or next((t for t in tiers if why_not_ours(t, name) is None), tiers[0])


class Subset:
    """What staging.stage copies of a directory that does not fit (its ``subset``): the
    files chosen under the dataset's lock, and the view written before they are published."""

    def __init__(self, source: str, reserve: int | str | None, policy: CachePolicy | None):
        self.source = source
        self.reserve = reserve
        self.policy = policy
        self.files: list[tuple[str, int, int, bool]] = []  # every file: rel, size, mtime, in RAM
        self.total: tuple[int, int] | None = None  # (bytes, files) of it all; None: all in RAM

    def select(self, listing: Listing, store: Store, name: str) -> Listing:
        """The part of ``listing`` to copy: the files the current copy holds that did not
        change (they cost nothing more: linked, whole copy or partial), then the largest
        files first while they fit; directories and symlinks first, at their pages (the
        fit check's estimator)."""
        page = page_size(store.dest)
        room, cap = self._room(store, name)
        entries = listing.entries
        tree = _held(store, name, listing)
        fixed = estimate.of_entries("", [e for e in entries if e[1] in ("d", "l")], page)
        room -= fixed.page_bytes
        total_pages = fixed.page_bytes
        files = [i for i, e in enumerate(entries) if e[1] == "f"]
        chosen: set[str] = set()
        for i in files:
            rel, _, size, mtime = entries[i][:4]
            if tree.get(rel) == (size, mtime):
                chosen.add(rel)
                total_pages += rounded(size, page)
        for i in sorted(files, key=lambda i: (-entries[i][2], entries[i][0])):
            rel, _, size = entries[i][:3]
            cost = rounded(size, page)
            if rel in chosen or cost > room or (cap is not None and total_pages + cost > cap):
                continue
            chosen.add(rel)
            room -= cost
            total_pages += cost
        keep = [
            i for i, e in enumerate(entries)
            if e[1] in ("d", "l") or e[0] in chosen or (e[1] == "h" and e[5] in chosen)
        ]  # fmt: skip
        regular = [e for e in entries if e[1] in ("f", "h")]
        self.files = sorted(
            (e[0], e[2], e[3], e[0] in chosen or (e[1] == "h" and e[5] in chosen)) for e in regular
        )
        if len(keep) == len(entries):
            self.total = None  # it all fits after all
            return listing
        self.total = (listing.bytes, listing.files)
        picked = [entries[i] for i in keep]
        return Listing(
            listing.location,
            picked,
            {k: v for k, v in listing.keys.items() if k in chosen} if listing.keys else None,
            sum(e[2] for e in picked if e[1] == "f"),
            sum(1 for e in picked if e[1] in ("f", "h")),
            [listing.atimes[i] for i in keep] if listing.atimes is not None else None,
            listing.record,
        )

    def _room(self, store: Store, name: str) -> tuple[int, int | None]:
        """Bytes that may still be written into the tier (free space and, on tmpfs, memory,
        less the reserve, other stagers' claims and a slack), and what the cache's max_size
        leaves this dataset in all (None: no max_size)."""
        fit = check_fit(0, store.dest, self.reserve, pending=pending(store.book))
        room = fit.free if fit.memory_usable is None else min(fit.free, fit.memory_usable)
        room -= fit.reserve + _SLACK_PAGES * page_size(store.dest)
        cap = makeroom.max_bytes(self.policy, store.dest)
        if cap is not None:
            cap -= makeroom.cached_bytes(store, exclude=name) + inflight.in_flight(store, name)
        return max(0, room), None if cap is None else max(0, cap)

    def publishing(self, store: Store, name: str, record: Record) -> Record:
        """Before the part (partial/<name>) is published: the view of that tree, valid from
        the exchange on (NOTE [partial view]), and the record that says it is partial."""
        if self.total is None:
            return replace(record, total_bytes=None, total_files=None)
        write_view(
            store, name, kind=PARTIAL, source=self.source, root=store.path(name),
            socket=None, files=self.files, top=store.partial(name), pending=True,
        )  # fmt: skip
        return replace(record, total_bytes=self.total[0], total_files=self.total[1])

    def current(self, store: Store, name: str, record: Record) -> None:
        """The part in RAM is current: the view (what is not in RAM may have changed) and
        the record's totals brought up to date; nothing rewritten when nothing changed.
        The view is swapped in one step (never a moment without one)."""
        view = read_view(store.dest, name)
        if self.total is None:  # all of it is in RAM: a whole copy has no view
            if view is not None:
                remove_view(store, name)
            new = replace(record, total_bytes=None, total_files=None)
        else:
            listed = view.files() if view is not None and view.kind == PARTIAL else None
            same = listed is not None and list(zip(*astuple(listed))) == self.files
            if not same or view.source != self.source:  # type: ignore[union-attr]
                write_view(
                    store, name, kind=PARTIAL, source=self.source, root=store.path(name),
                    socket=None, files=self.files, top=store.path(name),
                )  # fmt: skip
            new = replace(record, total_bytes=self.total[0], total_files=self.total[1])
        if new != record:
            store.write_record(new)


def _held(store: Store, name: str, listing: Listing) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of the listed files the published copy of ``name`` holds now, a
    whole copy's or a partial one's (a restage links them: no new pages), whatever its view
    says (a kill may have left none)."""
    if store.published(name) is None:
        return {}
    top = store.path(name)
    held = {}
    for e in listing.entries:
        if e[1] != "f":
            continue
        try:
            st = os.lstat(os.path.join(top, e[0]))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and (st.st_size, st.st_mtime_ns) == (e[2], e[3]):
            held[e[0]] = (e[2], e[3])
    return held
