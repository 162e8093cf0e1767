"""``shmstage prepare``: converge a node to its YAML config, idempotently.

Steps run in order (inspect, size the tmpfs, the store's own tmpfs and the node service's
units where the config asks, stage each dataset, pillow-simd) and each reports ok / changed /
skipped / failed (or would-change under ``dry_run``).  The first failed step stops the run;
what earlier steps did stays in place.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shmstage import system
from shmstage.capacity import MEMORY_BACKED, RESERVE_CAP
from shmstage.config import DEFAULT_PATH, DatasetConfig, NodeConfig
from shmstage.errors import ShmstageError
from shmstage.paths import is_within
from shmstage.sizes import format_size, parse_size

if TYPE_CHECKING:
    from shmstage.shm import RemountPlan

OK, CHANGED, FAILED, SKIPPED, WOULD_CHANGE = "ok", "changed", "failed", "skipped", "would-change"
_MIB = 1 << 20
# A manifest entry is one JSON list (path, kind, size, mtime, mode, link): ~100-200 bytes.
_MANIFEST_BYTES_PER_FILE = 256


@dataclass(frozen=True)
class Step:
    step: str  # "inspect", "shm-size", "stage <name>", "pillow-simd"
    status: str  # ok | changed | failed | skipped | would-change
    detail: str


@dataclass(frozen=True)
class PrepareReport:
    config: str | None
    dry_run: bool
    changed: bool  # some step changed the node (always false under dry_run)
    would_change: bool  # dry_run only: some step would change the node
    failed: bool
    error: str | None  # the failed step's message
    steps: tuple[Step, ...]


class StepFailed(ShmstageError):
    """A prepare step failed; earlier steps' changes stay."""


LOCK_ENV = "SHMSTAGE_PREPARE_LOCK"  # the lock file (default below); for tests and odd layouts
LOCK_PATH = "/run/lock/shmstage-prepare.lock"
LOCK_TIMEOUT_ENV = "SHMSTAGE_PREPARE_LOCK_TIMEOUT"  # seconds to wait for another prepare
LOCK_TIMEOUT = 3600.0


@contextlib.contextmanager
def prepare_lock(path: str | None = None, timeout: float | None = None) -> Iterator[None]:
    """Hold an exclusive flock for a whole prepare: two runs on one node (an Ansible run and
    a timer) take turns instead of interleaving.  Waits up to ``timeout`` seconds, saying on
    stderr which pid holds it; then fails."""
    path = path or os.environ.get(LOCK_ENV) or LOCK_PATH
    if path == LOCK_PATH and not os.path.isdir(os.path.dirname(LOCK_PATH)):
        path = "/run/" + os.path.basename(LOCK_PATH)  # containers without /run/lock
    if timeout is None:
        timeout = float(os.environ.get(LOCK_TIMEOUT_ENV) or LOCK_TIMEOUT)
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except PermissionError:  # root's lock file, a non-root prepare: flock needs no write
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise ShmstageError(
            f"cannot open the prepare lock {path}: {e.strerror}; "
            f"run as root or set {LOCK_ENV} to a writable file"
        ) from None
    try:
        deadline = time.monotonic() + timeout
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                if time.monotonic() >= deadline:
                    raise ShmstageError(
                        f"another shmstage prepare (pid {holder}) still holds {path} after "
                        f"{timeout:g} s; wait for it to finish, or stop it"
                    ) from None
                if not said:
                    print(
                        f"prepare: waiting for another shmstage prepare (pid {holder}) "
                        f"holding {path}...",
                        file=sys.stderr,
                        flush=True,
                    )
                    said = True
                time.sleep(0.2)
        with contextlib.suppress(OSError):  # who holds it, for the waiter's message
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def _locked(fn: Callable[..., PrepareReport]) -> Callable[..., PrepareReport]:
    @functools.wraps(fn)
    def run(config: NodeConfig, *, dry_run: bool = False, **kw: Any) -> PrepareReport:
        if dry_run:
            return fn(config, dry_run=dry_run, **kw)  # changes nothing: needs no turn
        with prepare_lock():
            return fn(config, dry_run=dry_run, **kw)

    return run


@_locked
def prepare(
    config: NodeConfig,
    *,
    dry_run: bool = False,
    log: Callable[[str], None] | None = None,
    peers: Any = None,
    systemd_dir: str = "/etc/systemd/system",
    systemd_running: str = "/run/systemd/system",
    sys_root: str = "/sys",
) -> PrepareReport:
    """Converge the node to ``config``; never raises for a failed step (see ``report.failed``).

    ``peers`` (:class:`shmstage.cluster.Peers`): stage each dataset together with the
    other nodes, which run ``prepare`` with the same datasets.  ``systemd_dir``: where the
    service's units go; ``systemd_running`` and ``sys_root`` (NUMA nodes): for tests."""
    say = log or (lambda _msg: None)
    steps: list[Step] = []
    error: str | None = None
    plan: list[tuple[str, Callable[[], tuple[str, str]]]] = [
        ("inspect", lambda: _inspect(config)),
        ("shm-size", lambda: _size_shm(config, dry_run)),
    ]
    # The node service's steps show only on a node that uses it (the store mounted first:
    # the service must find it when it starts).
    if config.store_tmpfs is not None:
        plan.append(("store-tmpfs", lambda: _store_tmpfs(config, dry_run, sys_root)))
    if config.service.enabled:
        plan.append(("service", lambda: _service(config, dry_run, systemd_dir, systemd_running)))
    for ds in config.datasets:
        plan.append((f"stage {ds.name}", lambda ds=ds: _stage(config, ds, dry_run, peers)))
    plan.append(("pillow-simd", lambda: _pillow(config, dry_run, say)))
    for name, run in plan:
        say(f"prepare: {name}...")
        try:
            status, detail = run()
        except (ShmstageError, OSError) as e:
            error = f"{name} failed: {e}"
            steps.append(Step(name, FAILED, str(e)))
            break
        steps.append(Step(name, status, detail))
    return PrepareReport(
        config=config.path,
        dry_run=dry_run,
        changed=any(s.status == CHANGED for s in steps),
        would_change=any(s.status == WOULD_CHANGE for s in steps),
        failed=error is not None,
        error=error,
        steps=tuple(steps),
    )


# -- steps: each returns (status, detail) or raises ShmstageError ------------------------


def _inspect(config: NodeConfig) -> tuple[str, str]:
    path = config.shm.path
    if not os.path.isdir(path):
        raise StepFailed(f"shm.path {path} does not exist; mount a tmpfs there or fix shm.path")
    mount = system.mount_of(path)
    usage = system.disk_usage(path)
    fstype = mount.fstype if mount else "unknown"
    if config.shm.size is not None:
        if mount is None or os.path.realpath(mount.mountpoint) != os.path.realpath(path):
            raise StepFailed(
                f"shm.path {path} is not a mount point, so it cannot be resized; "
                "point shm.path at the tmpfs mount (e.g. /dev/shm) or drop shm.size"
            )
        if fstype != "tmpfs":
            raise StepFailed(f"shm.path {path} is {fstype}, not tmpfs; only a tmpfs can be resized")
    mem = system.memory()
    detail = (
        f"{fstype} at {mount.mountpoint if mount else path}: {format_size(usage.total)}, "
        f"{format_size(usage.free)} free; {format_size(mem.usable)} RAM usable"
    )
    if fstype not in MEMORY_BACKED:
        detail += " (not RAM-backed)"
    return OK, detail


def _size_shm(config: NodeConfig, dry_run: bool) -> tuple[str, str]:
    shm = config.shm
    if shm.size is None:
        return SKIPPED, "shm.size not set; the tmpfs size is left alone"
    from shmstage.shm import apply_remount, plan_remount

    size: int | str = shm.size
    why = ""
    if size == "auto":
        current = system.disk_usage(shm.path).total
        wanted = auto_size(config)
        # auto only grows: a tmpfs already big enough is left alone (and persisted as is).
        size = max(current, wanted)
        why = f" (auto: datasets + reserve need {format_size(wanted)})"
    plan = plan_remount(size, shm.path, persist=shm.persist, fstab=shm.fstab)
    if not plan.changed:
        persisted = f", persisted in {shm.fstab}" if shm.persist else ""
        return OK, f"{shm.path} is {format_size(plan.current_size)}{persisted}{why}"
    what = _describe_remount(plan)
    if dry_run:
        return WOULD_CHANGE, f"would {what}{why}"
    apply_remount(plan)
    return CHANGED, f"{what}{why}"


def _store_tmpfs(config: NodeConfig, dry_run: bool, sys_root: str) -> tuple[str, str]:
    store = config.store_tmpfs
    assert store is not None  # the step runs only then
    from shmstage.store_tmpfs import apply_store_mount, mpol_for, plan_store_mount

    mpol = mpol_for(system.numa(sys_root))
    plan = plan_store_mount(
        store.size, store.path, mode=store.mode, mpol=mpol, fstab=store.fstab, shm=config.shm.path
    )
    options = f"size={plan.size_option},mode={plan.mode}" + (f",mpol={mpol}" if mpol else "")
    if not plan.changed:
        return OK, f"tmpfs at {plan.path} ({options}), persisted in {store.fstab}"
    parts = [*plan.commands]
    if plan.chmod:
        parts.append(f"chmod {plan.mode} {plan.path}")
    if plan.fstab_text is not None:
        parts.append(f"persist it in {store.fstab}")
    what = "; ".join(parts)
    if dry_run:
        return WOULD_CHANGE, f"would {what}"
    apply_store_mount(plan)
    return CHANGED, what


def _service(config: NodeConfig, dry_run: bool, directory: str, running: str) -> tuple[str, str]:
    from shmstage import systemd

    conf = os.path.abspath(config.path or DEFAULT_PATH)
    plan = systemd.plan_units(conf, directory=directory, running=running)
    not_running = "systemd is not running here: no service started (run `shmstage serve` yourself)"
    if not plan.changed:
        if not plan.systemd:
            return OK, f"units up to date in {directory}; {not_running}"
        return OK, f"{systemd.SERVICE} up to date, enabled and active"
    parts = []
    if plan.to_write:
        names = ", ".join(os.path.basename(p) for p, _ in plan.to_write)
        parts.append(f"{'would write' if dry_run else 'wrote'} {names} in {directory}")
    if plan.actions:
        parts.append(f"{'would run' if dry_run else 'ran'} systemctl " + ", ".join(plan.actions))
    if not plan.systemd:
        parts.append(not_running)
    if dry_run:
        return WOULD_CHANGE, "; ".join(parts)
    systemd.apply_units(plan)
    return CHANGED, "; ".join(parts)


def _describe_remount(plan: RemountPlan) -> str:
    parts = []
    if plan.remount_needed:
        before = format_size(plan.current_size) if plan.current_size else "unlimited"
        parts.append(
            f"resize {plan.path} {before} -> {format_size(plan.new_size)} (size={plan.size_option})"
        )
    if plan.fstab_changed:
        parts.append(f"persist size={plan.size_option} in {plan.fstab}")
    return " and ".join(parts)


def auto_size(config: NodeConfig) -> int:
    """Size for ``shm.size: auto``, rounded up to whole MiB:

        what the tmpfs holds besides the listed datasets and shmstage's bookkeeping
      + the tmpfs footprint of the listed sources + an estimate of their manifests
      + the reserve (default: staging's rule, 10% of the tmpfs, at most 4 GiB).

    Copies already staged are taken out of "what it holds" and put back as sources, so a
    converged node gets the same answer again (prepare stays idempotent)."""
    shm = config.shm.path
    dest_on_shm = is_within(os.path.realpath(config.dest), os.path.realpath(shm))
    other = system.disk_usage(shm).used
    needed = _MIB
    for ds in config.datasets:
        size, files = footprint(ds.source, config.dest)
        needed += size + files * _MANIFEST_BYTES_PER_FILE
        if dest_on_shm and _published(ds.name, config.dest) is not None:
            other -= footprint(os.path.join(config.dest, ds.name))[0]
    if dest_on_shm:
        other -= footprint(os.path.join(config.dest, ".shmstage"))[0]
    base = max(0, other) + needed
    reserve = config.reserve
    if reserve is None:
        reserve = min(RESERVE_CAP, -(-base // 9))  # 10% of the total is base / 9
    elif isinstance(reserve, str):  # "N%" of the tmpfs being sized: base is the other 100-N%
        per_million = parse_size(reserve, percent_of=1_000_000)  # below 100% (config)
        reserve = -(-base * per_million // (1_000_000 - per_million))
    return -(-(base + reserve) // _MIB) * _MIB


def footprint(path: str, dest: str | None = None) -> tuple[int, int]:
    """(bytes ``path`` takes on the tmpfs that holds ``dest``, number of files), by staging's
    own estimator: whole pages of the kernel's page size, hard links once, an archive by its
    extracted size.  A single other file counts as itself; a missing path is (0, 0)."""
    from shmstage.stage.build.estimate import estimate, page_size, rounded

    if not os.path.lexists(path):
        return 0, 0
    try:
        est = estimate(path, dest)
    except ShmstageError:
        try:
            return rounded(os.stat(path).st_size, page_size(dest)), 1
        except OSError:
            return 0, 0
    return est.page_bytes, est.files


def _bytes(path: str) -> int:
    return footprint(path)[0]


def _published(name: str, dest: str) -> Any:
    """The store's record of a published copy, read-only (``find`` would touch last_used)."""
    from shmstage.stage.store import Store

    store = Store(dest)
    if not store.exists():
        return None
    return store.open(create=False).published(name)


def _stage(
    config: NodeConfig, ds: DatasetConfig, dry_run: bool, peers: Any = None
) -> tuple[str, str]:
    from shmstage.stage import stage

    if "://" not in ds.source and not os.path.exists(ds.source):  # s3:// is checked by a LIST
        raise StepFailed(
            f"source {ds.source} does not exist; mount it or remove it from the config"
        )
    if dry_run:
        current = staged_is_current(ds.source, ds.name, config.dest)
        if current:
            return OK, f"{os.path.join(config.dest, ds.name)} up to date"
        what = "stage" if current is False else "check and refresh"
        return WOULD_CHANGE, f"would {what} {ds.source} ({format_size(_bytes(ds.source))})"
    from shmstage.stage import describe, holders

    leased = holders(ds.name, config.dest)
    if leased and not staged_is_current(ds.source, ds.name, config.dest):
        # Refreshing would replace the tree a running job reads: leave it until the job ends.
        return SKIPPED, (
            f"{os.path.join(config.dest, ds.name)} is in use by {describe(leased)}; "
            "not refreshed: run prepare again when the job has finished"
        )
    from shmstage.stage.cache.makeroom import CachePolicy

    # The tier's cache max_size holds for prepare too (a claim while copying, LRU eviction
    # of unleased datasets), as for `shmstage stage` with this config.
    policies = {
        t.path: CachePolicy(t.max_size, t.policy) for t in config.tiers if t.max_size is not None
    }
    result = stage(
        ds.source,
        name=ds.name,
        dest=config.dest,
        verify=ds.verify,
        reserve=config.reserve,
        peers=peers,
        policies=policies,
    )
    if result.changed:
        evicted = ", ".join(v.name for v in result.evicted)
        return CHANGED, (
            f"copied {format_size(result.copied_bytes)} to {result.path} "
            f"in {result.seconds:.1f}s (verify={ds.verify})"
            + (f"; evicted {evicted} to stay under the cache's max_size" if evicted else "")
        )
    files = f"{result.files} file{'' if result.files == 1 else 's'}"
    return OK, f"{result.path} up to date ({files}, {format_size(result.bytes)})"


def staged_is_current(source: str, name: str, dest: str) -> bool | None:
    """Would ``stage(source, name=name, dest=dest)`` copy nothing?  Read-only (unlike
    ``find``, it does not touch last_used); None when the store cannot be read."""
    from shmstage.stage.sources.walk import walk
    from shmstage.stage.store import Store

    try:
        record = _published(name, dest)
        manifest = Store(dest).manifest_for(record) if record else None
        if "://" in source:
            return None  # only a LIST can tell: "check and refresh"
        real = os.path.realpath(source)
        if record is None or manifest is None or record.source != real:
            return False
        if os.path.isdir(real):
            # The engine's own test (stage/engine.py): the walked tree equals the manifest.
            return manifest.get("entries") == [list(e) for e in walk(real).entries]
        st = os.stat(real)
        return manifest.get("archive") == [st.st_size, st.st_mtime_ns, st.st_ino]
    except (ShmstageError, OSError, KeyError, TypeError):
        return None


def _pillow(config: NodeConfig, dry_run: bool, say: Callable[[str], None]) -> tuple[str, str]:
    cfg = config.pillow_simd
    if not cfg.enabled:
        return SKIPPED, "pillow_simd.enabled is false"
    from shmstage import pillow

    target = cfg.python or "shmstage's python"
    plan = pillow.plan_install(cfg.python, version=cfg.version)
    if plan.nothing_to_do:
        return OK, f"pillow-simd {plan.before.version} in {target}"
    before = f"{plan.before.flavor} {plan.before.version or ''}".strip()
    if dry_run:
        return (
            WOULD_CHANGE,
            f"would build and install {plan.requirement} into {target} (now: {before})",
        )
    result = pillow.install(plan, log=say)
    if not result.changed:
        return OK, f"pillow-simd {result.after.version} in {target}"
    return CHANGED, f"installed pillow-simd {result.after.version} into {target} (was: {before})"
