"""The key-value store's server, on node 0: one thread per connection, every request answered
at once (waiting is the client's polling), a node of another job or a rank claimed twice refused.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import socket
import threading
import time
from typing import Any

from shmstage.cluster.kv.wire import (
    FORMED,
    HELLO_MAX,
    HELLO_WITHIN,
    PENDING,
    STALE,
    b64,
    proof,
    recv_frame,
    send_frame,
    unb64,
)


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
        # connections that have not said hello yet, oldest first (PENDING at most)
        self.silent: dict[socket.socket, None] = {}
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

    def settled(self, patient: bool = False) -> bool:
        """Every other node said goodbye, lost its connection or stopped beating: none
        still needs the store (to read why the job failed, or to finish).  ``patient``:
        a node that stopped beating but whose connection is open (frozen, SIGSTOP) still
        needs it: it may have acked a publish and not yet read the decision."""
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
                or (not patient and now - self.beat.get(r, now) > STALE)
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
                # Full of connections that say nothing (not this job's nodes): the oldest
                # goes, never the newcomer, so a stranger holding every slot cannot keep a
                # node out (a node says hello at once; it would have to lose a race with
                # PENDING connections opened after its own).
                oldest = next(iter(self.silent)) if len(self.silent) >= PENDING else None
                if oldest is not None:
                    del self.silent[oldest]
                self.silent[conn] = None
            if oldest is not None:
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)  # its thread sees the end and closes it
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._serve, args=(conn, addr), name="shmstage-kv", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        rank: int | None = None  # set once this connection claimed a rank
        with self.lock:
            self.conns.add(conn)
        try:
            hello = recv_frame(conn, HELLO_MAX, time.monotonic() + HELLO_WITHIN)
            if hello is None or hello.get("op") != "hello":
                return
            answer, rank = self._hello(hello, addr)
            send_frame(conn, answer)
            if "error" in answer:
                return
            with self.lock:
                self.silent.pop(conn, None)
            conn.settimeout(None)  # a node's connection idles while the ring runs
            while True:
                req = recv_frame(conn)
                if req is None:
                    return
                send_frame(conn, self._handle(req, rank))
        except Exception:  # noqa: BLE001 - a broken or foreign client: drop it, print nothing
            return
        finally:
            with self.lock:
                self.silent.pop(conn, None)
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
            main, held = hello.get("main"), isinstance(rank, int) and rank in self.claimed
            newcomer = nodes != self.nodes or (held if main else hello.get("unjoined"))
            if FORMED in self.data and newcomer:  # the job's nodes are fixed: it goes alone
                return {"error": "poison", "poison": self._late(nodes, rank)}, None
            if nodes != self.nodes:
                self.poison = (
                    f"the nodes were started with different --nodes: node {rank} with "
                    f"--nodes {nodes}, node 0 with --nodes {self.nodes}; start every node "
                    "with the same --nodes; this node publishes nothing"
                )
                if isinstance(rank, int) and rank not in self.claimed:
                    self.told.add(rank)  # (a node of this job holding that rank is not told)
                return {"error": "poison", "poison": self.poison}, None
            if not main:
                return {"ok": True}, None
            if not isinstance(rank, int) or not 0 <= rank < self.nodes:
                return {"error": "poison", "poison": f"invalid rank {rank!r}"}, None
            if held:
                self.poison = (
                    f"two nodes started as node {rank} of {self.nodes} ({self.claimed[rank]} "
                    f"and {addr[0]}): give every node its own --node-rank, and every job its "
                    "own --rendezvous port; this node publishes nothing"
                )  # the node that holds the rank is told when it next asks (told: by rank)
                return {"error": "poison", "poison": self.poison}, None
            self.claimed[rank] = str(addr[0])
            self.connected.add(rank)
            self.beat.setdefault(rank, time.monotonic())
            if self.poison is not None:
                self.told.add(rank)
        return {"ok": True, "poison": self.poison}, rank

    def _late(self, nodes: Any, rank: Any) -> str:
        """Why a node that comes after the job formed is refused (alone: the job goes on)."""
        if nodes != self.nodes:
            who = f"this job started with all its {self.nodes} nodes (--nodes {self.nodes})"
            fix = "every node of a job the same --nodes"
        else:
            at = self.claimed.get(rank, "another host") if isinstance(rank, int) else "?"
            who = f"node {rank} of {self.nodes} of this job is already running ({at})"
            fix = "every node its own --node-rank"
        return (
            f"{who}: this node is not part of it and publishes nothing (the job goes on); "
            f"give every job its own --rendezvous port and {fix}"
        )

    def _handle(self, req: dict[str, Any], rank: int | None = None) -> dict[str, Any]:
        op = req.get("op")
        out: dict[str, Any] = {}
        with self.lock:
            if op == "set":
                self.data[req["key"]] = unb64(req["value"])
            elif op == "get":
                value = self.data.get(req["key"])
                if value is None and req["key"] in self.counters:
                    value = str(self.counters[req["key"]]).encode()
                out["value"] = None if value is None else b64(value)
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
