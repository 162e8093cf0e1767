"""The engine's operations as the CLI and the loader call them: through the node service when
one answers and DEST is its store, else in this process (a user's own DEST, ``--no-service``,
or no service on this node).  Same names, same typed results, same errors either way.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from shmstage.errors import RefusedError
from shmstage.service.address import socket_path
from shmstage.stage import engine, resident
from shmstage.stage.cache.makeroom import CachePolicy
from shmstage.stage.cache.tiers import Placed, Plan, split
from shmstage.stage.store.layout import Store, managed_by

if TYPE_CHECKING:
    from shmstage.service.client import Connection

# The caller's object-store settings, handed to the service so it reads as them
CREDENTIAL_PREFIXES = ("AWS_", "GOOGLE_", "CLOUDSDK_", "AZURE_", "GCS_")


def service_for(dest: str | os.PathLike[str] | None, service: bool = True) -> Connection | None:
    """The service to route to: one answers, and every tier of ``dest`` is one of its
    (``dest`` None, no $SHMSTAGE_DEST: the service's tiers, the node's store)."""
    if not service:
        return None
    where = socket_path()
    try:  # nothing to connect to (what connect() takes for "nobody answers"): no socket module
        os.stat(where)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    except OSError:
        pass  # a path that cannot be a socket (a symlink loop): connect() says so, as before
    from shmstage.service.client import connect

    conn = connect(where)
    if conn is None:
        return None
    if dest is None and not os.environ.get("SHMSTAGE_DEST"):
        return conn
    return conn if conn.serves(",".join(split(dest))) else None


def credentials(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith(CREDENTIAL_PREFIXES)}


def absolute(src: str | os.PathLike[str]) -> str:
    """A local path resolved against our cwd (the service has another); a URL as it is."""
    text = os.fspath(src)
    return text if "://" in text else os.path.abspath(text)


def _dest_arg(dest: str | os.PathLike[str] | None) -> str | None:
    return None if dest is None else ",".join(absolute(t) for t in split(dest))


def no_service_line(tier: str) -> str:
    """Item 8: what a user is told when root manages ``tier`` and no service answers."""
    return (
        f"{tier} is managed by root and no shmstage service answers on {socket_path()}: ask "
        "an admin to start it (systemctl start shmstage) or stage into a directory of your "
        "own with --dest, e.g. --dest /dev/shm/shmstage-$USER"
    )


def explained(text: str, dest: str | os.PathLike[str] | None) -> str:
    """``text`` with the engine's "managed by root" sentence (a user's write refused on
    root's store) made the item-8 line: start the service, or use a directory of one's own."""
    if os.geteuid() == 0:
        return text
    for tier in split(dest):
        store = Store(tier).dest
        text = text.replace(managed_by(store, 0), no_service_line(store))
    return text


def refused(e: RefusedError, dest: Any, service: bool = True) -> RefusedError:
    """``e``, or (run in-process for want of a service, on root's store) the same refusal
    saying that no service answers and what to do."""
    if not service:  # --no-service: the user chose this process; today's words
        return e
    told = explained(str(e), dest)
    return e if told == str(e) else RefusedError(told)


def _in_process(fn: Callable[..., Any], where: Any, service: bool, /, *a: Any, **kw: Any) -> Any:
    """``fn(*a, **kw)`` here; a refusal on root's store says the service is not answering."""
    try:
        return fn(*a, **kw)
    except RefusedError as e:
        told = refused(e, where, service)
        if told is e:
            raise
        raise told from None


def stage(
    src: str | os.PathLike[str],
    *,
    dest: str | os.PathLike[str] | None = None,
    policies: Mapping[str, CachePolicy] | None = None,
    progress: Callable[[Any], None] | None = None,
    service: bool = True,
    **kw: Any,
) -> Placed:
    """:func:`shmstage.stage.engine.stage`; ``kw``: name, reserve, make_room, workers, verify,
    force, strip_components (``peers`` always runs here: cluster staging is in-process);
    ``partial=True``: :func:`shmstage.stage.resident.stage` (``stage --partial``)."""
    partial = bool(kw.pop("partial", False))
    conn = service_for(dest, service) if kw.get("peers") is None else None
    if conn is None:
        fn = resident.stage if partial else engine.stage
        return _in_process(
            fn, dest, service, src, dest=dest, policies=policies, progress=progress, **kw
        )  # fmt: skip
    kw.pop("peers", None)
    args = {k: v for k, v in kw.items() if v is not None} | ({"partial": True} if partial else {})
    args.update(src=absolute(src), dest=_dest_arg(dest), credentials=credentials())
    return conn.call("stage", args, progress)


def plan(
    src: str | os.PathLike[str],
    *,
    dest: str | os.PathLike[str] | None = None,
    policies: Mapping[str, CachePolicy] | None = None,
    service: bool = True,
    **kw: Any,
) -> Plan:
    conn = service_for(dest, service)
    if conn is None:
        return _in_process(engine.plan, dest, service, src, dest=dest, policies=policies, **kw)
    args = {k: v for k, v in kw.items() if v is not None}
    args.update(src=absolute(src), dest=_dest_arg(dest), credentials=credentials())
    return conn.call("plan", args)


def find(
    name_or_source: str | os.PathLike[str],
    dest: str | os.PathLike[str] | None = None,
    *,
    service: bool = True,
) -> Any:
    """:func:`shmstage.stage.engine.find`; through the service, a copy the caller may not
    read yet is handed out only after its source is read as the caller."""
    conn = service_for(dest, service)
    if conn is None:
        return engine.find(name_or_source, dest)
    key = os.fspath(name_or_source)
    key = absolute(key) if os.sep in key else key  # a name has no slash
    return conn.call("find", {"key": key, "dest": _dest_arg(dest), "credentials": credentials()})


def lease_until(name: str, dest: str | os.PathLike[str], pid: int, *, service: bool = True) -> None:
    """Hold a lease on staged dataset ``name`` in tier ``dest`` until process ``pid`` exits:
    the service's keeper (by pidfd, kept across its restarts) when it answers, else a
    detached holder of this user's (:func:`shmstage.stage.engine.lease_until`)."""
    conn = service_for(dest, service)
    if conn is None:
        engine.lease_until(os.path.join(os.fspath(dest), name), dest, pid)
        return
    conn.call("lease", {"key": name, "dest": _dest_arg(dest), "pid": pid})


def list_staged(
    dest: str | os.PathLike[str] | None = None, *, unfinished: bool = False, service: bool = True
) -> Any:
    conn = service_for(dest, service)
    if conn is None:
        return engine.list_staged(dest, unfinished=unfinished)
    return conn.call("list", {"dest": _dest_arg(dest), "unfinished": unfinished})


def verify(
    name: str,
    dest: str | os.PathLike[str] | None = None,
    *,
    checksum: bool = False,
    service: bool = True,
) -> Any:
    conn = service_for(dest, service)
    if conn is None:
        return engine.verify(name, dest, checksum=checksum)
    args = {"name": name, "dest": _dest_arg(dest), "checksum": checksum}
    return conn.call("verify", {**args, "credentials": credentials()})


def evict_report(
    name: str | None = None,
    *,
    dest: str | os.PathLike[str] | None = None,
    service: bool = True,
    **kw: Any,
) -> Any:
    """``kw``: all, older_than, dry_run, force (see :func:`shmstage.stage.engine.evict_report`)."""
    conn = service_for(dest, service)
    if conn is None:
        return _in_process(engine.evict_report, dest, service, name, dest=dest, **kw)
    return conn.call("evict", {"name": name, "dest": _dest_arg(dest), **kw})


def gc(
    dest: str | os.PathLike[str] | None = None, *, dry_run: bool = False, service: bool = True
) -> Any:
    conn = service_for(dest, service)
    if conn is None:
        return _in_process(engine.gc, dest, service, dest, dry_run=dry_run)
    return conn.call("gc", {"dest": _dest_arg(dest), "dry_run": dry_run})


def metrics(
    dest: str | os.PathLike[str] | None = None,
    policies: Mapping[str, CachePolicy] | None = None,
    *,
    service: bool = True,
) -> Any:
    conn = service_for(dest, service)
    if conn is None:
        from shmstage import metrics as node_metrics  # the metrics command's alone

        return node_metrics.collect(dest, policies)
    return conn.call("metrics", {"dest": _dest_arg(dest)})
