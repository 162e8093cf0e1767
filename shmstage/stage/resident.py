"""``stage --partial``: a directory larger than its tier keeps the largest part that fits (after
the reserve and the cache's max_size) in RAM, the same part for as long as its files do not
change, published as a dataset whose record says partial, with a view of kind "partial"
listing every file (store/views.py); ``DatasetFiles`` reads the rest from the source.

A dataset that fits is staged exactly as without --partial.  A partial stage evicts nothing:
it takes the room that is free (make-room would trade whole datasets for a fraction of one).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import astuple, replace
from typing import Any

from shmstage.capacity import check_fit
from shmstage.errors import CapacityError, RefusedError
from shmstage.stage import engine, staging
from shmstage.stage.build.estimate import page_size, rounded
from shmstage.stage.cache import makeroom
from shmstage.stage.cache.makeroom import CachePolicy
from shmstage.stage.cache.tiers import Placed, check_request, holding, joined, refusal, why_not_ours
from shmstage.stage.sources import kinds as sources
from shmstage.stage.sources.base import Listing
from shmstage.stage.store import counters, inflight
from shmstage.stage.store.layout import Record, Store
from shmstage.stage.store.reserve import pending
from shmstage.stage.store.views import PARTIAL, read_view, remove_view, write_view

_SLACK_PAGES = 64  # kept free beyond the reserve: long symlinks' pages, rounding


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
    """:func:`engine.stage` when ``src`` fits a tier (with ``make_room``: after evicting);
    else its largest part that fits into the tier that holds it, or the fastest, with the
    rest read from the source (see the module docstring).  ``kw`` as engine.stage's."""
    reader, credentials = kw.get("reader"), kw.get("credentials")
    tiers, policies, name = check_request(src, name, dest, policies, reader)
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
        src, name=name, dest=dest, reserve=reserve, make_room=make_room, policies=policies,
        force=bool(kw.get("force")), reader=reader, credentials=credentials,
    )  # fmt: skip
    if plan.tier is not None:  # it fits: exactly what stage does without --partial
        try:
            return engine.stage(
                src, name=name, dest=dest, reserve=reserve, make_room=make_room,
                policies=policies, **kw,
            )  # fmt: skip
        except CapacityError:
            pass  # the plan's estimate fit, the copy's count did not (nothing was kept)
    else:
        why = refusal(name, plan.skipped)
        if not isinstance(why, CapacityError):
            raise why  # not a question of room
    home = holding(name, joined(tiers))
    tier = home or next((t for t in tiers if why_not_ours(t, name) is None), tiers[0])
    subset = Subset(source, reserve, policies.get(tier))
    ds = staging.stage(src, name=name, dest=tier, reserve=reserve, subset=subset, **kw)
    if ds.changed:
        counters.add(tier, misses=1, copied_bytes=ds.copied_bytes)
    else:
        counters.add(tier, hits=1)
    return Placed(**ds.__dict__, tier=tier, tier_index=tiers.index(tier))


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
        """The part of ``listing`` to copy: the files in RAM now that did not change (they
        cost nothing more: linked), then the largest files first while they fit."""
        page = page_size(store.dest)
        before = read_view(store.dest, name) if store.published(name) is not None else None
        listed = before.files() if before is not None and before.kind == PARTIAL else None
        kept_before = (
            {n: (s, m) for n, s, m, r in zip(*astuple(listed)) if r} if listed is not None else {}
        )
        room, cap = self._room(store, name)
        entries = listing.entries
        files = [i for i, e in enumerate(entries) if e[1] == "f"]
        chosen: set[str] = set()
        total_pages = 0
        for i in files:
            rel, _, size, mtime = entries[i][:4]
            if kept_before.get(rel) == (size, mtime):
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

    def publishing(self, store: Store, name: str, record: Record, top: str = "") -> Record:
        """Before the part is published (``top``: its tree, partial/<name> by default): its
        view, and the record that says it is partial."""
        view = read_view(store.dest, name)
        if self.total is None:
            if view is not None and view.kind == PARTIAL:
                remove_view(store, name)  # all of it is in RAM now
            return replace(record, total_bytes=None, total_files=None)
        listed = view.files() if view is not None and view.kind == PARTIAL else None
        same = listed is not None and list(zip(*astuple(listed))) == self.files
        if not same or view.source != self.source:  # type: ignore[union-attr]
            write_view(
                store, name, kind=PARTIAL, source=self.source, root=store.path(name),
                socket=None, files=self.files, top=top or store.partial(name),
            )  # fmt: skip
        return replace(record, total_bytes=self.total[0], total_files=self.total[1])

    def current(self, store: Store, name: str, record: Record) -> None:
        """The part in RAM is current: the view (what is not in RAM may have changed) and
        the record's totals brought up to date; nothing rewritten when nothing changed."""
        new = self.publishing(store, name, record, top=store.path(name))
        if new != record:
            store.write_record(new)
