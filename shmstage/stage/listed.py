"""Build partial/<name> from a listed source (stage/sources.py), e.g. an s3:// prefix.

The same steps as a directory (engine._build_dir), with the source's change keys instead of
size+mtime: check the fit counting only what is still to fetch, keep what a killed run
fetched, hard-link files whose key is unchanged from the published copy, fetch the rest.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from shmstage.stage.estimate import page_size, rounded
from shmstage.stage.plan import Tree, require_fit
from shmstage.stage.reserve import Claim
from shmstage.stage.sources import Listing, Source, Want
from shmstage.stage.store import Store


def unchanged(manifest: dict[str, Any] | None, listing: Listing) -> bool:
    """The published copy already is this listing: nothing to fetch (one LIST, no GET)."""
    return manifest is not None and manifest.get("objects") == listing.keys


def build(
    store: Store,
    name: str,
    src: Source,
    listing: Listing,
    manifest: dict[str, Any] | None,
    workers: int | None,
    verify: str,
    reserve: int | None,
    resumable: bool,
    report: Callable[..., None],
    claim: Claim,
    counter: Callable[..., Callable[[int, int], None]],
) -> tuple[int, list[list[Any]]]:
    """Fill partial/<name>; returns (bytes fetched, the manifest's entries)."""
    from shmstage.stage.engine import _partial_plan, _prepare_partial

    part = store.partial(name)
    old_root = store.path(name)
    old_keys = (manifest or {}).get("objects") or {}
    old_entries = {e[0]: e for e in (manifest or {}).get("entries", [])}
    entries = [list(e) for e in listing.entries]
    # An unchanged object keeps the entry (its mtime) of the copy it is linked from.
    for e in entries:
        o = old_entries.get(e[0])
        if e[1] == "f" and o is not None and old_keys.get(e[0]) == listing.keys[e[0]]:
            e[3] = o[3]
    tree = Tree(
        listing.location,
        [tuple(e) for e in entries],
        [0] * len(entries),
        listing.bytes,
        listing.files,
    )
    page = page_size(store.dest)
    kept, freed = _partial_plan(part, tree, resumable)
    reuse = {
        rel for rel in listing.keys if rel not in kept and old_keys.get(rel) == listing.keys[rel]
    }
    needed = sum(
        rounded(e[2], page)
        for e in entries
        if e[1] == "f" and e[0] not in kept and e[0] not in reuse
    )
    claim.reserve(
        needed,
        lambda pending: require_fit(
            needed, len(entries), store.dest, reserve, pending=pending, freed=freed
        ),
    )
    keep = _prepare_partial(part, tree, resumable)
    for e in entries[1:]:
        if e[1] == "d":
            with suppress(FileExistsError):
                os.mkdir(os.path.join(part, e[0]), 0o700)
    wants = []
    for rel, kind, size, mtime, mode, _ in entries:
        if kind != "f" or rel in keep:
            continue
        if rel in reuse and _link(
            os.path.join(old_root, rel), os.path.join(part, rel), size, mtime, mode
        ):
            continue
        wants.append(Want(rel, size, mtime, mode, listing.keys[rel]))
    total = sum(w.size for w in wants)
    tick = claim.counting(counter(report, total, len(wants)))
    src.fetch(wants, part, tick, workers, verify == "checksum")
    for e in reversed(entries):  # children first
        if e[1] == "d":
            os.chmod(os.path.join(part, e[0]) if e[0] != "." else part, e[4])
    return total, entries


def _link(old: str, new: str, size: int, mtime: int, mode: int) -> bool:
    """Hard-link the published file if it still is what the manifest says (else fetch it)."""
    try:
        os.link(old, new, follow_symlinks=False)
    except OSError:
        return False
    st = os.lstat(new)
    if stat.S_ISREG(st.st_mode) and (st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode)) == (
        size,
        mtime,
        mode,
    ):
        return True
    os.unlink(new)
    return False
