"""Cluster staging: N nodes each read 1/N of a source and exchange the rest (torch.distributed).

    from shmstage.cluster import Peers, resolve
    spec = resolve(nodes=4, rank=None, rendezvous=None)   # rank/host from Slurm if unset
    spec = resolve(None, None, None)  # in `srun -N 4 --ntasks-per-node=1`: all from Slurm
    with Peers(spec) as peers:
        stage("/nfs/imagenet", peers=peers)

``resolve`` returns None for one node: then ``stage`` runs exactly as on a single node.
Modules: rendezvous (node 0's store + gloo, failures), kv (that store: a deadline on every
call), plan (shares and pieces), exchange (the pipelined ring), targets (the files a node
writes), waits (gloo waits that still see signals), peers (the hook the staging engine calls).
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shmstage.errors import RefusedError

if TYPE_CHECKING:
    from shmstage.cluster.peers import DEFAULT_INFLIGHT, DEFAULT_TIMEOUT, ClusterSpec, Peers
    from shmstage.cluster.rendezvous import PeerLost

DEFAULT_PORT = 29450  # not torchrun's 29400: `shmstage run` may stage, then start torchrun
SLURM_PORT_BASE, SLURM_PORT_SPAN = 30000, 2048  # under Slurm: one port per job and step
# A port not given is only where node 0 starts looking: two jobs (or two stages of one step)
# may derive the same one; node 0 takes the first free of PORT_PROBE, the other nodes find
# the one whose store names their job (its source, --name, --dest, Slurm job and step).
PORT_PROBE = 32

__all__ = ["DEFAULT_INFLIGHT", "DEFAULT_PORT", "DEFAULT_TIMEOUT", "PORT_PROBE", "SLURM_PORT_BASE", "SLURM_PORT_SPAN",
           "ClusterSpec", "PeerLost", "Peers", "first_host", "resolve", "slurm_nodes", "slurm_port"]  # fmt: skip

# Loaded on first use: every command's --help names DEFAULT_PORT, few stage with --nodes.
_LAZY = {"Peers": "peers", "ClusterSpec": "peers", "DEFAULT_INFLIGHT": "peers",
         "DEFAULT_TIMEOUT": "peers", "PeerLost": "rendezvous"}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"shmstage.cluster.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve(
    nodes: int | None,
    rank: int | None,
    rendezvous: str | None,
    timeout: float | None = None,
    inflight: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ClusterSpec | None:
    """This node's place from the flags, each unset one falling back to Slurm's variables
    (``slurm_nodes``, SLURM_NODEID, the first host of the step's or the job's node list, a
    port derived from the job: ``slurm_port``); None for one node."""
    env = os.environ if environ is None else environ
    if nodes is None:
        nodes = slurm_nodes(env)
    if nodes is None or nodes == 1:
        return None  # one node: the exchange's modules (~20 ms) are not loaded
    from shmstage.cluster.peers import DEFAULT_INFLIGHT, DEFAULT_TIMEOUT, ClusterSpec

    if nodes < 1:
        raise RefusedError(f"invalid --nodes {nodes}: must be at least 1")
    if rank is None and env.get("SLURM_NODEID", "").isdigit():
        rank = int(env["SLURM_NODEID"])  # in a step: this node's index among the step's nodes
    if rank is None:
        raise RefusedError(
            f"--nodes {nodes} needs this node's --node-rank (0 to {nodes - 1}); under Slurm it "
            "comes from SLURM_NODEID"
        )
    if not 0 <= rank < nodes:
        raise RefusedError(
            f"invalid --node-rank {rank}: must be 0 to {nodes - 1} for --nodes {nodes}"
        )
    # A step's node 0 (SLURM_NODEID counts the step's nodes) is the first of the step's list,
    # which is not the job's first node when the step runs on part of the allocation.
    nodelist = env.get("SLURM_STEP_NODELIST") if _in_step(env) else None
    if rendezvous is None and (nodelist or env.get("SLURM_JOB_NODELIST")):
        rendezvous = first_host(nodelist or env["SLURM_JOB_NODELIST"])
    if not rendezvous:
        raise RefusedError(
            f"--nodes {nodes} needs --rendezvous HOST[:PORT], node 0's address (under Slurm: "
            "the first host of SLURM_JOB_NODELIST)"
        )
    host, port, given = _host_port(rendezvous, slurm_port(env) or DEFAULT_PORT)
    return ClusterSpec(
        nodes,
        rank,
        host,
        port,
        DEFAULT_TIMEOUT if timeout is None else timeout,
        DEFAULT_INFLIGHT if inflight is None else inflight,
        # two jobs that share a rendezvous port must not mix: Slurm names the job
        _slurm_job(env),
        1 if given else PORT_PROBE,  # an explicit port is exactly that port
    )


def slurm_nodes(env: Mapping[str, str]) -> int | None:
    """The node count of a Slurm job step that runs one task per node on several nodes
    (``srun -N 4 --ntasks-per-node=1 shmstage stage SRC``), else None: a batch script's
    shell, ``salloc``'s, one node, or several tasks on a node (``srun --ntasks-per-node=8
    shmstage run ...``: the node's tasks share one copy through its lock, as without Slurm)."""
    if not _in_step(env):
        return None
    count = env.get("SLURM_STEP_NUM_NODES", "")
    if not count.isdigit() or int(count) < 2:
        return None
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE", "")  # "1(x4)", "8(x3),4"
    if tasks == count or (not tasks and re.fullmatch(r"1(\(x\d+\))?", per_node)):
        return int(count)
    return None


def slurm_port(env: Mapping[str, str]) -> int | None:
    """The rendezvous port of a Slurm job's step when none is given, so that two jobs (or
    two steps of one job) whose node 0 is the same host rarely start on one port:
    30000 + (SLURM_JOB_ID * 16 + SLURM_STEP_ID) mod 2048, below Linux's ephemeral ports.
    Where they do (jobs 128 apart, two stages in one step), PORT_PROBE sorts them out."""
    job = env.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        return None
    step = int(env["SLURM_STEP_ID"]) if _in_step(env) else 0
    return SLURM_PORT_BASE + (int(job) * 16 + step) % SLURM_PORT_SPAN


def _in_step(env: Mapping[str, str]) -> bool:
    # A batch script's shell has no SLURM_STEP_ID (or a name such as "batch"), a task of
    # an srun step its number.
    return env.get("SLURM_STEP_ID", "").isdigit()


def _slurm_job(env: Mapping[str, str]) -> str:
    if not env.get("SLURM_JOB_ID"):
        return ""
    step = f" step {env['SLURM_STEP_ID']}" if env.get("SLURM_STEP_ID") else ""
    return f"Slurm job {env['SLURM_JOB_ID']}{step}"


def _host_port(text: str, default_port: int) -> tuple[str, int, bool]:
    """(host, port, whether the text gave the port)."""
    host, sep, port = text.rpartition(":")
    if not sep or "]" in port:  # no port (or a bare IPv6 address in brackets)
        host, port = text, ""
    host = host.strip("[]")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise RefusedError(f"invalid --rendezvous {text}: the port must be 1 to 65535")
    if not host:
        raise RefusedError(
            f"invalid --rendezvous {text}: give HOST[:PORT], e.g. node01:{DEFAULT_PORT}"
        )
    return host, int(port) if port else default_port, bool(port)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``gpu[07-09,12],cpu1`` -> ``gpu07``."""
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if m is None:
        return nodelist
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + re.split(r"[-,]", ranges, maxsplit=1)[0]
