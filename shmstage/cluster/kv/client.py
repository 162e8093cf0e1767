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
            send_frame(sock, hello)
            answer = recv_frame(sock)
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
