"""``shmstage run``: stage the data, fill ``{staged}`` into the command, start it, forward signals.

The job runs in its own session, so every signal reaches it once: through shmstage, which
forwards what it gets (``kill PID``, ``kill -- -PGID``, a terminal's Ctrl-C, a pod's SIGTERM),
or, for a Slurm step-wide signal, from Slurm itself.  Its exit status becomes ours; when a
signal killed it, we die of that signal too, once cleaned up.  No process is left behind.
This module prepares the job (its command line and environment), stages and tears down;
:mod:`shmstage.supervisor` runs the child and forwards the signals.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from shmstage import nowait
from shmstage.errors import CapacityError, KilledBy, RefusedError, ShmstageError
from shmstage.supervisor import CommandNotFound, SignalHold, spawn

ENV_DATA = "SHMSTAGE_DATA"


class PlaceholderError(RefusedError):
    """A ``{...}`` in the command cannot be filled in; nothing was started (exit 2)."""


@dataclass(frozen=True)
class StageRequest:
    """One ``--stage SRC`` (with its ``--name NAME``)."""

    source: str
    name: str | None = None

    @classmethod
    def parse(cls, text: str) -> StageRequest:
        """``SRC``: the whole text is the source path, ``=`` included.

        The older ``SRC=NAME`` is still read where the file system leaves no doubt:
        TEXT itself does not exist, the part before the last ``=`` does, and NAME is
        a plain name.  ``/data/split=train`` is the directory of that name if it exists."""
        source, sep, name = text.rpartition("=")
        if (
            sep
            and source
            and name
            and "/" not in name
            and not os.path.lexists(text)
            and os.path.lexists(source)
        ):
            return cls(source, name)
        if not text:
            raise RefusedError("--stage needs a source path: --stage SRC [--name NAME]")
        return cls(text)


@dataclass(frozen=True)
class RunResult:
    returncode: int  # the job's exit status; 128+N when signal N killed it
    staged: tuple[Any, ...]  # StagedDataset per --stage, in order
    evicted: tuple[str, ...]  # names removed by --cleanup
    leftovers: int  # descendants still running after the job exited (terminated by us)
    signal: int | None = None  # the signal that killed the job, if one did


class JobKilled(KilledBy):
    """The job died of ``signal``: ``shmstage run`` dies of it too, once it has cleaned up."""


# --- placeholders -----------------------------------------------------------

# {{word}} -> literal {word};  {word} / {word:ARG} -> a placeholder.  Other braces
# ({"json": 1}, shell `{ a; }`) and ${VAR} are left alone, so only word-like
# placeholders can be mistyped into an error.
_PLACEHOLDER = re.compile(
    r"\{\{(?P<escaped>[A-Za-z_]\w*(?::[^{}]*)?)\}\}"
    r"|(?<!\$)\{(?P<key>[A-Za-z_]\w*)(?::(?P<arg>[^{}]*))?\}"
)


def _placeholders(args: Sequence[str]) -> list[tuple[str, str, str | None]]:
    """(argument, key, arg) for every placeholder in ``args``."""
    found = []
    for a in args:
        for m in _PLACEHOLDER.finditer(a):
            if m.group("key") is not None:
                found.append((a, m.group("key"), m.group("arg")))
    return found


def stage_name(request: StageRequest) -> str | None:
    """The name the staging engine will use for ``request`` (checked when explicit)."""
    from shmstage.stage.store import check_name, name_for

    return check_name(request.name) if request.name is not None else name_for(request.source)


def check_placeholders(args: Sequence[str], names: Sequence[str | None]) -> None:
    """Refuse, before anything is staged or started, placeholders that cannot be filled.

    ``names`` has one entry per --stage: its name, or None when not known before staging.
    """
    known = [n for n in names if n is not None]
    for arg, key, name in _placeholders(args):
        text = "{" + key + ("" if name is None else ":" + name) + "}"
        if key != "staged":
            raise PlaceholderError(
                f"unknown placeholder {text} in {arg!r}: use {{staged}} or {{staged:NAME}}, "
                f"or write {{{text}}} for a literal {text}"
            )
        if name is None and len(names) != 1:
            raise PlaceholderError(
                "{staged} needs exactly one --stage"
                + (f" (got {len(names)}): use {{staged:NAME}}" if names else ": add --stage SRC")
            )
        if name is not None and not name:
            raise PlaceholderError(f"empty name in {text} in {arg!r}: write {{staged:NAME}}")
        if name is not None and len(known) == len(names) and name not in known:
            raise PlaceholderError(
                f"{text}: no --stage is named {name!r} (names: {', '.join(known) or 'none'})"
            )


def substitute(args: Sequence[str], staged: Sequence[tuple[str, str]]) -> list[str]:
    """``args`` with ``{staged}`` / ``{staged:NAME}`` filled from ``staged`` ((name, path) per --stage)."""
    paths = dict(staged)

    def fill(m: re.Match[str]) -> str:
        if m.group("escaped") is not None:
            return "{" + m.group("escaped") + "}"
        key, name = m.group("key"), m.group("arg")
        if key != "staged":
            raise PlaceholderError(
                f"unknown placeholder {m.group(0)}: use {{staged}} or {{staged:NAME}}"
            )
        if name is None:
            if len(staged) != 1:
                raise PlaceholderError(f"{{staged}} needs exactly one --stage (got {len(staged)})")
            return staged[0][1]
        if name not in paths:
            raise PlaceholderError(
                f"{m.group(0)}: no --stage is named {name!r} (names: {', '.join(paths) or 'none'})"
            )
        return paths[name]

    return [_PLACEHOLDER.sub(fill, a) for a in args]


# --- environment ------------------------------------------------------------


def env_name(name: str) -> str:
    """``SHMSTAGE_DATA_<NAME>``: upper case, anything but letters and digits as ``_``."""
    return f"{ENV_DATA}_{re.sub(r'[^A-Za-z0-9]', '_', name).upper()}"


def loader_settings(
    workers: int | None = None,
    pin: bool | None = None,
    prefetch_factor: int | None = None,
    environ: Mapping[str, str] | None = None,
    config_path: str | None = None,
) -> dict[str, str]:
    """SHMSTAGE_* loader variables for the job: flags > the caller's environment > node config."""
    from shmstage.config import loader_env  # YAML parsing only when `run` needs it

    environ = os.environ if environ is None else environ
    settings = {k: v for k, v in loader_env(config_path).items() if k not in environ}
    if workers is not None:
        settings["SHMSTAGE_NUM_WORKERS"] = str(workers)
    if pin is not None:
        settings["SHMSTAGE_PIN_MEMORY"] = "1" if pin else "0"
    if prefetch_factor is not None:
        settings["SHMSTAGE_PREFETCH_FACTOR"] = str(prefetch_factor)
    return settings


def job_env(
    staged: Sequence[Any], settings: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The child's environment: ours plus SHMSTAGE_DATA(_<NAME>) and the loader settings."""
    env = dict(os.environ if environ is None else environ)
    if staged:
        env[ENV_DATA] = str(staged[0].path)
    for ds in staged:
        env[env_name(ds.name)] = str(ds.path)
    env.update(settings)
    return env


def resolve_command(command: Sequence[str], path: str | None = None) -> str:
    """The executable ``command[0]`` names, or CommandNotFound (exit 127)."""
    if not command:
        raise RefusedError("no command to run: shmstage run [OPTIONS] -- CMD [ARGS...]")
    exe = command[0]
    if "/" in exe:
        if os.path.isfile(exe) and os.access(exe, os.X_OK):
            return exe
        raise CommandNotFound(f"command not found: {exe}")
    found = shutil.which(exe, path=path)
    if found is None:
        raise CommandNotFound(f"command not found: {exe}")
    return found


# --- the whole command ------------------------------------------------------


def _waiting_note(request: StageRequest, log: Callable[[str], None] | None) -> Any:
    """A progress callback that says once that another process is staging the same data."""
    said = False

    def note(p: Any) -> None:
        nonlocal said
        if p.phase == "waiting" and log is not None and not said:
            said = True
            holder = f" (pid {p.holder})" if p.holder else ""
            log(f"waiting for another process{holder} staging {request.source}")

    return note


def _stage_leased(
    request: StageRequest,
    dest: str | None,
    log: Callable[[str], None] | None,
    peers: Any = None,
    service: bool = True,
    **room: Any,  # make_room, policies, reserve: see shmstage.stage.engine.stage
) -> tuple[Any, Any]:
    """Stage (through the node's service when one answers, see shmstage.service.api), then
    lease the copy for the job's lifetime here (retried once if an evict removed it in
    between).  The lease fd is close-on-exec: this process holds it while the job runs."""
    from shmstage.service import api
    from shmstage.stage.store.leases import acquire

    attempts = (1, 2) if peers is None else (2,)  # peers: every node stages once per source
    for attempt in attempts:
        ds = api.stage(
            request.source,
            name=request.name,
            dest=dest,
            progress=_waiting_note(request, log),
            peers=peers,
            service=service,
            **room,
        )
        try:
            return ds, acquire(ds.name, os.path.dirname(ds.path))  # its tier
        except ShmstageError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def run(
    command: Sequence[str],
    *,
    stage: Sequence[str | StageRequest] = (),
    dest: str | None = None,
    workers: int | None = None,
    pin: bool | None = None,
    prefetch_factor: int | None = None,
    reserve: int | str | None = None,
    cleanup: bool = False,
    make_room: bool = False,
    config_path: str | None = None,
    log: Callable[[str], None] | None = None,
    cluster: Any = None,
    service: bool = True,
    partial: bool = False,
    no_wait: bool = False,
) -> RunResult:
    """Stage each source, fill in the command, run it and return its status.

    ``no_wait``: start the job as soon as each directory is listed while its copy goes on
    (shmstage.nowait); the job reads it through shmstage.loader.DatasetFiles.  Its exit
    status is the job's, or the copy's failure when the job succeeded.

    ``reserve`` (bytes or "N%"): room to keep free while staging; None: the node config's
    ``reserve``, else the staging default.

    ``cluster`` (a :class:`shmstage.cluster.ClusterSpec`): stage together with the other
    nodes, which run the same command; the job starts once every node has its copy.

    ``service``: stage (and ``cleanup``) through the node's shmstage service when one answers
    and DEST is its store; False: in this process.  ``partial``: ``stage --partial`` (a
    source larger than DEST keeps what fits in RAM; the job reads the rest through
    DatasetFiles).

    Everything that can be refused (placeholders, a missing command, a bad node config, a
    failed staging) is refused before the job starts.
    """
    if partial and no_wait:
        raise RefusedError(
            "--partial and --no-wait do not combine: --partial publishes the part that fits "
            "before the job starts, --no-wait copies all of it while the job runs; drop one"
        )
    requests = [r if isinstance(r, StageRequest) else StageRequest.parse(r) for r in stage]
    names = [stage_name(r) for r in requests]
    known = [n for n in names if n is not None]
    if len(set(known)) != len(known):
        raise RefusedError(
            f"two --stage sources would share a name ({', '.join(known)}): name them with --stage SRC --name NAME"
        )
    check_placeholders(command[1:], names)
    exe = resolve_command(command)
    settings = loader_settings(workers, pin, prefetch_factor, config_path=config_path)
    if dest is None and "SHMSTAGE_DEST" not in os.environ:
        from shmstage.config import node_dest

        dest = node_dest(config_path)  # stage where `prepare` stages on this node
    policies: dict[str, Any] = {}
    if requests:
        from shmstage.config import configured, node_reserve

        policies = configured(dest, config_path)[1]  # the tiers' cache max_size (docs/cache.md)
        if reserve is None:  # as `stage` and `prepare` do: DataLoader workers need the room
            reserve = node_reserve(config_path)
    if dest is not None:
        # so staged_path() inside the job looks where this run staged
        settings = {**settings, "SHMSTAGE_DEST": str(dest)}

    staged: list[Any] = []
    evicted: list[str] = []
    returncode: int | None = None
    killed_by: int | None = None
    leftovers = 0
    held: list[Any] = []  # a lease per staged dataset, for the job's lifetime
    teardown = SignalHold()  # from the job's start to the end of the cleanup (SignalHold)
    failed = True
    stagers: list[Any] = []  # --no-wait: the stagers copying while the job runs
    joins: list[Any] = []  # --no-wait: other stagers' views the job reads
    try:
        if requests:
            from shmstage import stage as engine
            from shmstage.cluster import Peers
            from shmstage.stage import resident

            with Peers(cluster) if cluster is not None else contextlib.nullcontext() as peers:
                for r in requests:
                    live = nowait.start_live(
                        r.source,
                        r.name,
                        dest,
                        log,
                        cluster,
                        service,
                        held,
                        no_wait,
                        make_room=make_room,
                        policies=policies,
                        reserve=reserve,
                    )
                    if live is not None:
                        ds, stager, joined = live
                        staged.append(ds)
                        stagers += [stager] if stager is not None else []
                        joins += [joined] if joined is not None else []
                        continue
                    try:
                        ds, lease = _stage_leased(
                            r, dest, log, peers, service, make_room=make_room,
                            policies=policies, reserve=reserve,
                            **({"partial": True} if partial else {}),
                        )  # fmt: skip
                    except CapacityError as e:  # --partial takes no --no-wait, no --nodes
                        if partial or no_wait or peers is not None:
                            raise
                        raise resident.offer(e, r.source, dest, reserve) from None
                    held.append(lease)
                    staged.append(ds)
                    if log is not None:
                        for skip in ds.skipped:  # tiers (docs/cache.md)
                            log(f"skipped tier {skip.tier}: {skip.reason}")
                        for v in ds.evicted:
                            log(f"evicted {v.name} from {v.tier} to make room")
                        log(f"{engine.summary(ds)} -> {ds.path}")
        pairs = [(ds.name, str(ds.path)) for ds in staged]
        if len({n for n, _ in pairs}) != len(pairs):
            raise RefusedError(
                "two --stage sources share a name: name them with --stage SRC --name NAME"
            )
        args = substitute(command[1:], pairs)
        env = job_env(staged, settings)
        nowait.follow_live(stagers, joins, held, log)
        teardown.hold()
        returncode, leftovers, killed_by = spawn(
            [command[0], *args],
            env,
            executable=exe,
            log=log,
            held=teardown,
            spare=[s.pid for s in stagers],
        )
        returncode = nowait.finish_live(
            stagers, returncode, killed_by is not None or cleanup, teardown, log, joins
        )
        staged = nowait.unpublished(staged, stagers)
        failed = False
    finally:
        teardown.hold()  # staging stopped by a signal: a second one waits for the cleanup too
        for stager in stagers:  # an error or a signal: stop every copy (nothing published)
            stager.finish(True, lambda: None)
        try:
            _teardown(held, staged, evicted, cleanup, dest, log, service)
        finally:
            # the first signal wins: the job's, or the error (Interrupted) in flight
            teardown.release(redeliver=not failed and killed_by is None)
    return RunResult(returncode, tuple(staged), tuple(evicted), leftovers, killed_by)


def _teardown(
    held: list[Any],
    staged: list[Any],
    evicted: list[str],
    cleanup: bool,
    dest: str | None,
    log: Callable[[str], None] | None,
    service: bool = True,
) -> None:
    """Release the job's leases and, with ``cleanup``, evict what this run staged."""
    for lease in held:
        lease.release()
    if cleanup and staged:
        from shmstage import stage as engine
        from shmstage.service import api

        for ds in staged:
            if ds.changed:  # only what this run copied; a dataset others staged stays
                # The job's status (or the error that stopped it) wins over any cleanup
                # failure: a cleanup that cannot happen is said on stderr and left.
                try:
                    evicted.extend(api.evict_report(ds.name, dest=dest, service=service).evicted)
                except engine.InUse as e:  # another job reads it: not ours to take away
                    if log is not None:
                        log(f"not evicting {ds.name}: in use by {engine.describe(e.holders)}")
                except ShmstageError as e:  # e.g. being restaged by someone else right now
                    if log is not None:
                        log(f"not evicting {ds.name}: {e}")
        if log is not None and evicted:
            log(f"evicted: {', '.join(evicted)}")
