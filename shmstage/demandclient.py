"""A process's state in ``DatasetFiles`` (datasetfiles.py): its demand connection to the
stager, the files it knows landed, and its counters of bytes served from RAM and from the
source, added to its user's counter for ``shmstage metrics`` (store/served.py)."""

from __future__ import annotations

import io
import multiprocessing.util
import os
import socket
import threading
import time
from contextlib import suppress
from typing import Any

from shmstage.stage.store import served
from shmstage.stage.store.views import ANSWER, View

FLUSH_EVERY = 1.0  # seconds between writes of this process's counters (and one at exit)
POLL = 1.0  # seconds a demand waits before it looks whether the stager is still alive


class Counted(io.FileIO):
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


class Local:
    """What one process holds: its lock, demand connection, landed files and counters."""

    def __init__(self, view: View | None, resident: bytes, name: str, book: str | None) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.view = view  # replaced when the view is re-read
        self.published = False  # the live copy was published: read <final>
        self.dead = False  # the stager is gone and never published: read the source
        # Which stager's view this process follows (viewfollow.identity: a new stager writes
        # a new view directory) and, when it is not the one ``DatasetFiles`` was listed from, the
        # index in that view of each listed file (-1: not there, or listed otherwise).
        # ``landed``, ``answers`` and ``asked`` count in the followed view's numbering.
        self.view_id: tuple[object, ...] = ()
        self.vmap: list[int] | None = None
        self.landed_fd = -1  # that view's ``landed``, held open: never a newer view's log
        self.landed = bytearray(resident)
        self.landed_at = 0  # bytes of the ``landed`` log read so far
        self.stalled = False  # the stager is stopped or makes no progress: do without it
        self.progress = time.monotonic()  # when it last answered, landed a file or ran
        self.cpu: int | None = None  # its CPU ticks when last looked at
        self.sock: socket.socket | None = None
        self.answers: dict[int, int] = {}  # the stager's final word on each file asked for
        self.asked: set[int] = set()  # requests sent on this connection
        self.reading = False  # one thread reads the socket, the others wait on ``cond``
        self.counters = Counters(name, book)
        # At exit, DataLoader workers' included (multiprocessing runs these, not atexit's), or
        # when this Local is collected: the finalizer holds the counters, never the Local
        # (a bound method of it would keep every instance alive).
        multiprocessing.util.Finalize(self, self.counters.close, exitpriority=10)

    def __del__(self) -> None:  # collected with its DatasetFiles: its connection goes too
        sock = self.__dict__.get("sock")
        if sock is not None:
            with suppress(OSError):
                sock.close()

    @property
    def ram(self) -> int:
        return self.counters.ram

    @property
    def source(self) -> int:
        return self.counters.source

    def count(self, ram: int, source: int) -> None:
        self.counters.count(ram, source)

    def flush(self) -> None:
        self.counters.flush()


class Counters:
    """One process's bytes served from RAM and from the source for one dataset, and the
    counter file they are written to (at most once every ``FLUSH_EVERY`` s, and at the end)."""

    def __init__(self, name: str, book: str | None) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.ram = 0
        self.source = 0
        self.flushed = 0.0
        self.added = (0, 0)  # of ram, source: what served/ has of this process's counts
        self.name = name
        self.book = book

    def count(self, ram: int, source: int) -> None:
        with self.lock:
            self.ram += ram
            self.source += source
        if time.monotonic() - self.flushed >= FLUSH_EVERY:
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

    def close(self) -> None:
        """The last addition (at exit, or when collected); no file is held open between."""
        self.flush(last=True)


def recv_answer(sock: socket.socket) -> tuple[int, int] | str | None:
    """One answer ``(index, status)``; "timeout" when none came in ``POLL`` s; None at EOF."""
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
