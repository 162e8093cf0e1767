"""The hook ``stage`` calls when several nodes stage one source together (``peers=``).

The engine stays the same on every node (lock, fit, partial, publish); at four points it
asks its peers: do we all see the same tree, and do we all hold it already (``agree``)?
fill these files (``fill``, instead of the local copier); may we publish (``barrier``)?
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from shmstage.cluster.exchange import SLOTS, Ring
from shmstage.cluster.kv import Mismatch, StoreLost
from shmstage.cluster.plan import make_plan, piece_size
from shmstage.cluster.rendezvous import PeerLost, Rendezvous
from shmstage.cluster.targets import Target, give_owner, unreadable, verify_written
from shmstage.cluster.waits import LinkLost, wait_work
from shmstage.errors import RefusedError, ShmstageError
from shmstage.stage.sources.beneath import SourceTree
from shmstage.stage.sources.owners import stager_groups

DEFAULT_TIMEOUT = (
    300.0  # seconds: gloo's own default (30 min) is far too long to notice a dead node
)
DEFAULT_INFLIGHT = 256 << 20


@dataclass(frozen=True)
class ClusterSpec:
    """Where this node stands in the cluster, and how patient it is."""

    nodes: int
    rank: int
    host: str
    port: int
    timeout: float = DEFAULT_TIMEOUT
    inflight: int = DEFAULT_INFLIGHT  # bytes of pieces this node holds at most
    job: str = ""  # which job this is (e.g. "Slurm job 123"), with the source: see agree
    ports: int = 1  # > 1: ``port`` was derived; node 0 takes the first free of this many


class Peers:
    """One node's side of cluster staging; use as a context manager around ``stage``."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.rv = Rendezvous(spec.host, spec.port, spec.nodes, spec.rank, spec.timeout, spec.ports)
        self.tree: Any = None
        self.piece = 0
        self.ring: Ring | None = None  # started early on a node that needs every file

    def __enter__(self) -> Peers:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.ring is not None:
            self.ring.close()
        own = e is not None and not isinstance(e, PeerLost)
        # A node refused by the rendezvous (another job's, another --nodes) has nothing to
        # tell that job: its nodes are not this one's peers.
        if own and not isinstance(e, Mismatch):
            if isinstance(e, ShmstageError):
                reason = str(e)
            elif isinstance(e, KeyboardInterrupt):  # Ctrl-C: its str() is empty
                reason = "interrupted by SIGINT"
            else:
                reason = f"{kind.__name__}: {e}"  # type: ignore[union-attr]
            self.rv.report(reason or "interrupted")
        self.rv.close(failed=e is not None, own=own)

    def identify(self, source: str, name: str | None, dest: str | None) -> None:
        """Say which job this node runs (``stage`` calls it first, before anything can
        fail): its failure reports go only to that job's node 0, and a node staging
        another copy (another --name or --dest) is refused instead of joining."""
        if self.rv.store is None:  # joined: `prepare` stages more, as the same job
            self.rv.job = self.job(source, name, dest)

    def job(self, source: str, name: str | None = None, dest: str | None = None) -> str:
        """The job identity every node of the job shares (the command line, the Slurm job)."""
        parts = (f"source {source}", f"name {name}" if name else "", f"dest {dest}" if dest else "")
        return " ".join(filter(None, (*parts, self.spec.job)))

    def fail(self, reason: str) -> None:
        """Tell the other nodes this one stops (a caller that reports failures as values,
        like ``prepare``), so they fail at once instead of after ``timeout``."""
        self.rv.report(reason)

    # --- the hook ----------------------------------------------------------------------

    def agree(self, tree: Any, current: bool, cold: bool = False) -> bool:
        """Check every node sees the tree node 0 sees (else all refuse, naming the first
        difference); True when every node already holds it (then nothing moves).

        ``cold``: this node holds nothing of the dataset, so it needs every file and the
        plan cannot be other than all files: it starts reading its share now, while torch
        loads and the others arrive (seconds on a busy node)."""
        self.tree = tree
        if cold and not current and self.ring is None:
            files = [(e[0], e[2]) for e in tree.entries if e[1] == "f"]
            piece = piece_size(self.spec.inflight, SLOTS)
            plan = make_plan(files, self.spec.nodes, piece)
            if plan.total:
                self.ring = Ring(plan, self.spec.rank, tree, self.spec.timeout, _root())
                self.ring.prefetch()
        # The job: every node of one job stages the same source (and Slurm job); a node of
        # another job on the same port is refused instead of joining this one's rounds.
        self.rv.connect(job=self.rv.job or self.job(tree.root))
        self.rv.round += 1
        entries = [list(e) for e in tree.entries]
        digest = hashlib.sha256(json.dumps(entries).encode()).hexdigest()
        mine = {
            "digest": digest,
            "current": current,
            "piece": piece_size(self.spec.inflight, SLOTS),
        }
        views = self.rv.allgather_json("tree", mine)  # then the job's nodes are fixed
        self.piece = views[0]["piece"]  # node 0's: every node must cut the same pieces
        if any(v["digest"] != views[0]["digest"] for v in views):
            self._refuse(entries, views)
        return all(v["current"] for v in views)

    def fill(self, jobs: list[Any], tick: Callable[[int, int], None], checksum: bool) -> None:
        """Write ``jobs`` (the engine's copy jobs) with bytes read once across the nodes."""
        files = [(e[0], e[2]) for e in self.tree.entries if e[1] == "f"]
        index = {rel: i for i, (rel, _) in enumerate(files)}
        mine = bytearray(len(files))
        for job in jobs:
            mine[index[job[6]]] = 1
        needs = self.rv.allgather("need", zlib.compress(bytes(mine)))
        bits = 0  # one byte (0 or 1) per file: OR as big integers, not 1M Python steps
        for blob in needs:
            bits |= int.from_bytes(zlib.decompress(blob), "little")
        union = bits.to_bytes(len(files), "little")
        chosen = [i for i, b in enumerate(union) if b and files[i][1] > 0]
        plan = make_plan([files[i] for i in chosen], self.spec.nodes, self.piece)
        by_rel = {job[6]: job for job in jobs}
        targets = {}
        for j, i in enumerate(chosen):
            job = by_rel.get(files[i][0])
            if job is not None:
                src, dst, size, mtime, atime, mode = job[:6]
                who = job[7] if len(job) > 7 else 0
                targets[j] = Target(dst, src, size, mtime, atime, mode, size, rel=job[6], ident=who)
        own = _root()
        groups = None if own else stager_groups()
        empty = [job for job in jobs if job[2] == 0]
        if empty:
            with _top(self.tree) as top:  # the walked top, never the path again
                for job in empty:
                    _empty_file(job, own, groups, top)
                    tick(0, 1)
        if plan.total == 0:
            return
        ring, self.ring = self.ring, None
        if ring is None or (ring.plan.files, ring.plan.piece) != (plan.files, plan.piece):
            if ring is not None:
                ring.close()  # read ahead for another plan (node 0 cuts other pieces)
            ring = Ring(plan, self.spec.rank, self.tree, self.spec.timeout, own)
        group = self.rv.gloo()
        try:
            ring.run(group, targets, tick, checksum, self._watch)
        except LinkLost as e:
            raise self.rv.lost(e.error, e.peer) from None
        if checksum:
            bad = verify_written(targets, plan)
            if bad:
                raise ShmstageError(
                    f"checksum mismatch after copying {len(bad)} file(s), e.g. {bad[0]}: the copy "
                    "differs from what its owner node read; the memory is faulty? re-run"
                )

    def _watch(self) -> None:
        """While a gloo wait lasts: raise if a node said it stopped or its connection to
        node 0 closed (rendezvous.watch, patient: node 0 gets --timeout to answer).  Node 0
        not answering is no news: a frozen node 0 may go on, and gloo's own --timeout
        decides.  Before raising, this node loses contact (rendezvous.lose_contact); the
        gloo wait it ends is left pending, so the exit must not wait for it
        (waits.left_behind, shmstage.cli.main)."""
        try:
            self.rv.watch(patient=True)
        except StoreLost:
            pass
        except PeerLost as e:
            self.rv.lose_contact(f"lost contact: {e}")
            raise

    def barrier(self) -> None:
        """Return when every node has every byte and node 0 decided to publish (every node
        decides the same: rendezvous.decide); the engine publishes right after."""
        try:
            self.rv.allgather("ready", b"1")
            if self.rv.group is not None:  # also proves the gloo links are still up
                from datetime import timedelta

                try:
                    work = self.rv.group.barrier()
                except Exception as e:  # a group that broke since the ring
                    raise self.rv.lost(e) from None
                try:
                    wait_work(work, timedelta(seconds=self.spec.timeout), None)
                except LinkLost as e:
                    raise self.rv.lost(e.error) from None
        except BaseException:
            self.rv.give_up()  # node 0 has not committed: it waits for this node's ack
            raise
        self.rv.decide()

    # --- refusing ----------------------------------------------------------------------

    def _refuse(self, entries: list[list[Any]], views: list[dict[str, Any]]) -> None:
        """Node 0 posts its entries; every node that differs says where; all raise."""
        if self.spec.rank == 0:
            blob = zlib.compress(json.dumps(entries).encode())
            self.rv.allgather("entries", blob)
            diff = ""
        else:
            theirs = json.loads(zlib.decompress(self.rv.allgather("entries", b"")[0]))
            diff = (
                first_difference(theirs, entries)
                if views[self.spec.rank]["digest"] != views[0]["digest"]
                else ""
            )
        said = self.rv.allgather("diff", diff.encode())
        for r, text in enumerate(said):
            if text:
                raise RefusedError(
                    f"node {r} sees a different {self.tree.root} than node 0: {text.decode()}; "
                    "every node must see the same source (is the file system mounted and in sync "
                    "everywhere?); nothing was staged"
                )
        raise RefusedError(f"the nodes see different trees at {self.tree.root}; nothing was staged")


def first_difference(want: list[list[Any]], have: list[list[Any]]) -> str:
    """The first entry where ``have`` (this node's tree) differs from ``want`` (node 0's)."""
    theirs = {e[0]: e for e in want}
    ours = {e[0]: e for e in have}
    for e in want:
        mine = ours.get(e[0])
        if mine is None:
            return f"{e[0]} is missing"
        if mine != e:
            what = [
                label
                for label, a, b in (("kind", e[1], mine[1]), ("size", e[2], mine[2]),
                                    ("mtime", e[3], mine[3]), ("mode", e[4], mine[4]),
                                    ("target", e[5], mine[5]))
                if a != b
            ]  # fmt: skip
            return (
                f"{e[0]} differs ({', '.join(what)}: node 0 sees {e[1:5]}, this node {mine[1:5]})"
            )
    for e in have:
        if e[0] not in theirs:
            return f"{e[0]} is extra"
    return "the order of entries differs"


def _root() -> bool:
    return os.geteuid() == 0  # root keeps owners, as the local copier (copy.keeps_owner)


def _top(tree: Any) -> SourceTree:
    try:
        return SourceTree(tree.root, tree.top)
    except OSError as e:
        raise unreadable(tree.root, e) from None


def _empty_file(job: Any, own: bool, groups: frozenset[int] | None, top: SourceTree) -> None:
    src, dst, size, mtime, atime, mode = job[:6]
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        who = job[7] if len(job) > 7 else 0
        give_owner(
            Target(dst, src, size, mtime, atime, mode, 0, rel=job[6], ident=who),
            fd,
            top,
            own,
            groups,
        )
        os.fchmod(fd, mode)
        os.utime(fd, ns=(atime, mtime))
    finally:
        os.close(fd)
