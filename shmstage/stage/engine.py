"""stage / find / list / verify / evict: the staging engine's public operations.

``stage`` takes the dataset's lock, asks the source (stage/sources.py) whether the published
copy is current (a no-op when it is), builds the new version in ``partial/<name>``
(stage/build.py: fit, resume, hard links to unchanged files, fetch, manifest), then
publishes it atomically.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from typing import Any

from shmstage import errors
from shmstage.errors import CapacityError, PermissionDenied, RefusedError, ShmstageError
from shmstage.paths import is_within
from shmstage.sizes import format_size
from shmstage.stage import access, leases
from shmstage.stage.build import copier, fromdir
from shmstage.stage.build import partial as build
from shmstage.stage.leases import Holder
from shmstage.stage.reserve import Claim
from shmstage.stage.sources import kinds as sources
from shmstage.stage.sources import tar as tarsrc
from shmstage.stage.sources.beneath import SOURCE_TOP, SourceTree, ident, join_ident, split_ident
from shmstage.stage.sources.directory import DirSource
from shmstage.stage.sources.walk import walk
from shmstage.stage.store import (
    Record,
    Store,
    _rmtree,
    alive,
    cannot_remove,
    check_name,
    managed_by,
    name_for,
    trash_owner,
)

VERIFY_MODES = ("size", "checksum")


@dataclass(frozen=True)
class StagedDataset:
    """A complete, published copy of a dataset."""

    name: str
    source: str
    path: str  # DEST/<name>: exactly the source tree
    bytes: int
    files: int
    staged_at: float  # epoch seconds of the last (re)publish
    last_used: float  # epoch seconds of the last stage()/find() that returned it
    changed: bool = False  # this call copied something
    copied_bytes: int = 0
    seconds: float = 0.0  # this call's wall time (list(): the last staging's)


@dataclass(frozen=True)
class Listed(StagedDataset):
    """What ``list_staged`` returns: a dataset, and (with ``unfinished``) the leftovers too."""

    # unfinished: path is the partial tree, bytes/files are so far; trash: an old tree
    state: str = "staged"  # "staged", "unfinished" (in progress or killed) or "trash"
    stager_alive: bool = False  # unfinished/trash: a live process owns it
    stager_pid: int | None = None  # that process
    leased_by: tuple[int, ...] = ()  # pids holding a lease (see shmstage.stage.leases)


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


@dataclass(frozen=True)
class Difference:
    path: str
    problem: str  # "missing", "extra", "changed", "content"
    detail: str = ""


@dataclass(frozen=True)
class VerifyReport:
    name: str
    path: str
    source: str
    checksum: bool
    files: int  # regular files checked
    ok: bool
    differences: list[Difference] = field(default_factory=list)


class Interrupted(errors.Interrupted):
    """SIGTERM (or SIGHUP) arrived while staging; the partial copy was removed."""

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(signum, f"interrupted by {name}; the partial copy was removed")


def _dataset(record: Record, store: Store, **kw: Any) -> StagedDataset:
    return StagedDataset(
        name=record.name,
        source=record.source,
        path=store.path(record.name),
        bytes=record.bytes,
        files=record.files,
        staged_at=record.staged_at,
        last_used=record.last_used,
        **kw,
    )


# --- stage ---------------------------------------------------------------------------


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
) -> StagedDataset:
    """Stage ``src`` (a directory or tar archive) under DEST/<name> and return the copy.

    ``strip_components`` drops that many leading path components of an archive's
    members, like ``tar --strip-components``.  ``peers`` (a
    :class:`shmstage.cluster.Peers`) stages a directory together with other nodes:
    each reads a share of the source and they exchange the rest.  ``admit(need)`` runs
    once what a restage (or a resume) still writes is known, before its fit is claimed:
    the cache's policy (tiers.py) makes room there or refuses (CapacityError)."""
    t0 = time.monotonic()
    if verify not in VERIFY_MODES:
        raise RefusedError(f"invalid verify mode {verify!r}: use size or checksum")
    if workers is not None and workers < 1:
        raise RefusedError(f"invalid number of workers {workers}: must be at least 1")
    raw = os.fspath(src)
    if peers is not None:  # before anything fails: a failure is reported to this job only
        peers.identify(os.path.abspath(raw), name, None if dest is None else os.path.abspath(dest))
    if strip_components < 0:
        raise RefusedError(f"invalid --strip-components {strip_components}: must be 0 or more")
    kind, source = sources.resolve(raw)
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
        with _signals_raise(), store.lock(name, on_wait=waiting, shared=True):
            return _hand_out(store, source, kind, name, force, strip_components, t0)
    store.open()
    # The claim is this stager's share of DEST's free space (reserve.py).
    with _signals_raise(), store.lock(name, on_wait=waiting), Claim(store.book, name) as claim:
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
            )
        except BaseException:
            _drop_unused_lock(store, name)
            raise


def _drop_unused_lock(store: Store, name: str) -> None:
    """A failed first stage (a full tmpfs, a refusal) leaves nothing of ``name``: not even its
    lock file.  Unlinked while we hold it, as evict does (waiters then lock a new file)."""
    left = (
        store.path(name),
        store.partial(name),
        os.path.join(store.partial_dir, f".{name}.source"),
        store.meta_path(name),
        store.next_path(name),
        store.manifest_path(name),
        store.new_manifest_path(name),
    )
    with suppress(OSError):
        if not any(os.path.lexists(p) for p in left):
            store.drop_lock(name)


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
            return _dataset(store.touch(record), store, seconds=time.monotonic() - t0)
        why = f"{name} in {store.dest} is out of date with {source}"
    raise RefusedError(f"{why}; {managed_by(store.dest, owner)}")


@contextmanager
def _signals_raise() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into an exception so cleanup runs (Ctrl-C already raises).

    Once one of them (or ^C) is taken, SIGINT/SIGTERM/SIGHUP are only noted until the
    cleanup is done: an impatient second signal must not unwind the cleanup half-way (the
    partial in trash, the lock, the new manifest left behind while the message says it was
    removed).  The first signal decides how we die.  A Python handler, not a blocked mask:
    the copier's threads would take a process-directed signal the main thread blocks."""
    if threading.current_thread() is threading.main_thread():
        stopping = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        # Only where the default applies: `nohup` (SIG_IGN) and a caller's own handler win.
        ours = {
            s
            for s in stopping
            if signal.getsignal(s)
            == (signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        }
        with _stopping_held(ours):
            yield
    else:
        yield


@contextmanager
def _stopping_held(ours: set[signal.Signals]) -> Iterator[None]:
    def later(signum: int, frame: Any) -> None:
        pass  # the first signal is being acted on: this one changes nothing

    def handler(signum: int, frame: Any) -> None:
        for s in ours:
            signal.signal(s, later)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in ours}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


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
) -> StagedDataset:
    store.check_published(name)  # DEST/<name> must be our own directory if it exists
    store.recover(name)  # finish a publish a kill interrupted
    _clear_dead_trash(store, name)  # an old version whose remover was killed
    record = store.published(name)
    manifest = store.manifest_for(record) if record else None
    if record is not None and record.source != source and not force:
        raise RefusedError(
            f"{store.path(name)} already holds {record.source}; stage {source} under another --name, "
            "or pass --force to replace it"
        )
    same = record is not None and manifest is not None and record.source == source and not force
    src = sources.open_source(kind, source, strip_components, peers)
    report("scanning")
    part = store.partial(name)
    marker = os.path.join(store.partial_dir, f".{name}.source")
    prev_marker = _read_marker(marker)  # put back if the fit check refuses
    # A first copy with no peers copies while its walk runs; with peers each reads a share.
    cold = record is None and not os.path.lexists(part)

    def unchanged() -> StagedDataset:
        _drop_leftovers(store, name, marker)
        if kind not in sources.LISTED_KINDS:
            _recheck_access(store, name, source, kind, manifest)
        return _dataset(store.touch(record), store, seconds=time.monotonic() - t0)  # type: ignore[arg-type]

    try:
        if cold and peers is None and isinstance(src, DirSource):
            _write_marker(marker, source)
            _kill_at("marker")
            tree = fromdir.build_first(src, store, name, workers, verify, reserve, report, claim)
            _kill_at("build")
            built = build.Built(tree.bytes, tree.bytes, tree.files)
        else:
            stamp = src.stamp()  # a tar archive: its size, mtime and inode, without a read
            if same and stamp is not None and all(manifest.get(k) == v for k, v in stamp.items()):  # type: ignore[union-attr]
                return unchanged()
            listing = src.listing()  # a walk, an archive's headers, one LIST
            current = same and stamp is None and build.current(manifest, listing)
            if peers is not None and not peers.agree(src.tree, current, cold) and current:
                peers.fill([], lambda b, f: None, False)  # the others need our share
                peers.barrier()
            if current:
                return unchanged()
            resumable = not force and prev_marker == source
            _write_marker(marker, source)
            _kill_at("marker")
            built = build.build(
                store, name, src, listing, manifest if same else None, workers, verify,
                reserve, resumable, report, claim, admit,
            )  # fmt: skip
            _kill_at("build")
        _kill_at("manifest")
        if peers is not None:
            peers.barrier()  # all or nothing: publish only once every node has every byte
        report("publishing")
        if kind not in sources.LISTED_KINDS:  # no reader the source path shuts out
            walked = getattr(src, "tree", None)
            top = _checked_top(
                source,
                kind,
                {SOURCE_TOP: split_ident(walked.top)} if walked is not None else {},
                getattr(src, "fingerprint", None),
            )
            access.restrict_root(part, source, kind, owner=top)
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
        if built.copied < built.bytes and (record is None or record.memcg != new.memcg):
            # Kept or linked files stay charged to whoever wrote them (a killed run, the old
            # version's stager): make-room must not count them as ours (None: counts 0).
            new = replace(new, memcg=None)
        _publish(store, name, new, marker)
        return _dataset(new, store, changed=True, copied_bytes=built.copied, seconds=seconds)
    except BaseException as e:
        # Ctrl-C, SIGTERM, a failed copy: never leave a half tree (in RAM) behind.
        if isinstance(e, CapacityError):  # refused before writing: leave everything as it was,
            _restore_marker(marker, prev_marker)  # a resumable partial included (exit 2)
            raise
        if getattr(e, "keeps_partial", False):  # another node failed: resume from here next time
            raise
        with suppress(OSError):  # never hide why it failed; what stays, gc removes
            store.discard(part)
        _remove_marker(marker)
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
) -> build.Need | None:
    """Read-only: what ``stage`` would write restaging ``src`` over its published copy in
    ``dest`` (the engine's own count: unchanged files are linked, a resume keeps what it
    has), or None when ``name`` is not published there.  An unchanged source needs
    nothing (``bytes`` 0, ``total`` 0).  The same refusal as ``stage`` for another source."""
    kind, source = sources.resolve(os.fspath(src))
    store = Store(dest)
    if not os.path.lexists(store.book):
        return None
    record = store.published(check_name(name))
    if record is None:
        return None
    if record.source != source and not force:  # stage's own refusal
        raise RefusedError(
            f"{store.path(name)} already holds {record.source}; stage {source} under another --name, "
            "or pass --force to replace it"
        )
    manifest = store.manifest_for(record)
    same = manifest is not None and record.source == source and not force
    opened = sources.open_source(kind, source, strip_components, None)
    stamp = opened.stamp()
    if same and stamp is not None and all(manifest.get(k) == v for k, v in stamp.items()):  # type: ignore[union-attr]
        return build.Need(0, 0, 0, 0)
    listing = opened.listing()
    if same and stamp is None and build.current(manifest, listing):
        return build.Need(0, 0, 0, 0)
    marker = os.path.join(store.partial_dir, f".{name}.source")
    resumable = not force and _read_marker(marker) == source
    incremental = opened.incremental
    entries: list[Any] = [list(e) for e in listing.entries] if incremental else listing.entries
    need, _, _ = build.to_write(
        store, name, entries, listing.keys, manifest if same else None, resumable, incremental
    )
    return need


def _recheck_access(
    store: Store, name: str, source: str, kind: str, manifest: dict[str, Any] | None
) -> None:
    """An unchanged source: its path may have opened or closed since the copy was made.
    The root's owner is put back only from the very top the stage walked (not a link, and
    for a directory the [dev, ino] its manifest recorded)."""
    with suppress(OSError, KeyError, IndexError, TypeError):  # best effort: not our copy, ...
        access.restrict_root(
            store.path(name),
            source,
            kind,
            manifest["entries"][0][4],  # type: ignore[index]
            _checked_top(source, kind, manifest, (manifest or {}).get("archive")),
        )


def _checked_top(
    source: str, kind: str, manifest: dict[str, Any] | None, archive: list[int] | None
) -> os.stat_result | None:
    """The source's top as the stage read it (a directory's [dev, ino] as the manifest
    records it; a tar archive's fingerprint [size, mtime, ino]), or None when it is not that
    any more (its owner swapped it for a link to someone else's, say): the copy's root
    takes its owner from it."""
    try:
        top = os.stat(source.rstrip("/") or "/", follow_symlinks=False)
    except OSError:
        return None
    if kind == "dir":
        recorded = (manifest or {}).get(SOURCE_TOP)
        same = stat.S_ISDIR(top.st_mode) and (not recorded or ident(top) == join_ident(recorded))
    else:
        same = stat.S_ISREG(top.st_mode) and (
            not archive or [top.st_size, top.st_mtime_ns, top.st_ino] == list(archive)
        )
    return top if same else None


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
    _remove_marker(marker)
    if old is not None:
        _rmtree(old)


def _clear_dead_trash(store: Store, name: str) -> None:
    for entry in _listdir(store.trash_dir):
        owner, pid, start = trash_owner(entry)
        if owner == name and pid is not None and not alive(pid, start):
            _rmtree(os.path.join(store.trash_dir, entry))


def _drop_leftovers(store: Store, name: str, marker: str) -> None:
    """The published copy is current: what a killed run left in partial/ is of no use."""
    store.discard(store.partial(name))
    _remove_marker(marker)
    with suppress(FileNotFoundError):
        os.unlink(store.new_manifest_path(name))


def _write_marker(path: str, source: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(source)  # a path's bytes, UTF-8 or not


def _read_marker(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, encoding="utf-8", errors="surrogateescape") as f:
        return f.read()


def _remove_marker(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def _restore_marker(path: str, source: str | None) -> None:
    if source is None:
        _remove_marker(path)
    elif _read_marker(path) != source:
        _write_marker(path, source)


# --- find / list -------------------------------------------------------------------------


def find(
    name_or_source: str | os.PathLike[str], dest: str | os.PathLike[str] | None = None
) -> StagedDataset | None:
    """The complete published copy of a dataset, by name or by source path; None if not staged."""
    key = os.fspath(name_or_source)
    store = Store(dest)
    if not os.path.lexists(store.book):
        return None
    store.open(create=False)
    record = None
    if "/" not in key:
        try:
            record = store.published(check_name(key))
        except RefusedError:
            record = None
    if record is None and (os.sep in key or os.path.exists(key)):
        source = sources.location_of(key)
        for n in store.names():
            r = store.published(n)
            if r is not None and r.source == source:
                record = r
                break
    if record is None:
        return None
    return _dataset(store.touch(record), store)


def list_staged(
    dest: str | os.PathLike[str] | None = None, *, unfinished: bool = False
) -> list[Listed]:
    """Every complete published dataset under DEST, by name; with ``unfinished``, also the
    partial copies (in progress or left by a killed run) and old trees still in trash."""
    store = Store(dest)
    if not os.path.lexists(store.book):
        return []
    store.open(create=False)
    out = []
    for n in store.names():
        r = store.published(n)
        if r is not None:
            leased = tuple(h.pid for h in leases.holders(n, store.dest))
            out.append(Listed(**_dataset(r, store, seconds=r.seconds).__dict__, leased_by=leased))
    if unfinished:
        out.extend(_leftovers(store))
    return out


def _leftovers(store: Store) -> list[Listed]:
    out = []
    for entry in _listdir(store.partial_dir):
        path = os.path.join(store.partial_dir, entry)
        if entry.startswith(".") or not os.path.isdir(path) or os.path.islink(path):
            continue
        source = _read_marker(os.path.join(store.partial_dir, f".{entry}.source")) or ""
        pids = _lock_holders(store, entry)
        size, files = _tree_size(path)
        out.append(
            Listed(
                entry, source, path, size, files, 0.0, 0.0, state="unfinished",
                stager_alive=bool(pids), stager_pid=pids[0] if pids else None,
            )
        )  # fmt: skip
    for entry in _listdir(store.trash_dir):
        path = os.path.join(store.trash_dir, entry)
        name, pid, start = trash_owner(entry)
        size, files = _tree_size(path)
        live = pid is not None and alive(pid, start)
        out.append(
            Listed(
                name, "", path, size, files, 0.0, 0.0, state="trash",
                stager_alive=live, stager_pid=pid if live else None,
            )
        )  # fmt: skip
    return out


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:  # missing, or partial/ and trash/ (0700) of a store another user owns
        return []


def _lock_holders(store: Store, name: str) -> tuple[int, ...]:
    """Pids holding the dataset's lock (a live stager or evict), from /proc/locks."""
    try:
        st = os.lstat(store.lock_path(name))
    except OSError:
        return ()
    return tuple(h.pid for h in leases.holders_of(st.st_dev, st.st_ino))


def _tree_size(path: str) -> tuple[int, int]:
    """Bytes and files in a tree so far (regular files' sizes)."""
    size = files = 0
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            size += e.stat(follow_symlinks=False).st_size
                            files += 1
                    except OSError:
                        continue
        except OSError:
            continue
    if os.path.isfile(path) and not os.path.islink(path):
        with suppress(OSError):
            return os.lstat(path).st_size, 1
    return size, files


# --- verify -------------------------------------------------------------------------------


def verify(
    name: str,
    dest: str | os.PathLike[str] | None = None,
    checksum: bool = False,
    *,
    workers: int | None = None,
) -> VerifyReport:
    """Compare DEST/<name> with its manifest (and, with ``checksum``, every byte with the source)."""
    store = Store(dest)
    record = (
        store.open(create=False).published(check_name(name))
        if os.path.lexists(store.book)
        else None
    )
    manifest = store.manifest_for(record) if record else None
    if record is None or manifest is None:
        raise ShmstageError(f"{name} is not staged in {store.dest} (see `shmstage list`)")
    path = store.path(name)
    expected = {e[0]: _norm(e) for e in manifest["entries"]}
    actual = {e[0]: _norm(list(e)) for e in walk(path, check_links=False, hardlinks=False).entries}
    diffs: list[Difference] = []
    for rel, want in expected.items():
        have = actual.get(rel)
        if have is None:
            diffs.append(Difference(rel, "missing"))
        elif have != want and not (
            rel == "." and have[:4] == want[:4] and access.is_restriction(want[4], have[4])
        ):
            diffs.append(Difference(rel, "changed", _what_changed(want, have)))
    for rel in actual:
        if rel not in expected:
            diffs.append(Difference(rel, "extra"))
    files = sum(1 for e in expected.values() if e[1] == "f")
    if checksum:
        damaged = {d.path for d in diffs}
        if record.kind == "tar":
            if not os.path.isfile(record.source):
                raise ShmstageError(f"cannot compare checksums: the source {record.source} is gone")
            bad = tarsrc.compare(record.source, path, manifest.get("strip_components", 0))
        elif record.kind in sources.LISTED_KINDS:  # against the ETags: no download
            from shmstage.stage.sources.s3 import compare

            bad = compare(manifest, path)
        else:
            if not os.path.isdir(record.source):
                raise ShmstageError(f"cannot compare checksums: the source {record.source} is gone")
            top = _verified_top(record.source, manifest)
            jobs = [
                (
                    os.path.join(record.source, rel),
                    os.path.join(path, rel),
                    e[2],
                    e[3],
                    0,
                    e[4],
                    rel,
                )
                for rel, e in expected.items()
                if e[1] == "f" and rel not in damaged
            ]
            with top:  # the workers read below this very directory (inherited), never the path
                tops = {record.source.rstrip("/") + "/": top}
                bad = copier.compare(jobs, workers or copier.default_workers(), tops)
        diffs.extend(
            Difference(rel, "content", "bytes differ from the source")
            for rel in sorted(set(bad))
            if rel not in damaged
        )
    diffs.sort(key=lambda d: d.path)
    return VerifyReport(name, path, record.source, checksum, files, not diffs, diffs)


def _verified_top(source: str, manifest: dict[str, Any]) -> SourceTree:
    """The source's top for verify --checksum, opened once: the directory the stage walked
    (its [dev, ino] in the manifest), else at least no symlink in its place (a manifest of
    an older stage): a top swapped for another directory would make verify an oracle on
    files its owner cannot read."""
    recorded = manifest.get(SOURCE_TOP)
    try:
        if recorded:
            return SourceTree(source, join_ident(recorded))
        if os.path.islink(source.rstrip("/")):
            raise OSError(errno.ELOOP, "a symlink", source)
        return SourceTree(source)
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.ELOOP, errno.ENOTDIR):
            raise ShmstageError(
                f"cannot compare checksums: the source {source} is not the directory that was "
                "staged (replaced since, by a symlink or another directory); re-stage it, and "
                "check who can change it"
            ) from None
        raise ShmstageError(
            f"cannot compare checksums: cannot read {source}: {e.strerror}"
        ) from None


def _norm(e: list[Any]) -> list[Any]:
    rel, kind, size, mtime, mode, extra = e
    if kind == "h":
        return [rel, "f", size, mtime, mode, None]
    if kind == "d":
        return [rel, "d", 0, 0, mode, None]  # a directory's mtime is not data
    return [rel, kind, size, mtime, mode, extra]


def _what_changed(want: list[Any], have: list[Any]) -> str:
    if want[1] != have[1]:
        kinds = {"f": "file", "d": "directory", "l": "symlink"}
        return f"{kinds.get(want[1], want[1])} became a {kinds.get(have[1], have[1])}"
    parts = []
    if want[2] != have[2]:
        parts.append(f"size {want[2]} -> {have[2]}")
    if want[3] != have[3]:
        parts.append("mtime")
    if want[4] != have[4]:
        parts.append(f"mode {want[4]:o} -> {have[4]:o}")
    if want[5] != have[5]:
        parts.append(f"target {want[5]} -> {have[5]}")
    return ", ".join(parts)


# --- evict --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Leased:
    """A dataset jobs hold leases on, and who (see :mod:`shmstage.stage.leases`)."""

    name: str
    holders: tuple[Holder, ...]  # the processes holding its lease


@dataclass(frozen=True)
class EvictReport:
    evicted: tuple[str, ...]  # names removed (dry_run: that would be)
    in_use: tuple[Leased, ...] = ()  # skipped: leased by a running job (--all, --older-than)
    forced: tuple[Leased, ...] = ()  # removed anyway (force): these jobs will fail
    dry_run: bool = False  # nothing was removed


def evict(
    name: str | None = None,
    *,
    dest: str | os.PathLike[str] | None = None,
    all: bool = False,
    older_than: float | None = None,
    dry_run: bool = False,
    force: bool = False,
) -> list[str]:
    """Remove staged datasets (one by name, all, or those unused for ``older_than`` seconds);
    returns the names removed.  See :func:`evict_report` for what was skipped."""
    report = evict_report(
        name, dest=dest, all=all, older_than=older_than, dry_run=dry_run, force=force
    )
    return list(report.evicted)


def evict_report(
    name: str | None = None,
    *,
    dest: str | os.PathLike[str] | None = None,
    all: bool = False,
    older_than: float | None = None,
    dry_run: bool = False,
    force: bool = False,
) -> EvictReport:
    """Remove staged datasets.  A dataset a job leases is refused by name (``leases.InUse``)
    and skipped by ``all``/``older_than`` (listed in ``in_use``), unless ``force``.
    ``all`` also runs :func:`shmstage.stage.gc.gc`: only the empty skeleton stays."""
    chosen = sum(x for x in (name is not None, bool(all), older_than is not None))
    if chosen != 1:
        raise RefusedError("evict needs exactly one of NAME, --all or --older-than")
    store = Store(dest)
    if not os.path.lexists(store.book):
        if name is not None:
            raise ShmstageError(f"{name} is not staged in {store.dest} (see `shmstage list`)")
        return EvictReport((), dry_run=dry_run)
    store.open(create=False)
    if name is not None:
        check_name(name)
        if not (
            store.read_record(name)
            or store.read_next(name)
            or os.path.lexists(store.path(name))
            or os.path.lexists(store.partial(name))
        ):
            raise ShmstageError(f"{name} is not staged in {store.dest} (see `shmstage list`)")
        targets = [name]
    else:
        now = time.time()
        targets = []
        for n in store.names():
            r = store.read_record(n) or store.read_next(n)
            if r is None:
                continue
            if all or now - max(r.last_used, r.staged_at) >= (older_than or 0):
                targets.append(n)
    evicted: list[str] = []
    in_use: list[Leased] = []
    forced: list[Leased] = []
    for n in targets:
        if dry_run:
            holders = leases.holders(n, store.dest)
            if holders and not force:
                if name is not None:
                    raise leases.InUse(n, holders)
                in_use.append(Leased(n, holders))
            else:
                evicted.append(n)
            continue
        try:
            with store.lock(n, wait=False):
                # With the file in place, a lease taken from now on is seen below, or waits
                # for us and then finds the dataset gone.
                leases.ensure_file(store, n)
                fd, holders = leases.try_exclusive(store, n)
                try:
                    if holders:
                        if not force:
                            raise leases.InUse(n, holders)
                        forced.append(Leased(n, holders))
                    store.check_published(n)
                    try:
                        store.discard(store.path(n))
                        store.discard(store.partial(n))
                    except OSError as e:
                        raise cannot_remove(e, e.filename or store.path(n)) from None
                    _remove_marker(os.path.join(store.partial_dir, f".{n}.source"))
                    store.forget(n)
                    leases.unlink_locked(store, n)
                    store.drop_lock(n)  # nothing of the dataset is left behind
                    store.drop_placing(n)
                finally:
                    if fd is not None:
                        os.close(fd)
        except leases.InUse as e:
            if name is not None:
                raise
            in_use.append(Leased(n, e.holders))
            continue
        except RefusedError:
            if name is not None:
                raise
            continue  # being staged right now: in use, not ours to remove
        evicted.append(n)
    if all and not dry_run:
        from shmstage.stage.gc import gc

        gc(store.dest)  # leftovers of killed runs: partial trees, markers, trash, stale files
    return EvictReport(tuple(evicted), tuple(in_use), tuple(forced), dry_run)


def summary(ds: StagedDataset) -> str:
    """One line for stderr after ``stage``."""
    rate = ds.copied_bytes / ds.seconds if ds.seconds > 0 else 0
    if not ds.changed:
        return f"{ds.name} is up to date ({ds.files} files, {format_size(ds.bytes)}) in {ds.seconds:.2f} s"
    return (
        f"staged {ds.name}: {ds.files} files, {format_size(ds.bytes)} "
        f"({format_size(ds.copied_bytes)} copied) in {ds.seconds:.2f} s ({format_size(rate)}/s)"
    )
