"""``shmstage run``: stage the data, then run the training command on the staged copy."""

from __future__ import annotations

import click

from shmstage.cli.output import log


def _log(message: str) -> None:
    log(f"shmstage: {message}")


@click.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--stage",
    "stages",
    multiple=True,
    metavar="SRC[=NAME]",
    help="Stage SRC before the job (repeatable); NAME names it for {staged:NAME}.",
)
@click.option(
    "--dest",
    type=click.Path(file_okay=False),
    help="Staging area. Default: /dev/shm/shmstage (or $SHMSTAGE_DEST).",
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
    "--cleanup",
    is_flag=True,
    help="Evict the datasets this run staged once the job exits.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    envvar="SHMSTAGE_CONFIG",
    help="Node config whose loader section gives default loader settings.",
)
@click.argument(
    "command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="[--] CMD [ARGS]..."
)
def run_cmd(
    stages: tuple[str, ...],
    dest: str | None,
    workers: int | None,
    pin: bool | None,
    prefetch_factor: int | None,
    cleanup: bool,
    config_path: str | None,
    command: tuple[str, ...],
) -> None:
    """Stage datasets, then run CMD on the staged copy and return its exit status.

    \b
    {staged} in ARGS becomes the staged path (one --stage), {staged:NAME} the
    one named NAME; {{staged}} is a literal {staged}.  The job also gets
    SHMSTAGE_DATA, SHMSTAGE_DATA_<NAME> and the loader settings make_loader reads.
    Signals sent to shmstage are forwarded to the job; its exit status is
    returned (128+N if signal N killed it).

    \b
      shmstage run --stage /nfs/imagenet -- torchrun --nproc-per-node 8 train.py --data {staged}
    """
    from shmstage.launch import run

    result = run(
        command,
        stage=stages,
        dest=dest,
        workers=workers,
        pin=pin,
        prefetch_factor=prefetch_factor,
        cleanup=cleanup,
        config_path=config_path,
        log=_log,
    )
    raise SystemExit(result.returncode)
