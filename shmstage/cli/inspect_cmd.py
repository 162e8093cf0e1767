"""``shmstage inspect``: what the node has, and whether a dataset fits."""

from __future__ import annotations

import click

from shmstage.cli.output import emit, json_option, table, verdict
from shmstage.cli.params import RESERVE
from shmstage.inspection import NodeReport, inspect_node


def _render(report: NodeReport) -> None:
    # Pad outside the colour codes so the column lines up with and without a tty.
    rows = [
        (c.name, verdict(c.verdict) + " " * (4 - len(c.verdict)), c.detail) for c in report.checks
    ]
    click.echo(table(rows))
    click.echo(f"\n{verdict(report.verdict)}  Next: {report.next_step}")


@click.command("inspect")
@click.option(
    "--path",
    default="/dev/shm",
    metavar="DIR",
    show_default=True,
    help="The tmpfs to check (where datasets get staged).",
)
@click.option(
    "--dataset",
    metavar="DIR",
    default=None,
    help="Also measure DIR (a directory, tar archive or s3://, gs:// or az:// prefix: bytes, "
    "files, where it lives) and check that it fits; exit 1 if not.",
)
@click.option(
    "--dest",
    metavar="DIR",
    default=None,
    envvar="SHMSTAGE_DEST",
    help="Staging destination for the fit check.  [default: $SHMSTAGE_DEST or stage's default for /dev/shm, else PATH/shmstage]",
)
@click.option(
    "--reserve",
    type=RESERVE,
    default=None,
    help="Space to keep free after staging: a size, or N% of the destination's size.  [default: 10% of the tmpfs, at most 4G]",
)
@json_option
@click.pass_context
def inspect_cmd(
    ctx: click.Context,
    path: str,
    dataset: str | None,
    dest: str | None,
    reserve: int | str | None,
    as_json: bool,
) -> None:
    """Check the node: tmpfs, memory, CPUs, Pillow, torch, fit.

    \b
    Examples:
      shmstage inspect                             # the node at a glance
      shmstage inspect --dataset /nfs/imagenet     # ... and does this dataset fit?
      shmstage inspect --json                      # for scripts (schema in docs/inspect.md)

    Each row is OK, WARN or FAIL; the last line says what to do next.
    Exits 0 when the node could be inspected (the verdicts are data), 1 when
    --dataset does not fit, 2 when --dataset does not exist.
    """
    report = inspect_node(path, dataset, dest=dest, reserve=reserve)
    emit(report, as_json, _render)
    if report.fits is False:
        ctx.exit(1)
