"""What each request does in the service's child, and who may ask for it: the engine's ops
over the service's own tiers, with the caller's identity (reads run as the caller, the
engine publishes as root), and the few rules of who may remove what.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pwd
import stat
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from shmstage import metrics
from shmstage.config import share_for
from shmstage.errors import PermissionDenied, RefusedError, ShmstageError
from shmstage.identity import Caller, Share
from shmstage.stage import engine, resident
from shmstage.stage.cache.tiers import holding, joined, split
from shmstage.stage.sources import kinds
from shmstage.stage.store.layout import Store
from shmstage.stage.store.names import check_name, name_for
from shmstage.stage.topaccess import may_list

try:  # the lease keeper (helper C)
    from shmstage.service.keeper import Keeper
except ImportError:  # pragma: no cover - removed once keeper.py is in main
    Keeper = None  # type: ignore[assignment,misc]


Progress = Callable[[Any], None]


def warm_up() -> None:
    """Import, in the service before it forks, what the ops import lazily (a child forked
    while another thread imports would wait forever on the import lock): the object
    stores' modules, and what a one-off command loads only when it needs it (archives,
    run --no-wait's live copy, threaded walks)."""
    for src in ("s3://x/y", "gs://x/y", "az://x/y", "/x.tar", "/x.tar.gz", "/x"):
        try:
            kinds.location_of(src)
        except Exception:  # noqa: S112 - only the imports matter here
            continue
    for module in LAZY:
        with contextlib.suppress(ImportError):  # a Python built without lzma, say
            importlib.import_module(module)


# Loaded on first use by the commands (a directory's one-off stage spends no time on them),
# and the archive codecs they load while reading as the caller, who may not be able to
# read the interpreter's own library (a python under /root).
LAZY = (
    "concurrent.futures",
    "shmstage.stage.build.ondemand",
    "shmstage.stage.build.untar",
    "shmstage.stage.sources.tar",
    "tarfile",
    "gzip",
    "bz2",
    "lzma",
    "zlib",
)


def make_keeper(service: Any) -> Any:
    if Keeper is None:
        return None
    state = os.environ.get("SHMSTAGE_STATE_DIR", "/var/lib/shmstage")
    return Keeper(state)


# --- who asks, where --------------------------------------------------------------------


def tiers_of(service: Any, dest: str | None) -> str:
    """The service's own tiers a request names: all of them when ``dest`` is None, else, for
    each tier of ``dest``, the service's configured string for it. The client's path is only
    compared, never used: through a symlink the client owns it could point elsewhere by the
    time the engine (root) writes there."""
    if dest is None:
        return joined(service.tiers)
    ours = {os.path.realpath(t): t for t in service.tiers}
    mapped = []
    for t in split(dest):
        own = ours.get(os.path.realpath(t))
        if own is None:
            raise RefusedError(
                f"{t} is not a tier of the shmstage service ({joined(service.tiers)}): "
                "stage into your own directory with --dest and --no-service"
            )
        mapped.append(own)
    return joined(mapped)


def _reader(caller: Caller, args: Mapping[str, Any]) -> dict[str, Any]:
    """``reader=``/``credentials=`` for the engine: it reads the source as the caller, with
    the caller's object-store settings, never the service's."""
    return {"reader": caller, "credentials": dict(args.get("credentials") or {})}


def _share(service: Any, src: str) -> dict[str, Any]:
    """``share=`` for an object-store source the node config shares with a group or all
    (the copy is otherwise its requester's alone)."""
    if "://" not in src:
        return {}
    gid, everyone = share_for(src, service.shares)
    return {"share": Share(gid, everyone)} if gid is not None or everyone else {}


def _grant(ds: Any, caller: Caller) -> None:
    """Let ``caller`` (who passed the freshness check as themselves) into the copy."""
    grant = getattr(engine, "grant", None)
    if grant is not None and ds is not None and not caller.is_root:
        grant(ds.name, os.path.dirname(ds.path), caller.uid)


def may_read(path: str, caller: Caller) -> bool:
    """Whether ``caller`` may list ``path`` by its mode bits (the copy's top directory)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if caller.is_root:
        return True
    if st.st_uid == caller.uid:
        want = stat.S_IRUSR | stat.S_IXUSR
    elif st.st_gid == caller.gid or st.st_gid in caller.groups:
        want = stat.S_IRGRP | stat.S_IXGRP
    else:
        want = stat.S_IROTH | stat.S_IXOTH
    return st.st_mode & want == want


def owner_of(dest: str, name: str) -> int | None:
    """The uid owning ``name``'s top directory in the tier holding it (None: not there)."""
    tier = holding(name, dest)
    for t in [tier] if tier else split(dest):
        try:
            return os.lstat(Store(t).path(name)).st_uid
        except OSError:
            continue
    return None


def _may_replace(dest: str, name: str | None, src: str, caller: Caller) -> None:
    """``--force`` replacing a dataset by a copy of another source is root's call alone: the
    copy's top keeps its source's owner, who is not the owner of the name (a user stages
    under another --name).  A forced recopy of the same source is the engine's to judge."""
    if caller.is_root:
        return
    if name is None:
        name = name_for(src)
    if name is None:
        return
    tier = holding(name, dest)
    record = Store(tier).published(name) if tier else None
    if record is None:
        return
    _, source = kinds.resolve(src, caller)  # the engine's own spelling of the source
    if source != record.source:
        raise PermissionDenied(
            f"--force would replace {name} (a copy of {record.source}) with {source}: only "
            f"root may replace a dataset by another source through the shmstage service; "
            f"stage {source} under another --name"
        )


def user_name(uid: int) -> str:
    """``alice (uid 1000)``, or ``uid 1000`` when the name is unknown."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


# --- the ops ------------------------------------------------------------------------------


MAX_WORKERS = max(32, 4 * (os.cpu_count() or 1))  # a user's --workers, at most (each a fork)


def _counts(a: Mapping[str, Any]) -> None:
    """What the CLI's option types check, checked again: a request may come from anyone."""
    if a.get("workers") is not None and not 1 <= a["workers"] <= MAX_WORKERS:
        raise RefusedError(f"--workers must be 1 to {MAX_WORKERS} through the shmstage service")
    if a.get("strip_components", 0) < 0:
        raise RefusedError("--strip-components must be 0 or more")


def op_stage(service: Any, caller: Caller, a: dict[str, Any], progress: Progress) -> Any:
    _counts(a)
    dest = tiers_of(service, a.get("dest"))
    if a.get("force"):
        _may_replace(dest, a.get("name"), a["src"], caller)
    ds = (resident.stage if a.get("partial") else engine.stage)(
        a["src"],
        name=a.get("name"),
        dest=dest,
        reserve=_reserve(service, a),
        make_room=bool(a.get("make_room")),
        policies=service.policies,
        workers=a.get("workers"),
        verify=a.get("verify", "size"),
        force=bool(a.get("force")),
        strip_components=a.get("strip_components", 0),
        progress=progress,
        **_reader(caller, a),
        **_share(service, a["src"]),
    )
    return ds  # a stage with reader= lets its reader into the copy by itself


def op_plan(service: Any, caller: Caller, a: dict[str, Any], progress: Progress) -> Any:
    _counts(a)
    return engine.plan(
        a["src"],
        name=a.get("name"),
        dest=tiers_of(service, a.get("dest")),
        reserve=_reserve(service, a),
        make_room=bool(a.get("make_room")),
        policies=service.policies,
        force=bool(a.get("force")),
        strip_components=a.get("strip_components", 0),
        **_reader(caller, a),
    )


def op_find(service: Any, caller: Caller, a: dict[str, Any], progress: Progress) -> Any:
    """The copy, when the caller may have it: readable to them as it is, or, after the
    freshness check reads its source as the caller, granted to them."""
    found = engine.find(a["key"], tiers_of(service, a.get("dest")))
    _let_in(service, caller, a, found)
    return found


def _let_in(service: Any, caller: Caller, a: Mapping[str, Any], found: Any) -> None:
    """Let ``caller`` reach ``found``'s copy, as find does: already readable to them, or
    granted once the freshness check read its source as them; else find's refusal."""
    if found is None or may_read(found.path, caller):
        return
    engine.plan(
        found.source,
        name=found.name,
        dest=os.path.dirname(found.path),
        policies=service.policies,
        **_reader(caller, a),
    )  # raises when the caller cannot read the source
    _grant(found, caller)


def op_list(service: Any, caller: Caller, a: dict[str, Any], progress: Progress) -> Any:
    """Every row for root; for anyone else only the datasets whose copy they may list (its
    source path and name are theirs to see), leftovers of one included."""
    rows = engine.list_staged(
        tiers_of(service, a.get("dest")), unfinished=bool(a.get("unfinished"))
    )
    if caller.is_root:
        return rows
    return [r for r in rows if may_list(os.path.join(r.tier, r.name), caller)]


def op_verify(service: Any, caller: Caller, a: dict[str, Any], progress: Progress) -> Any:
    """As the caller: one who may not reach the copy (nor read its source) gets find's
    refusal, never an answer about it."""
    dest = tiers_of(service, a.get("dest"))
    if not caller.is_root:
        check_name(a["name"])
        _let_in(service, caller, a, engine.find(a["name"], dest))
    return engine.verify(
        a["name"],
        dest,
        checksum=bool(a.get("checksum")),
        **_reader(caller, a),
    )


def op_evict(service: Any, caller: Caller, a: dict[str, Any], progress: Progress) -> Any:
    """Root evicts anything; a user only a dataset whose top directory they own, never
    with --force (that takes data from under a running job) nor --all/--older-than."""
    dest = tiers_of(service, a.get("dest"))
    name = a.get("name")
    if name is not None:
        check_name(name)
    if not caller.is_root:
        if a.get("force"):
            raise PermissionDenied("only root may evict with --force through the shmstage service")
        if name is None:
            raise PermissionDenied(
                "only root may evict --all or --older-than through the shmstage service: "
                "evict your own datasets by NAME"
            )
        owner = owner_of(dest, name)
        if owner is not None and owner != caller.uid:
            raise PermissionDenied(
                f"{name}'s copy belongs to {user_name(owner)}: only that user or root may evict it"
            )
    return engine.evict_report(
        name,
        dest=dest,
        all=bool(a.get("all")),
        older_than=a.get("older_than"),
        dry_run=bool(a.get("dry_run")),
        force=bool(a.get("force")),
    )


def op_gc(service: Any, caller: Caller, a: dict[str, Any], progress: Progress) -> Any:
    return engine.gc(tiers_of(service, a.get("dest")), dry_run=bool(a.get("dry_run")))


def op_metrics(service: Any, caller: Caller, a: dict[str, Any], progress: Progress) -> Any:
    """Every dataset for root (Prometheus scrapes as root); for anyone else, as ``list``,
    only the datasets whose copy they may list (the tiers' totals are the node's)."""
    found = metrics.collect(tiers_of(service, a.get("dest")), service.policies)
    if caller.is_root:
        return found
    mine = tuple(d for d in found.datasets if may_list(os.path.join(d.tier, d.name), caller))
    return replace(found, datasets=mine)


def op_lease(service: Any, caller: Caller, a: dict[str, Any], progress: Progress) -> Any:
    """In the service itself, not a child: the keeper holds its pidfds for the service's life."""
    if service.keeper is None:
        raise ShmstageError("this shmstage service cannot hold leases yet")
    # The keeper resolves the key: its refusal is one line for "not staged" and "not yours".
    return service.keeper.hold(a["key"], tiers_of(service, a.get("dest")), a["pid"], caller)


def op_unlease(service: Any, caller: Caller, a: dict[str, Any], progress: Progress) -> Any:
    if service.keeper is None:
        raise ShmstageError("this shmstage service cannot hold leases yet")
    return service.keeper.release(a["token"], caller)


def _reserve(service: Any, a: Mapping[str, Any]) -> int | str | None:
    """The node's reserve wins: a user may not shrink the room kept for DataLoaders."""
    return service.reserve if service.reserve is not None else a.get("reserve")


OPS: dict[str, Callable[[Any, Caller, dict[str, Any], Progress], Any]] = {
    "stage": op_stage,
    "plan": op_plan,
    "find": op_find,
    "list": op_list,
    "verify": op_verify,
    "evict": op_evict,
    "gc": op_gc,
    "metrics": op_metrics,
}
IN_SERVICE: dict[str, Callable[[Any, Caller, dict[str, Any], Progress], Any]] = {
    "lease": op_lease,
    "unlease": op_unlease,
}


def run(service: Any, caller: Caller, op: str, args: dict[str, Any], progress: Progress) -> Any:
    return (OPS.get(op) or IN_SERVICE[op])(service, caller, args, progress)
