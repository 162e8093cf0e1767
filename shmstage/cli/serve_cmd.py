"""``shmstage serve``: run the node service that owns the store (as root)."""

from __future__ import annotations

import os

import click

from shmstage.cli.output import log
from shmstage.cli.params import config_option
from shmstage.errors import RefusedError


@click.command("serve")
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(dir_okay=False),
    help="The Unix socket to listen on. Default: $SHMSTAGE_SOCKET, else /run/shmstage/shmstage.sock.",
)
@config_option(
    "Node config whose dest tiers, cache settings (max_size) and reserve the service owns. "
    "Default: /etc/shmstage.yaml if it exists."
)
def serve_cmd(socket_path: str | None, config_path: str | None) -> None:
    """Run the node's shmstage service: it owns the store, and stages for every user.

    \b
    stage, run --stage, list, verify, evict, gc, metrics and the loader use it when
    its socket answers (--no-service: in-process).  It knows each caller from the
    kernel (SO_PEERCRED), reads sources only as that caller, and keeps the staged
    pages in its own memory cgroup.  Runs as root, in the foreground (systemd:
    the unit shipped with shmstage); SIGTERM stops it.  docs/service.md.
    """
    from shmstage.service.server import Service

    if os.geteuid() != 0:
        raise RefusedError(
            "shmstage serve runs as root (it owns the store and reads as each caller): "
            "start it with `systemctl start shmstage` or sudo"
        )
    service = Service(socket_path, config_path)
    service.serve(log)
    log("stopped")
