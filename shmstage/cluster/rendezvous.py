"""Meeting the other nodes: a small store on node 0 for agreement, a gloo group for the bytes.

Every exchange of small facts (is your tree the same? is your copy current? what do you
need? who failed?) goes through node 0's store (kv.py) with ``--timeout`` on every call,
so a node that never comes, dies, hangs or freezes (node 0 included) is named instead of
waited for.  The gloo group is only made when bytes must move; it finds its peers through
the same store.  torch is imported lazily: ``--nodes 1`` never loads it.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import threading
import time
from contextlib import suppress
from datetime import timedelta
from typing import Any

from shmstage.cluster.kv import FORMED, Client, Server, StoreLost, StoreTimeout, gloo_store
from shmstage.cluster.waits import first_line
from shmstage.errors import ShmstageError

HEARTBEAT = 1.0  # seconds: a node whose count stands still this long is dead or hung
QUICK = 3.0  # seconds for a best-effort call on the way out (node 0 may be frozen)


class PeerLost(ShmstageError):
    """Another node failed, died or hung; nothing was published, the partial copy stays."""

    keeps_partial = True


class Rendezvous:
    """A store and (on demand) a gloo group for ``nodes`` processes, one per node."""

    def __init__(
        self, host: str, port: int, nodes: int, rank: int, timeout: float, ports: int = 1
    ) -> None:
        self.host, self.port, self.nodes, self.rank, self.timeout = host, port, nodes, rank, timeout
        # > 1: the port was derived, not given: node 0 takes the first free one of
        # port .. port + ports - 1, the others find the one whose store is this job's
        self.ports = ports
        self.store: Client | None = None
        self.server: Server | None = None
        self.group: Any = None
        self.job: str | None = None  # which job this is: every hello says it (kv.Server)
        self.round = 0  # one per stage() call, so `prepare` can stage several datasets
        self.beating = threading.Event()  # set: stop the heartbeat

    # --- connecting -------------------------------------------------------------------

    def connect(self, timeout: float | None = None, job: str | None = None) -> None:
        """Join the job's store (node 0: open it first).  ``job`` says which job this is
        (the source, the Slurm job): a node of another job is refused, not mixed in."""
        if self.store is not None:
            return
        if job is not None:
            self.job = job
        if importlib.util.find_spec("torch") is None:  # before anyone waits for this node
            raise ShmstageError(
                "--nodes needs torch (torch.distributed moves the bytes between nodes): "
                "pip install 'shmstage[cluster]', or stage on each node alone without --nodes"
            )
        wait = self.timeout if timeout is None else timeout
        if self.rank == 0 and self.server is None:
            self.server = self._listen()
        try:
            self.store = Client(self.host, self.port, self.nodes, self.rank, self.job, wait,
                                ports=1 if self.rank == 0 else self.ports)  # fmt: skip
        except StoreLost as e:
            raise PeerLost(str(e)) from None
        self.port = self.store.port  # the one found: the heartbeat and gloo use it too
        self.store.timeout = self.timeout
        self.store.watch = self.watch
        threading.Thread(target=self._heartbeat, name="shmstage-heartbeat", daemon=True).start()

    def _listen(self) -> Server:
        """Node 0 opens the store on its port, or (derived) the first free one after it."""
        last: OSError | None = None
        for port in range(self.port, self.port + self.ports):
            try:
                server = Server(self.host, port, self.nodes, self.job)
            except OSError as e:
                last = e
                if e.errno == errno.EADDRINUSE:
                    continue  # another job's, or another stage's of this step
                break
            self.port = port
            return server
        assert last is not None
        ports = f"ports {self.port}-{self.port + self.ports - 1}" if self.ports > 1 else ""
        why = (
            f"{ports or f'port {self.port}'} in use (other jobs' rendezvous?)"
            if last.errno == errno.EADDRINUSE
            else f"port {self.port} {last.strerror}"
        )
        raise ShmstageError(
            f"cannot open the rendezvous on {self.host}:{self.port} (node 0): {why}; "
            "pick a free port with --rendezvous HOST:PORT"
        )

    def gloo(self) -> Any:
        """The gloo group (made once, by every node together)."""
        if self.group is None:
            # c10d and gloo log failures as C++ errors with stack traces; the one-line error
            # says what happened.  Read once, when torch loads: set only for the import, so
            # that a job started after staging (`shmstage run`) keeps torch's own default.
            level = os.environ.get("TORCH_CPP_LOG_LEVEL")
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
            try:
                from torch.distributed import PrefixStore, ProcessGroupGloo
            finally:
                if level is None:
                    del os.environ["TORCH_CPP_LOG_LEVEL"]

            assert self.store is not None
            store = PrefixStore(f"gloo{self.round}/", gloo_store(self.store))
            try:
                self.group = ProcessGroupGloo(
                    store, self.rank, self.nodes, timedelta(seconds=self.timeout)
                )
            except Exception as e:
                if isinstance(e, ShmstageError) and not isinstance(e, (StoreLost, StoreTimeout)):
                    raise  # Interrupted, a mismatch: as they are
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
        store = self._store()
        try:
            store.set(self.key(what), value)
            keys = [self.key(what, r) for r in range(self.nodes)]
            deadline = time.monotonic() + self.timeout
            last_beat: dict[int, tuple[int, float]] = {}  # rank -> (count, when it last moved)
            while True:
                try:
                    store.wait(keys, min(1.0, self.timeout))
                    break
                except StoreTimeout:
                    pass
                self.watch()
                if patient:
                    now, beats = time.monotonic(), self._beats()
                    for r, k in enumerate(keys):
                        count, moved = last_beat.get(r, (-1, now))
                        if beats[r] != count:
                            last_beat[r] = (beats[r], now)
                        elif now - moved > self.timeout and not store.check([k]):
                            raise PeerLost(
                                f"lost {_ranks([r], self.nodes)} (no heartbeat for "
                                f"{self.timeout:g} s: killed, crashed, hung or unreachable) "
                                f"while waiting for it ({what})"
                            ) from None
                    continue
                if time.monotonic() > deadline:
                    missing = [r for r, k in enumerate(keys) if not store.check([k])]
                    raise PeerLost(
                        f"{_ranks(missing, self.nodes)} did not answer within {self.timeout:g} s "
                        f"(while agreeing on {what}); nothing was published, re-run to resume "
                        "(raise --timeout if a node is only slow)"
                    ) from None
            store.set(FORMED, b"1")  # every node joined: the job's nodes are fixed (kv.FORMED)
            return [store.get(k) for k in keys]
        except StoreLost as e:
            raise PeerLost(str(e)) from None

    def allgather_json(self, what: str, value: Any, patient: bool = False) -> list[Any]:
        blobs = self.allgather(what, json.dumps(value).encode(), patient)
        return [json.loads(v) for v in blobs]

    def _store(self) -> Client:
        if self.store is None:
            self.connect()
        assert self.store is not None
        return self.store

    # --- publishing: all or none -----------------------------------------------------

    # One counter per round decides: node 0 adds COMMIT, a node that gives up adds ABORT;
    # the store adds under one lock, so the first addition wins and every node reads the
    # same outcome (value % ABORT == COMMIT: committed first).
    COMMIT, ABORT = 1, 1000

    def decide(self) -> None:
        """After every node posted "ready": return when the job publishes, raise when it
        does not - the same outcome on every node.  Node 0 commits only once every other
        node has acked after node 0 saw them ready: a node that gave up meanwhile (timed out
        on a frozen node 0, then exited) never acks, or its abort was counted first."""
        store = self._store()
        key, check = f"r{self.round}/decide", f"r{self.round}/check"
        try:
            if self.rank == 0:
                store.set(check, b"1")
                acks = [self.key("ack", r) for r in range(1, self.nodes)]
                try:
                    store.wait(acks, self.timeout)
                except StoreTimeout:
                    missing = [r for r, k in enumerate(acks, 1) if not store.check([k])]
                    raise PeerLost(
                        f"{_ranks(missing, self.nodes)} did not answer within {self.timeout:g} s "
                        "(before publishing); nothing was published, re-run to resume"
                    ) from None
                if store.add(key, self.COMMIT) != self.COMMIT:
                    raise self._aborted()
                return
            acked = False
            end = time.monotonic() + self.timeout
            while time.monotonic() < end:
                if not acked and store.check([check]):
                    store.set(self.key("ack"), b"1")
                    acked = True
                value = store.add(key, 0)
                if value % self.ABORT == self.COMMIT:
                    return
                if value:
                    raise self._aborted()
                time.sleep(0.05)
        except StoreLost as e:
            if self.give_up():
                return
            raise PeerLost(str(e)) from None
        except BaseException:
            if self.give_up():
                return
            raise
        if self.give_up():
            return
        raise PeerLost(
            f"node 0 did not decide within {self.timeout:g} s whether to publish; nothing was "
            "published, re-run to resume"
        )

    def give_up(self) -> bool:
        """This node stops before publishing: count its abort, unless node 0 committed
        first - then True (publish, as every other node does).  Best effort: a node 0 that
        does not answer finds this node's connection closed instead (it never acks)."""
        if self.store is None:
            return False
        try:
            value = self.store.add(f"r{self.round}/decide", self.ABORT, min(QUICK, self.timeout))
        except Exception:  # noqa: BLE001 - node 0 frozen or gone: it sees this node go
            return False
        return value % self.ABORT == self.COMMIT

    def _aborted(self) -> PeerLost:
        return PeerLost(
            "another node gave up before publishing (see its line); nothing was published, "
            "re-run to resume"
        )

    # --- failures ---------------------------------------------------------------------

    def report(self, reason: str, suspect: int | None = None, lost: bool = False) -> None:
        """Tell the others why this node stops (``lost``: because it lost ``suspect`` or
        the exchange; else for a reason of its own).  Best effort, and quick: node 0 may
        be gone or frozen."""
        quick = min(QUICK, self.timeout)
        blob = json.dumps({"reason": reason, "suspect": suspect, "lost": lost}).encode()
        try:
            if self.store is None and self.rank == 0:  # open it, for the others to read why
                self.connect(timeout=quick)
            if self.store is not None:
                self.store.set(f"fail/{self.rank}", blob, quick)
            elif self.job is not None:  # failed before joining: say why, without joining now
                # as this job's node: node 0 of another job ignores it (kv.Server._hello)
                once = Client(self.host, self.port, self.nodes, self.rank, self.job, quick,
                              main=False, ports=self.ports, unjoined=True)  # fmt: skip
                try:
                    once.set(f"fail/{self.rank}", blob, quick)
                finally:
                    once.close()
        except Exception:  # noqa: BLE001 - the store is node 0's: it may be dead already
            pass

    def reports(self, deadline: float | None = None) -> dict[int, dict[str, Any]]:
        """Every other node's failure report (StoreLost: node 0 did not answer)."""
        out = {}
        store = self._store()
        for r in range(self.nodes):
            if r != self.rank:
                blob = store.get_now(f"fail/{r}", deadline)
                if blob is not None:
                    out[r] = json.loads(blob)
        return out

    def raise_reported(self) -> None:
        """Raise if another node already said it stopped for a reason of its own."""
        for r, rep in self.reports().items():
            if not rep["lost"]:
                raise PeerLost(
                    f"node {r} of {self.nodes} failed: {rep['reason']}; nothing was published"
                )

    def watch(self, patient: bool = False) -> None:
        """Raise if another node stopped for a reason of its own or lost its connection
        (killed, crashed): run while waiting for keys, so nobody waits ``timeout`` for a
        node that is gone (gloo waits for every node's address this way).  ``patient``: node
        0 gets ``timeout`` to answer (a call that times out drops this node's connection)."""
        assert self.store is not None
        self.raise_reported()
        wait = self.timeout if patient else min(QUICK, self.timeout)
        crashed = [
            r for r, st in self.store.status(wait).items()
            if r != self.rank and st["claimed"] and not st["connected"] and not st["bye"]
        ]  # fmt: skip
        if crashed:
            raise self._gone(crashed, "its connection closed: killed or crashed")

    def lose_contact(self, reason: str, suspect: int | None = None) -> None:
        """Say this node lost ``suspect`` or the exchange; drop its links (waiters see it)."""
        self.report(reason, suspect, lost=True)
        if self.group is not None:
            with suppress(Exception):
                self.group.abort()

    def lost(self, error: BaseException, suspect: int | None = None) -> PeerLost:
        """Turn a failed gloo or store operation into one line naming the node to blame.

        A dead node shows only to its ring neighbours (connection reset), and gloo does not
        always say which link broke; the others see the neighbours go.  So: a node that
        posted a reason of its own is named with it; else node 0's store says which nodes
        lost their connection (killed, crashed) or stopped beating (hung, frozen)."""
        if isinstance(error, (StoreLost, PeerLost)):
            return PeerLost(str(error))  # node 0 itself: nobody else to ask
        self.lose_contact(f"lost contact: {first_line(error)}", suspect)
        quick = min(QUICK, self.timeout)
        deadline = time.monotonic() + 3 * HEARTBEAT
        try:
            while True:
                for r, rep in sorted(self.reports(quick).items()):
                    if not rep["lost"]:
                        return PeerLost(
                            f"node {r} of {self.nodes} failed: {rep['reason']}; nothing was "
                            "published"
                        )
                status = self._store().status(quick)
                seen = self.reports(quick)  # alive to post: not the culprit
                crashed = [
                    r for r, st in status.items()
                    if r != self.rank and r not in seen and st["claimed"] and not st["connected"]
                    and not st["bye"]
                ]  # fmt: skip
                hung = [
                    r for r, st in status.items()
                    if r != self.rank and r not in seen and st["connected"]
                    and (st["quiet"] or 0) > 2 * HEARTBEAT
                ]  # fmt: skip
                if crashed:
                    return self._gone(crashed, "its connection closed: killed or crashed")
                if hung:  # a fact already (the gloo wait took --timeout): name it now,
                    # not 3 heartbeats later on every node of the chain
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        except StoreLost as e:
            return PeerLost(str(e))
        if hung:
            return self._gone(hung, f"no sign of life for {2 * HEARTBEAT:g} s: hung or frozen")
        return PeerLost(
            f"the exchange failed: {first_line(error)}; nothing was published, re-run to resume"
        )

    def _gone(self, ranks: list[int], why: str) -> PeerLost:
        return PeerLost(
            f"lost {_ranks(ranks, self.nodes)} during the exchange ({why}); nothing was "
            "published on any node, re-run to resume from the partial copies"
        )

    # --- heartbeats --------------------------------------------------------------------

    def _beats(self) -> list[int]:
        store = self._store()
        return [store.add(f"hb/{r}", 0) for r in range(self.nodes)]

    def _heartbeat(self) -> None:
        """Count up ``hb/<rank>`` while this node lives (its own connection: the main
        thread's may be busy in a wait)."""
        try:
            store = Client(self.host, self.port, self.nodes, self.rank, self.job, self.timeout,
                           main=False)  # fmt: skip
        except Exception:  # noqa: BLE001 - the store is gone: the main thread finds out
            return
        try:
            while not self.beating.wait(HEARTBEAT / 2):
                store.add(f"hb/{self.rank}", 1)
        except Exception:  # noqa: BLE001 - likewise
            return
        finally:
            store.close()

    def close(self, failed: bool = False, own: bool = False) -> None:
        """Node 0 holds the store: keep it up until every other node has said goodbye,
        lost its connection or stopped beating (bounded), so that none of them finds it
        gone while it still needs it (and blames node 0).

        ``failed``: the stage failed (a broken group is left to the exit: shutting it down
        can wait for its timeout).  ``own``: for a reason of this node's own (a signal, an
        error); mid-exchange the others wait on gloo links that break only when this
        process exits: then node 0 exits at once, and the others name it."""
        self.beating.set()
        exchanging = self.group is not None
        if exchanging and not failed:
            with suppress(Exception):
                self.group.shutdown()
        self.group = None
        if self.store is not None:
            with suppress(Exception):
                self.store.bye(min(QUICK, self.timeout))
            self.store.close()
            self.store = None
        if self.server is not None:
            # refused: the nodes still to come are told why, up to --timeout; published: a
            # node frozen between its ack and reading the decision learns it when it wakes
            # (up to --timeout: else it fails while the others published)
            patient = not failed
            wait = (
                self.timeout
                if self.server.poison is not None or patient
                else min(self.timeout, 30.0)
            )
            if own and exchanging:
                wait = 0.0
            deadline = time.monotonic() + wait
            while not self.server.settled(patient) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.server.close()
            self.server = None


def _ranks(ranks: list[int], nodes: int) -> str:
    if len(ranks) == 1:
        return f"node {ranks[0]} of {nodes}"
    return "nodes " + ", ".join(map(str, ranks)) + f" of {nodes}"
