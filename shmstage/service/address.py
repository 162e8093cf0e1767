"""Where the node service listens: all a command needs to know before it asks (no socket or
pickle module is loaded until a socket is there to connect to)."""

from __future__ import annotations

import os

from shmstage.config import ConfigError, node_service
from shmstage.config.model import DEFAULT_SOCKET

SOCKET_ENV = "SHMSTAGE_SOCKET"


def socket_path(
    path: str | os.PathLike[str] | None = None,
    config_path: str | os.PathLike[str] | None = None,
    *,
    strict: bool = False,
) -> str:
    """The service's socket: ``path``, else ``$SHMSTAGE_SOCKET``, else the node config's
    ``service.socket``, else /run/shmstage/shmstage.sock.  A config that does not load is
    an error only when ``strict`` (the service); a client then tries the default."""
    if path is not None:
        return os.fspath(path)
    if os.environ.get(SOCKET_ENV):
        return os.environ[SOCKET_ENV]
    try:
        service = node_service(config_path)
    except ConfigError:
        if strict:
            raise
        service = None
    return service.socket if service is not None else DEFAULT_SOCKET
