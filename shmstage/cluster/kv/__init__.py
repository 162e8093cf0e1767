"""A small key-value store over TCP on node 0, with a deadline on every call.

torch's TCPStore has none on the client side: a node 0 that is frozen (SIGSTOP, a
suspended job, a frozen VM) or a listener that accepts and never answers blocks every
other node forever, whatever the timeout.  Here every request is answered at once by the
server (waiting is the client's polling), so a socket timeout of ``timeout`` seconds is a
deadline on every call.  The first request of a connection says who connects (job, node
count, rank): a node of another job or with another ``--nodes`` is refused at once, and a
rank claimed twice or a count that differs makes every node of the job fail with that
line instead of some publishing and others timing out - until the job has formed
(``FORMED``): a node that comes after is refused alone, and the job goes on.

Frames: 4-byte big-endian length, then a JSON object; values travel base64-encoded.

Parts: ``wire`` (frames, limits, errors), ``server`` (node 0), ``client`` (every node, and
``gloo_store``); their public names are importable from here.
"""

from shmstage.cluster.kv.client import Client, gloo_store
from shmstage.cluster.kv.server import Server, listen
from shmstage.cluster.kv.wire import (
    FORMED,
    HELLO_MAX,
    HELLO_WITHIN,
    PENDING,
    POLL,
    STALE,
    TOKEN_ENV,
    Mismatch,
    StoreLost,
    StoreTimeout,
    proof,
)

__all__ = [
    "FORMED",
    "HELLO_MAX",
    "HELLO_WITHIN",
    "PENDING",
    "POLL",
    "STALE",
    "TOKEN_ENV",
    "Client",
    "Mismatch",
    "Server",
    "StoreLost",
    "StoreTimeout",
    "gloo_store",
    "listen",
    "proof",
]
