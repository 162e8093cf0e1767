"""The key-value store's wire: frames (a 4-byte big-endian length, then a JSON object; values
travel base64-encoded), the limits and the token proof both ends check, and its errors.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import struct
import time
from typing import Any

from shmstage.errors import RefusedError, ShmstageError

POLL = 0.05  # seconds between two checks of a waited-for key (one round trip to node 0)
STALE = 3.0  # seconds without a heartbeat after which the server calls a node hung
LENGTH = struct.Struct(">I")
# Frames: a hello is small; after it, a node of this job may post a tree's entries (tens
# of MB for millions of files).  Whoever merely reaches the port gets the small limit, a
# deadline for the hello, and at most PENDING connections that have not said it yet.
HELLO_MAX = 64 << 10
FRAME_MAX = 1 << 28
HELLO_WITHIN = 10.0  # seconds: a node sends its hello at once after connecting
PENDING = 64
# A secret every node of the job shares (optional): without it, whoever reaches node 0's
# port can pose as a node of the job (docs/cluster-staging.md, "Trust").
TOKEN_ENV = "SHMSTAGE_RENDEZVOUS_TOKEN"
# Set by every node once the first agreement has gathered every node's view: the job's
# members are fixed, so a node that comes after (a rank claimed again, another --nodes) is
# refused alone and the job goes on; before it, which of two claims is right is unknown,
# so every node of the job fails (the poison).
FORMED = "job/formed"


def proof(job: str | None) -> str:
    """What a hello shows for ``job`` and this node's token ("" without a token)."""
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        return ""
    return hashlib.sha256(f"{token}\0{job}".encode()).hexdigest()


class StoreLost(ShmstageError):
    """Node 0's store did not answer within the deadline, or its connection broke."""

    keeps_partial = True


class StoreTimeout(ShmstageError):
    """Waited-for keys did not appear in time (the store itself answered)."""

    keeps_partial = True


class Mismatch(RefusedError):
    """The nodes were not started as one job (another --nodes, a rank twice, another job)."""


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(LENGTH.pack(len(data)) + data)


def recv_frame(
    sock: socket.socket, limit: int = FRAME_MAX, until: float | None = None
) -> dict[str, Any] | None:
    """One frame (None: the peer closed); ``until``: a monotonic deadline for all of it."""
    head = read_exactly(sock, LENGTH.size, until)
    if head is None:
        return None
    (n,) = LENGTH.unpack(head)
    if n > limit:
        raise ValueError(f"frame of {n} bytes")
    body = read_exactly(sock, n, until)
    if body is None:
        return None
    obj = json.loads(body)
    if not isinstance(obj, dict):
        raise ValueError("frame is not an object")
    return obj


def read_exactly(sock: socket.socket, n: int, until: float | None = None) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        if until is not None:  # a byte at a time must not stretch it
            sock.settimeout(max(0.001, until - time.monotonic()))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def b64(value: bytes) -> str:
    return base64.b64encode(value).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)
