"""The layout under DEST: published datasets, and the bookkeeping beside them.

Everything that is not dataset data lives in ``DEST/.shmstage/`` (see the
package docstring for the map).  This module owns the safety checks for a
DEST inside a world-writable sticky directory such as /dev/shm, the
per-dataset locks, the JSON records, atomic publish and removal.  Long because every
write under DEST goes through here: locks (and who holds them), records, publish, removal.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from shmstage import system
from shmstage.errors import PermissionDenied, RefusedError, ShmstageError
from shmstage.libc import load_libc

DEFAULT_DEST = "/dev/shm/shmstage"
BOOK = ".shmstage"
FORMAT = 1
PLACING = "placing"  # DEST/.shmstage/placing/<name>: flocked while choosing <name>'s tier

# \Z, not "$": "$" also matches before a final newline ("ds\n" is not "ds"); no leading
# "-" (it reads as an option on the job's command line) or "." (hidden, "..")
_NAME_RE = re.compile(r"^[A-Za-z0-9_+][A-Za-z0-9._+-]{0,199}\Z")
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
T = TypeVar("T")


def resolve_dest(dest: str | os.PathLike[str] | None) -> str:
    """``dest``, else ``$SHMSTAGE_DEST``, else /dev/shm/shmstage, as an absolute path
    (of a list of tiers, the first)."""
    chosen = (
        os.fspath(dest) if dest is not None else os.environ.get("SHMSTAGE_DEST") or DEFAULT_DEST
    )
    # A comma separates storage tiers (tiers.py); an operation on one DEST takes the first.
    chosen = chosen.split(",", 1)[0].strip() or DEFAULT_DEST
    return os.path.abspath(os.path.expanduser(chosen))


def check_name(name: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise RefusedError(
            f"invalid dataset name {name!r}: use letters, digits, '.', '_', '-' or '+' "
            "(at most 200, not starting with '.' or '-')"
        )
    return name


def name_for(source: str) -> str:
    """The default name: the source's base name without an archive suffix, made safe."""
    base = os.path.basename(source.rstrip("/")) or "root"
    for suffix in (".tar.gz", ".tar.bz2", ".tar.xz", ".tgz", ".tar"):
        if base.endswith(suffix) and len(base) > len(suffix):
            base = base[: -len(suffix)]
            break
    base = re.sub(r"[^A-Za-z0-9._+-]", "_", base).lstrip(".-") or "dataset"
    return base[:200]


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

    # --- paths ----------------------------------------------------------------

    def path(self, name: str) -> str:
        return os.path.join(self.dest, name)

    def partial(self, name: str) -> str:
        return os.path.join(self.partial_dir, name)

    def meta_path(self, name: str) -> str:
        return os.path.join(self.meta_dir, name + ".json")

    def manifest_path(self, name: str) -> str:
        return os.path.join(self.manifest_dir, name + ".json")

    # --- safety ---------------------------------------------------------------

    def exists(self) -> bool:
        return os.path.lexists(self.book)

    def open(self, *, create: bool = True) -> Store:
        """Check DEST and the bookkeeping directories (creating them when ``create``)."""
        if create:
            _makedirs_checked(self.dest)
        _check_dir(self.dest, "destination", shared_ok=True)
        if not create and not os.path.lexists(self.book):
            return self
        for path, mode in (
            (self.book, 0o755),
            (self.meta_dir, 0o755),
            (self.manifest_dir, 0o755),
            (self.lock_dir, 0o755),
            (self.partial_dir, 0o700),
            (self.trash_dir, 0o700),
            (self.lease_dir, 0o755),
            (self.reservation_dir, 0o755),
        ):
            if create:
                _mkdir_checked(path, mode)
            elif os.path.lexists(path):
                _check_dir(path, "bookkeeping directory")
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
        _check_owner(self.path(name), st)
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
            return _os_error(e, what)
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
            with suppress(FileExistsError):
                os.mkdir(where, 0o755)
        except OSError as e:
            raise ShmstageError(f"cannot lock {name} in {where}: {e.strerror}") from None
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
        _write_json(self.meta_path(record.name), data)
        self.ensure_stamp(record.name)  # before any job can use it (see touch)

    def read_manifest(self, name: str) -> dict[str, Any] | None:
        data = _read_json(self.manifest_path(name))
        if not data or data.get("format") != FORMAT:
            return None
        return data

    def write_manifest(self, name: str, data: dict[str, Any]) -> None:
        _write_json(self.manifest_path(name), {"format": FORMAT, **data})

    def prepare_manifest(self, name: str, data: dict[str, Any]) -> str:
        """Write the next version's manifest beside the current one; :meth:`commit_manifest` swaps it in."""
        path = self.new_manifest_path(name)
        _write_json(path, {"format": FORMAT, **data})
        return path

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
        _write_json(self.next_path(record.name), {"format": FORMAT, **record.__dict__})

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
            _rmtree(old)
        except OSError as e:
            e.filename = old  # where what is left now is (its type kept: see cannot_remove)
            raise

    def clear_trash(self) -> None:
        try:
            for entry in os.listdir(self.trash_dir):
                _rmtree(os.path.join(self.trash_dir, entry))
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
    reader's own cgroup."""
    keys = [k for k in Record.__dataclass_fields__ if k != "memcg"]
    return Record(**{k: data[k] for k in keys}, memcg=data.get("memcg"))


def _is_stamp(st: os.stat_result) -> bool:
    return (
        stat.S_ISCHR(st.st_mode)
        and (os.major(st.st_rdev), os.minor(st.st_rdev)) == _NULL_DEVICE
        and stat.S_IMODE(st.st_mode) == 0o666
    )


class Busy(RefusedError):
    """Another process holds the dataset's lock."""


def managed_by(dest: str, owner: int) -> str:
    """What a user may do on a store someone else manages (the one line every refusal gives)."""
    who = "root" if owner == 0 else f"uid {owner}"
    return (
        f"{dest} is managed by {who} and you (uid {os.geteuid()}) may not write there: you can "
        "use the datasets staged there and current (`shmstage stage`, `shmstage run --stage` "
        f"hand them out), but not stage, restage or remove any; ask {who} to, or use your own "
        "--dest, e.g. --dest /dev/shm/shmstage-$USER"
    )


# --- locks on files that may be unlinked ---------------------------------------------------


@contextmanager
def lock_file(
    path: str,
    *,
    shared: bool = False,
    wait: bool = True,
    on_wait: Callable[[int | None], None] | None = None,
    busy: Callable[[int | None], ShmstageError] | None = None,
    refused: Callable[[OSError], ShmstageError] | None = None,
) -> Iterator[None]:
    """Hold a flock on ``path`` (created unless ``shared``), writing our pid into it.

    Lock files are unlinked while held (evict, gc), so a waiter may end up holding a file
    that is gone while a newcomer locks a new one: after each flock we check the path still
    names the file we locked and start over if it does not.  ``shared``: read-only, not
    created (no lock when the file does not exist) and no pid written."""
    while True:
        flags = os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            if shared:
                fd = os.open(path, flags | os.O_RDONLY)
            else:
                fd = os.open(path, flags | os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            if not shared:
                raise ShmstageError(
                    f"cannot open lock file {path}: its directory is gone"
                ) from None
            yield
            return
        except OSError as e:
            raise (
                refused(e) if refused else _os_error(e, f"cannot open lock file {path}")
            ) from None
        try:
            st = os.fstat(fd)
            _check_owner(path, st)
            kind = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
            try:
                fcntl.flock(fd, kind | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                if not wait:
                    raise (busy(holder) if busy else Busy(f"{path} is locked")) from None
                if on_wait is not None:
                    on_wait(holder)
                fcntl.flock(fd, kind)
            try:
                now = os.lstat(path)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                continue  # unlinked while we waited: lock the new file
            if not shared:
                # Only says who holds it: a full tmpfs (ENOSPC) must not stop a no-op.
                with suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{me(' ')}\n".encode(), 0)
            yield
            return
        finally:
            os.close(fd)


def drop_unheld(path: str, *, dry_run: bool = False) -> bool:
    """Unlink the lock file ``path`` if nobody holds it (True when it is gone; ``dry_run``:
    would be).  Taken without waiting: a holder or waiter re-checks the path after its
    flock (``lock_file``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            st, now = os.fstat(fd), os.lstat(path)
        except FileNotFoundError:
            return True
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False  # replaced meanwhile: someone else's now
        if dry_run:
            return True
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True
    finally:
        os.close(fd)


# --- who is alive ---------------------------------------------------------------------------
#
# A pid alone is reused (containers start at 1: "being removed by pid 18" forever): every
# record that names a process names it by pid and start time (/proc/PID/stat field 22, in
# clock ticks since boot), and a process is that one only if both match.


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: the fields after the last ')' are 3...
    try:
        return int(raw[raw.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def me(sep: str = "-") -> str:
    """This process as ``<pid><sep><start time>`` (``<pid>`` where /proc does not say)."""
    pid = os.getpid()
    start = start_time(pid)
    return f"{pid}{sep}{start}" if start is not None else str(pid)


def alive(pid: int, start: int | None = None) -> bool:
    """Whether process ``pid`` lives and, when ``start`` is known, is the one that started
    then (not a later process given the same pid).  No start: a record of the old format."""
    if start is None:
        return os.path.exists(f"/proc/{pid}")
    return start_time(pid) == start


def trash_owner(entry: str) -> tuple[str, int | None, int | None]:
    """trash/<name>.<pid>-<start>.<ns> -> (name, pid, start); <name>.<pid>.<ns> (the old
    format) -> (name, pid, None)."""
    parts = entry.rsplit(".", 2)
    if len(parts) == 3:
        pid, _, start = parts[1].partition("-")
        if pid.isdigit() and (start.isdigit() or not start):
            return parts[0], int(pid), int(start) if start else None
    return entry, None, None


# --- helpers ---------------------------------------------------------------------


def _os_error(e: OSError, what: str) -> ShmstageError:
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(f"{what}: {e.strerror}; pick a --dest you can write to")
    return ShmstageError(f"{what}: {e.strerror}")


def cannot_remove(e: OSError, path: str) -> ShmstageError:
    """The one line for a tree ``evict`` or ``gc`` could not remove (_rmtree's OSError)."""
    if isinstance(e, MountInside):
        where = os.path.join(path, e.inner) if e.inner else path
        return ShmstageError(
            f"cannot remove {path}: {where} is a mount point inside the dataset: unmount it, "
            "then run gc"
        )
    if isinstance(e, TooDeep):
        return ShmstageError(f"cannot remove {path}: {e.strerror}")
    if e.errno in (errno.EACCES, errno.EPERM):
        return PermissionDenied(
            f"cannot remove {path}: {e.strerror}; it holds files you may not remove: have their "
            "owner or root remove it"
        )
    return ShmstageError(f"cannot remove {path}: {e.strerror}; run this again")


def _check_owner(path: str, st: os.stat_result) -> None:
    uid = os.geteuid()
    if st.st_uid not in (0, uid):
        raise RefusedError(
            f"{path} is owned by uid {st.st_uid}, not by you or root; refusing to use it "
            "(pick another --dest, e.g. /dev/shm/shmstage-$USER)"
        )


def _check_dir(path: str, what: str, *, shared_ok: bool = False) -> os.stat_result:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ShmstageError(f"{what} {path} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise RefusedError(
            f"{what} {path} is a symlink; refusing to follow it (it may have been planted): "
            "remove it or pick another --dest"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise RefusedError(f"{what} {path} is not a directory")
    _check_owner(path, st)
    # Others may create entries in a sticky DEST (e.g. --dest /dev/shm) but cannot move ours;
    # every entry we use there is checked on its own.  Bookkeeping must be ours alone.
    writable_by_others = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable_by_others and not (shared_ok and st.st_mode & stat.S_ISVTX):
        raise RefusedError(
            f"{what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            "refusing to use it: chmod go-w it or pick another --dest"
        )
    return st


def _mkdir_checked(path: str, mode: int) -> None:
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    except OSError as e:
        raise _os_error(e, f"cannot create {path}") from None
    else:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, mode)  # exact mode whatever the umask
        finally:
            os.close(fd)
    _check_dir(path, "bookkeeping directory")


def _makedirs_checked(path: str) -> None:
    if os.path.lexists(path):
        return
    parent = os.path.dirname(path)
    if parent != path and not os.path.lexists(parent):
        _makedirs_checked(parent)
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass  # checked by the caller: a planted entry is refused there
    except OSError as e:
        raise _os_error(e, f"cannot create {path}") from None


def _read_pid(fd: int) -> int | None:
    """The pid a lock file names (``<pid> <start>``, or ``<pid>`` in the old format), if that
    process still lives."""
    try:
        fields = os.pread(fd, 64, 0).decode().split()
        pid = int(fields[0]) if fields else 0
        start = int(fields[1]) if len(fields) > 1 else None
    except (OSError, ValueError):
        return None
    return pid if pid > 0 and alive(pid, start) else None


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


def _write_json(path: str, data: dict[str, Any]) -> None:
    """Write-then-rename so a reader never sees half a record."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        with os.fdopen(fd, "w") as f:
            f.write(
                json.dumps(data, separators=(",", ":"))
            )  # dumps: the C encoder; dump is pure Python
        os.rename(tmp, path)
    except OSError as e:
        with suppress(OSError):
            os.unlink(tmp)
        raise _os_error(e, f"cannot write {path}") from None


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


_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SWAPS = 3  # how often an entry may change kind under us, or a directory refill, before we give up


def _take(fd: int) -> None:
    """Make the open directory ``fd`` (inside a tree being removed) ours and 0700, so its
    entries can be removed: a tree root without CAP_DAC_OVERRIDE copied keeps its source's
    owners and modes.  Through the fd: the inode we hold, whatever its name points to now."""
    if os.fstat(fd).st_uid != os.geteuid():
        os.fchown(fd, os.geteuid(), os.getegid())
    os.fchmod(fd, 0o700)


def _in(fd: int, inside: bool, op: Callable[[], T]) -> T:
    """Run ``op`` (an ``*at`` call in the directory ``fd``); on a permission error take ``fd``
    and retry, but only when ``fd`` is part of the tree: the directory holding the tree
    (DEST, trash, the tmpfs root) is never chowned or chmodded."""
    try:
        return op()
    except PermissionError:
        if not inside:
            raise
        _take(fd)
        return op()


def _open_dir(pfd: int, name: str, inside: bool, dev: int | None = None) -> int:
    """Open the directory ``name`` in ``pfd`` for listing, without following a link; take it
    first when we may not read it (a 0000 directory, someone else's), but never one on
    another file system than ``dev`` (a mount inside the tree: left as it is)."""
    try:
        return _in(pfd, inside, lambda: os.open(name, _DIR_OPEN, dir_fd=pfd))
    except PermissionError:
        pass
    path_fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
    try:
        # An O_PATH fd cannot be fchmod'ed; its /proc link is that very inode (what glibc's
        # fchmodat(AT_SYMLINK_NOFOLLOW) does), not a name the tree's owner could swap.
        via = f"/proc/self/fd/{path_fd}"
        st = os.fstat(path_fd)
        if dev is not None and st.st_dev != dev:  # the caller names the mount: no chown
            return os.dup(path_fd)
        try:
            if st.st_uid != os.geteuid():
                os.chown(via, os.geteuid(), os.getegid())
            os.chmod(via, 0o700)
            return os.open(via, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:  # no /proc: not "gone", which would skip it silently
            raise OSError(errno.EACCES, "cannot take it back without /proc", name) from None
    finally:
        os.close(path_fd)


class MountInside(OSError):
    """A directory inside a tree being removed is another mount: never descended into (its
    files are another file system's), and the tree is left for gc once it is unmounted.
    ``inner``: that directory, relative to the tree's top ("" for the top itself)."""

    inner = ""


class TooDeep(OSError):
    """A tree nested deeper than this process may hold directories open (RLIMIT_NOFILE)."""


@dataclass
class _Frame:
    """A directory being emptied: open as ``fd``, the entry ``name`` of ``pfd``."""

    pfd: int
    name: str
    inside: bool
    fd: int
    swaps: int
    entries: list[tuple[str, bool | None]]
    rounds: int = 1  # listings of it so far


_nofile_raised = False


def _more_fds() -> None:
    """Raise this process's soft limit on open files to its hard limit, once: removing a
    tree holds one fd per level of its depth (never a path: see _rmtree)."""
    global _nofile_raised
    if _nofile_raised:
        return
    _nofile_raised = True
    with suppress(ValueError, OSError):
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _listing(fd: int) -> list[tuple[str, bool | None]]:
    entries: list[tuple[str, bool | None]] = []
    with os.scandir(fd) as it:
        for entry in it:
            try:
                is_dir: bool | None = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = None  # no d_type here and no search permission yet: stat it later
            entries.append((entry.name, is_dir))
    entries.reverse()  # popped from the end: in listing order
    return entries


def _enter(
    stack: list[_Frame],
    pfd: int,
    name: str,
    inside: bool,
    is_dir: bool | None,
    dev: int | None,
    swaps: int = 0,
) -> None:
    """Remove the entry ``name`` of ``pfd`` when it is not a directory; else open it and push
    it on ``stack`` to be emptied.  ``dev``: the tree's file system (None: the tree's top);
    ``swaps``: how often this entry changed kind under us already."""
    while True:
        if swaps > _SWAPS:
            raise OSError(errno.EBUSY, "it keeps changing while being removed", name)
        try:
            if is_dir is None:
                st = _in(pfd, inside, lambda: os.stat(name, dir_fd=pfd, follow_symlinks=False))
                is_dir = stat.S_ISDIR(st.st_mode)
            if not is_dir:
                try:
                    _in(pfd, inside, lambda: os.unlink(name, dir_fd=pfd))
                except IsADirectoryError:  # made a directory since we looked
                    is_dir, swaps = True, swaps + 1
                    continue
                return
            try:
                fd = _open_dir(pfd, name, inside, dev)
            except OSError as e:
                if e.errno in (errno.ENOTDIR, errno.ELOOP):
                    # swapped for a file or a symlink since we looked: remove that, not its target
                    is_dir, swaps = False, swaps + 1
                    continue
                raise
        except FileNotFoundError:
            return
        try:
            if dev is not None and os.fstat(fd).st_dev != dev:
                e = MountInside(
                    errno.EBUSY, "a mount point inside the dataset: unmount it, then run gc"
                )
                e.inner = os.path.join(*(f.name for f in stack[1:]), name)
                raise e
            entries = _listing(fd)
        except BaseException:
            os.close(fd)
            raise
        stack.append(_Frame(pfd, name, inside, fd, swaps, entries))
        return


def _remove_at(pfd: int, name: str, inside: bool, is_dir: bool | None) -> None:
    """Remove the entry ``name`` of the open directory ``pfd`` and, for a directory, all
    below it; every call relative to an open directory fd (see _rmtree).  Iterative (an
    explicit stack of open directories), so a tree of any depth is no RecursionError; never
    descends into another file system (a mount inside the tree: MountInside)."""
    stack: list[_Frame] = []
    try:
        _enter(stack, pfd, name, inside, is_dir, None)
        if not stack:
            return
        dev = os.fstat(stack[0].fd).st_dev
        if dev != os.fstat(pfd).st_dev:
            raise MountInside(errno.EBUSY, "a mount point: unmount it, then run gc")
        while stack:
            top = stack[-1]
            if top.entries:
                child, child_is_dir = top.entries.pop()
                _enter(stack, top.fd, child, True, child_is_dir, dev)
                continue
            try:
                _in(top.pfd, top.inside, partial(os.rmdir, top.name, dir_fd=top.pfd))
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno == errno.ENOTDIR:  # the name now holds a link: our fd does not
                    stack.pop()
                    os.close(top.fd)
                    _enter(stack, top.pfd, top.name, top.inside, False, dev, top.swaps + 1)
                    continue
                if e.errno != errno.ENOTEMPTY:
                    raise
                if top.rounds >= _SWAPS:  # refilled as fast as it is emptied
                    raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), top.name) from None
                top.rounds += 1
                top.entries = _listing(top.fd)
                continue
            stack.pop()
            os.close(top.fd)
    except OSError as e:
        if e.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        raise TooDeep(
            e.errno,
            f"it is nested deeper ({len(stack)} levels) than this process may hold "
            "directories open: raise the open-file limit (ulimit -n), then run gc",
        ) from None
    finally:
        for frame in stack:
            os.close(frame.fd)


def _rmtree(path: str) -> None:
    """Remove a tree, including read-only directories (staged trees keep source modes) and,
    for root without CAP_DAC_OVERRIDE, directories its source's owners own.

    Every step is relative to an open directory fd, never a path: the owner of a staged tree
    may still reach it (when it could not be renamed into trash first) and swap a directory
    of it for a symlink while we work; by path, root would follow that link out of the tree.
    Only what is inside the tree is ever chowned or chmodded: never the directory holding it,
    which may be DEST or the tmpfs root itself."""
    parent, name = os.path.split(os.path.normpath(path))
    if name in ("", os.curdir, os.pardir):
        raise ValueError(f"refusing to remove {path!r}")
    try:
        pfd = os.open(parent or os.curdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    _more_fds()
    try:
        _remove_at(pfd, name, False, None)
    except MountInside as e:
        e.filename = (
            os.path.join(path, e.inner) if e.inner else path
        )  # for callers' "{strerror}: {filename}"
        raise
    except TooDeep as e:
        e.filename = path
        raise
    finally:
        os.close(pfd)


_libc: Any = None


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
