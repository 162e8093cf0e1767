"""Build partial/<name> from any source (stage/sources/): the steps written once.

Given the source's listing and the published copy's manifest:

1. count what is still to write: files a killed run already fetched into partial/ are kept
   (a resume), files whose change key equals the published copy's are hard links to it,
   and what else partial/ holds is freed;
2. claim that much of DEST (reserve.py) and check the fit, before a byte is written;
3. make the directories, the links to the published copy and the symlinks;
4. ``fill`` the rest, writing the manifest meanwhile: build/ writes a directory's files
   (fromdir.py) and extracts a tar archive (untar.py); an object store fetches its own;
5. hard links inside the tree, then directories' modes and times, children first.

A source that is not incremental (a tar archive) is handed no files: it fills the whole
tree itself in step 4; steps 3 and 5 are its own.  The first copy of a directory has a
faster path of its own (fromdir.build_first), which checks the fit with the same rule in
steps while its walk runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shmstage.errors import ShmstageError
from shmstage.stage.build import fromdir
from shmstage.stage.build.estimate import SHORT_SYMLINK, of_entries, page_size, require_fit, rounded
from shmstage.stage.build.tree import (
    Counter,
    apply_acls,
    drop_acls,
    finish_tree,
    link_unchanged,
    make_symlink,
    prepare_manifest,
)
from shmstage.stage.sources.base import Listing, Source, Tick, Want
from shmstage.stage.sources.walk import Entry, walk
from shmstage.stage.store import Store, rmtree
from shmstage.stage.store.reserve import Claim

if TYPE_CHECKING:
    from shmstage.stage.build import ondemand


def filler_of(kind: str) -> Callable[..., Any] | None:
    """The filler of the sources whose files build/ writes, by kind; every other kind (an
    object store) fetches its own through ``Source.fetch`` (None).  A source knows nothing of
    build/: the lookup is here.  untar loads only for an archive (a directory's stage skips
    its import)."""
    if kind == "dir":
        return fromdir.fill
    if kind == "tar":
        from shmstage.stage.build import untar

        return untar.fill
    return None


def fill(
    src: Source,
    wants: Sequence[Want],
    root: str,
    tick: Tick,
    workers: int | None,
    checksum: bool,
    meanwhile: Callable[[], None] | None = None,
) -> Any:
    """Write ``wants`` under ``root`` from ``src`` (see ``Source.fetch`` for the contract)."""
    filler = filler_of(src.kind)
    if filler is None:
        return src.fetch(wants, root, tick, workers, checksum, meanwhile)
    return filler(src, wants, root, tick, workers, checksum, meanwhile)


@dataclass(frozen=True)
class Built:
    copied: int  # bytes written (not linked, not kept)
    bytes: int  # the tree's data (hard links once)
    files: int
    top_mode: int | None = None  # the top's mode before its access is set at the publish


def current(manifest: dict[str, Any] | None, listing: Listing) -> bool:
    """The published copy already is this listing: nothing to write."""
    if manifest is None:
        return False
    if listing.keys is not None:  # e.g. ETags: one LIST, no GET
        # The keys name the files only: the directories are compared too (an object store's
        # folder marker is a directory with no key).
        dirs = [e[0] for e in listing.entries if e[1] == "d"]
        return manifest.get("objects") == listing.keys and dirs == [
            e[0] for e in manifest.get("entries", []) if e[1] == "d"
        ]
    return manifest.get("entries") == [list(e) for e in listing.entries]


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
    admit: Callable[[Need], None] | None = None,
    live: ondemand.Live | None = None,
) -> Built:
    """Fill partial/<name> from ``src`` and write its manifest (steps in the module docstring).
    ``manifest`` is the published copy's, when it is of the same source (else None).
    ``admit(need)`` runs before the fit is claimed, and may make room or refuse.  ``live``
    (a directory only): step 4 writes a live view and copies in demand order (ondemand.py)."""
    if live is not None and (src.kind != "dir" or getattr(src, "peers", None) is not None):
        raise ShmstageError("only a directory staged by one node is read while it is copied")
    part = store.partial(name)
    old_root = store.path(name)
    incremental = src.incremental
    resumable = resumable and incremental
    # lists: a linked file takes the published entry's mtime (tuples suffice for the rest)
    entries: list[Any] = [list(e) for e in listing.entries] if incremental else listing.entries
    keys = listing.keys

    # 1-2: the fit, counting only what is still to write.
    need, kept, reuse = to_write(store, name, entries, keys, manifest, resumable, incremental)
    if admit is not None:
        admit(need)  # the cache's policy over this tier (tiers.py): room, max_size
    claim.reserve(
        need.bytes,
        lambda pending: require_fit(
            need.bytes, need.inodes, store.dest, reserve, pending=pending, freed=need.freed
        ),
    )
    # what to_write kept and nothing else (a file fetched under another key is not kept)
    keep = prepare_partial(part, [e for e in entries if e[1] != "f" or e[0] in kept], resumable)
    if keys is not None:  # until this run's manifest is written, no file is known to be kept
        with suppress(FileNotFoundError):
            os.unlink(store.new_manifest_path(name))

    written: list[bool] = []

    def write_manifest() -> None:  # while the source fetches, where it can
        objects = {"objects": keys} if keys is not None else {}
        prepare_manifest(store, name, listing.location, entries, **objects, **listing.record)
        written.append(True)

    if not incremental:  # 3-5 are the source's: it fills the whole tree
        tick = claim.counting(Counter(report, listing.bytes, listing.files))
        tree = fill(src, (), part, tick, workers, verify == "checksum")
        entries = [list(e) for e in tree.entries]
        write_manifest()
        return Built(listing.bytes, tree.bytes, tree.files)

    # 3: directories, links to the published copy, symlinks.
    atimes = listing.atimes
    wants: list[Want] = []
    hard: list[list[Any]] = []
    dirs: list[tuple[str, int, int, int]] = []
    old_umask = os.umask(0)
    try:
        for i, e in enumerate(entries):
            rel, kind, size, mtime, mode, extra = e
            atime = atimes[i] if atimes is not None else -1
            if kind == "d":
                dirs.append((rel, mode, mtime, atime))
                if rel != ".":
                    with suppress(FileExistsError):
                        os.mkdir(os.path.join(part, rel), 0o700)
            elif kind == "f":
                if rel in keep:
                    continue
                if rel in reuse and link_unchanged(
                    os.path.join(old_root, rel), os.path.join(part, rel), e, src.owner(rel)
                ):
                    continue  # gone or not what we published: fetched again below
                wants.append(Want(rel, size, mtime, mode, keys[rel] if keys else None, atime))
            elif kind == "l":
                make_symlink(os.path.join(part, rel), extra, mtime, src.owner(rel))
            else:
                hard.append([rel, extra])
    finally:
        os.umask(old_umask)

    # 4: the rest from the source.
    total = sum(w.size for w in wants)
    tick = claim.counting(Counter(report, total, len(wants)))
    if live is not None:
        from shmstage.stage.build import ondemand  # run --no-wait only

        ondemand.fill_live(
            live, ondemand.Fill(src, wants, part, tick, workers), verify == "checksum",
            write_manifest, store=store, name=name, entries=entries, hard=hard, dirs=dirs,
        )  # fmt: skip
    else:
        fill(src, wants, part, tick, workers, verify == "checksum", write_manifest)
    if not written:
        write_manifest()

    # 5: what needs every file in place.
    finish_tree(part, hard, dirs, src.owner, src.group)
    apply_acls(part, entries)
    if live is not None and live.restrict_top is not None:
        live.restrict_top(part)  # (finish_tree opened it no further than this already did)
    top = next((d[1] for d in dirs if d[0] == "."), None)
    return Built(total, listing.bytes, listing.files, top)


@dataclass(frozen=True)
class Need:
    """What building partial/<name> still writes: the fit ``stage`` checks (step 1)."""

    bytes: int  # whole pages still to write: neither linked to the published copy nor kept
    inodes: int
    freed: int  # what removing the rest of partial/ (a killed run's files) frees first
    total: int  # whole pages the new version takes once published (what max_size counts)


def to_write(
    store: Store,
    name: str,
    entries: list[Any],
    keys: dict[str, Any] | None,
    manifest: dict[str, Any] | None,
    resumable: bool,
    incremental: bool,
) -> tuple[Need, set[str], set[str]]:
    """Step 1, read-only but for ``entries``: (what is still to write, files of partial/ a
    resume keeps, files linked to the published copy).  A linked file's entry (a list)
    takes the mtime of the copy it is linked from."""
    old = {e[0]: e for e in manifest["entries"]} if manifest and incremental else {}
    old_keys = (manifest or {}).get("objects") or {}

    def unchanged(e: list[Any]) -> bool:
        o = old.get(e[0])
        if o is None or o[1] != "f":
            return False
        if keys is None:
            return list(o) == e
        return old_keys.get(e[0]) == keys[e[0]]

    # A resume keeps a file only if it was fetched under today's change key: size, mtime
    # and mode do not tell an object rewritten within LastModified's second (the killed
    # run's manifest says which key each file was fetched under).
    resumed = entries
    if resumable and keys is not None:
        fetched = fetched_keys(store, name)
        resumed = [e for e in entries if e[1] != "f" or fetched.get(e[0]) == keys[e[0]]]
    page = page_size(store.dest)
    kept, freed = plan_partial(store.partial(name), resumed, resumable and incremental)
    reuse: set[str] = set()
    needed = inodes = 0
    for e in entries:
        kind = e[1]
        if kind == "f":
            if e[0] in kept:
                continue
            if old and unchanged(e):  # no published copy: nothing to link
                reuse.add(e[0])
                e[3] = old[e[0]][3]  # keeps the mtime of the copy it is linked from
            else:
                needed += rounded(e[2], page)
        elif kind == "l" and len(os.fsencode(e[5] or "")) + 1 > SHORT_SYMLINK:
            needed += page
        inodes += 1
    total = of_entries("", entries, page).page_bytes
    return Need(needed, inodes, freed, total), kept, reuse


def fetched_keys(store: Store, name: str) -> dict[str, Any]:
    """The change keys partial/<name>'s files were fetched under: those of the manifest a
    killed run wrote beside it ({} when there is none, or it is another tree's)."""
    try:
        fd = os.open(store.new_manifest_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            data = json.load(f)
        root = os.lstat(store.partial(name))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("root") != [root.st_ino, root.st_dev]:
        return {}
    objects = data.get("objects")
    return objects if isinstance(objects, dict) else {}


# --- the partial tree a killed run left ---------------------------------------------------


def _keeps(have: tuple, want: Entry | None) -> bool:
    """A file a killed run already copied: size, mtime and mode match the source."""
    return (
        want is not None
        and want[1] == "f"
        and have[1] == "f"
        and tuple(want[2:5]) == tuple(have[2:5])
    )


def plan_partial(part: str, entries: list, resumable: bool) -> tuple[set[str], int]:
    """Read-only: files of ``part`` a resume keeps, and the bytes the rest frees when removed."""
    if not os.path.lexists(part):
        return set(), 0
    keep: set[str] = set()
    freed = 0
    can_keep = resumable and os.path.isdir(part) and not os.path.islink(part)
    planned = {e[0]: e for e in entries} if can_keep else {}
    try:
        have = walk(part, check_links=False, hardlinks=False).entries[1:]
    except ShmstageError:
        return set(), 0  # not a tree we can read: count nothing as freed
    for e in have:
        if can_keep and _keeps(e, planned.get(e[0])):
            keep.add(e[0])
        elif e[1] == "f":
            with suppress(OSError):
                st = os.lstat(os.path.join(part, e[0]))
                if st.st_nlink == 1:  # a link shared with the published copy frees nothing
                    freed += st.st_blocks * 512
    return keep, freed


def prepare_partial(part: str, entries: list, resumable: bool) -> set[str]:
    """Make ``part`` ready to build into; returns files a killed earlier run already copied.

    A file counts as copied when its size, mtime and mode match the source: the
    copier sets the mtime only after the last byte is written."""
    if not resumable or not os.path.isdir(part) or os.path.islink(part):
        if os.path.lexists(part):
            rmtree(part)
        os.mkdir(part, 0o700)
        os.chmod(part, 0o700)  # never setgid (inherited from DEST): new files get our egid
        return set()
    os.chmod(part, 0o700)
    have = walk(part, check_links=False, hardlinks=False)
    planned = {e[0]: e for e in entries}
    keep: set[str] = set()
    # children before parents so a removed directory is already empty of what we keep
    for e in reversed(have.entries[1:]):
        rel, kind = e[0], e[1]
        want = planned.get(rel)
        path = os.path.join(part, rel)
        if kind == "d" and want is not None and want[1] == "d":
            os.chmod(path, 0o700)
            drop_acls(path)  # a killed run's: new files would inherit them; apply_acls rewrites
            continue
        if _keeps(e, want):
            keep.add(rel)
            continue
        if kind == "d":
            rmtree(path)
        else:
            os.unlink(path)
    return keep
