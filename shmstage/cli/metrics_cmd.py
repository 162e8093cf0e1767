"""``shmstage metrics``: the node cache as Prometheus metrics (node_exporter textfile)."""

from __future__ import annotations

import click

from shmstage.cli.output import dumps, json_option, log
from shmstage.cli.params import config_option, no_service_option
from shmstage.config import configured
from shmstage.metrics import FILENAME, render, write_textfile
from shmstage.service import api
from shmstage.stage.store import DEFAULT_DEST


@click.command("metrics")
@click.option(
    "--textfile",
    type=click.Path(file_okay=False),
    metavar="DIR",
    help=f"Write DIR/{FILENAME} for node_exporter's textfile collector (atomic rename) "
    "instead of printing to stdout.",
)
@click.option(
    "--dest",
    envvar="SHMSTAGE_DEST",
    help="Where staged datasets live, or tiers separated by commas. "
    f"Default: $SHMSTAGE_DEST, else the node config's dest, else {DEFAULT_DEST}.",
)
@config_option(
    "Node config whose dest tiers and cache max_size are reported. "
    "Default: /etc/shmstage.yaml if it exists."
)
@no_service_option
@json_option
def metrics_cmd(
    textfile: str | None,
    dest: str | None,
    config_path: str | None,
    no_service: bool,
    as_json: bool,
) -> None:
    """Print (or write for node_exporter) the cache's metrics in Prometheus' text format.

    \b
    Per tier: file system size/used/free, datasets, max_size; per dataset: bytes, files,
    last use, leases; counters: stage hits and misses, bytes copied, evictions.
      shmstage metrics --textfile /var/lib/node_exporter/textfile_collector
    """
    dest, policies = configured(dest, config_path)
    m = api.metrics(dest, policies, service=not no_service)
    if textfile is not None:
        log(f"wrote {write_textfile(textfile, render(m))}")
    if as_json:
        click.echo(dumps(m))
    elif textfile is None:
        click.echo(render(m), nl=False)
