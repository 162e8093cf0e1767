"""Meeting the other nodes: a TCPStore on node 0 for agreement, a gloo group for the bytes.

Every exchange of small facts (is your tree the same? is your copy current? what do you
need? who failed?) goes through the store with ``--timeout`` on every wait, so a node that
never comes, dies or hangs is named instead of waited for.  The gloo group is only made
when bytes must move.  torch is imported lazily: ``--nodes 1`` never loads it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import suppress
from datetime import timedelta
from typing import Any

from shmstage.errors import ShmstageError

HEARTBEAT = 1.0  # seconds: a node whose count stands still this long is dead or hung


class PeerLost(ShmstageError):
    """Another node failed, died or hung; nothing was published, the partial copy stays."""

    keeps_partial = True


class Rendezvous:
    """A store and (on demand) a gloo group for ``nodes`` processes, one per node."""

    def __init__(self, host: str, port: int, nodes: int, rank: int, timeout: float) -> None:
        self.host, self.port, self.nodes, self.rank, self.timeout = host, port, nodes, rank, timeout
        self.store: Any = None
        self.group: Any = None
        self.round = 0  # one per stage() call, so `prepare` can stage several datasets
        self.beating = threading.Event()  # set: stop the heartbeat

    # --- connecting -------------------------------------------------------------------

    def connect(self, timeout: float | None = None) -> None:
        if self.store is not None:
            return
        # c10d logs every failed store call of a dying cluster as a C++ warning with a stack
        # trace; the one-line error says what happened.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        try:
            from torch.distributed import TCPStore
        except ImportError:
            raise ShmstageError(
                "--nodes needs torch (torch.distributed moves the bytes between nodes): "
                "pip install 'shmstage[cluster]', or stage on each node alone without --nodes"
            ) from None

        wait = self.timeout if timeout is None else timeout
        try:
            self.store = TCPStore(
                self.host,
                self.port,
                self.nodes,
                is_master=self.rank == 0,
                timeout=timedelta(seconds=wait),
                wait_for_workers=False,
            )
        except Exception as e:  # RuntimeError/DistNetworkError: a one-line reason
            where = f"{self.host}:{self.port}"
            if self.rank == 0:
                raise ShmstageError(
                    f"cannot open the rendezvous on {where} (node 0): {_first_line(e)}; "
                    "pick a free port with --rendezvous HOST:PORT"
                ) from None
            raise PeerLost(
                f"cannot reach the rendezvous on {where} (node 0) within {wait:g} s: "
                f"{_first_line(e)}; is node 0 running with the same --rendezvous?"
            ) from None
        self.store.set_timeout(timedelta(seconds=self.timeout))
        threading.Thread(target=self._heartbeat, name="shmstage-heartbeat", daemon=True).start()

    def gloo(self) -> Any:
        """The gloo group (made once, by every node together)."""
        if self.group is None:
            from torch.distributed import PrefixStore, ProcessGroupGloo

            store = PrefixStore("gloo/", self.store)
            try:
                self.group = ProcessGroupGloo(
                    store, self.rank, self.nodes, timedelta(seconds=self.timeout)
                )
            except Exception as e:
                raise self.lost(e) from None
        return self.group

    # --- agreement --------------------------------------------------------------------

    def key(self, what: str, rank: int | None = None) -> str:
        r = self.rank if rank is None else rank
        return f"r{self.round}/{what}/{r}"

    def allgather(self, what: str, value: bytes, patient: bool = False) -> list[bytes]:
        """Post ``value``; return every node's, by rank; names the nodes that never post.

        ``patient``: wait as long as the missing nodes' heartbeats go on (they are busy,
        e.g. timing a long copy); give up on one whose heartbeat stood still ``timeout``."""
        self.store.set(self.key(what), value)
        keys = [self.key(what, r) for r in range(self.nodes)]
        deadline = time.monotonic() + self.timeout
        last_beat: dict[int, tuple[int, float]] = {}  # rank -> (count, when it last moved)
        while True:
            try:
                self.store.wait(keys, timedelta(seconds=min(1.0, self.timeout)))
                break
            except Exception as e:
                if _failed_store(e):
                    raise self.lost(e) from None
                self.raise_reported()
                if patient:
                    now, beats = time.monotonic(), self._beats()
                    for r, k in enumerate(keys):
                        count, moved = last_beat.get(r, (-1, now))
                        if beats[r] != count:
                            last_beat[r] = (beats[r], now)
                        elif now - moved > self.timeout and not self.store.check([k]):
                            raise PeerLost(
                                f"lost {_ranks([r], self.nodes)} (no heartbeat for "
                                f"{self.timeout:g} s: killed, crashed, hung or unreachable) "
                                f"while waiting for it ({what})"
                            ) from None
                    continue
                if time.monotonic() > deadline:
                    missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                    raise PeerLost(
                        f"{_ranks(missing, self.nodes)} did not answer within {self.timeout:g} s "
                        f"(while agreeing on {what}); nothing was published, re-run to resume "
                        "(raise --timeout if a node is only slow)"
                    ) from None
        return [self.store.get(k) for k in keys]

    def allgather_json(self, what: str, value: Any, patient: bool = False) -> list[Any]:
        blobs = self.allgather(what, json.dumps(value).encode(), patient)
        return [json.loads(v) for v in blobs]

    # --- failures ---------------------------------------------------------------------

    def report(self, reason: str, suspect: int | None = None, lost: bool = False) -> None:
        """Tell the others why this node stops (``lost``: because it lost ``suspect`` or
        the exchange; else for a reason of its own).  Best effort: node 0 may be gone."""
        try:
            if self.store is None:
                self.connect(timeout=min(5.0, self.timeout))
            self.store.set(
                f"fail/{self.rank}",
                json.dumps({"reason": reason, "suspect": suspect, "lost": lost}).encode(),
            )
        except Exception:  # noqa: BLE001 - the store is node 0's: it may be dead already
            pass

    def reports(self) -> dict[int, dict[str, Any]]:
        out = {}
        for r in range(self.nodes):
            k = f"fail/{r}"
            try:
                if r != self.rank and self.store.check([k]):
                    out[r] = json.loads(self.store.get(k))
            except Exception:  # noqa: BLE001 - store gone: what we have
                break
        return out

    def raise_reported(self) -> None:
        """Raise if another node already said it stopped for a reason of its own."""
        for r, rep in self.reports().items():
            if not rep["lost"]:
                raise PeerLost(
                    f"node {r} of {self.nodes} failed: {rep['reason']}; nothing was published"
                )

    def lost(self, error: BaseException, suspect: int | None = None) -> PeerLost:
        """Turn a failed gloo or store operation into one line naming the node to blame.

        A dead node shows only to its ring neighbours (connection reset), and gloo does not
        always say which link broke; the others see the neighbours go.  So: a node that
        posted a reason of its own is named with it; else the nodes whose heartbeat stopped
        without a word (killed, crashed, hung) are."""
        self.report(f"lost contact: {_first_line(error)}", suspect, lost=True)
        if self.group is not None:  # drop our links now: nodes waiting on us see it at once
            with suppress(Exception):
                self.group.abort()
        try:
            first = self._beats()
        except Exception:  # noqa: BLE001 - node 0 (the store) is gone
            return self._gone([0])
        deadline = time.monotonic() + 3 * HEARTBEAT
        while True:
            seen = self.reports()
            for r, rep in sorted(seen.items()):
                if not rep["lost"]:
                    return PeerLost(
                        f"node {r} of {self.nodes} failed: {rep['reason']}; nothing was published"
                    )
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        try:
            last = self._beats()
        except Exception:  # noqa: BLE001
            return self._gone([0])
        # Nodes that posted a report were alive to do so (and may have exited since).
        seen = self.reports()
        stalled = [
            r for r in range(self.nodes) if r != self.rank and last[r] == first[r] and r not in seen
        ]
        if stalled:
            return self._gone(stalled)
        return PeerLost(
            f"the exchange failed: {_first_line(error)}; nothing was published, re-run to resume"
        )

    def _gone(self, ranks: list[int]) -> PeerLost:
        return PeerLost(
            f"lost {_ranks(ranks, self.nodes)} during the exchange (killed, crashed, hung or "
            f"unreachable for {self.timeout:g} s); nothing was published on any node, "
            "re-run to resume from the partial copies"
        )

    # --- heartbeats --------------------------------------------------------------------

    def _beats(self) -> list[int]:
        return [self.store.add(f"hb/{r}", 0) for r in range(self.nodes)]

    def _heartbeat(self) -> None:
        """Count up ``hb/<rank>`` while this node lives (its own store connection: the
        main thread's may be blocked in a wait)."""
        from torch.distributed import TCPStore

        try:
            store = TCPStore(
                self.host, self.port, self.nodes, is_master=False,
                timeout=timedelta(seconds=min(self.timeout, 30)), wait_for_workers=False,
            )  # fmt: skip
            while not self.beating.wait(HEARTBEAT / 2):
                store.add(f"hb/{self.rank}", 1)
        except Exception:  # noqa: BLE001 - the store is gone: the main thread finds out
            return

    def close(self) -> None:
        """Node 0 holds the store: keep it up until every node has said goodbye (bounded)."""
        self.beating.set()
        if self.store is None:
            return
        try:
            self.store.add("bye", 1)
            if self.rank == 0:
                deadline = time.monotonic() + min(self.timeout, 30.0)
                while self.store.add("bye", 0) < self.nodes and time.monotonic() < deadline:
                    if self.reports():
                        time.sleep(1.0)  # a failure: give the others time to read the reasons
                        break
                    time.sleep(0.05)
        except Exception:  # noqa: BLE001 - best effort
            pass
        if self.group is not None:
            with suppress(Exception):
                self.group.shutdown()
        self.group = None
        self.store = None


def _ranks(ranks: list[int], nodes: int) -> str:
    if len(ranks) == 1:
        return f"node {ranks[0]} of {nodes}"
    return "nodes " + ", ".join(map(str, ranks)) + f" of {nodes}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _failed_store(e: BaseException) -> bool:
    """A store wait that failed for another reason than its timeout (node 0 is gone)."""
    return "timeout" not in str(e).lower() and "timed out" not in str(e).lower()
