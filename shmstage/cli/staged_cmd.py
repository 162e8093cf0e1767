"""``shmstage list``, ``verify``, ``evict`` and ``gc``: look after staged datasets."""

from __future__ import annotations

import sys
import time

import click

from shmstage.cli.output import emit, json_option, table, verdict
from shmstage.cli.params import AGE, no_service_option
from shmstage.config import configured
from shmstage.service import api
from shmstage.sizes import format_size
from shmstage.stage import (
    DEFAULT_DEST,
    EvictReport,
    GcReport,
    InTier,
    VerifyReport,
)
from shmstage.stage.store.leases import describe
from shmstage.terminal import printable

_DEST_HELP = (
    "Where staged datasets live, or tiers separated by commas. "
    f"Default: $SHMSTAGE_DEST, else the node config's dest, else {DEFAULT_DEST}."
)


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"


def _render_list(items: list[InTier]) -> None:
    if not items:
        click.echo("nothing staged")
        return
    tiers = list(dict.fromkeys(d.tier for d in items))
    rows = [
        (
            *((f"{tiers.index(d.tier) + 1}:{d.tier}",) if len(tiers) > 1 else ()),
            d.name,
            format_size(d.bytes) + _part(d),
            d.files,
            _when(d.staged_at),
            _when(d.last_used),
            _state(d),
            d.source or "-",
        )
        for d in items
    ]
    headers = ("NAME", "SIZE", "FILES", "STAGED", "LAST USED", "STATE", "SOURCE")
    click.echo(table(rows, headers=(("TIER",) if len(tiers) > 1 else ()) + headers))
    if any(d.state != "staged" and not d.stager_alive for d in items):
        click.echo("(`shmstage gc` removes what no live process owns)", err=True)


def _part(d: InTier) -> str:
    """`stage --partial`: what part of the dataset is in RAM (the rest is read from its source)."""
    if d.total_bytes is None:
        return ""
    return f" ({d.resident:.0%} of {format_size(d.total_bytes)})"


def _state(d: InTier) -> str:
    if d.state == "staged":
        return "in use by " + ",".join(map(str, d.leased_by)) if d.leased_by else "staged"
    if d.stager_alive:
        return f"{d.state}, pid {d.stager_pid} working"
    return f"{d.state}, nobody working"


@click.command("list")
@click.option("--dest", envvar="SHMSTAGE_DEST", help=_DEST_HELP)
@no_service_option
@json_option
def list_cmd(dest: str | None, no_service: bool, as_json: bool) -> None:
    """List staged datasets, copies in progress or left by killed runs, and old trees in trash.

    STATE is staged, in use by PIDS (jobs holding a lease), unfinished (a partial copy:
    SIZE and FILES so far, and whether its stager is alive) or trash.
    """
    rows = api.list_staged(configured(dest)[0], unfinished=True, service=not no_service)
    emit(rows, as_json, _render_list)


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
@no_service_option
@json_option
def verify_cmd(
    name: str, checksum: bool, dest: str | None, no_service: bool, as_json: bool
) -> None:
    """Check a staged dataset against its manifest; exit 3 if anything differs.

    Finds changed, missing and extra files; --checksum also finds a flipped byte.
    """
    report = api.verify(name, dest=configured(dest)[0], checksum=checksum, service=not no_service)
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
@click.option(
    "--force",
    is_flag=True,
    help="Also remove datasets a running job leases (that job fails reading files that are gone).",
)
@no_service_option
@json_option
def evict_cmd(
    name: str | None,
    all_: bool,
    older_than: float | None,
    dest: str | None,
    dry_run: bool,
    force: bool,
    no_service: bool,
    as_json: bool,
) -> None:
    """Remove staged datasets: NAME, --all, or --older-than AGE (frees their RAM).

    A dataset a running job leases (`shmstage run`, `shmstage.lease()`, `make_loader`) is
    refused (NAME: exit 2) or skipped with a note (--all, --older-than) unless --force.
    """
    if sum((name is not None, all_, older_than is not None)) != 1:
        raise click.UsageError("give exactly one of NAME, --all or --older-than")
    report = api.evict_report(
        name,
        dest=configured(dest)[0],
        all=all_,
        older_than=older_than,
        dry_run=dry_run,
        force=force,
        service=not no_service,
    )
    for leased in report.in_use:
        click.echo(
            f"note: {leased.name} is in use by {printable(describe(leased.holders))}; left in place "
            "(pass --force to remove it anyway)",
            err=True,
        )
    for leased in report.forced:
        click.echo(
            f"warning: evicted {leased.name} while in use by {printable(describe(leased.holders))}: "
            "that job will fail reading files that are gone",
            err=True,
        )

    def render(r: EvictReport) -> None:
        word = "would evict" if dry_run else "evicted"
        names = ", ".join(printable(n) for n in r.evicted)
        click.echo(f"{word}: {names}" if r.evicted else "nothing to evict")

    emit(report, as_json, render)


def _render_gc(report: GcReport) -> None:
    word = "would remove" if report.dry_run else "removed"
    for item in report.removed:
        size = f" ({format_size(item.bytes)})" if item.bytes else ""
        click.echo(f"{word} {item.what}: {printable(item.path)}{size}")  # a name anyone made
    for item in report.skipped:
        click.echo(f"kept {item.what}: {printable(item.path)} ({printable(item.reason)})")
    if not report.removed:
        click.echo("nothing to remove")
    else:
        click.echo(f"{word} {len(report.removed)} leftover(s), {format_size(report.bytes)}")


@click.command("gc")
@click.option("--dest", envvar="SHMSTAGE_DEST", help=_DEST_HELP)
@click.option("--dry-run", is_flag=True, help="Show what would be removed; remove nothing.")
@no_service_option
@json_option
def gc_cmd(dest: str | None, dry_run: bool, no_service: bool, as_json: bool) -> None:
    """Remove what killed or failed runs left behind, but nothing a live process owns.

    Partial trees, .NAME.json.new manifests, markers, half-written files, lock and lease
    files of removed datasets, records whose tree is gone, and trash. Safe while others stage:
    a dataset whose lock is held is skipped.
    """
    report = api.gc(configured(dest)[0], dry_run=dry_run, service=not no_service)
    emit(report, as_json, _render_gc)
