"""Click parameter types and option groups shared by commands (modelled on Flask's
CertParamType), and what the cluster options resolve to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from shmstage.sizes import SizeError, check_reserve, is_percent, parse_age, parse_size


class SizeType(click.ParamType):
    """``64G``, ``512MiB``, bytes; ``N%`` kept as text when ``allow_percent`` (the
    command resolves it against the memory it can see)."""

    name = "size"

    def __init__(self, allow_percent: bool = False) -> None:
        self.allow_percent = allow_percent

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int):
            return value
        text = str(value)
        try:
            if is_percent(text):
                if not self.allow_percent:
                    self.fail(
                        f"{text!r}: a percentage is not allowed here; give a size like 4G",
                        param,
                        ctx,
                    )
                parse_size(text, percent_of=100)  # validates the range
                return text.strip()
            return parse_size(text)
        except SizeError as e:
            self.fail(str(e), param, ctx)


class AgeType(click.ParamType):
    """``90``, ``30m``, ``12h``, ``7d`` -> seconds."""

    name = "age"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return parse_age(value)
        except SizeError as e:
            self.fail(str(e), param, ctx)


class ReserveType(SizeType):
    """``--reserve``: a size or N% (0 < N < 100), the config's ``reserve`` rule."""

    def __init__(self) -> None:
        super().__init__(allow_percent=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        out = super().convert(value, param, ctx)
        try:
            check_reserve(out)  # what is left: 100% (in the order the config checks)
        except SizeError as e:
            self.fail(str(e), param, ctx)
        return out


SIZE = SizeType()
SIZE_OR_PERCENT = SizeType(allow_percent=True)
RESERVE = ReserveType()
AGE = AgeType()


def config_option(help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--config FILE`` (``$SHMSTAGE_CONFIG``, parameter ``config_path``): the node config."""
    return click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False),
        envvar="SHMSTAGE_CONFIG",
        help=help,
    )


def cluster_options(f: Any = None, *, slurm_nodes: bool = True) -> Any:
    """``--nodes/--node-rank/--rendezvous/--timeout/--inflight``: stage one source with
    several nodes, each reading a share (``stage``, ``run`` and ``prepare`` take them).
    ``slurm_nodes``: the help says --nodes defaults to a Slurm step's node count (``prepare``
    takes it only when given: see prepare_cmd)."""
    if f is None:
        return lambda g: cluster_options(g, slurm_nodes=slurm_nodes)
    from shmstage.cluster import DEFAULT_PORT, PORT_PROBE, SLURM_PORT_BASE, SLURM_PORT_SPAN

    default = (
        "Default: 1, alone; in a Slurm step with one task per node on several nodes (srun -N 4 "
        "--ntasks-per-node=1), $SLURM_STEP_NUM_NODES. --nodes 1 stages alone."
        if slurm_nodes
        else "Default: 1, alone (also under Slurm)."
    )
    options = [
        click.option(
            "--nodes",
            type=click.IntRange(min=1),
            help="Stage together with this many nodes (one shmstage per node): each reads 1/N "
            f"of SRC and they exchange the rest over torch.distributed (gloo). {default}",
        ),
        click.option(
            "--node-rank",
            type=click.IntRange(min=0),
            help="This node's rank, 0 to N-1. Default: $SLURM_NODEID.",
        ),
        click.option(
            "--rendezvous",
            metavar="HOST[:PORT]",
            help=f"Node 0's address for the rendezvous. Default: the first host of "
            "$SLURM_STEP_NODELIST in a Slurm step, else of $SLURM_JOB_NODELIST. Port default "
            f"{DEFAULT_PORT}; under Slurm {SLURM_PORT_BASE} + ($SLURM_JOB_ID * 16 + "
            f"$SLURM_STEP_ID) mod {SLURM_PORT_SPAN}. A port not given is where node 0 starts: "
            f"it takes the first free of {PORT_PROBE} from there, and the other nodes find the "
            "one that names their job (source, --name, --dest, Slurm job and step), so jobs "
            "or stages that derive one port each meet their own. A port given is exact.",
        ),
        click.option(
            "--timeout",
            type=click.FloatRange(min=0, min_open=True),
            default=300.0,
            show_default=True,
            help="Seconds to wait for another node before all fail, naming it (--nodes).",
        ),
        click.option(
            "--inflight",
            type=SIZE,
            default="256M",
            show_default=True,
            help="Bytes of the exchange this node holds in memory at most (--nodes).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def cluster_spec(
    nodes: int | None,
    node_rank: int | None,
    rendezvous: str | None,
    timeout: float,
    inflight: int,
    dest: str | None,
    service: bool,
) -> Any:
    """The cluster options resolved (``shmstage.cluster.resolve``) for a command that stages
    through the node's service when one answers (``stage``, ``run``).  A node count that
    only Slurm's step gave (no ``--nodes``) yields to that service: cluster staging runs in
    this process, as the job's user, and would refuse a store that root's service manages,
    where staging through the service alone works as it did before Slurm was asked."""
    from shmstage.cluster import resolve
    from shmstage.service import api

    spec = resolve(nodes, node_rank, rendezvous, timeout, inflight)
    if spec is not None and nodes is None and api.service_for(dest, service) is not None:
        return None
    return spec


def no_service_option(f: Any) -> Any:
    """``--no-service`` (parameter ``no_service``): run in this process even when the node's
    shmstage service answers (`shmstage serve`, docs/service.md)."""
    return click.option(
        "--no-service",
        "no_service",
        is_flag=True,
        help="Run in this process, not through the node's shmstage service (which is used when "
        "its socket, $SHMSTAGE_SOCKET or /run/shmstage/shmstage.sock, answers and DEST is its store).",
    )(f)
