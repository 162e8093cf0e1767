"""``shmstage prepare``: converge this node to its YAML config."""

from __future__ import annotations

from contextlib import nullcontext

import click

from shmstage.cli.output import emit, json_option, log, stderr_is_tty, table
from shmstage.cli.params import cluster_options
from shmstage.config import DEFAULT_PATH, ENV_VAR, load_config
from shmstage.errors import ShmstageError
from shmstage.prepare import PrepareReport, prepare


class PrepareFailed(ShmstageError):
    """A step failed; the report was printed and earlier steps' changes stay (exit 1)."""


def render(report: PrepareReport) -> None:
    rows = [(s.step, s.status, s.detail) for s in report.steps]
    click.echo(table(rows, headers=("STEP", "STATUS", "DETAIL")))
    if report.failed:
        return
    if report.dry_run:
        click.echo(
            "dry run: "
            + ("these changes would be made" if report.would_change else "nothing would change")
        )
    else:
        click.echo("changed" if report.changed else "nothing changed")


@click.command("prepare")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    envvar=ENV_VAR,
    help=f"Node config (YAML). Default: {DEFAULT_PATH} (or ${ENV_VAR}).",
)
@click.option("--dry-run", is_flag=True, help="Show what would change; change nothing.")
@click.option(
    "--validate",
    is_flag=True,
    help="Only check the config file (exit 2 with every problem if invalid); run no step.",
)
@click.option(
    "--systemd-dir",
    type=click.Path(file_okay=False),
    default="/etc/systemd/system",
    show_default=True,
    help="Where the node service's unit and slice are written (config `service.enabled`).",
)
@cluster_options(slurm_nodes=False)
@json_option
def prepare_cmd(
    config_path: str | None,
    dry_run: bool,
    validate: bool,
    systemd_dir: str,
    nodes: int | None,
    node_rank: int | None,
    rendezvous: str | None,
    timeout: float,
    inflight: int,
    as_json: bool,
) -> None:
    """Converge this node to its YAML config (/etc/shmstage.yaml).

    \b
    Steps: inspect -> remount the tmpfs if needed -> mount the store's own
    tmpfs (store_tmpfs) -> install, enable and start the node service
    (service.enabled; started only where systemd runs) -> stage each dataset ->
    install pillow-simd if enabled.  Safe to run again: a converged node reports
    "nothing changed".  The whole config is validated before anything runs.
    The first failing step stops the run (exit 1); earlier steps' changes stay.
    With --nodes N every node runs prepare with the same config and the nodes
    stage each dataset together, reading it once (see `shmstage stage --nodes`).
    """
    config = load_config(config_path)
    if validate:
        n = len(config.datasets)
        emit(
            config,
            as_json,
            lambda c: click.echo(f"{c.path}: valid ({n} dataset{'' if n == 1 else 's'})"),
        )
        return
    from shmstage.cluster import Peers, resolve

    # Only a --nodes given: prepare's root steps (remount, store tmpfs) may fail on one node
    # before any staging, and nodes that took their count from Slurm would wait --timeout
    # for it at the rendezvous.
    skip = dry_run or nodes is None
    spec = None if skip else resolve(nodes, node_rank, rendezvous, timeout, inflight)
    with Peers(spec) if spec is not None else nullcontext() as peers:
        report = prepare(
            config,
            dry_run=dry_run,
            log=log if stderr_is_tty() else None,
            peers=peers,
            systemd_dir=systemd_dir,
        )
        if report.failed and peers is not None:
            peers.fail(report.error or "prepare failed")
    emit(report, as_json, render)
    if report.failed:
        raise PrepareFailed(report.error or "a step failed")
