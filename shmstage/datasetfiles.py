"""``DatasetFiles``: a job's reads of a staged dataset, whether all, part or none of it is in
RAM yet: every file's name at once, and its bytes from RAM once there, else from the stager
(a demand on a live copy) or from the source (checked against the listing).  No torch import;
``shmstage.loader`` re-exports it and builds ``FolderDataset`` on it.
"""

from __future__ import annotations

import errno
import io
import multiprocessing.util
import os
import socket
import stat
import threading
import time
from array import array
from contextlib import suppress
from typing import Any, BinaryIO

from shmstage.errors import ShmstageError
from shmstage.stage.store import served
from shmstage.stage.store.layout import Store
from shmstage.stage.store.views import (
    ANSWER,
    LANDED_OK,
    PUBLISHED,
    REQUEST,
    FileList,
    View,
    read_view,
)

__all__ = ["DatasetFiles"]

_FLUSH_EVERY = 1.0  # seconds between writes of this process's counters (and one at exit)
_POLL = 1.0  # seconds a demand waits before it looks whether the stager is still alive
_SETTLE = 200  # tries (x 50 ms) for a live copy to settle (publish) before giving up
_CREATING = threading.Lock()  # one _Local per process, however many threads start at once


class _Counted(io.FileIO):
    """A file in RAM whose reads add to its process's counters."""

    def __init__(self, path: str, count: Any) -> None:
        super().__init__(path, "rb")
        self._count = count

    def readinto(self, buffer: Any) -> int | None:
        n = super().readinto(buffer)
        if n:
            self._count(n, 0)
        return n

    def readall(self) -> bytes:
        data = super().readall()
        self._count(len(data), 0)
        return data


class _Local:
    """What one process holds: its lock, demand connection, landed files and counters."""

    def __init__(self, files: DatasetFiles) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.view = files._view  # replaced when the view is re-read
        self.published = False  # the live copy was published: read <final>
        self.dead = False  # the stager is gone and never published: read the source
        self.landed = bytearray(files._resident)
        self.landed_at = 0  # bytes of the ``landed`` log read so far
        self.sock: socket.socket | None = None
        self.answers: dict[int, int] = {}  # the stager's final word on each file asked for
        self.asked: set[int] = set()  # requests sent on this connection
        self.reading = False  # one thread reads the socket, the others wait on ``cond``
        self.ram = 0
        self.source = 0
        self.flushed = 0.0
        self.added = (0, 0)  # of ram, source: what served/ has of this process's counts
        self.name = files._name
        self.book = Store(files._dest).book if files._store else None
        # At exit, DataLoader workers' included (multiprocessing runs these, not atexit's)
        multiprocessing.util.Finalize(self, self.flush, kwargs={"last": True}, exitpriority=10)

    def count(self, ram: int, source: int) -> None:
        with self.lock:
            self.ram += ram
            self.source += source
        if time.monotonic() - self.flushed >= _FLUSH_EVERY:
            self.flush()

    def flush(self, last: bool = False) -> None:
        """Add what this process read since the last flush to its user's counter file; the
        file I/O is done outside ``lock`` (NOTE [served] in stage/store/served.py)."""
        if self.book is None or os.getpid() != self.pid:
            return
        with self.lock:
            self.flushed = time.monotonic()
            ram, source = self.ram - self.added[0], self.source - self.added[1]
            if not ram and not source:
                return
            self.added = (self.ram, self.source)
        if last:
            served.add_at_exit(self.book, self.name, ram, source)
        elif not served.add(self.book, self.name, ram, source):
            with self.lock:  # locked by another process now: the next flush adds these
                self.added = (self.added[0] - ram, self.added[1] - source)


class DatasetFiles:
    """The files of a staged dataset (``path``: what ``{staged}`` gives, ``DEST/<name>``) or
    of any directory.  ``names`` is complete at once; ``open``/``read`` give a file's bytes
    from RAM when it is there, else (a copy still running, a partial copy) from the stager
    or the source, never half a file.  Picklable (DataLoader workers, fork or spawn) and
    thread-safe; each process opens its own connection and counts its own reads."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self._dest, self._name = os.path.split(self.path)
        self._store = os.path.isdir(Store(self._dest).book)
        self._view, listed = _listed_view(self._dest, self._name) if self._store else (None, None)
        if listed is not None:
            self._names = listed.names
            self._sizes = array("q", listed.sizes)
            self._mtimes = array("q", listed.mtimes)
            self._resident = bytes(listed.resident)
        else:
            names, sizes = _walk(self.path)
            self._names, self._sizes = names, array("q", sizes)
            self._mtimes = array("q")
            self._resident = b"\1" * len(names)
        self._index = {n: i for i, n in enumerate(self._names)}
        self._local: _Local | None = None

    # --- what there is ---------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """The relative path of every regular file, sorted."""
        return self._names

    @property
    def kind(self) -> str:
        """ "copy" (all in RAM, or a plain directory), "live" (still being copied) or
        "partial" (only part of it in RAM)."""
        return self._view.kind if self._view is not None else "copy"

    def __len__(self) -> int:
        return len(self._names)

    def size(self, name: str) -> int:
        return self._sizes[self._at(name)]

    @property
    def served(self) -> tuple[int, int]:
        """(bytes read from RAM, bytes read from the source) by this process."""
        local = self._here()
        return local.ram, local.source

    def flush(self) -> None:
        """Write this process's counters now (they are written at most once a second, and at
        exit)."""
        self._here().flush()

    # --- reading ---------------------------------------------------------------

    def open(self, name: str) -> BinaryIO:
        """A binary file object with ``name``'s bytes (see the class docstring)."""
        i = self._at(name)
        local = self._here()
        view = local.view
        if view is None:
            try:
                return self._ram(self.path, name, local)
            except FileNotFoundError:
                raise self._gone(name) from None
        if view.kind == "partial":
            if self._resident[i]:
                # Not there: a first partial copy about to be published (its view comes
                # first), or restaged since: the source has the same bytes (checked).
                with suppress(FileNotFoundError):
                    return self._ram(view.root, name, local)
            return self._from_source(i, view, local)
        return self._live(i, local)

    def read(self, name: str) -> bytes:
        with self.open(name) as f:
            return f.read()

    # --- pickling: a process's connection and counters stay with it -----------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_local"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # --- inside ------------------------------------------------------------------

    def _at(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise ShmstageError(f"{name!r} is not a file of {self.path}") from None

    def _here(self) -> _Local:
        local = self._local
        if local is None or local.pid != os.getpid():  # a new process (fork): its own state
            with _CREATING:
                local = self._local
                if local is None or local.pid != os.getpid():
                    local = self._local = _Local(self)
        return local

    def _ram(self, root: str, name: str, local: _Local) -> BinaryIO:
        path = os.path.join(root, name)
        try:
            return io.BufferedReader(_Counted(path, local.count))
        except FileNotFoundError:
            raise
        except OSError as e:
            raise ShmstageError(f"cannot read {path}: {e.strerror}") from None

    def _from_source(self, i: int, view: View, local: _Local) -> BinaryIO:
        """The file read whole from the source as this process, checked against the listing
        before and after the read: a changed file is one clear error, never a mix."""
        rel = self._names[i]
        path = view.source + "/" + rel
        want = (self._sizes[i], self._mtimes[i])
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise self._changed(rel, path, "was removed") from None
        except OSError as e:
            raise ShmstageError(f"cannot read {path}: {e.strerror}") from None
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode) or (before.st_size, before.st_mtime_ns) != want:
                raise self._changed(rel, path, "changed")
            chunks, left = [], want[0]
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 22))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            after = os.fstat(fd)
            if left or (after.st_size, after.st_mtime_ns) != want:
                raise self._changed(rel, path, "changed while it was read")
        except OSError as e:
            raise ShmstageError(f"cannot read {path}: {e.strerror}") from None
        finally:
            os.close(fd)
        data = b"".join(chunks)
        local.count(0, len(data))
        return io.BytesIO(data)

    def _gone(self, rel: str) -> ShmstageError:
        return ShmstageError(
            f"{rel} is gone from {self.path}: the copy was evicted or restaged while this job "
            "read it; run the job again"
        )

    def _changed(self, rel: str, path: str, how: str) -> ShmstageError:
        return ShmstageError(
            f"{rel} {how} at its source ({path}) since {self._name} was listed: restage it "
            "and run the job again"
        )

    def _live(self, i: int, local: _Local) -> BinaryIO:
        """A file of a copy still running (the view's ``live`` kind; see NOTE in
        docs/loader.md): from RAM once landed, after a demand to the stager if need be."""
        rel = self._names[i]
        for _ in range(_SETTLE):
            view = local.view
            if local.published:
                try:
                    return self._ram(view.final, rel, local)  # type: ignore[union-attr]
                except FileNotFoundError:
                    raise self._gone(rel) from None
            if local.dead:  # what landed may still be there (else gc took it): the rest, source
                if local.landed[i]:
                    with suppress(OSError, ShmstageError):  # removed, or the stager's only
                        return self._ram(view.root, rel, local)  # type: ignore[union-attr]
                return self._from_source(i, view, local)  # type: ignore[arg-type]
            if local.landed[i] or self._poll_landed(local, i):
                try:
                    return self._ram(view.root, rel, local)  # type: ignore[union-attr]
                except FileNotFoundError:
                    self._settle(local)  # published (renamed away) or removed by gc
                    continue
            status = self._demand(local, i)
            if status == LANDED_OK:
                local.landed[i] = 1
            elif status == PUBLISHED:
                local.published = True
            elif status is None:  # the stager is gone, or its socket is
                self._settle(local)
            else:
                raise ShmstageError(
                    f"{rel}: the stager of {self._name} cannot serve it "
                    f"({os.strerror(-status) if -status in errno.errorcode else status}); "
                    "restage it and run the job again"
                )
        raise ShmstageError(
            f"{rel}: the copy of {self._name} neither landed nor was published; "
            f"see `shmstage list --dest {self._dest}`"
        )

    def _poll_landed(self, local: _Local, i: int) -> bool:
        """Read what the ``landed`` log gained since the last look (whole records only)."""
        with local.lock:
            try:
                got, local.landed_at = local.view.landed_since(local.landed_at)  # type: ignore[union-attr]
            except OSError:
                return False
            for index in got:
                if index < len(local.landed):
                    local.landed[index] = 1
            return bool(local.landed[i])

    def _settle(self, local: _Local) -> None:
        """The view again: gone and <final> there = published; its stager dead, or gone with
        nothing published = read the source; else wait a little (a publish under way)."""
        view = read_view(self._dest, self._name)
        if view is None:
            if os.path.isdir(self.path):
                local.published = True
            else:
                local.dead = True
            return
        local.view = view
        if not view.alive():
            local.dead = True
            return
        time.sleep(0.05)

    def _demand(self, local: _Local, i: int) -> int | None:
        """Ask the stager for file ``i`` and wait for its answer (None: the stager is gone).
        Requests are pipelined on one connection per process; one thread reads the answers
        and hands each to the thread waiting for it."""
        with local.cond:
            if i in local.answers:  # final: landed (0), published (1) or refused (< 0)
                return local.answers[i]
            if local.sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                try:
                    sock.connect(local.view.socket or "")  # type: ignore[union-attr]
                except OSError:
                    sock.close()
                    return None
                sock.settimeout(_POLL)
                local.sock = sock
            if i not in local.asked:  # another thread's request for it is answered to all
                try:
                    local.sock.sendall(REQUEST.pack(i))
                except OSError:
                    self._drop(local)
                    return None
                local.asked.add(i)
            while i not in local.answers:
                if local.sock is None:
                    return None
                if local.reading:
                    local.cond.wait(_POLL)
                    continue
                local.reading = True
                sock = local.sock
                local.cond.release()
                try:
                    got = _recv_answer(sock)
                finally:
                    local.cond.acquire()
                    local.reading = False
                if got is None:
                    self._drop(local)
                    local.cond.notify_all()
                    return None
                if got != "timeout":
                    local.answers[got[0]] = got[1]
                local.cond.notify_all()
                if got == "timeout" and not local.view.alive():  # type: ignore[union-attr]
                    self._drop(local)
                    return None
            return local.answers[i]

    def _drop(self, local: _Local) -> None:
        """Forget the connection and what was asked on it (the asking threads ask again)."""
        if local.sock is not None:
            with suppress(OSError):
                local.sock.close()
            local.sock = None
        local.asked.clear()


def _recv_answer(sock: socket.socket) -> tuple[int, int] | str | None:
    """One answer ``(index, status)``; "timeout" when none came in ``_POLL`` s; None at EOF."""
    data = b""
    while len(data) < 8:
        try:
            chunk = sock.recv(8 - len(data))
        except TimeoutError:
            if not data:
                return "timeout"
            continue
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    index, status = ANSWER.unpack(data)
    return index, status


def _listed_view(dest: str, name: str) -> tuple[View | None, FileList | None]:
    """The view of DEST/<name> and its file list, read together (a view that goes away
    between the two was published: read again)."""
    for _ in range(3):
        view = read_view(dest, name)
        if view is None:
            return None, None
        listed = view.files()
        if listed is not None:
            return view, listed
    return None, None


def _walk(top: str) -> tuple[tuple[str, ...], list[int]]:
    """Every regular file below ``top`` (symlinks not followed), sorted by relative path."""
    if not os.path.isdir(top):
        raise ShmstageError(f"{top} is not a directory (nor a staged dataset being copied)")
    found: list[tuple[str, int]] = []

    def fail(e: OSError) -> None:
        raise ShmstageError(f"cannot list {e.filename}: {e.strerror}")

    for root, _dirs, files in os.walk(top, onerror=fail):
        for f in files:
            full = os.path.join(root, f)
            with suppress(FileNotFoundError):
                st = os.lstat(full)
                if stat.S_ISREG(st.st_mode):
                    found.append((os.path.relpath(full, top), st.st_size))
    found.sort()
    return tuple(n for n, _ in found), [s for _, s in found]
