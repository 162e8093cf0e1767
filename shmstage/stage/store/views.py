"""The view of a dataset that is not (all) in RAM: ``DEST/.shmstage/views/<name>/``.

A live view (``run --no-wait``) is written by the stager before the job starts and removed
after the publish; a partial view (``--partial``) lives as long as the resident subset.  Its
files (version 1, see docs/staging.md "Views"): ``view.json`` (what and where), ``files``
(every regular file, sorted: ``rel \\t size \\t mtime_ns \\t resident``, rel percent-encoded
for tab, newline and percent) and, live only, ``landed`` (little-endian uint32 indices of
files complete under root, appended only once a file's bytes, mode and times are final).
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass

from shmstage.errors import ShmstageError
from shmstage.stage.store import access
from shmstage.stage.store.checks import mkdir_checked, os_error
from shmstage.stage.store.layout import Store, exchange
from shmstage.stage.store.locks import alive, running, start_time
from shmstage.stage.store.trees import rmtree

FORMAT = 1
LIVE = "live"
PARTIAL = "partial"
KINDS = (LIVE, PARTIAL)
VIEW_JSON = "view.json"
FILES = "files"
LANDED = "landed"
# A partial view names the tree it describes (``tree``: the root inode of DEST/<name>, kept
# by the publish's exchange): a view over another tree is no view.  A restage writes the
# next tree's view here first; the exchange of the trees makes it the valid one, and the
# stager then moves it into views/<name> (see NOTE [partial view]).
NEXT = ".{name}.next.view"

# The demand protocol on a live view's socket: the job sends REQUEST (a file's index), the
# stager answers ANSWER (index, status) once the file landed (LANDED_OK), or PUBLISHED
# (read the final copy), or a negative errno-like status (this file cannot be served).
REQUEST = struct.Struct("<I")
ANSWER = struct.Struct("<Ii")
LANDED_OK = 0
PUBLISHED = 1
_INDEX = struct.Struct("<I")

_ENCODE = {ord("%"): "%25", ord("\t"): "%09", ord("\n"): "%0A"}


def encode_rel(rel: str) -> str:
    """A relative path as one field of ``files``: no tab, no newline."""
    return rel.translate(_ENCODE)


def decode_rel(field: str) -> str:
    if "%" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        c = field[i]
        if c == "%":
            out.append(chr(int(field[i + 1 : i + 3], 16)))
            i += 3
        else:
            out.append(c)
            i += 1
    return "".join(out)


@dataclass(frozen=True)
class FileList:
    """A view's ``files``: index i is the i-th file (names sorted, as ``DatasetFiles.names``)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    mtimes: tuple[int, ...]  # st_mtime_ns at the source when listed
    resident: tuple[bool, ...]  # in RAM under the view's root (live: when listed)

    def __len__(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class View:
    """One view as read from disk (``read_view``)."""

    kind: str  # LIVE or PARTIAL
    name: str
    source: str  # absolute source directory; a file is at source + "/" + rel
    root: str  # the directory holding what is in RAM (live: the in-flight tree)
    final: str  # DEST/<name>, where the copy is (or will be) published
    socket: str | None  # live: the stager's demand socket
    pid: int
    pid_start: int | None  # /proc/PID/stat field 22 of the stager; None for a partial view
    path: str  # the view's directory
    tree: int | None = None  # partial: the root inode of the tree it describes

    def alive(self) -> bool:
        """Whether the stager that wrote a live view still runs (a partial view: always)."""
        if self.kind != LIVE:
            return True
        return self.pid_start is not None and running(self.pid, self.pid_start)

    def files(self) -> FileList | None:
        """The file list; None when the view went away meanwhile (published: re-read)."""
        try:
            with open(os.path.join(self.path, FILES), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        return parse_files(raw)

    def landed_since(self, offset: int = 0) -> tuple[list[int], int]:
        """Indices landed after byte ``offset`` of ``landed``, and the offset to pass next.
        ([], offset) when there is none (yet, or any more: the view went away)."""
        try:
            fd = os.open(os.path.join(self.path, LANDED), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return [], offset
        try:
            raw = read_from(fd, offset)
        finally:
            os.close(fd)
        return unpack_landed(raw), offset + len(raw) - len(raw) % _INDEX.size


def read_from(fd: int, offset: int) -> bytes:
    chunks = []
    while True:
        chunk = os.pread(fd, 1 << 20, offset)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        offset += len(chunk)


def unpack_landed(raw: bytes) -> list[int]:
    """The indices in ``raw``; a trailing part of an index (a write under way) is left."""
    whole = len(raw) - len(raw) % _INDEX.size
    return [i for (i,) in _INDEX.iter_unpack(raw[:whole])]


def parse_files(raw: bytes) -> FileList:
    names, sizes, mtimes, resident = [], [], [], []
    for line in raw.decode("utf-8", "surrogateescape").split("\n"):
        if not line:
            continue
        rel, size, mtime, res = line.split("\t")
        names.append(decode_rel(rel))
        sizes.append(int(size))
        mtimes.append(int(mtime))
        resident.append(res == "1")
    return FileList(tuple(names), tuple(sizes), tuple(mtimes), tuple(resident))


def format_files(files: Iterable[tuple[str, int, int, bool]]) -> bytes:
    """``files`` as the ``files`` file; sorted by rel here, so index i means one thing."""
    lines = [
        f"{encode_rel(rel)}\t{size}\t{mtime}\t{1 if res else 0}\n"
        for rel, size, mtime, res in sorted(files)
    ]
    return "".join(lines).encode("utf-8", "surrogateescape")


def read_view(dest: str | os.PathLike[str], name: str) -> View | None:
    """The view of ``name`` in the store at ``dest``; None when there is none (published,
    never written, or unreadable to this user: its files are as private as the copy)."""
    store = Store(dest)
    view = _load(store.view_path(name), name)
    if view is not None and view.kind == LIVE:
        return view
    try:
        st = os.lstat(store.path(name))
    except OSError:
        return None
    for v in (view, _load(next_path(store, name), name)):
        if v is not None and v.kind == PARTIAL and v.tree == st.st_ino:
            return v  # the view of the tree published now
    return None  # a view over another tree (a kill between the two): no view


def next_path(store: Store, name: str) -> str:
    return os.path.join(store.views_dir, NEXT.format(name=name))


def _load(path: str, name: str) -> View | None:
    try:
        with open(os.path.join(path, VIEW_JSON), "rb") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    try:
        if data["format"] != FORMAT or data["kind"] not in KINDS or data["name"] != name:
            return None
        tree = data.get("tree")
        start = data.get("pid_start")
        return View(
            kind=data["kind"],
            name=name,
            source=str(data["source"]),
            root=str(data["root"]),
            final=str(data["final"]),
            socket=None if data.get("socket") is None else str(data["socket"]),
            pid=int(data["pid"]),
            pid_start=None if start is None else int(start),
            path=path,
            tree=None if tree is None else int(tree),
        )
    except (KeyError, TypeError, ValueError):
        return None


def write_view(
    store: Store,
    name: str,
    *,
    kind: str,
    source: str,
    root: str,
    socket: str | None,
    files: Iterable[tuple[str, int, int, bool]],
    top: str,
    pending: bool = False,
) -> View:
    """Write ``name``'s view at once (a directory renamed into place), replacing an old one.
    Its files get the access of ``top`` (the copy's top: who may read the copy may read the
    view, as the manifests).  A partial view names ``top``'s tree (its root inode); with
    ``pending`` it is the next tree's, about to be published (:func:`promote` after the
    publish).  Call holding ``name``'s lock."""
    mkdir_checked(store.views_dir, 0o755)
    path = next_path(store, name) if pending else store.view_path(name)
    tmp = os.path.join(store.views_dir, f".{name}.{os.getpid()}.tmp")
    pid = os.getpid()
    data = {
        "format": FORMAT,
        "kind": kind,
        "name": name,
        "source": source,
        "root": root,
        "final": store.path(name),
        "socket": socket,
        "pid": pid,
        "pid_start": start_time(pid) if kind == LIVE else None,
    }
    if kind == PARTIAL:
        data["tree"] = os.lstat(top).st_ino
    want = access.bookkeeping_access(top)
    try:
        with suppress(FileNotFoundError):
            rmtree(tmp)  # a killed writer's
        os.mkdir(tmp, 0o700)
        contents = {
            VIEW_JSON: json.dumps(data, separators=(",", ":")).encode(),
            FILES: format_files(files),
        }
        if kind == LIVE:
            contents[LANDED] = b""
        for file, raw in contents.items():
            _write_shared(os.path.join(tmp, file), raw, want)
        os.chmod(tmp, 0o755)  # its files say who may read them
        _replace(store, name, tmp, path)
    except OSError as e:
        with suppress(OSError):
            rmtree(tmp)
        raise os_error(e, f"cannot write the view {path}") from None
    view = _load(path, name)
    if view is None:
        raise ShmstageError(f"cannot read back the view {path}")
    return view


def _replace(store: Store, name: str, new: str, path: str) -> None:
    """Put the directory ``new`` at ``path`` in one step: readers see the old view or the
    new one, never none (a kill in between included)."""
    if os.path.lexists(path) and exchange(new, path):
        rmtree(new)  # the old one, swapped out
        return
    if path == store.view_path(name):
        remove_view(store, name, pending=False)  # no RENAME_EXCHANGE: an instant with none
    else:
        with suppress(FileNotFoundError):
            rmtree(path)
    os.rename(new, path)


def promote(store: Store, name: str) -> None:
    """After the publish: the next tree's view (``write_view(pending=True)``), valid since
    the exchange, becomes views/<name>.  Call holding ``name``'s lock."""
    pending = next_path(store, name)
    if not os.path.lexists(pending):
        return
    try:
        _replace(store, name, pending, store.view_path(name))
    except OSError as e:
        raise os_error(e, f"cannot write the view {store.view_path(name)}") from None


def settle(store: Store, name: str) -> None:
    """Before a stage or by gc (holding ``name``'s lock): finish what a kill left of a
    partial view: the next tree's view published (promote), or dropped when its tree never
    was; a partial view over a tree it does not describe removed (a whole copy's)."""
    try:
        ino: int | None = os.lstat(store.path(name)).st_ino
    except OSError:
        ino = None
    pending = _load(next_path(store, name), name)
    if pending is not None and pending.tree == ino:
        promote(store, name)
    elif os.path.lexists(next_path(store, name)):
        with suppress(FileNotFoundError):
            rmtree(next_path(store, name))
    view = _load(store.view_path(name), name)
    if view is not None and view.kind == PARTIAL and view.tree != ino:
        remove_view(store, name)


def _write_shared(path: str, raw: bytes, want: access.Access) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        access.share_like(fd, want)
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


class LandedLog:
    """The stager's end of ``landed``: indices appended in whole records, one write each."""

    def __init__(self, view: View) -> None:
        self.fd = os.open(
            os.path.join(view.path, LANDED),
            os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
        )

    def append(self, indices: Iterable[int]) -> None:
        raw = b"".join(_INDEX.pack(i) for i in indices)
        # One write of whole records: O_APPEND on tmpfs puts it at the end in one piece, and
        # a reader never sees a size past the bytes written (it drops a partial record anyway).
        while raw:
            raw = raw[os.write(self.fd, raw) :]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def remove_view(store: Store, name: str, *, pending: bool = True) -> None:
    """Remove ``name``'s view, at once for its readers (renamed away, then removed), and its
    stager's demand socket (a killed stager's is left behind); with ``pending`` the next
    tree's partial view too."""
    path = store.view_path(name)
    if pending:
        with suppress(FileNotFoundError):
            rmtree(next_path(store, name))
    view = _load(path, name)
    if view is not None and view.socket and os.path.dirname(view.socket) == store.views_dir:
        with suppress(FileNotFoundError):
            os.unlink(view.socket)
    gone = os.path.join(store.views_dir, f".{name}.{os.getpid()}.gone")
    try:
        os.rename(path, gone)
    except FileNotFoundError:
        return
    except OSError as e:
        raise os_error(e, f"cannot remove the view {path}") from None
    rmtree(gone)


def remove_dead_view(store: Store, name: str) -> bool:
    """Remove ``name``'s live view when its stager is gone (gc, the next stage); whether it did."""
    view = read_view(store.dest, name)
    if view is None or view.kind != LIVE or view.alive():
        return False
    remove_view(store, name)
    return True


def dead_leftovers(store: Store) -> list[str]:
    """Paths in the views directory that dead stagers left (a half-written or half-removed
    view, a demand socket): ``.<name>.<pid>.tmp``, ``.<name>.<pid>.gone``, ``.<pid>-<start>.sock``."""
    found = []
    for entry in _entries(store):
        if not entry.startswith("."):
            continue
        if entry.endswith(".sock"):
            pid, _, start = entry[1:-5].partition("-")
            owner = (int(pid), int(start)) if pid.isdigit() and start.isdigit() else None
        else:
            parts = entry.rsplit(".", 2)
            owner = (int(parts[1]), None) if len(parts) == 3 and parts[1].isdigit() else None
        if owner is None:
            continue
        pid, start = owner
        if pid != os.getpid() and not (alive(pid) if start is None else running(pid, start)):
            found.append(os.path.join(store.views_dir, entry))
    return found


def _entries(store: Store) -> list[str]:
    try:
        return os.listdir(store.views_dir)
    except OSError:
        return []


def view_names(store: Store) -> list[str]:
    """The names that have a view (hidden temporaries left out)."""
    names = []
    for entry in _entries(store):
        with suppress(OSError):
            if not entry.startswith(".") and stat.S_ISDIR(
                os.lstat(os.path.join(store.views_dir, entry)).st_mode
            ):
                names.append(entry)
    return sorted(names)
