"""``DatasetFiles``: a job's reads of a staged dataset, whether all, part or none of it is in
RAM yet: every file's name at once, and its bytes from RAM once there, else from the stager
(a demand on a live copy) or from the source (checked against the listing).  No torch import;
``shmstage.loader`` re-exports it and builds ``FolderDataset`` on it.
"""

from __future__ import annotations

import errno
import io
import os
import socket
import stat
import threading
import time
from array import array
from collections.abc import Iterable
from contextlib import suppress
from typing import Any, BinaryIO

from shmstage.demandclient import POLL, Counted, Local, recv_answer
from shmstage.errors import ShmstageError
from shmstage.filelisting import copy_of, walk
from shmstage.sourcefile import SourceFile
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

_SETTLE = 200  # tries (x 50 ms) for a live copy to settle (publish) before giving up
_CREATING = threading.Lock()  # one Local per process, however many threads start at once


class DatasetFiles:
    """The files of a staged dataset (``path``: what ``{staged}`` gives, ``DEST/<name>``) or
    of any directory.  ``names`` is complete at once; ``open``/``read`` give a file's bytes
    from RAM when it is there, else (a copy still running, a partial copy) from the stager
    or the source, never half a file.  Picklable (DataLoader workers, fork or spawn) and
    thread-safe; each process opens its own connection and counts its own reads."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.path.abspath(os.fspath(path))
        # DEST/<name>, also for a path inside it ({staged}/train) or a symlink to it: the
        # view is the whole copy's, so a subdirectory's names are the view's below it.
        self._dest, self._name, sub = copy_of(self.path)
        self._top = os.path.join(self._dest, self._name)
        self._store = os.path.isdir(Store(self._dest).book)
        self._view, listed = _listed_view(self._dest, self._name) if self._store else (None, None)
        if listed is not None:
            self._names = listed.names  # the whole copy's: indices are the view's
            self._sizes = array("q", listed.sizes)
            self._mtimes = array("q", listed.mtimes)
            self._resident = bytes(listed.resident)
            self._prefix = "" if sub == "." else sub + "/"
            if self._prefix and not any(n.startswith(self._prefix) for n in self._names):
                raise ShmstageError(
                    f"{self.path} is not a directory of {self._top} (no file below {sub})"
                )
        else:
            names, sizes = walk(self.path)
            self._names, self._sizes = names, array("q", sizes)
            self._mtimes = array("q")
            self._resident = b"\1" * len(names)
            self._prefix = ""
        cut = len(self._prefix)
        self._index = {n[cut:]: i for i, n in enumerate(self._names) if n.startswith(self._prefix)}
        self._shown = tuple(self._index)
        self._local: Local | None = None

    # --- what there is ---------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """The relative path (to ``path``) of every regular file, sorted."""
        return self._shown

    @property
    def kind(self) -> str:
        """ "copy" (all in RAM, or a plain directory), "live" (still being copied) or
        "partial" (only part of it in RAM)."""
        return self._view.kind if self._view is not None else "copy"

    def __len__(self) -> int:
        return len(self._shown)

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
                    return self._ram(view.root, self._names[i], local)
            return self._from_source(i, view, local)
        return self._live(i, local)

    def read(self, name: str) -> bytes:
        with self.open(name) as f:
            return f.read()

    def want(self, names: Iterable[str]) -> None:
        """A hint that ``names`` will be read soon: on a copy still running, the stager is
        asked for each of them now (each once per process; the requests pipelined, none
        waited for), so they are copied before the rest.  A no-op for a copy all in RAM, a
        partial copy or a stager that is gone.  ``make_loader`` calls it for the next
        batches (docs/loader.md)."""
        wanted = [self._at(n) for n in names]
        local = self._here()
        if local.view is None or local.view.kind != "live" or local.published or local.dead:
            return
        with local.cond:
            self._drain(local)
            ask = [
                i
                for i in dict.fromkeys(wanted)
                if not local.landed[i] and i not in local.asked and i not in local.answers
            ]
            if not ask or not self._connect(local):
                return
            try:
                local.sock.sendall(b"".join(REQUEST.pack(i) for i in ask))  # type: ignore[union-attr]
            except OSError:
                self._drop(local)
                return
            local.asked.update(ask)

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

    def _here(self) -> Local:
        local = self._local
        if local is None or local.pid != os.getpid():  # a new process (fork): its own state
            with _CREATING:
                local = self._local
                if local is None or local.pid != os.getpid():
                    book = Store(self._dest).book if self._store else None
                    local = self._local = Local(self._view, self._resident, self._name, book)
        return local

    def _ram(self, root: str, name: str, local: Local) -> BinaryIO:
        path = os.path.join(root, name)
        try:
            return io.BufferedReader(Counted(path, local.count))
        except FileNotFoundError:
            raise
        except OSError as e:
            raise ShmstageError(f"cannot read {path}: {e.strerror}") from None

    def _from_source(self, i: int, view: View, local: Local) -> BinaryIO:
        """The file streamed from the source as this process (never held whole in memory),
        checked against the listing when opened and against what it was when opened after
        every read: a changed file is one clear error, never a mix (see ``SourceFile``)."""
        rel = self._names[i]
        path = view.source + "/" + rel
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise self._changed(rel, path, "was removed") from None
        except OSError as e:
            raise ShmstageError(f"cannot read {path}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise ShmstageError(f"cannot read {path}: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode) or (st.st_size, st.st_mtime_ns) != (
            self._sizes[i],
            self._mtimes[i],
        ):
            os.close(fd)
            raise self._changed(rel, path, "changed")
        changed = self._changed(rel, path, "changed while it was read")
        raw = SourceFile(fd, path, st, lambda n: local.count(0, n), changed)
        return io.BufferedReader(raw, buffer_size=1 << 20)

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

    def _live(self, i: int, local: Local) -> BinaryIO:
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
                    f = self._ram(view.root, rel, local)  # type: ignore[union-attr]
                except FileNotFoundError:
                    self._settle(local)  # published (renamed away) or removed by gc
                    continue
                if self._listed(f, i):
                    return f
                # A restage's publish swaps the old copy into root for an instant: not the
                # listed file, so read the view again (published: <final> is the new one).
                f.close()
                self._settle(local)
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

    def _listed(self, f: BinaryIO, i: int) -> bool:
        """Whether the open file ``f`` is file ``i`` as listed (size and mtime_ns)."""
        st = os.fstat(f.fileno())
        return (st.st_size, st.st_mtime_ns) == (self._sizes[i], self._mtimes[i])

    def _poll_landed(self, local: Local, i: int) -> bool:
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

    def _settle(self, local: Local) -> None:
        """The view again: gone and <final> there = published; its stager dead, or gone with
        nothing published = read the source; else wait a little (a publish under way)."""
        view = read_view(self._dest, self._name)
        if view is None:
            if os.path.isdir(self._top):
                local.published = True
            else:
                local.dead = True
            return
        local.view = view
        if not view.alive():
            local.dead = True
            return
        time.sleep(0.05)

    def _demand(self, local: Local, i: int) -> int | None:
        """Ask the stager for file ``i`` and wait for its answer (None: the stager is gone).
        Requests are pipelined on one connection per process; one thread reads the answers
        and hands each to the thread waiting for it."""
        with local.cond:
            if i in local.answers:  # final: landed (0), published (1) or refused (< 0)
                return local.answers[i]
            if not self._connect(local):
                return None
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
                    local.cond.wait(POLL)
                    continue
                local.reading = True
                sock = local.sock
                local.cond.release()
                try:
                    got = recv_answer(sock)
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

    def _connect(self, local: Local) -> bool:
        """This process's connection to the stager (``local.cond`` held); False: gone."""
        if local.sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                sock.connect(local.view.socket or "")  # type: ignore[union-attr]
            except OSError:
                sock.close()
                return False
            sock.settimeout(POLL)
            local.sock = sock
        return True

    def _drain(self, local: Local) -> None:
        """Take the answers already here without waiting (``local.cond`` held, no thread
        reading): answers to hints nobody waits for must not pile up at the stager."""
        if local.sock is None or local.reading:
            return
        sock = local.sock
        sock.setblocking(False)  # not MSG_DONTWAIT: a socket with a timeout polls first
        try:
            here = sock.recv(1 << 16, socket.MSG_PEEK)
            data = sock.recv(len(here) - len(here) % ANSWER.size) if here else b""
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(local)
            return
        finally:
            if sock.fileno() >= 0:
                sock.settimeout(POLL)
        for index, status in ANSWER.iter_unpack(data):
            local.answers[index] = status
            if status == LANDED_OK and index < len(local.landed):
                local.landed[index] = 1
        if data:
            local.cond.notify_all()

    def _drop(self, local: Local) -> None:
        """Forget the connection and what was asked on it (the asking threads ask again)."""
        if local.sock is not None:
            with suppress(OSError):
                local.sock.close()
            local.sock = None
        local.asked.clear()


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
