"""The stager's end of a live view's demand socket (store/views.py: the protocol): jobs send
file indices, the stager answers once each file has landed, or that the copy is published,
or that a file cannot be served.  Served from the copy loop's own select (ondemand.py): no
thread touches the copier.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterable

from shmstage.stage.store.views import ANSWER, LANDED_OK, PUBLISHED, REQUEST

MAX_UNSENT = 1 << 20  # a job that never reads its answers is dropped, never waited for
BACKLOG = 128


class Client:
    """One connection.  Its answers wait in ``outbuf`` from ``sent`` on: appended in place and
    sent from an offset (no copy of what is still unsent per answer: a client sending many
    requests and reading nothing must not make the copy loop quadratic)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = b""
        self.outbuf = bytearray()
        self.sent = 0  # bytes of outbuf already sent

    def unsent(self) -> int:
        return len(self.outbuf) - self.sent


class DemandServer:
    """A listening AF_UNIX socket and its connections; ``demands()`` gives the indices asked
    for since the last call that have not landed (their askers wait in ``waiting``)."""

    def __init__(self, path: str, files: int) -> None:
        self.path = path
        self.files = files
        self.landed = bytearray(files)  # 1: complete under root (or resident from the start)
        self.waiting: dict[int, list[Client]] = {}
        self.clients: dict[int, Client] = {}
        self.asked: list[int] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if not path.startswith("\0"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # a dead stager's, same pid and start: impossible, but
            self.sock.bind(path)
            if not path.startswith("\0"):
                # connect(2) needs write access; the answers say only which file landed
                # when (the names and bytes stay behind the view's and the copy's modes).
                os.chmod(path, 0o666)
            self.sock.listen(BACKLOG)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise

    def fds(self) -> list[int]:
        return [self.sock.fileno(), *self.clients]

    def writers(self) -> list[int]:
        return [fd for fd, c in self.clients.items() if c.unsent()]

    def handle(self, readable: Iterable[int], writable: Iterable[int] = ()) -> None:
        """Accept, read requests, flush answers: whatever select said is ready."""
        for fd in writable:
            client = self.clients.get(fd)
            if client is not None:
                self._flush(client)
        for fd in readable:
            if fd == self.sock.fileno():
                self._accept()
                continue
            client = self.clients.get(fd)
            if client is not None:
                self._read(client)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # EMFILE and the like: the job waits in the backlog
                return
            conn.setblocking(False)
            self.clients[conn.fileno()] = Client(conn)

    def _read(self, client: Client) -> None:
        try:
            data = client.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(client)
            return
        raw = client.inbuf + data
        whole = len(raw) - len(raw) % REQUEST.size
        client.inbuf = raw[whole:]
        for (index,) in REQUEST.iter_unpack(raw[:whole]):
            if client.sock.fileno() < 0:
                return  # dropped: it did not read its answers
            if index >= self.files:
                self._answer(client, index, -errno.EINVAL)
            elif self.landed[index]:
                self._answer(client, index, LANDED_OK)
            else:
                waiters = self.waiting.setdefault(index, [])
                if client not in waiters:
                    waiters.append(client)
                self.asked.append(index)

    def demands(self) -> list[int]:
        """Indices asked for since the last call that have not landed yet, in asking order."""
        asked, self.asked = self.asked, []
        return [i for i in asked if not self.landed[i]]

    def land(self, indices: Iterable[int], status: int = LANDED_OK) -> None:
        """``indices`` landed (status 0), or cannot be served (a negative status)."""
        for index in indices:
            if status == LANDED_OK:
                self.landed[index] = 1
            for client in self.waiting.pop(index, ()):
                self._answer(client, index, status)

    def publish(self) -> None:
        """The copy is published: every waiting demand and every request already sent is
        answered "read the final copy", then every connection is closed."""
        self._accept()
        for fd in list(self.clients):
            client = self.clients.get(fd)
            if client is not None:
                self._read(client)
        for index, clients in list(self.waiting.items()):
            for client in clients:
                self._answer(client, index, PUBLISHED)
        self.waiting.clear()
        # What fits in each socket's buffer, never waited for (the view goes only after
        # this): a job whose answer is lost re-reads the view, finds it gone, reads <final>.
        for client in list(self.clients.values()):
            self._flush(client)
        self.close()

    def _answer(self, client: Client, index: int, status: int) -> None:
        waiting = client.unsent()
        client.outbuf += ANSWER.pack(index, status)
        if waiting:  # sent when poll says it is writable (ondemand.py: _wait)
            if waiting >= MAX_UNSENT:
                self._drop(client)
            return
        self._flush(client)

    def _flush(self, client: Client) -> None:
        if not client.unsent() or client.sock.fileno() < 0:
            return
        try:
            sent = client.sock.send(memoryview(client.outbuf)[client.sent :])
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(client)
            return
        client.sent += sent
        if client.sent == len(client.outbuf):
            client.outbuf.clear()
            client.sent = 0
        elif client.sent > MAX_UNSENT:  # drop what was sent, now and then: O(1) per byte
            del client.outbuf[: client.sent]
            client.sent = 0
        if client.unsent() > MAX_UNSENT:
            self._drop(client)

    def _drop(self, client: Client) -> None:
        self.clients.pop(client.sock.fileno(), None)
        for index, waiters in list(self.waiting.items()):
            if client in waiters:
                waiters.remove(client)
                if not waiters:  # nobody waits for it now: the bulk copy may go on
                    del self.waiting[index]
        with contextlib.suppress(OSError):
            client.sock.close()

    def close(self) -> None:
        """Stop serving: every job sees EOF (the stager is gone: read from the source)."""
        for client in list(self.clients.values()):
            with contextlib.suppress(OSError):
                client.sock.close()
        self.clients.clear()
        self.waiting.clear()
        if self.sock.fileno() >= 0:
            self.sock.close()
            if not self.path.startswith("\0"):
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
