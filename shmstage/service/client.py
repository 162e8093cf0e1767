"""The client end of the service's socket: ``connect()`` says whether a service answers (and
which tiers it owns); ``Connection.call`` sends one request and returns its typed result, or
raises the same ShmstageError the engine raised in the service.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

from shmstage.errors import ShmstageError
from shmstage.service.protocol import (
    ERROR,
    PROGRESS,
    RESULT,
    Hello,
    ProtocolError,
    RemoteError,
    ServiceLost,
    encode_request,
    peer,
    raise_remote,
    read_frame,
    socket_path,
)

CONNECT_TIMEOUT = 5.0  # connect and hello; a request itself may take hours (a big stage)


class NotTheService(ShmstageError):
    """The socket answers, but its owner is neither root nor this user: no pickle is read."""


class Connection:
    """A service that answered ``hello`` on ``path``; each call is one connection."""

    def __init__(self, path: str, hello: Hello) -> None:
        self.path = path
        self.hello = hello

    @property
    def tiers(self) -> tuple[str, ...]:
        return self.hello.tiers

    def serves(self, dest: str | os.PathLike[str] | None) -> bool:
        """Whether every tier of ``dest`` is one of the service's (None: its own tiers)."""
        if dest is None:
            return True
        ours = {os.path.realpath(t) for t in self.tiers}
        asked = [t.strip() for t in os.fspath(dest).split(",") if t.strip()]
        return bool(asked) and all(os.path.realpath(t) in ours for t in asked)

    def call(
        self, op: str, args: dict[str, Any], progress: Callable[[Any], None] | None = None
    ) -> Any:
        """Send ``op`` and return its result; progress events go to ``progress``."""
        sock = _open(self.path, timeout=CONNECT_TIMEOUT)
        if sock is None:
            raise ServiceLost(_lost_line(self.path))
        try:
            sock.settimeout(None)
            sock.sendall(encode_request(op, args))
            return _answer(sock, self.path, progress)
        except OSError:
            raise ServiceLost(_lost_line(self.path)) from None
        finally:
            sock.close()


def connect(path: str | None = None) -> Connection | None:
    """The service on ``path`` (else $SHMSTAGE_SOCKET, else /run/shmstage/shmstage.sock), or
    None when nothing answers there."""
    where = socket_path(path)
    sock = _open(where, timeout=CONNECT_TIMEOUT)
    if sock is None:
        return None
    try:
        sock.sendall(encode_request("hello", {}))
        hello = _answer(sock, where, None)
    except (OSError, ServiceLost):
        return None  # it went away between connect and hello: as if nothing answered
    finally:
        sock.close()
    if not isinstance(hello, Hello):
        raise ProtocolError(f"{where} does not answer as the shmstage service does")
    return Connection(where, hello)


def _open(path: str, timeout: float) -> socket.socket | None:
    """A connection to ``path`` whose peer is root or this user; None when nobody answers."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
        sock.close()
        return None
    except OSError as e:
        sock.close()
        if e.errno in (13,):  # EACCES: a socket we may not use is not ours to use
            return None
        raise ServiceLost(f"cannot reach the shmstage service on {path}: {e.strerror}") from None
    owner = peer(sock).uid
    if owner not in (0, os.geteuid()):
        sock.close()
        raise NotTheService(f"{path} is not the shmstage service (owned by uid {owner})")
    return sock


def _answer(sock: socket.socket, path: str, progress: Callable[[Any], None] | None) -> Any:
    while True:
        got = read_frame(sock)
        if got is None:
            raise ServiceLost(_lost_line(path))
        kind, value = got
        if kind == PROGRESS:
            if progress is not None:
                progress(value)
            continue
        if kind == RESULT:
            return value
        if kind == ERROR and isinstance(value, RemoteError):
            raise_remote(value)
        raise ProtocolError(f"{path} sent a frame the shmstage client does not know")


def _lost_line(path: str) -> str:
    return (
        f"the shmstage service on {path} closed the connection mid-request (restarted?): "
        "run the command again; a partial copy resumes"
    )
