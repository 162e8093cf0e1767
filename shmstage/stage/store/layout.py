"""The Store: the layout under DEST (published datasets, and the bookkeeping beside them in
``DEST/.shmstage/``, see the package docstring of shmstage.stage for the map), its records
and manifests, and atomic publish, trash and recovery.

Long because the Store is one object that every write under DEST goes through: opening and
checking the tree, locks, records, manifests, publish and removal share its paths and checks.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from shmstage import system
from shmstage.errors import RefusedError, ShmstageError
from shmstage.libc import load_libc
from shmstage.stage.store import access, served
from shmstage.stage.store.checks import (
    check_dir,
    check_owner,
    lock_dir_checked,
    lock_dir_mode,
    makedirs_checked,
    mkdir_checked,
    os_error,
)
from shmstage.stage.store.locks import Busy, drop_unheld, lock_file, me
from shmstage.stage.store.names import BOOK, resolve_dest
from shmstage.stage.store.trees import rmtree

FORMAT = 1
PLACING = "placing"  # DEST/.shmstage/placing/<name>: flocked while choosing <name>'s tier
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@dataclass(frozen=True)
class Record:
    """The summary kept in ``meta/<name>.json`` for one published dataset."""

    name: str
    source: str
    kind: str  # "dir" or "tar"
    bytes: int
    files: int
    staged_at: float
    last_used: float
    seconds: float
    root_ino: int  # inode of DEST/<name> when published: ties the record to that exact tree
    # st_dev when published: kept for the format, never compared (a block device's number
    # changes when NVMe is renumbered at boot or a loop device is re-attached; see same_tree)
    root_dev: int
    # The stager's memory cgroup (system.memory_cgroup_id): the dataset's tmpfs pages are
    # charged there, so evicting it gives RAM back only to that cgroup and its ancestors
    # (make-room).  None in a record from before it was kept: counts as charged elsewhere.
    memcg: str | None = field(default_factory=system.memory_cgroup_id)
    # ``stage --partial``: the whole dataset's bytes and files (``bytes``/``files`` are then the
    # part in RAM, under DEST/<name>; the rest is read from the source, views/<name>); None:
    # all of it is in RAM
    total_bytes: int | None = None
    total_files: int | None = None


class Store:
    """One DEST directory.  ``Store(dest)`` only computes paths; ``open()`` checks them."""

    def __init__(self, dest: str | os.PathLike[str] | None = None) -> None:
        self.dest = resolve_dest(dest)
        self.book = os.path.join(self.dest, BOOK)
        self.meta_dir = os.path.join(self.book, "meta")
        self.manifest_dir = os.path.join(self.book, "manifests")
        self.lock_dir = os.path.join(self.book, "locks")
        self.partial_dir = os.path.join(self.book, "partial")
        self.trash_dir = os.path.join(self.book, "trash")
        self.lease_dir = os.path.join(self.book, "leases")
        self.reservation_dir = os.path.join(self.book, "reservations")
        self.views_dir = os.path.join(self.book, "views")  # views.py: datasets not (all) in RAM

    # --- paths ----------------------------------------------------------------

    def path(self, name: str) -> str:
        return os.path.join(self.dest, name)

    def partial(self, name: str) -> str:
        return os.path.join(self.partial_dir, name)

    def meta_path(self, name: str) -> str:
        return os.path.join(self.meta_dir, name + ".json")

    def manifest_path(self, name: str) -> str:
        return os.path.join(self.manifest_dir, name + ".json")

    def view_path(self, name: str) -> str:
        return os.path.join(self.views_dir, name)

    # --- safety ---------------------------------------------------------------

    def exists(self) -> bool:
        return os.path.lexists(self.book)

    def open(self, *, create: bool = True) -> Store:
        """Check DEST and the bookkeeping directories (creating them when ``create``)."""
        if create:
            makedirs_checked(self.dest)
        check_dir(self.dest, "destination", shared_ok=True)
        if not create and not os.path.lexists(self.book):
            return self
        # Locks every stager waits on (locks/, reservations/, placing/; counters' and the fit
        # check's): in root's store only root may open one, so no user can flock one and hang
        # every stage.  Readers there take none (lock_file); leases/ stays open (leases.py).
        locks = lock_dir_mode(self.book)
        for path, mode in (
            (self.book, 0o755),
            (self.meta_dir, 0o755),
            (self.manifest_dir, 0o755),
            (self.lock_dir, locks),
            # 0711: a live view's in-flight tree (views.py) is entered by its readers; its
            # siblings' tops and markers stay 0700/0600, and nobody else may list it
            (self.partial_dir, 0o711),
            (self.trash_dir, 0o700),
            (self.lease_dir, 0o755),
            (self.reservation_dir, locks),
        ):
            if create and mode in (0o700, 0o711):
                lock_dir_checked(path, mode)
            elif create:
                mkdir_checked(path, mode)
            elif os.path.lexists(path):
                check_dir(path, "bookkeeping directory")
        if create:  # where jobs count the bytes they read (NOTE [served] in served.py)
            served.make_dir(self.book)
        return self

    def check_published(self, name: str) -> os.stat_result | None:
        """lstat of DEST/<name>, refusing anything but our own real directory."""
        try:
            st = os.lstat(self.path(name))
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise RefusedError(
                f"{self.path(name)} exists and is not a staged dataset directory; "
                "remove it or stage under another --name"
            )
        record = self.read_record(name) if os.geteuid() == 0 else None
        if record is not None and self.same_tree(st, record.root_ino):
            return st  # root staged it and gave it its source's owner (cp -a; see access.py)
        check_owner(self.path(name), st)
        return st

    # --- locks ----------------------------------------------------------------

    @contextmanager
    def lock(
        self,
        name: str,
        *,
        wait: bool = True,
        on_wait: Callable[[int | None], None] | None = None,
        shared: bool = False,
    ) -> Iterator[None]:
        """Hold the per-dataset lock (flock; released by the kernel if we die).

        ``shared``: a reader's lock for a user who may not write DEST (see :meth:`writable`):
        the file is opened read-only (flock needs no write access) and not created; it waits
        while a stager or evict holds the lock.  No lock file: nobody ever staged ``name``.
        """
        path = self.lock_path(name)
        with lock_file(
            path,
            shared=shared,
            wait=wait,
            on_wait=on_wait,
            busy=lambda holder: Busy(
                f"{name} is being staged by another shmstage (pid {holder or '?'}); try again later"
            ),
            refused=lambda e: self.refused(e, f"cannot open lock file {path}"),
        ):
            yield

    def lock_path(self, name: str) -> str:
        return os.path.join(self.lock_dir, name + ".lock")

    def writable(self) -> bool:
        """Whether this process may create lock files here: False for a user on a store root
        (or another stager) manages, or on a read-only mount.  Such a user may still use a
        dataset staged there and current (``stage`` hands it out under a shared lock)."""
        if not os.path.lexists(self.lock_dir):
            return True  # a new store: open() creates it (or says why it cannot)
        return os.access(self.lock_dir, os.W_OK | os.X_OK, effective_ids=True)

    def refused(self, e: OSError, what: str) -> ShmstageError:
        """The one line for an operation that needs to write a store this user may not."""
        if e.errno == errno.EROFS:
            return RefusedError(
                f"{what}: {self.dest} is on a read-only file system; datasets staged there "
                "and current can be used, nothing can be staged or removed: pick another --dest"
            )
        try:
            owner = os.lstat(self.book).st_uid
        except OSError:
            owner = os.geteuid()
        if e.errno not in (errno.EACCES, errno.EPERM) or owner == os.geteuid():
            return os_error(e, what)
        return RefusedError(managed_by(self.dest, owner))

    # --- placing ----------------------------------------------------------------

    def placing_path(self, name: str) -> str:
        return os.path.join(self.book, PLACING, name)

    @contextmanager
    def placing(
        self, name: str, on_wait: Callable[[int | None], None] | None = None
    ) -> Iterator[None]:
        """Hold ``placing/<name>`` (tiers.py: serialises choosing ``name``'s tier).  A user who
        may not write this store takes none: they can only be handed a current copy."""
        where = os.path.join(self.book, PLACING)
        if not self.writable():
            yield
            return
        try:
            lock_dir_checked(where, lock_dir_mode(self.book))
        except ShmstageError as e:
            raise ShmstageError(f"cannot lock {name}: {e}") from None
        with lock_file(
            self.placing_path(name),
            on_wait=on_wait,
            refused=lambda e: ShmstageError(f"cannot lock {name} in {where}: {e.strerror}"),
        ):
            yield

    def drop_placing(self, name: str, *, dry_run: bool = False) -> bool:
        """Remove ``placing/<name>`` unless someone holds it (they re-check after their flock:
        see :func:`lock_file`); True when it is gone (``dry_run``: would be)."""
        return drop_unheld(self.placing_path(name), dry_run=dry_run)

    def placing_names(self) -> list[str]:
        try:
            return sorted(os.listdir(os.path.join(self.book, PLACING)))
        except OSError:
            return []

    def drop_lock(self, name: str) -> None:
        """Unlink the lock file of an evicted dataset; call while holding its lock."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.lock_path(name))

    # --- records --------------------------------------------------------------

    def read_record(self, name: str) -> Record | None:
        data = _read_json(self.meta_path(name))
        if not data or data.get("format") != FORMAT:
            return None
        try:
            record = _record_of(data)
        except (KeyError, TypeError):
            return None
        try:
            used = os.lstat(self._used_path(name)).st_mtime
        except OSError:
            return record
        return Record(**{**record.__dict__, "last_used": max(used, record.last_used)})

    def write_record(self, record: Record) -> None:
        data = {"format": FORMAT, **record.__dict__}
        _write_json(self.meta_path(record.name), data, self.path(record.name))
        self.ensure_stamp(record.name)  # before any job can use it (see touch)

    def read_manifest(self, name: str) -> dict[str, Any] | None:
        data = _read_json(self.manifest_path(name))
        if not data or data.get("format") != FORMAT:
            return None
        return data

    def write_manifest(self, name: str, data: dict[str, Any]) -> None:
        _write_json(self.manifest_path(name), {"format": FORMAT, **data}, self.path(name))

    def prepare_manifest(self, name: str, data: dict[str, Any]) -> str:
        """Write the next version's manifest beside the current one; :meth:`commit_manifest` swaps it in.
        Private (0600) until the publish gives it the new copy's access (:meth:`share_bookkeeping`)."""
        path = self.new_manifest_path(name)
        _write_json(path, {"format": FORMAT, **data})
        return path

    def share_bookkeeping(self, name: str, top: str | None = None) -> None:
        """Give ``name``'s manifests and record the access of its copy's top (``top``: the
        one about to be published), after that top's mode or ACL changed."""
        want = access.bookkeeping_access(self.path(name) if top is None else top)
        # The lease file too: only who may read the copy may lease it (leases.ensure_file).
        paths = [self.new_manifest_path(name), self.lease_path(name)]
        if top is None:  # and a partial copy's view (views.py): it lists the files too
            paths += [self.manifest_path(name), self.meta_path(name)]
            paths += [os.path.join(self.view_path(name), f) for f in ("files", "view.json")]
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                access.share_like(fd, want)
            finally:
                os.close(fd)

    def lease_path(self, name: str) -> str:
        return os.path.join(self.lease_dir, name + ".lease")

    def new_manifest_path(self, name: str) -> str:
        return os.path.join(self.manifest_dir, f".{name}.json.new")

    def commit_manifest(self, name: str) -> None:
        os.rename(self.new_manifest_path(name), self.manifest_path(name))

    def manifest_for(self, record: Record) -> dict[str, Any] | None:
        """The manifest of exactly the tree ``record`` describes: the committed one, or the
        next one while a publish is between its exchange and its commit (see ``recover``)."""
        for path in (self.manifest_path(record.name), self.new_manifest_path(record.name)):
            data = _read_json(path)
            if data and data.get("format") == FORMAT and _root_ino(data) == record.root_ino:
                return data
        return None

    def same_tree(self, st: os.stat_result, root_ino: int) -> bool:
        """Is ``st`` (an lstat under DEST) the tree whose root inode was ``root_ino``?

        The inode, on the file system DEST is on now: not the st_dev recorded at publish,
        which names the block device, and that number changes when NVMe disks are
        renumbered at boot, a dm/md device is assembled again or a loop device is
        re-attached, while every inode on the file system stays what it was.  A tree on
        another file system (something mounted on DEST/<name>) is never ours."""
        if st.st_ino != root_ino:
            return False
        try:
            return os.lstat(self.dest).st_dev == st.st_dev
        except OSError:
            return False

    # A publish writes the next version's record to meta/.<name>.next.json BEFORE the
    # exchange, so whichever tree DEST/<name> is when a kill lands, one record matches it
    # (``published``) and ``recover`` can finish the step.  See NOTE [publish] in engine.py.

    def next_path(self, name: str) -> str:
        return os.path.join(self.meta_dir, f".{name}.next.json")

    def write_next(self, record: Record) -> None:
        """Before the exchange: readable as the copy in partial/ about to be published."""
        data = {"format": FORMAT, **record.__dict__}
        _write_json(self.next_path(record.name), data, self.partial(record.name))

    def read_next(self, name: str) -> Record | None:
        data = _read_json(self.next_path(name))
        if not data or data.get("format") != FORMAT:
            return None
        try:
            return _record_of(data)
        except (KeyError, TypeError):
            return None

    def recover(self, name: str) -> None:
        """Finish or undo a publish a kill interrupted; call while holding the dataset's lock."""
        nxt = self.read_next(name)
        if nxt is None:
            return
        try:
            exchanged = self.same_tree(os.lstat(self.path(name)), nxt.root_ino)
        except OSError:
            exchanged = False
        if exchanged:
            # The exchange happened: roll forward.
            data = _read_json(self.new_manifest_path(name))
            if data and _root_ino(data) == nxt.root_ino:
                self.commit_manifest(name)
            self.write_record(nxt)
        with suppress(FileNotFoundError):
            os.unlink(self.next_path(name))

    def names(self) -> list[str]:
        """Every dataset with a record (or a publish in flight)."""
        try:
            listing = os.listdir(self.meta_dir)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = {n[: -len(".json")] for n in listing if n.endswith(".json") and n[:1] != "."}
        out |= {
            n[1 : -len(".next.json")] for n in listing if n.endswith(".next.json") and n[:1] == "."
        }
        return sorted(out)

    def published(self, name: str) -> Record | None:
        """The record of ``name`` if DEST/<name> is exactly the tree it describes."""
        try:
            st = os.lstat(self.path(name))
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            return None
        for read in (self.read_record, self.read_next):  # .next only during a publish
            record = read(name)
            if record is not None and self.same_tree(st, record.root_ino):
                return record
        return None

    def _used_path(self, name: str) -> str:
        return os.path.join(self.meta_dir, f".{name}.used")

    def touch(self, record: Record) -> Record:
        """Set ``last_used`` to now: the mtime of the dataset's stamp, so a reader never
        rewrites the record a concurrent stager may be replacing.  Any user's job counts
        (see :meth:`ensure_stamp`); best effort: a store of an older version, or one on a
        read-only file system, keeps its order."""
        now = time.time()
        path = self._used_path(record.name)
        if not os.path.lexists(path):
            self.ensure_stamp(record.name)  # a record written before stamps existed
        try:
            # No times: the kernel sets "now" for anyone who may write the stamp, while
            # setting any other time takes its owner (utimensat(2)).
            os.utime(path, None, follow_symlinks=False)
        except OSError:
            return record
        return Record(**{**record.__dict__, "last_used": max(now, record.last_used)})

    def ensure_stamp(self, name: str) -> None:
        """Make the dataset's LRU stamp, ``meta/.<name>.used``, one every user may write.

        The jobs that use a dataset root staged mostly run as other users, who cannot write
        DEST's bookkeeping; make-room must still see their use, or it evicts the dataset a
        job just read.  The stamp is a character device like /dev/null (1:3), mode 0666:
        write permission lets anyone set its time to now and nothing else.  It holds no
        data (what is written to it is discarded: no one can fill the tmpfs through it; on
        a ``nodev`` mount it cannot even be opened), a reader of it gets end of file at once
        (an older shmstage's touch, which opens it, never blocks), and no one but root can
        remove or replace it (meta/ is root's).  Making a device takes root (CAP_MKNOD):
        elsewhere the stamp is a regular file only its owner may touch, as before.  A
        regular-file stamp of an older version is replaced, keeping its time.  Best effort."""
        path = self._used_path(name)
        times = None
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        except OSError:
            return
        else:
            if _is_stamp(st) or os.geteuid() != 0:
                return  # a device already, or a regular file a non-root owner touches
            times = (st.st_atime, st.st_mtime)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
            try:
                os.mknod(tmp, stat.S_IFCHR | 0o600, os.makedev(*_NULL_DEVICE))
                os.chmod(tmp, 0o666)  # exactly, whatever the umask
            except PermissionError:  # not root, or no CAP_MKNOD here (a user namespace)
                if times is not None:
                    return  # keep the regular file there is
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                os.close(fd)
            if times is not None:
                os.utime(tmp, times, follow_symlinks=False)
            os.rename(tmp, path)
        except OSError:
            with suppress(OSError):
                os.unlink(tmp)

    # --- publish and remove ---------------------------------------------------

    def publish(self, name: str) -> str | None:
        """Move partial/<name> to DEST/<name> in one step; returns where the old version now
        is (partial/<name> or in trash), for the caller to remove, or None."""
        new, target = self.partial(name), self.path(name)
        try:
            return self._publish(new, target)
        except PermissionError:
            pass
        # Moving a directory to another parent rewrites its "..": the kernel wants write
        # permission on the directory itself, which a 0555 source root (a non-root stager)
        # or a root owned by the source's owner (root without CAP_DAC_OVERRIDE) denies.  Make
        # both trees ours and writable for the move; the new one gets its owner and mode back.
        with _movable(new, restore=True), _movable(target, restore=False):
            return self._publish(new, target)

    def _publish(self, new: str, target: str) -> str | None:
        if not os.path.lexists(target):
            if _renameat2(new, target, _RENAME_NOREPLACE):
                return None
            os.rename(new, target)
            return None
        if _renameat2(new, target, _RENAME_EXCHANGE):
            return new  # the old version now sits where the new one was built
        # No RENAME_EXCHANGE (old kernel, some file systems): readers see no dataset
        # for an instant, never a half tree.
        old = self._trash_path(os.path.basename(target))
        os.rename(target, old)
        os.rename(new, target)
        return old

    def to_trash(self, path: str) -> str:
        """Rename a tree we own into trash (it vanishes at once); returns where it went."""
        if not os.path.lexists(path) or os.path.dirname(path) == self.trash_dir:
            return path
        old = self._trash_path(os.path.basename(path))
        try:
            os.rename(path, old)
        except OSError:
            return path
        return old

    def discard(self, path: str) -> None:
        """Remove a tree we own: rename it into trash first so it vanishes at once."""
        if not os.path.lexists(path):
            return
        old = self._trash_path(os.path.basename(path))
        try:
            os.rename(path, old)
        except OSError:
            old = path  # e.g. root without CAP_DAC_OVERRIDE: the tree's root is someone else's
        try:
            rmtree(old)
        except OSError as e:
            e.filename = old  # where what is left now is (its type kept: see cannot_remove)
            raise

    def clear_trash(self) -> None:
        try:
            for entry in os.listdir(self.trash_dir):
                rmtree(os.path.join(self.trash_dir, entry))
        except FileNotFoundError:
            pass

    def forget(self, name: str) -> None:
        for path in (
            self.meta_path(name),
            self.next_path(name),
            self.manifest_path(name),
            self.new_manifest_path(name),
            self._used_path(name),
        ):
            with suppress(FileNotFoundError):
                os.unlink(path)

    def _trash_path(self, name: str) -> str:
        return os.path.join(self.trash_dir, f"{name}.{me()}.{time.monotonic_ns()}")


_NULL_DEVICE = (1, 3)  # /dev/null's numbers: the LRU stamp (Store.ensure_stamp)


def _record_of(data: dict[str, Any]) -> Record:
    """A record from its JSON; ``memcg`` may be missing (an older record): None, never the
    reader's own cgroup; ``total_*`` are only in a partial copy's."""
    optional = ("memcg", "total_bytes", "total_files")
    keys = [k for k in Record.__dataclass_fields__ if k not in optional]
    return Record(**{k: data[k] for k in keys}, **{k: data.get(k) for k in optional})


def _is_stamp(st: os.stat_result) -> bool:
    return (
        stat.S_ISCHR(st.st_mode)
        and (os.major(st.st_rdev), os.minor(st.st_rdev)) == _NULL_DEVICE
        and stat.S_IMODE(st.st_mode) == 0o666
    )


def managed_by(dest: str, owner: int) -> str:
    """What a user may do on a store someone else manages (the one line every refusal gives)."""
    who = "root" if owner == 0 else f"uid {owner}"
    return (
        f"{dest} is managed by {who} and you (uid {os.geteuid()}) may not write there: you can "
        "use the datasets staged there and current (`shmstage stage`, `shmstage run --stage` "
        f"hand them out), but not stage, restage or remove any; ask {who} to, or use your own "
        "--dest, e.g. --dest /dev/shm/shmstage-$USER"
    )


def _root_ino(manifest: dict[str, Any]) -> int | None:
    """The root inode a manifest was written for (its ``root`` is [st_ino, st_dev])."""
    root = manifest.get("root")
    return root[0] if isinstance(root, list) and root else None


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: str, data: dict[str, Any], top: str | None = None) -> None:
    """Write-then-rename so a reader never sees half a record.  It names the source and the
    files of the copy at ``top``: readable by who may list that top (None: nobody yet)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with suppress(FileNotFoundError):
            os.unlink(tmp)  # a killed writer's, with whatever access it had
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        if top is not None:
            try:
                access.share_like(fd, access.bookkeeping_access(top))
            except OSError:
                os.close(fd)
                raise
        with os.fdopen(fd, "w") as f:
            f.write(
                json.dumps(data, separators=(",", ":"))
            )  # dumps: the C encoder; dump is pure Python
        os.rename(tmp, path)
    except OSError as e:
        with suppress(OSError):
            os.unlink(tmp)
        raise os_error(e, f"cannot write {path}") from None


@contextmanager
def _movable(path: str, *, restore: bool) -> Iterator[None]:
    """Make the directory ``path`` ours and writable by us (for a rename into another parent);
    give it its owner and mode back afterwards, wherever it went (the fd follows the inode):
    always when the block fails, else only with ``restore`` (an old version on its way out
    stays ours, so it can be removed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        yield  # not there (a first publish has no old tree), or not a directory: as it is
        return

    def put_back() -> None:
        if st.st_uid != os.geteuid():
            os.fchown(fd, st.st_uid, st.st_gid)
        os.fchmod(fd, stat.S_IMODE(st.st_mode))

    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.fchown(fd, os.geteuid(), os.getegid())  # root without CAP_DAC_OVERRIDE
        os.fchmod(fd, stat.S_IMODE(st.st_mode) | stat.S_IRWXU)
        try:
            yield
        except BaseException:
            with suppress(OSError):
                put_back()
            raise
        if restore:
            put_back()
    finally:
        os.close(fd)


_libc: Any = None


def exchange(src: str, dst: str) -> bool:
    """Swap two existing paths in one step (renameat2 RENAME_EXCHANGE); False where the
    kernel or file system cannot (the caller falls back to a remove and a rename)."""
    return _renameat2(src, dst, _RENAME_EXCHANGE)


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """renameat2(2); False where the kernel or file system lacks it (caller falls back)."""
    global _libc
    if _libc is None:
        try:
            _libc = load_libc()
            _libc.renameat2.argtypes = [
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_uint,
            ]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    rc = _libc.renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), dst)
