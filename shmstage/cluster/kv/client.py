"""The key-value store's client, one per node: every call has a deadline (a socket timeout), so
a node 0 that is frozen or never answers is reported instead of waited for; and the client as
a torch ``Store`` for gloo.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from shmstage.cluster.kv.wire import (
    POLL,
    TOKEN_ENV,
    Mismatch,
    StoreLost,
    StoreTimeout,
    b64,
    proof,
    recv_frame,
    send_frame,
    unb64,
)
from shmstage.errors import ShmstageError


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
        ports: int = 1,
        unjoined: bool = False,
    ) -> None:
        self.host, self.port, self.nodes, self.rank = host, port, nodes, rank
        self.job, self.timeout, self.main = job, timeout, main
        self.unjoined = unjoined  # a node that never joined, saying why it stops (no rank)
        self.ports = ports  # >1: node 0 listens on one of port .. port + ports - 1
        self.lock = threading.Lock()
        self.unread = False
        self.stores: list[Any] = []  # gloo_store's torch Stores over this client
        self.watch: Callable[[], None] | None = None
        self.sock = self._connect(timeout)

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self, timeout: float) -> socket.socket:
        """Connect (retrying while nobody listens yet: node 0 may start later) and say hello.

        With ``ports`` > 1, node 0 took the first free port of the range: try each in turn
        and keep the one whose store is this job's (another job's says so, and is skipped)."""
        deadline = time.monotonic() + timeout
        first = self.port
        while True:
            others: dict[int, _Elsewhere] = {}  # this round's ports that are not this job's
            for port in range(first, first + self.ports):
                self.port = port
                try:
                    sock = self._hello(deadline, timeout, probing=self.ports > 1)
                except _Elsewhere as e:
                    others[port] = e
                    continue
                if sock is not None:
                    return sock
            # closed before answering: node 0 is busy (many connections at once), or gone
            if deadline - time.monotonic() <= 0.2:
                self.port = first
                if self.ports == 1:
                    raise StoreLost(
                        f"the rendezvous on {self.where} (node 0) closed the connection at "
                        "once: node 0 gave up already, or something else than shmstage "
                        "listens there"
                    )
                jobs = [p for p, e in sorted(others.items()) if e.kind == "job"]
                tokens = [e for e in others.values() if e.kind == "token"]
                if tokens and not jobs:  # only stores that refused this node's token
                    raise tokens[0].error
                raise StoreLost(
                    f"found no rendezvous of this job ({self.job}) on {self.host} ports "
                    f"{first}-{first + self.ports - 1} (node 0) within {timeout:g} s"
                    + (f" (port {', '.join(map(str, jobs))}: other jobs')" if jobs else "")
                    + "; is node 0 running with the same --rendezvous?"
                )
            time.sleep(0.2)

    def _hello(
        self, deadline: float, timeout: float, probing: bool = False
    ) -> socket.socket | None:
        """One connection and its hello; None when node 0 closed it without an answer.
        ``probing``: _Elsewhere when nobody listens on this port or another job does."""
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
                if probing:
                    raise _Elsewhere("closed", e) from None
                last = e
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        left = deadline - time.monotonic()
        # probing: a listener that does not answer a hello at once is not this job's node 0
        sock.settimeout(max(0.001, min(left, 1.0) if probing else left))
        hello = {"op": "hello", "job": self.job, "nodes": self.nodes, "rank": self.rank,
                 "main": self.main, "unjoined": self.unjoined, "proof": proof(self.job)}  # fmt: skip
        try:
            send_frame(sock, hello)
            answer = recv_frame(sock)
        except (ConnectionResetError, BrokenPipeError):
            sock.close()
            return None
        except (OSError, ValueError) as e:
            sock.close()
            if probing:  # something else than shmstage, or a frozen node 0 of another job
                raise _Elsewhere("silent", e) from None
            raise StoreLost(self._silent(timeout, e)) from None
        if answer is None:
            sock.close()
            return None
        error = answer.get("error")
        if error in ("token", "job") and probing:
            sock.close()  # with a token, another job's node 0 cannot check this job's proof
            raise _Elsewhere(error, self._refused(error, answer))
        if error:
            sock.close()
            raise self._refused(error, answer)
        self._check(answer)
        sock.settimeout(self.timeout)
        return sock

    def _refused(self, error: str, answer: dict[str, Any]) -> Mismatch:
        if error == "token":
            return Mismatch(
                f"the rendezvous on {self.where} (node 0) refused this node's {TOKEN_ENV}: "
                "set the same secret on every node of the job (or on none); nothing was "
                "published by this node"
            )
        if error == "job":
            return Mismatch(
                f"the rendezvous on {self.where} belongs to another job ({answer.get('job')}), "
                f"not this one ({self.job}): every node of one job stages the same source "
                "under the same --name and --dest, and each job needs its own --rendezvous "
                "port; nothing was published by this node"
            )
        return Mismatch(str(answer.get("poison") or error))

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
                    recv_frame(self.sock)
                    self.unread = False
                send_frame(self.sock, req)
                sent = True
                answer = recv_frame(self.sock)
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
        self.call({"op": "set", "key": key, "value": b64(value)}, deadline)

    def get_now(self, key: str, deadline: float | None = None) -> bytes | None:
        value = self.call({"op": "get", "key": key}, deadline)
        return None if value is None else unb64(value)

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

    import torch.distributed as dist  # lazy: torch is heavy, and only --nodes needs it here

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


class _Elsewhere(Exception):
    """Probing a port range: this port is not this job's rendezvous (``error`` says why)."""

    def __init__(self, kind: str, error: BaseException) -> None:
        super().__init__(str(error))
        self.kind, self.error = kind, error  # kind: closed, silent, token or job
