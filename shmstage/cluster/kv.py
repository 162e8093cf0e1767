"""A small key-value store over TCP on node 0, with a deadline on every call.

torch's TCPStore has none on the client side: a node 0 that is frozen (SIGSTOP, a
suspended job, a frozen VM) or a listener that accepts and never answers blocks every
other node forever, whatever the timeout.  Here every request is answered at once by the
server (waiting is the client's polling), so a socket timeout of ``timeout`` seconds is a
deadline on every call.  The first request of a connection says who connects (job, node
count, rank): a node of another job or with another ``--nodes`` is refused at once, and a
rank claimed twice or a count that differs makes every node of the job fail with that
line instead of some publishing and others timing out.

Frames: 4-byte big-endian length, then a JSON object; values travel base64-encoded.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import hmac
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from shmstage.errors import RefusedError, ShmstageError

POLL = 0.05  # seconds between two checks of a waited-for key (one round trip to node 0)
STALE = 3.0  # seconds without a heartbeat after which the server calls a node hung
_LEN = struct.Struct(">I")
# Frames: a hello is small; after it, a node of this job may post a tree's entries (tens
# of MB for millions of files).  Whoever merely reaches the port gets the small limit, a
# deadline for the hello, and at most PENDING connections that have not said it yet.
HELLO_MAX = 64 << 10
_MAX = 1 << 28
HELLO_WITHIN = 10.0  # seconds: a node sends its hello at once after connecting
PENDING = 64
# A secret every node of the job shares (optional): without it, whoever reaches node 0's
# port can pose as a node of the job (docs/cluster-staging.md, "Trust").
TOKEN_ENV = "SHMSTAGE_RENDEZVOUS_TOKEN"


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


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(
    sock: socket.socket, limit: int = _MAX, until: float | None = None
) -> dict[str, Any] | None:
    """One frame (None: the peer closed); ``until``: a monotonic deadline for all of it."""
    head = _exactly(sock, _LEN.size, until)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise ValueError(f"frame of {n} bytes")
    body = _exactly(sock, n, until)
    if body is None:
        return None
    obj = json.loads(body)
    if not isinstance(obj, dict):
        raise ValueError("frame is not an object")
    return obj


def _exactly(sock: socket.socket, n: int, until: float | None = None) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        if until is not None:  # a byte at a time must not stretch it
            sock.settimeout(max(0.001, until - time.monotonic()))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


# --- server (node 0) -------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host`` (the --rendezvous host): only the address the other
    nodes are told to use, not every interface of node 0.  Every address instead (as
    TCPStore) when ``host`` is a name that resolves here to a loopback address other than
    localhost's (Debian's 127.0.1.1 for the host's own name: the others reach it by
    another address), or to no address of this machine (EADDRNOTAVAIL: NAT, a proxy)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    literal = _is_literal(host)
    for family, _, _, _, addr in infos:
        loopback = addr[0] == "::1" or addr[0].startswith("127.")
        if loopback and not literal and host != "localhost":
            break
        try:
            return socket.create_server(addr, family=family, backlog=256)
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                raise
    try:
        return socket.create_server(
            ("", port), family=socket.AF_INET6, backlog=256, dualstack_ipv6=True
        )
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise
        return socket.create_server(("", port), backlog=256)  # no IPv6 here


def _is_literal(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
            return True
        except OSError:
            pass
    return False


class Server:
    """Node 0's side: a listening socket and one thread per connection."""

    def __init__(self, host: str, port: int, nodes: int, job: str | None) -> None:
        # ``job``: every hello must name it (a node of another job, e.g. one that failed
        # before joining and reports why, must not touch this job)
        self.nodes, self.job = nodes, job
        self.proof = proof(job)
        self.data: dict[str, bytes] = {}
        self.counters: dict[str, int] = {}
        self.lock = threading.Lock()
        self.poison: str | None = None  # set: every node of this job fails with this line
        self.claimed: dict[int, str] = {}  # rank -> peer address of its main connection
        self.connected: set[int] = set()  # ranks whose main connection is open
        self.beat: dict[int, float] = {}  # rank -> monotonic time of its last heartbeat
        self.bye: set[int] = set()
        self.told: set[int] = set()  # ranks that were answered with the poison line
        self.pending = 0  # connections that have not said hello yet
        self.conns: set[socket.socket] = set()
        self.sock = listen(host, port)
        self.closed = False
        threading.Thread(target=self._accept, name="shmstage-kv-accept", daemon=True).start()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with self.lock:
            conns = list(self.conns)
        for conn in conns:  # their threads see the end and close them
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def settled(self) -> bool:
        """Every other node said goodbye, lost its connection or stopped beating: none
        still needs the store (to read why the job failed, or to finish)."""
        now = time.monotonic()
        with self.lock:
            if self.poison is not None:
                # Refused: a node that has not come yet must still read why (instead of
                # waiting --timeout for a node 0 that is gone, then blaming it).
                return all(
                    r in self.told
                    or r in self.bye
                    or (r in self.claimed and r not in self.connected)
                    for r in range(1, self.nodes)
                )
            return all(
                r in self.bye
                or (r in self.claimed and r not in self.connected)
                or now - self.beat.get(r, now) > STALE
                for r in range(1, self.nodes)
            )

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                if self.closed:
                    return
                # EMFILE, ENFILE, ECONNABORTED...: a burst of connections passes; keep
                # accepting (the idle ones are dropped after HELLO_WITHIN)
                time.sleep(0.05)
                continue
            with self.lock:
                crowded = self.pending >= PENDING
                if not crowded:
                    self.pending += 1
            if crowded:  # many that say nothing: not this job's nodes (they retry)
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._serve, args=(conn, addr), name="shmstage-kv", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        rank: int | None = None  # set once this connection claimed a rank
        pending = True
        with self.lock:
            self.conns.add(conn)
        try:
            hello = _recv(conn, HELLO_MAX, time.monotonic() + HELLO_WITHIN)
            if hello is None or hello.get("op") != "hello":
                return
            answer, rank = self._hello(hello, addr)
            _send(conn, answer)
            if "error" in answer:
                return
            with self.lock:
                self.pending -= 1
                pending = False
            conn.settimeout(None)  # a node's connection idles while the ring runs
            while True:
                req = _recv(conn)
                if req is None:
                    return
                _send(conn, self._handle(req, rank))
        except Exception:  # noqa: BLE001 - a broken or foreign client: drop it, print nothing
            return
        finally:
            with self.lock:
                self.pending -= pending
                self.conns.discard(conn)
                if rank is not None:
                    self.connected.discard(rank)
            conn.close()

    def _hello(self, hello: dict[str, Any], addr: Any) -> tuple[dict[str, Any], int | None]:
        nodes, rank, job = hello.get("nodes"), hello.get("rank"), hello.get("job")
        shown = hello.get("proof")
        if not hmac.compare_digest(shown if isinstance(shown, str) else "", self.proof):
            return {"error": "token"}, None  # say nothing of this job to who cannot show it
        with self.lock:
            if job != self.job:
                # another job's node (or none that says which): refuse it, and leave this
                # job alone - its failure reports and --nodes are not this job's
                return {"error": "job", "job": self.job}, None
            if nodes != self.nodes:
                self.poison = (
                    f"the nodes were started with different --nodes: node {rank} with "
                    f"--nodes {nodes}, node 0 with --nodes {self.nodes}; start every node "
                    "with the same --nodes; this node publishes nothing"
                )
                if isinstance(rank, int):
                    self.told.add(rank)
                return {"error": "poison", "poison": self.poison}, None
            if not hello.get("main"):
                return {"ok": True}, None
            if not isinstance(rank, int) or not 0 <= rank < self.nodes:
                return {"error": "poison", "poison": f"invalid rank {rank!r}"}, None
            if rank in self.claimed:
                self.poison = (
                    f"two nodes started as node {rank} of {self.nodes} ({self.claimed[rank]} "
                    f"and {addr[0]}): give every node its own --node-rank, and every job its "
                    "own --rendezvous port; this node publishes nothing"
                )
                self.told.add(rank)
                return {"error": "poison", "poison": self.poison}, None
            self.claimed[rank] = str(addr[0])
            self.connected.add(rank)
            self.beat.setdefault(rank, time.monotonic())
            if self.poison is not None:
                self.told.add(rank)
        return {"ok": True, "poison": self.poison}, rank

    def _handle(self, req: dict[str, Any], rank: int | None = None) -> dict[str, Any]:
        op = req.get("op")
        out: dict[str, Any] = {}
        with self.lock:
            if op == "set":
                self.data[req["key"]] = _unb64(req["value"])
            elif op == "get":
                value = self.data.get(req["key"])
                if value is None and req["key"] in self.counters:
                    value = str(self.counters[req["key"]]).encode()
                out["value"] = None if value is None else _b64(value)
            elif op == "add":
                key, n = req["key"], int(req["n"])
                self.counters[key] = self.counters.get(key, 0) + n
                out["value"] = self.counters[key]
                if key.startswith("hb/") and n:
                    self.beat[int(key[3:])] = time.monotonic()
            elif op == "check":
                out["value"] = all(k in self.data or k in self.counters for k in req["keys"])
            elif op == "delete":
                out["value"] = self.data.pop(req["key"], None) is not None
            elif op == "count":
                out["value"] = len(self.data) + len(self.counters)
            elif op == "bye":
                self.bye.add(int(req["rank"]))
            elif op == "status":
                now = time.monotonic()
                out["value"] = {
                    str(r): {
                        "claimed": r in self.claimed,
                        "connected": r in self.connected,
                        "bye": r in self.bye,
                        "quiet": now - self.beat[r] if r in self.beat else None,
                    }
                    for r in range(self.nodes)
                }
            else:
                out["error"] = f"unknown op {op!r}"
            out["poison"] = self.poison
            if self.poison is not None and rank is not None:
                self.told.add(rank)
        return out


# --- client ----------------------------------------------------------------------------


class Client:
    """One connection to node 0's store; every call ends within ``timeout`` seconds
    (``StoreLost`` otherwise).  Thread-safe: gloo calls it from its own threads."""

    def __init__(
        self,
        host: str,
        port: int,
        nodes: int,
        rank: int,
        job: str | None,
        timeout: float,
        main: bool = True,
    ) -> None:
        self.host, self.port, self.nodes, self.rank = host, port, nodes, rank
        self.job, self.timeout, self.main = job, timeout, main
        self.lock = threading.Lock()
        self.unread = False
        self.stores: list[Any] = []  # gloo_store's torch Stores over this client
        self.watch: Callable[[], None] | None = None
        self.sock = self._connect(timeout)

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self, timeout: float) -> socket.socket:
        """Connect (retrying while nobody listens yet: node 0 may start later) and say hello."""
        deadline = time.monotonic() + timeout
        while True:
            sock = self._hello(deadline, timeout)
            if sock is not None:
                return sock
            # closed before answering: node 0 is busy (many connections at once), or gone
            if deadline - time.monotonic() <= 0.2:
                raise StoreLost(
                    f"the rendezvous on {self.where} (node 0) closed the connection at once: "
                    "node 0 gave up already, or something else than shmstage listens there"
                )
            time.sleep(0.2)

    def _hello(self, deadline: float, timeout: float) -> socket.socket | None:
        """One connection and its hello; None when node 0 closed it without an answer."""
        last: OSError | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreLost(
                    f"cannot reach the rendezvous on {self.where} (node 0) within {timeout:g} s"
                    f"{': ' + (last.strerror or str(last)) if last else ''}; is node 0 running "
                    "with the same --rendezvous?"
                )
            try:
                sock = socket.create_connection((self.host, self.port), timeout=min(left, 5.0))
                break
            except OSError as e:
                last = e
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        hello = {"op": "hello", "job": self.job, "nodes": self.nodes, "rank": self.rank,
                 "main": self.main, "proof": proof(self.job)}  # fmt: skip
        try:
            _send(sock, hello)
            answer = _recv(sock)
        except (ConnectionResetError, BrokenPipeError):
            sock.close()
            return None
        except (OSError, ValueError) as e:
            sock.close()
            raise StoreLost(self._silent(timeout, e)) from None
        if answer is None:
            sock.close()
            return None
        error = answer.get("error")
        if error == "token":
            sock.close()
            raise Mismatch(
                f"the rendezvous on {self.where} (node 0) refused this node's {TOKEN_ENV}: "
                "set the same secret on every node of the job (or on none); nothing was "
                "published by this node"
            )
        if error == "job":
            sock.close()
            raise Mismatch(
                f"the rendezvous on {self.where} belongs to another job ({answer.get('job')}), "
                f"not this one ({self.job}): every node of one job stages the same source "
                "under the same --name and --dest, and each job needs its own --rendezvous "
                "port; nothing was published by this node"
            )
        if error:
            sock.close()
            raise Mismatch(str(answer.get("poison") or error))
        self._check(answer)
        sock.settimeout(self.timeout)
        return sock

    def _silent(self, timeout: float, e: BaseException | None = None) -> str:
        how = f" ({e})" if isinstance(e, OSError) and not isinstance(e, TimeoutError) else ""
        return (
            f"node 0 (the rendezvous on {self.where}) did not answer within {timeout:g} s{how}: "
            "stopped, hung or unreachable (or something else than shmstage listens there); "
            "nothing was published, re-run to resume"
        )

    def _check(self, answer: dict[str, Any]) -> None:
        if answer.get("poison"):
            raise Mismatch(answer["poison"])

    def call(self, req: dict[str, Any], deadline: float | None = None) -> Any:
        """One request, answered within ``deadline`` seconds (default ``timeout``)."""
        wait = self.timeout if deadline is None else min(deadline, self.timeout)
        with self.lock:
            if self.sock is None:
                raise StoreLost(f"the rendezvous on {self.where} (node 0) is gone")
            sent = False
            try:
                self.sock.settimeout(wait)
                if self.unread:  # the answer to a call a signal cut short
                    _recv(self.sock)
                    self.unread = False
                _send(self.sock, req)
                sent = True
                answer = _recv(self.sock)
            except BaseException as e:
                if not isinstance(e, (OSError, ValueError)):  # a signal: Interrupted
                    if sent:
                        self.unread = True  # read it before the next answer
                    else:
                        self._drop()  # maybe half a frame sent: the stream is lost
                    raise
                self._drop()
                if isinstance(e, TimeoutError):
                    raise StoreLost(self._silent(wait)) from None
                raise StoreLost(
                    f"lost the connection to node 0 (the rendezvous on {self.where}): {e}"
                ) from None
            if answer is None:
                self._drop()
                raise StoreLost(
                    f"node 0 (the rendezvous on {self.where}) closed the connection: it exited"
                )
        self._check(answer)
        if "error" in answer:
            raise ShmstageError(f"rendezvous: {answer['error']}")
        return answer.get("value")

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None  # type: ignore[assignment]

    def close(self) -> None:
        with self.lock:
            self._drop()

    # --- the store verbs ---------------------------------------------------------------

    def set(self, key: str, value: bytes, deadline: float | None = None) -> None:
        self.call({"op": "set", "key": key, "value": _b64(value)}, deadline)

    def get_now(self, key: str, deadline: float | None = None) -> bytes | None:
        value = self.call({"op": "get", "key": key}, deadline)
        return None if value is None else _unb64(value)

    def add(self, key: str, n: int, deadline: float | None = None) -> int:
        return int(self.call({"op": "add", "key": key, "n": n}, deadline))

    def check(self, keys: list[str], deadline: float | None = None) -> bool:
        return bool(self.call({"op": "check", "keys": keys}, deadline))

    def wait(self, keys: list[str], timeout: float) -> None:
        """Return once every key exists; ``StoreTimeout`` after ``timeout`` seconds.
        ``watch`` (if set) runs about once a second meanwhile: it raises to stop waiting
        for a node that is known to be gone."""
        end = time.monotonic() + timeout
        watched = time.monotonic()
        while not self.check(keys):
            now = time.monotonic()
            if now >= end:
                raise StoreTimeout(f"keys not set within {timeout:g} s: {keys}")
            if self.watch is not None and now - watched > 1.0:
                watched = now
                self.watch()
            time.sleep(POLL)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value, waiting for it up to ``timeout`` (default the client's)."""
        self.wait([key], self.timeout if timeout is None else timeout)
        value = self.get_now(key)
        if value is None:
            raise StoreTimeout(f"key {key} vanished")
        return value

    def delete(self, key: str) -> bool:
        return bool(self.call({"op": "delete", "key": key}))

    def count(self) -> int:
        return int(self.call({"op": "count"}))

    def bye(self, deadline: float | None = None) -> None:
        self.call({"op": "bye", "rank": self.rank}, deadline)

    def status(self, deadline: float | None = None) -> dict[int, dict[str, Any]]:
        return {int(r): s for r, s in self.call({"op": "status"}, deadline).items()}


def gloo_store(client: Client) -> Any:
    """``client`` as a torch ``Store``, for gloo to find its peers through (deadlines kept)."""
    from datetime import timedelta

    import torch.distributed as dist

    class _Store(dist.Store):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()

        def set(self, key: str, value: Any) -> None:
            client.set(key, bytes(value) if not isinstance(value, str) else value.encode())

        def get(self, key: str) -> bytes:
            return client.get(key)

        def add(self, key: str, n: int) -> int:
            return client.add(key, n)

        def check(self, keys: list[str]) -> bool:
            return client.check(keys)

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            wait = client.timeout if timeout is None else timeout.total_seconds()
            client.wait(keys, min(wait, client.timeout) if wait > 0 else client.timeout)

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            raise NotImplementedError("compare_set")

        def delete_key(self, key: str) -> bool:
            return client.delete(key)

        def num_keys(self) -> int:
            return client.count()

        def set_timeout(self, timeout: timedelta) -> None:
            pass

        def clone(self) -> Any:  # gloo clones its store (one per thread): same connection
            return keep(_Store())

    def keep(store: Any) -> Any:
        # The C++ side calls back into this Python object, found through pybind's registry:
        # it must live as long as gloo may call it, so the client holds every one made.
        client.stores.append(store)
        return store

    return keep(_Store())
