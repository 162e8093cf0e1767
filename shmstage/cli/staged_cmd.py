"""``shmstage list``, ``verify`` and ``evict``: look after staged datasets."""

from __future__ import annotations

import sys
import time

import click

from shmstage.cli.output import emit, json_option, table, verdict
from shmstage.cli.params import AGE
from shmstage.sizes import format_size
from shmstage.stage import DEFAULT_DEST, StagedDataset, VerifyReport, evict, list_staged, verify

_DEST_HELP = f"Where staged datasets live. Default: {DEFAULT_DEST} (or $SHMSTAGE_DEST)."


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"


def _render_list(items: list[StagedDataset]) -> None:
    if not items:
        click.echo("nothing staged")
        return
    rows = [
        (d.name, format_size(d.bytes), d.files, _when(d.staged_at), _when(d.last_used), d.source)
        for d in items
    ]
    click.echo(table(rows, headers=("NAME", "SIZE", "FILES", "STAGED", "LAST USED", "SOURCE")))


@click.command("list")
@click.option("--dest", envvar="SHMSTAGE_DEST", help=_DEST_HELP)
@json_option
def list_cmd(dest: str | None, as_json: bool) -> None:
    """List staged datasets: name, size, files, when staged and last used, source."""
    emit(list_staged(dest), as_json, _render_list)


def _render_verify(report: VerifyReport) -> None:
    how = "every byte compared with the source" if report.checksum else "sizes, mtimes and modes"
    if report.ok:
        click.echo(f"{verdict('OK')} {report.name}: {report.files} files match ({how})")
        return
    rows = [(d.problem, d.path, d.detail) for d in report.differences]
    click.echo(table(rows, headers=("PROBLEM", "PATH", "DETAIL")))
    click.echo(f"{verdict('FAIL')} {report.name}: {len(report.differences)} difference(s) ({how})")


@click.command("verify")
@click.argument("name")
@click.option(
    "--checksum", is_flag=True, help="Also compare every byte with the source (reads it all)."
)
@click.option("--dest", envvar="SHMSTAGE_DEST", help=_DEST_HELP)
@json_option
def verify_cmd(name: str, checksum: bool, dest: str | None, as_json: bool) -> None:
    """Check a staged dataset against its manifest; exit 3 if anything differs.

    Finds changed, missing and extra files; --checksum also finds a flipped byte.
    """
    report = verify(name, dest=dest, checksum=checksum)
    emit(report, as_json, _render_verify)
    if not report.ok:
        sys.exit(3)


@click.command("evict")
@click.argument("name", required=False)
@click.option(
    "--all", "all_", is_flag=True, help="Evict every staged dataset (and leftovers of killed runs)."
)
@click.option(
    "--older-than", type=AGE, help="Evict datasets not used for this long (e.g. 12h, 7d)."
)
@click.option("--dest", envvar="SHMSTAGE_DEST", help=_DEST_HELP)
@click.option("--dry-run", is_flag=True, help="Show what would be evicted; remove nothing.")
@json_option
def evict_cmd(
    name: str | None,
    all_: bool,
    older_than: float | None,
    dest: str | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Remove staged datasets: NAME, --all, or --older-than AGE (frees their RAM)."""
    if sum((name is not None, all_, older_than is not None)) != 1:
        raise click.UsageError("give exactly one of NAME, --all or --older-than")
    names = evict(name, dest=dest, all=all_, older_than=older_than, dry_run=dry_run)

    def render(evicted: list[str]) -> None:
        word = "would evict" if dry_run else "evicted"
        click.echo(f"{word}: {', '.join(evicted)}" if evicted else "nothing to evict")

    emit(names, as_json, render)
