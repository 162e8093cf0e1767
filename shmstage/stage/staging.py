"""Staging one dataset into one store: its lock, the source asked whether the copy is
current, the new version built in ``partial/<name>`` (stage/build/partial.py), and its atomic
publish (NOTE [publish]).  engine.py chooses the store (the tier) and calls ``stage``.

Long because one stage's steps (lock, freshness, build, publish, the cleanup of a failure)
share its state, and a copy may be made while its job runs (``live``) or in part
(``subset``): each hooks into those same steps rather than repeating them."""

from __future__ import annotations

import errno
import os
import signal
import stat
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from shmstage.errors import CapacityError, PermissionDenied, RefusedError, ShmstageError
from shmstage.identity import Caller, Share
from shmstage.paths import is_within
from shmstage.stage import topaccess
from shmstage.stage.build import copier, fromdir
from shmstage.stage.build import partial as build
from shmstage.stage.signals import signals_raise
from shmstage.stage.sources import acls
from shmstage.stage.sources import kinds as sources
from shmstage.stage.store import leases, views
from shmstage.stage.store.datasets import StagedDataset, dataset_of
from shmstage.stage.store.layout import Record, Store, managed_by
from shmstage.stage.store.names import check_name, name_for
from shmstage.stage.store.partial import (
    clear_dead_trash,
    drop_leftovers,
    drop_unused_lock,
    read_marker,
    remove_marker,
    restore_marker,
    write_marker,
)
from shmstage.stage.store.reserve import Claim
from shmstage.stage.store.trees import rmtree
from shmstage.stage.verification import VERIFY_MODES

if TYPE_CHECKING:
    from shmstage.stage.build import ondemand  # run --no-wait's (loaded where it is used)


@dataclass(frozen=True)
class Progress:
    """What ``stage`` is doing; passed to the ``progress`` callback."""

    phase: str  # "waiting", "scanning", "copying", "publishing", "verifying"
    bytes_done: int = 0
    bytes_total: int = 0
    files_done: int = 0
    files_total: int = 0
    elapsed: float = 0.0
    holder: int | None = None  # "waiting": pid holding the lock


def stage(
    src: str | os.PathLike[str],
    *,
    name: str | None = None,
    dest: str | os.PathLike[str] | None = None,
    workers: int | None = None,
    verify: str = "size",
    reserve: int | str | None = None,
    force: bool = False,
    progress: Callable[[Progress], None] | None = None,
    strip_components: int = 0,
    peers: Any = None,
    admit: Callable[[build.Need], None] | None = None,
    reader: Caller | None = None,
    credentials: Mapping[str, str] | None = None,
    share: Share | None = None,
    live: ondemand.Live | None = None,
    subset: Any = None,
) -> StagedDataset:
    """Stage ``src`` (a directory or tar archive) under DEST/<name> and return the copy.

    ``strip_components`` drops that many leading path components of an archive's
    members, like ``tar --strip-components``.  ``peers`` (a
    :class:`shmstage.cluster.Peers`) stages a directory together with other nodes:
    each reads a share of the source and they exchange the rest.  ``admit(need)`` runs
    once what a restage (or a resume) still writes is known, before its fit is claimed:
    the cache's policy (engine.py, cache/) makes room there or refuses (CapacityError).

    ``reader``: the source is read only with the reader's file-system ids (identity.py), the
    store written with ours: a copy is made, or found current and handed out, only after
    the reader's own walk of the source and a check that they may open every file of it
    (else RefusedError, nothing staged).  ``credentials``: an object store's, instead of
    this process's environment (with a reader and none: no credentials of ours are used);
    ``share``: who besides the reader may read an object-store copy.  ``live``: ondemand.py;
    ``subset``: resident.py."""
    t0 = time.monotonic()
    if reader is not None and reader.is_root:
        reader = None
    if verify not in VERIFY_MODES:
        raise RefusedError(f"invalid verify mode {verify!r}: use size or checksum")
    if workers is not None and workers < 1:
        raise RefusedError(f"invalid number of workers {workers}: must be at least 1")
    raw = os.fspath(src)
    if peers is not None:  # before anything fails: a failure is reported to this job only
        peers.identify(os.path.abspath(raw), name, None if dest is None else os.path.abspath(dest))
    if strip_components < 0:
        raise RefusedError(f"invalid --strip-components {strip_components}: must be 0 or more")
    kind, source = sources.resolve(raw, reader)
    if kind != "tar" and strip_components:
        raise RefusedError(
            f"--strip-components applies to tar archives, and {raw} is a "
            f"{'directory' if kind == 'dir' else 'prefix'}; stage the subdirectory you want instead"
        )
    if kind != "dir" and peers is not None:
        raise RefusedError(
            f"{raw} is not a directory: staging with several nodes reads directories only; "
            "stage it on each node alone (without --nodes), or unpack it on the share"
        )
    name = check_name(name) if name is not None else name_for(source)
    store = Store(dest)
    real_dest = os.path.realpath(store.dest)
    if kind in sources.LISTED_KINDS:
        pass  # not a path on this machine: nothing to overlap
    elif is_within(real_dest, source) or (kind == "dir" and is_within(source, real_dest)):
        raise RefusedError(
            f"source {raw} and destination {store.dest} overlap; stage to a separate directory"
        )

    def report(phase: str, **kw: Any) -> None:
        if progress is not None:
            progress(Progress(phase, elapsed=time.monotonic() - t0, **kw))

    waiting = lambda pid: report("waiting", holder=pid)  # noqa: E731
    if os.path.lexists(store.book) and not store.writable():
        # A store root (or another user) manages: a current copy needs no write.
        store.open(create=False)
        with signals_raise(), store.lock(name, on_wait=waiting, shared=True):
            return _hand_out(store, source, kind, name, force, strip_components, t0)
    store.open()
    # The claim is this stager's share of DEST's free space (reserve.py).
    with signals_raise(), store.lock(name, on_wait=waiting), Claim(store.book, name) as claim:
        try:
            return _stage_locked(
                store,
                source,
                kind,
                name,
                workers,
                verify,
                reserve,
                force,
                report,
                t0,
                claim,
                strip_components,
                peers,
                admit,
                (reader, credentials, share),
                live,
                subset,
            )
        except BaseException:
            drop_unused_lock(store, name)
            raise


def _hand_out(
    store: Store,
    source: str,
    kind: str,
    name: str,
    force: bool,
    strip_components: int,
    t0: float,
) -> StagedDataset:
    """``stage`` for a user who may not write DEST: the published copy if it is current,
    else one line saying what they can do (exit 2).  Reads only."""
    try:
        owner = os.lstat(store.book).st_uid
    except OSError:
        owner = -1
    record = store.published(name)
    manifest = store.manifest_for(record) if record else None
    if record is None or manifest is None:
        why = f"{name} is not staged in {store.dest}"
    elif record.source != source:
        why = f"{store.path(name)} holds {record.source}, not {source}"
    elif force:
        why = f"--force restages {name}"
    else:
        try:
            src = sources.open_source(kind, source, strip_components, None)
            if src.kind == "dir":  # walked as the copy's stager walked it (root: with ACLs)
                src.acls = owner == 0 and acls.supported(store.dest)  # type: ignore[attr-defined]
            stamp = src.stamp()
            if stamp is not None:
                current = all(manifest.get(k) == v for k, v in stamp.items())
            else:
                current = build.current(manifest, src.listing())
        except PermissionDenied as e:
            # Only what the user could read at its source is handed out (a 0700 directory
            # in it shuts them out of the copy too): refused, not failed.
            raise RefusedError(
                f"{name} in {store.dest} is not handed out to you: {e} (you get a staged copy "
                "only where you may read all of its source); ask the source's owner for read access"
            ) from None
        if current:
            return dataset_of(store.touch(record), store, seconds=time.monotonic() - t0)
        why = f"{name} in {store.dest} is out of date with {source}"
    raise RefusedError(f"{why}; {managed_by(store.dest, owner)}")


def _stage_locked(
    store: Store,
    source: str,
    kind: str,
    name: str,
    workers: int | None,
    verify: str,
    reserve: int | None,
    force: bool,
    report: Callable[..., None],
    t0: float,
    claim: Claim,
    strip_components: int = 0,
    peers: Any = None,
    admit: Callable[[build.Need], None] | None = None,
    asker: tuple[Caller | None, Mapping[str, str] | None, Share | None] = (None, None, None),
    live: ondemand.Live | None = None,
    subset: Any = None,
) -> StagedDataset:
    reader, credentials, share = asker
    store.check_published(name)  # DEST/<name> must be our own directory if it exists
    store.recover(name)  # finish a publish a kill interrupted
    views.remove_dead_view(store, name)  # a killed live stager's (run --no-wait)
    views.settle(store, name)  # what a kill left of a partial view
    clear_dead_trash(store, name)  # an old version whose remover was killed
    record = store.published(name)
    manifest = store.manifest_for(record) if record else None
    if record is not None and record.source == source:
        topaccess.check_shared(store.path(name), name, source, reader, share)
    if record is not None:
        topaccess.check_replace(store, record, source, force, reader)
    if record is not None and record.source != source and not force:
        raise RefusedError(
            f"{store.path(name)} already holds {record.source}; stage {source} under another --name, "
            "or pass --force to replace it"
        )
    if record is not None and record.source != source:  # refused before a byte is copied
        with leases.unleased(store, name, source):  # and again at publish
            pass
    same = record is not None and manifest is not None and record.source == source and not force
    src = sources.open_source(kind, source, strip_components, peers, reader, credentials, share)
    if src.kind == "dir":  # root's copies keep owners, so they can keep the ACLs too (acls.py)
        src.acls = src.own and acls.supported(store.dest)  # type: ignore[attr-defined]
    report("scanning")
    part = store.partial(name)
    marker = os.path.join(store.partial_dir, f".{name}.source")
    prev_marker = read_marker(marker)  # put back if the fit check refuses
    # A first copy with no peers copies while its walk runs; with peers each reads a share.
    cold = record is None and not os.path.lexists(part) and live is None
    if live is not None:
        live.restrict_top = lambda top: topaccess.restrict_new(top, source, kind, src, reader)

    def unchanged() -> StagedDataset:
        drop_leftovers(store, name, marker)
        if kind not in sources.LISTED_KINDS:
            topaccess.recheck(store, name, source, kind, manifest, reader)
        if subset is not None:  # the part in RAM is current; the rest may have changed
            subset.current(store, name, record)
        return dataset_of(store.touch(record), store, seconds=time.monotonic() - t0)  # type: ignore[arg-type]

    try:
        if cold and peers is None and src.kind == "dir" and subset is None:  # build/fromdir.py
            write_marker(marker, source)
            _kill_at("marker")
            tree = fromdir.build_first(src, store, name, workers, verify, reserve, report, claim)
            _kill_at("build")
            built = build.Built(tree.bytes, tree.bytes, tree.files, tree.entries[0][4])
        else:
            stamp = src.stamp()  # a tar archive: its size, mtime and inode, without a read
            if same and stamp is not None and all(manifest.get(k) == v for k, v in stamp.items()):  # type: ignore[union-attr]
                return unchanged()
            listing = src.listing()  # a walk, an archive's headers, one LIST
            if subset is not None:
                listing = subset.select(listing, store, name)
            current = same and stamp is None and build.current(manifest, listing)
            if peers is not None and not peers.agree(src.tree, current, cold) and current:
                peers.fill([], lambda b, f: None, False)  # the others need our share
                peers.barrier()
            if current:
                return unchanged()
            resumable = not force and prev_marker == source
            write_marker(marker, source)
            _kill_at("marker")
            built = build.build(
                store, name, src, listing, manifest if same else None, workers, verify,
                reserve, resumable, report, claim, admit, live,
            )  # fmt: skip
            _kill_at("build")
        _kill_at("manifest")
        if peers is not None:
            peers.barrier()  # all or nothing: publish only once every node has every byte
        report("publishing")
        if kind not in sources.LISTED_KINDS:  # no reader the source path shuts out
            topaccess.restrict_new(part, source, kind, src, reader, built.top_mode)
        elif built.top_mode is not None:  # closed while in flight (build/tree.py: finish_tree)
            os.chmod(part, stat.S_IMODE(built.top_mode))
        root = os.lstat(part)
        now = time.time()
        seconds = time.monotonic() - t0
        new = Record(
            name,
            source,
            kind,
            built.bytes,
            built.files,
            now,
            now,
            seconds,
            root.st_ino,
            root.st_dev,
        )
        new = subset.publishing(store, name, new) if subset is not None else new  # its view
        if built.copied < built.bytes and (record is None or record.memcg != new.memcg):
            # Kept or linked files stay charged to whoever wrote them (a killed run, the old
            # version's stager): make-room must not count them as ours (None: counts 0).
            new = replace(new, memcg=None)
        if record is not None and record.source != source:
            with leases.unleased(store, name, source):  # a new lease waits for the exchange
                _publish(store, name, new, marker)
        else:
            _publish(store, name, new, marker)
        if live is not None:
            live.published()
        views.settle(store, name)  # NOTE [partial view]: the new tree's view, or none
        return dataset_of(new, store, changed=True, copied_bytes=built.copied, seconds=seconds)
    except BaseException as e:
        # Ctrl-C, SIGTERM, a failed copy: never leave a half tree (in RAM) behind.
        if isinstance(e, CapacityError):  # refused before writing: leave everything as it was,
            restore_marker(marker, prev_marker)  # a resumable partial included (exit 2)
            raise
        if getattr(e, "keeps_partial", False):  # another node failed: resume from here next time
            raise
        with suppress(OSError):  # never hide why it failed; what stays, gc removes
            store.discard(part)
        remove_marker(marker)
        nxt = store.read_next(name)
        if nxt is None or store.published(name) != nxt:  # else it describes DEST/<name> now
            with suppress(OSError):
                os.unlink(store.new_manifest_path(name))  # ~100 MB for ImageNet
        if (
            isinstance(e, copier.CopyFailed)
            and e.failure.kind == "write"
            and e.failure.errno in (errno.ENOSPC, errno.EDQUOT)
        ):
            where = e.failure.path
            if where.startswith(part + "/"):
                where = where[len(part) + 1 :]
            raise ShmstageError(
                f"no space left on {store.dest} while copying {where}; the partial copy was removed "
                "and other staged datasets are untouched: free space, lower --reserve, or grow the tmpfs "
                "with `shmstage remount --size ...`"
            ) from None
        if isinstance(e, OSError):
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ShmstageError(
                    f"no space left on {store.dest}; the partial copy was removed and other staged "
                    "datasets are untouched: free space or grow the tmpfs with `shmstage remount --size ...`"
                ) from None
            raise ShmstageError(
                f"cannot stage into {store.dest}: {e.strerror}: {e.filename}"
            ) from None
        raise


def restage_need(
    src: str | os.PathLike[str],
    *,
    name: str,
    dest: str | os.PathLike[str] | None = None,
    force: bool = False,
    strip_components: int = 0,
    reader: Caller | None = None,
    credentials: Mapping[str, str] | None = None,
) -> build.Need | None:
    """Read-only: what ``stage`` would write restaging ``src`` over its published copy in
    ``dest`` (the engine's own count: unchanged files are linked, a resume keeps what it
    has), or None when ``name`` is not published there.  An unchanged source needs
    nothing (``bytes`` 0, ``total`` 0).  The same refusal as ``stage`` for another source.
    ``reader``, ``credentials``: as ``stage`` reads the source."""
    kind, source = sources.resolve(os.fspath(src), reader)
    store = Store(dest)
    if not os.path.lexists(store.book):
        return None
    record = store.published(check_name(name))
    if record is None:
        return None
    topaccess.check_shared(store.path(name), name, record.source, reader)
    if record.source != source and not force:  # stage's own refusal
        raise RefusedError(
            f"{store.path(name)} already holds {record.source}; stage {source} under another --name, "
            "or pass --force to replace it"
        )
    manifest = store.manifest_for(record)
    same = manifest is not None and record.source == source and not force
    opened = sources.open_source(kind, source, strip_components, None, reader, credentials)
    stamp = opened.stamp()
    if same and stamp is not None and all(manifest.get(k) == v for k, v in stamp.items()):  # type: ignore[union-attr]
        return build.Need(0, 0, 0, 0)
    listing = opened.listing()
    if same and stamp is None and build.current(manifest, listing):
        return build.Need(0, 0, 0, 0)
    marker = os.path.join(store.partial_dir, f".{name}.source")
    resumable = not force and read_marker(marker) == source
    incremental = opened.incremental
    entries: list[Any] = [list(e) for e in listing.entries] if incremental else listing.entries
    need, _, _ = build.to_write(
        store, name, entries, listing.keys, manifest if same else None, resumable, incremental
    )
    return need


# NOTE [partial view]: a --partial copy and its view change in one step.
#
#   A partial view names the tree it describes (its root inode); ``read_view`` takes no
#   view over another tree.  A restage writes the new tree's view to views/.<name>.next.view
#   before the publish; the exchange of the trees makes it the valid one (read_view looks
#   there too), and ``views.settle`` then swaps it into views/<name> (RENAME_EXCHANGE).  A
#   kill anywhere leaves the old copy with its view, or the new copy with its own; an old
#   partial view over a whole copy is none, and the next stage or gc removes what is left.
#   An up-to-date restage whose unlisted files changed swaps the view in one step too.

# NOTE [publish]: publish and record are one step a kill cannot split.
#
#   build partial/<name> -> manifests/.<name>.json.new -> meta/.<name>.next.json (the new
#   tree's inode: renameat2 keeps it) -> exchange (DEST/<name> <-> partial/<name>) -> old
#   tree to trash -> commit manifest -> meta/<name>.json -> drop .next -> drop marker -> rm trash
#
# Before the exchange DEST/<name> matches the old record, after it the .next one, so
# ``published`` (and ``list``, ``find``, leases) sees a complete dataset at every instant;
# the next locked operation (stage, evict, gc) runs ``Store.recover`` to finish the step.
# A partial tree, a marker, a stale .new manifest or a trash tree left by a kill shows in
# ``list`` (unfinished / trash) and ``gc`` or ``evict`` removes it.

KILL_STEPS = ("marker", "build", "manifest", "record", "exchange", "trash", "commit", "final")


def _kill_at(step: str) -> None:
    """TEST ONLY: SIGKILL ourselves at ``step`` when $SHMSTAGE_TEST_KILL_AT names it (SIGTERM
    for ``STEP:TERM``), so tests can check every state a kill leaves is visible and removable."""
    want = os.environ.get("SHMSTAGE_TEST_KILL_AT")
    if want == step:
        os.kill(os.getpid(), signal.SIGKILL)
    elif want == step + ":TERM":
        os.kill(os.getpid(), signal.SIGTERM)


def _publish(store: Store, name: str, new: Record, marker: str) -> None:
    """Publish partial/<name> as ``new`` (see NOTE [publish])."""
    leases.ensure_file(store, name)  # before readers can see it: a reader may not write DEST
    store.share_bookkeeping(name, store.partial(name))  # the manifest: as the new copy's top
    store.write_next(new)
    _kill_at("record")
    old = store.publish(name)
    _kill_at("exchange")
    if old is not None:
        old = store.to_trash(old)
        _kill_at("trash")
    store.commit_manifest(name)
    _kill_at("commit")
    store.write_record(new)
    _kill_at("final")
    with suppress(FileNotFoundError):
        os.unlink(store.next_path(name))
    remove_marker(marker)
    if old is not None:
        rmtree(old)
