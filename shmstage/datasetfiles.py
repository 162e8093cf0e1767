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
    View,
)
from shmstage.viewfollow import (
    attach,
    checked,
    drop,
    follow,
    grow,
    listed_view,
    open_view,
    stuck,
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
        self._view, listed, self._view_id = (
            listed_view(self._dest, self._name) if self._store else (None, None, ())
        )
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
                f = self._checked(view.root, i, local, whole=False)
                if f is not None:
                    return f
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
            if local.stalled:
                return
            self._drain(local)
            ask = [
                j
                for j in dict.fromkeys(self._vindex(local, i) for i in wanted)
                if j >= 0
                and not local.landed[j]
                and j not in local.asked
                and j not in local.answers
            ]
            if not ask or not self._connect(local):
                return
            try:
                local.sock.sendall(b"".join(REQUEST.pack(i) for i in ask))  # type: ignore[union-attr]
            except OSError:
                drop(local)
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
                    local = Local(self._view, self._resident, self._name, book)
                    if self._view is not None and self._view.kind == "live":
                        attach(local, self._view_id)
                    self._local = local
        return local

    def _vindex(self, local: Local, i: int) -> int:
        """File ``i``'s index in the view followed (-1: not in it, or listed otherwise)."""
        return i if local.vmap is None else local.vmap[i]

    def _checked(self, root: str, i: int, local: Local, *, whole: bool) -> BinaryIO | None:
        """File ``i`` under ``root`` when it is the file listed, else None (``checked``)."""
        want = (self._sizes[i], self._mtimes[i])
        return checked(os.path.join(root, self._names[i]), want, local, whole=whole)

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
        docs/loader.md): from RAM once landed, after a demand to the stager if need be.
        Every file read under the view's root or the final copy is checked against the
        listing; one that is not the file listed is looked for again, never returned."""
        rel = self._names[i]
        for _ in range(_SETTLE):
            view: View = local.view  # type: ignore[assignment]
            if local.published:
                f = self._checked(view.final, i, local, whole=False)
                # Evicted, or published from a newer listing: the source, checked.
                return f if f is not None else self._from_source(i, view, local)
            j = self._vindex(local, i)
            if j < 0:  # a new stager's view lists it otherwise: the source says how
                return self._from_source(i, view, local)
            if local.stalled:
                self._poll_landed(local, j)  # progress again: back to the stager
            if local.dead or local.stalled:
                # The stager is gone (or stopped, or stuck): its copy if published, what
                # landed under its root, else the source; each checked.
                f = self._checked(view.final, i, local, whole=False)
                if f is None and local.landed[j]:
                    f = self._checked(view.root, i, local, whole=True)
                return f if f is not None else self._from_source(i, view, local)
            if local.landed[j] or self._poll_landed(local, j):
                f = self._checked(view.root, i, local, whole=True)
                if f is not None:
                    return f
                # Gone (published, removed by gc), or not the file listed (a restage's
                # publish swaps the old copy into root for an instant, a new stager
                # rewrites it): read the view again.
                self._settle(local)
                continue
            status = self._demand(local, j)
            if status == LANDED_OK:
                local.landed[j] = 1
            elif status == PUBLISHED:
                local.published = True
            elif status is None:  # the stager is gone, stopped, or its socket is
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

    def _poll_landed(self, local: Local, j: int) -> bool:
        """Whether file ``j`` (the followed view's numbering) has landed, reading what the
        ``landed`` log gained since the last look."""
        with local.lock:
            grow(local)
            return bool(local.landed[j])

    def _settle(self, local: Local) -> None:
        """The view again: gone and <final> there = published; another stager's = follow
        it; its stager dead = read without it; stopped or stuck = likewise until it moves
        again; else wait a little (a publish under way)."""
        got = open_view(self._dest, self._name)
        if got is None:
            if os.path.isdir(self._top):
                local.published = True
            else:
                local.dead = True
            return
        view, fd = got
        with local.cond:
            followed = follow(local, view, fd, (self._names, self._sizes, self._mtimes))
        if not followed:
            time.sleep(0.05)
            return
        if not view.alive():
            local.dead = True
            return
        with local.cond:
            local.stalled = stuck(local)
        if not local.stalled:
            time.sleep(0.05)

    def _demand(self, local: Local, i: int) -> int | None:
        """Ask the stager for file ``i`` (the followed view's numbering) and wait for its
        answer (None: the stager is gone, stopped or stuck).  Requests are pipelined on one
        connection per process; one thread reads the answers and hands each to the thread
        waiting for it."""
        with local.cond:
            if local.stalled:
                return None
            if i in local.answers:  # final: landed (0), published (1) or refused (< 0)
                return local.answers[i]
            if not self._connect(local):
                return None
            if i not in local.asked:  # another thread's request for it is answered to all
                try:
                    local.sock.sendall(REQUEST.pack(i))
                except OSError:
                    drop(local)
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
                if sock is not local.sock:  # another view followed meanwhile: not its answer
                    continue
                if got is None:
                    drop(local)
                    local.cond.notify_all()
                    return None
                if got != "timeout":
                    local.answers[got[0]] = got[1]
                    local.progress = time.monotonic()
                local.cond.notify_all()
                if got == "timeout" and (
                    not local.view.alive() or stuck(local)  # type: ignore[union-attr]
                ):
                    drop(local)
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
            drop(local)
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
