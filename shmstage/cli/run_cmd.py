"""``shmstage run``: stage the data, then run the training command on the staged copy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from shmstage.cli.output import log
from shmstage.cli.params import (
    RESERVE,
    cluster_options,
    cluster_spec,
    config_option,
    no_service_option,
)


def _log(message: str) -> None:
    log(f"shmstage: {message}")


class _RunCommand(click.Command):
    """Keeps the order of --stage and --name on the command line: each --name names the
    --stage before it (Click collects repeated options per option, not in order)."""

    def make_parser(self, ctx: click.Context) -> Any:
        parser = super().make_parser(ctx)
        parse = parser.parse_args

        def parse_args(args: list[str]) -> Any:
            opts, largs, order = parse(args)
            ctx.meta[_ORDER] = [p.name for p in order if p.name in ("stages", "names")]
            return opts, largs, order

        parser.parse_args = parse_args  # type: ignore[method-assign]
        return parser


_ORDER = "shmstage.run.stage_order"


def _requests(ctx: click.Context, stages: Sequence[str], names: Sequence[str]) -> list[Any]:
    from shmstage.launch import StageRequest

    order = ctx.meta.get(_ORDER, [])
    if order.count("stages") != len(stages):  # from $SHMSTAGE_RUN_STAGE: no names
        order = ["stages"] * len(stages) + [w for w in order if w == "names"]
    out: list[tuple[str, str | None]] = []
    s = n = 0
    for which in order:
        if which == "stages":
            out.append((stages[s], None))
            s += 1
            continue
        if not out:
            raise click.UsageError(
                f"--name {names[n]} must follow the --stage it names: --stage SRC --name NAME"
            )
        if out[-1][1] is not None:
            raise click.UsageError(
                f"--stage {out[-1][0]} has two names ({out[-1][1]}, {names[n]}): give one --name"
            )
        out[-1] = (out[-1][0], names[n])
        n += 1
    return [
        StageRequest.parse(src) if name is None else StageRequest(src, name) for src, name in out
    ]


@click.command(
    "run",
    cls=_RunCommand,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--stage",
    "stages",
    multiple=True,
    metavar="SRC",
    help="Stage SRC (a directory, tar archive or s3://, gs:// or az:// prefix) before the job "
    "(repeatable).",
)
@click.option(
    "--name",
    "names",
    multiple=True,
    metavar="NAME",
    allow_from_autoenv=False,
    help="Name of the --stage just before it (default: SRC's base name); the job finds it "
    "as {staged:NAME} and SHMSTAGE_DATA_<NAME>.",
)
@click.option(
    "--dest",
    type=click.Path(file_okay=False),
    help="Staging area, or tiers separated by commas (fastest first). "
    "Default: $SHMSTAGE_DEST, else the node config's dest, else /dev/shm/shmstage.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=0),
    help="Loader workers per rank for make_loader (exports SHMSTAGE_NUM_WORKERS).",
)
@click.option(
    "--pin/--no-pin",
    default=None,
    help="Force pinned host memory on/off in make_loader (default: on with an accelerator).",
)
@click.option(
    "--prefetch-factor",
    type=click.IntRange(min=1),
    help="Batches each loader worker keeps ready (exports SHMSTAGE_PREFETCH_FACTOR).",
)
@click.option(
    "--reserve",
    type=RESERVE,
    help="Room to keep free for DataLoader shared memory when staging: a size, or N% of "
    "DEST's file system. Default: the node config's reserve, else 10% of DEST, at most 4G.",
)
@click.option(
    "--make-room",
    is_flag=True,
    help="Evict least-recently-used staged datasets no running job leases until each "
    "--stage fits (see stage --make-room).",
)
@click.option(
    "--cleanup",
    is_flag=True,
    help="Evict the datasets this run staged once the job exits.",
)
@click.option(
    "--partial",
    is_flag=True,
    help="A directory larger than DEST keeps the largest part that fits in RAM, leased for the "
    "job's life; the job reads the rest from the source through shmstage.loader.DatasetFiles "
    "(see stage --partial).",
)
@click.option(
    "--no-wait",
    is_flag=True,
    help="Start the job as soon as each directory --stage is listed; the copy goes on, files "
    "the job asks for first, and is published as usual. The job must read through "
    "shmstage.loader.DatasetFiles({staged}) (docs/run.md).",
)
@config_option(
    "Node config: its loader section gives default loader settings, its dest the tiers and "
    "their cache max_size, its reserve the room kept free."
)
@cluster_options
@no_service_option
@click.argument(
    "command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="[--] CMD [ARGS]..."
)
@click.pass_context
def run_cmd(
    ctx: click.Context,
    stages: tuple[str, ...],
    names: tuple[str, ...],
    dest: str | None,
    workers: int | None,
    pin: bool | None,
    prefetch_factor: int | None,
    reserve: int | str | None,
    make_room: bool,
    cleanup: bool,
    partial: bool,
    no_wait: bool,
    config_path: str | None,
    nodes: int | None,
    node_rank: int | None,
    rendezvous: str | None,
    timeout: float,
    inflight: int,
    no_service: bool,
    command: tuple[str, ...],
) -> None:
    """Stage datasets, then run CMD on the staged copy and return its exit status.

    \b
    {staged} in ARGS becomes the staged path (one --stage), {staged:NAME} the
    one named NAME; {{staged}} is a literal {staged}.  The job also gets
    SHMSTAGE_DATA, SHMSTAGE_DATA_<NAME> and the loader settings make_loader reads.
    Signals sent to shmstage are forwarded to the job; its exit status is
    returned, and if signal N killed it shmstage dies of signal N too (a shell
    sees 128+N, and a loop stops on ^C).

    \b
      shmstage run --stage /nfs/imagenet -- torchrun --nproc-per-node 8 train.py --data {staged}
      shmstage run --stage /nfs/a --name a --stage /nfs/b.tar --name b -- train.py {staged:a} {staged:b}
    """
    from shmstage.launch import JobKilled, run

    cluster = None
    # Nothing to stage meets no other node, also in a Slurm step; and --no-wait asked for a
    # copy the job reads while it goes on, which a count only Slurm gave must not turn into a
    # cluster stage (whose files are complete only at its end).
    if stages and not (no_wait and nodes is None):
        cluster = cluster_spec(
            nodes, node_rank, rendezvous, timeout, inflight, dest, not no_service
        )
    result = run(
        command,
        stage=_requests(ctx, stages, names),
        dest=dest,
        workers=workers,
        pin=pin,
        prefetch_factor=prefetch_factor,
        reserve=reserve,
        cleanup=cleanup,
        make_room=make_room,
        config_path=config_path,
        log=_log,
        cluster=cluster,
        service=not no_service,
        partial=partial,
        no_wait=no_wait,
    )
    if result.signal is not None:
        raise JobKilled(result.signal)  # cleaned up: now die of it (shmstage.cli.main)
    raise SystemExit(result.returncode)
