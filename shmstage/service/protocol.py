"""The service's wire format: one JSON request line from the client, checked against a strict
schema per op; length-prefixed pickled frames back (progress events, then one result or one
error).  Pickle travels only server -> client, and a client reads it only from root or itself.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import select
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from shmstage.errors import ShmstageError
from shmstage.service.address import SOCKET_ENV as SOCKET_ENV
from shmstage.service.address import socket_path as socket_path

VERSION = 1
MAX_REQUEST = 1 << 20  # one JSON line; anything longer is refused unread
READ_DEADLINE = 5.0  # seconds a client has to send its whole request line
MAX_FRAME = 1 << 30  # a result frame (a list of a million datasets stays far below)

_HEADER = struct.Struct("!I")
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13; Python names it in 3.13


class ProtocolError(ShmstageError):
    """A request (or a reply) that is not what the protocol says; the connection is closed."""


class ServiceLost(ShmstageError):
    """The service (or its worker) went away before answering; nothing was half-published."""


@dataclass(frozen=True)
class Hello:
    """The service's answer to ``hello``: who it is and which tiers it owns."""

    version: str  # shmstage's version
    protocol: int
    tiers: tuple[str, ...]  # fastest first
    socket: str


@dataclass(frozen=True)
class Request:
    op: str
    args: dict[str, Any]


@dataclass(frozen=True)
class Peer:
    """Who is on the other end, as the kernel says (SO_PEERCRED, SO_PEERGROUPS)."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...]


# --- the ops and their arguments ---------------------------------------------------------

_STR, _INT, _BOOL, _NUM = (str,), (int,), (bool,), (int, float)
_OPT_STR = (str, type(None))
_OPT_INT = (int, type(None))
_ENV = "env"  # a {str: str} of the caller's object-store variables

_STAGING = {
    "src": _STR,
    "name": _OPT_STR,
    "dest": _OPT_STR,
    "reserve": (int, str, type(None)),
    "make_room": _BOOL,
    "force": _BOOL,
    "strip_components": _INT,
    "credentials": _ENV,
}

SCHEMAS: dict[str, dict[str, Any]] = {
    "hello": {},
    "stage": {**_STAGING, "workers": _OPT_INT, "verify": _STR, "partial": _BOOL},
    "plan": _STAGING,
    "find": {"key": _STR, "dest": _OPT_STR, "credentials": _ENV},
    "list": {"dest": _OPT_STR, "unfinished": _BOOL},
    "verify": {"name": _STR, "dest": _OPT_STR, "checksum": _BOOL, "credentials": _ENV},
    "evict": {
        "name": _OPT_STR,
        "dest": _OPT_STR,
        "all": _BOOL,
        "older_than": (int, float, type(None)),
        "dry_run": _BOOL,
        "force": _BOOL,
    },
    "gc": {"dest": _OPT_STR, "dry_run": _BOOL},
    "metrics": {"dest": _OPT_STR},
    "lease": {"key": _STR, "dest": _OPT_STR, "pid": _INT},
    "unlease": {"token": _STR},
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "stage": ("src",),
    "plan": ("src",),
    "find": ("key",),
    "verify": ("name",),
    "lease": ("key", "pid"),
    "unlease": ("token",),
}
_PATHS = {"src", "dest"}  # absolute (the client resolves them against its cwd)


def _check_value(op: str, key: str, value: Any, kinds: Any) -> None:
    if kinds == _ENV:
        ok = isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        )
    else:
        # bool is an int to Python; a JSON true is never a count
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        raise ProtocolError(f"bad request: {op}.{key} has the wrong type")
    if key in _PATHS and isinstance(value, str) and "://" not in value:
        tiers = value.split(",") if key == "dest" else [value]
        if not all(os.path.isabs(t.strip()) for t in tiers):
            raise ProtocolError(f"bad request: {op}.{key} must be an absolute path")
    if isinstance(value, str) and "\0" in value:
        raise ProtocolError(f"bad request: {op}.{key} holds a NUL byte")


def parse_request(line: bytes) -> Request:
    """The request in ``line``, checked: version, a known op, only its keys, each of its type."""
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: [[[[...
        raise ProtocolError("bad request: not one JSON line") from None
    if not isinstance(msg, dict) or set(msg) != {"v", "op", "args"}:
        raise ProtocolError('bad request: expected {"v": 1, "op": ..., "args": {...}}')
    if msg["v"] != VERSION:
        raise ProtocolError(f"bad request: protocol version {msg['v']!r}, this service speaks 1")
    op, args = msg["op"], msg["args"]
    if not isinstance(op, str) or op not in SCHEMAS:
        raise ProtocolError(f"bad request: unknown op {str(op)[:40]!r}")
    if not isinstance(args, dict):
        raise ProtocolError(f"bad request: {op}.args is not an object")
    schema = SCHEMAS[op]
    for key, value in args.items():
        if key not in schema:
            raise ProtocolError(f"bad request: {op} takes no {str(key)[:40]!r}")
        _check_value(op, key, value, schema[key])
    missing = [k for k in REQUIRED.get(op, ()) if k not in args]
    if missing:
        raise ProtocolError(f"bad request: {op} needs {', '.join(missing)}")
    return Request(op, args)


def encode_request(op: str, args: dict[str, Any]) -> bytes:
    line = json.dumps({"v": VERSION, "op": op, "args": args}, separators=(",", ":")).encode()
    if len(line) >= MAX_REQUEST:
        raise ProtocolError(f"request too large ({len(line)} bytes)")
    return line + b"\n"


def read_request(sock: socket.socket, deadline: float = READ_DEADLINE) -> bytes:
    """The request line (without its newline), read within ``deadline`` seconds and
    ``MAX_REQUEST`` bytes; anything else raises ProtocolError."""
    end = time.monotonic() + deadline
    buf = bytearray()
    while True:
        left = end - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            raise ProtocolError(f"bad request: no complete request line within {deadline:g} s")
        chunk = sock.recv(65536)
        if not chunk:
            raise ProtocolError("bad request: the connection closed before a full line")
        buf += chunk
        nl = buf.find(b"\n")
        if nl >= 0:
            if nl + 1 != len(buf):
                raise ProtocolError("bad request: more than one line")
            return bytes(buf[:nl])
        if len(buf) >= MAX_REQUEST:
            raise ProtocolError(f"bad request: longer than {MAX_REQUEST} bytes")


# --- frames: server -> client ---------------------------------------------------------------

PROGRESS, RESULT, ERROR = "progress", "result", "error"


def frame(kind: str, value: Any) -> bytes:
    body = pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket) -> tuple[str, Any] | None:
    """The next (kind, value), or None at end of stream (the service went away).  Only call
    this on a socket whose peer passed :func:`trusted_peer`: a frame is a pickle."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    (size,) = _HEADER.unpack(head)
    if size > MAX_FRAME:
        raise ProtocolError(f"reply frame of {size} bytes: not the shmstage service")
    body = _recv_exact(sock, size)
    if body is None:
        return None
    kind, value = pickle.loads(body)
    return kind, value


# --- errors across the socket ---------------------------------------------------------------


@dataclass(frozen=True)
class RemoteError:
    """A ShmstageError raised in the service, to be raised again in the client, same class
    and message (``state``: the exception's attributes, ``args`` its arguments)."""

    module: str
    qualname: str
    args: tuple[Any, ...]
    state: dict[str, Any]


def remote_error(exc: BaseException) -> RemoteError:
    cls = type(exc)
    state = dict(getattr(exc, "__dict__", {}))
    try:
        pickle.dumps((exc.args, state))
    except Exception:  # an attribute that does not pickle: keep what the message needs
        state = {k: state[k] for k in ("message", "hint", "exit_code") if k in state}
        return RemoteError(cls.__module__, cls.__qualname__, (str(exc),), state)
    return RemoteError(cls.__module__, cls.__qualname__, exc.args, state)


def raise_remote(err: RemoteError) -> None:
    """Raise the error the service sent: the same ShmstageError subclass where this client
    has it, else a ShmstageError with the same message and exit code."""
    cls: Any = ShmstageError
    if err.module == "shmstage" or err.module.startswith("shmstage."):
        try:
            found = importlib.import_module(err.module)
            for part in err.qualname.split("."):
                found = getattr(found, part)
            if isinstance(found, type) and issubclass(found, ShmstageError):
                cls = found
        except (ImportError, AttributeError):
            pass
    exc = cls.__new__(cls)
    exc.args = tuple(err.args)
    exc.__dict__.update(err.state)
    if not hasattr(exc, "message"):
        exc.message = str(err.args[0]) if err.args else "the shmstage service failed"
        exc.hint = None
    raise exc


# --- who is on the other end ----------------------------------------------------------------


def peer(sock: socket.socket) -> Peer:
    """The peer's pid, uid, gid (SO_PEERCRED) and supplementary groups (SO_PEERGROUPS), as the
    kernel recorded them at connect."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    groups: tuple[int, ...] = ()
    size = 4 * 64
    while True:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
        except OSError as e:
            if e.errno == 34 and size < 4 * 65536:  # ERANGE: more groups than room
                size *= 4
                continue
            raise
        groups = struct.unpack(f"{len(raw) // 4}I", raw)
        break
    return Peer(pid, uid, gid, tuple(groups))
