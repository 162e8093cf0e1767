"""Resize a tmpfs (normally /dev/shm) and persist its size in fstab.

With :mod:`shmstage.store_tmpfs`, the only modules that change mounts or fstab (whose text
:mod:`shmstage.fstab` edits and writes for them).  :func:`plan_remount` checks everything and changes nothing (``--dry-run``
stops there); :func:`apply_remount` carries a plan out: remount first, then swap in the new
fstab atomically.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass

from shmstage import system
from shmstage.errors import PermissionDenied, RefusedError, ShmstageError
from shmstage.fstab import backup_path, edit_fstab, fstab_diff, read_fstab, write_fstab
from shmstage.sizes import format_size, is_percent, mount_size, parse_size

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_MIB = 1 << 20


@dataclass(frozen=True)
class RemountPlan:
    """What ``remount`` would do.  Nothing has been changed yet."""

    path: str  # the tmpfs mount point
    requested: str  # the size as given: "64G", "50%", "68719476736"
    current_size: int  # bytes; 0 = unlimited tmpfs
    new_size: int  # bytes, rounded the way the kernel will round them
    size_option: str  # the value passed as size= ("64G", "1536M")
    used: int  # bytes in use on the tmpfs now
    ceiling: int  # RAM this node/cgroup can hold: the limit without --force
    remount_needed: bool
    commands: tuple[str, ...]  # exact shell commands, for humans and --dry-run
    persist: bool
    fstab: str | None
    fstab_changed: bool
    fstab_diff: str  # unified diff; "" when fstab stays as it is
    backup: str | None  # where the old fstab is kept when it changes
    warnings: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return self.remount_needed or self.fstab_changed


@dataclass(frozen=True)
class RemountResult:
    """What ``remount`` did (or, with ``dry_run``, would do)."""

    path: str
    dry_run: bool
    changed: bool
    old_size: int
    new_size: int  # read back from the kernel after a real remount
    size_option: str
    used: int
    remounted: bool
    commands: tuple[str, ...]
    fstab: str | None
    fstab_changed: bool
    fstab_diff: str
    backup: str | None
    warnings: tuple[str, ...]
    message: str


# --- planning ---------------------------------------------------------------


def _tmpfs_mount(path: str, proc: str) -> system.Mount:
    if not os.path.exists(path):
        raise RefusedError(f"{path} does not exist; give the mount point of a tmpfs with --path")
    real = os.path.realpath(path)
    mount = system.mount_of(real, proc)
    if mount is not None and mount.mountpoint == real and mount.fstype == "tmpfs":
        return mount
    if mount is None:
        where = "it is on no mount this process can see"
    elif mount.fstype == "tmpfs":
        where = (
            f"it is inside the tmpfs mounted at {mount.mountpoint}; use --path {mount.mountpoint}"
        )
    else:
        where = f"it is on {mount.fstype} mounted at {mount.mountpoint}"
    raise RefusedError(
        f"{path} is not a tmpfs mount point ({where}); remount only resizes tmpfs mounts such as /dev/shm"
    )


def current_size(mount: system.Mount, path: str) -> int:
    """The tmpfs size in bytes (0 = unlimited), from its ``size=`` option or statvfs."""
    opt = mount.option("size")
    if opt is not None:
        try:
            return parse_size(opt)
        except ShmstageError:
            pass  # an odd spelling: ask statvfs instead
    return system.disk_usage(path).total


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _ram_words(mem: system.Memory) -> str:
    if mem.cgroup.limit is not None and mem.cgroup.limit < mem.total:
        return "this cgroup's memory limit"
    return "RAM on this node"


def human(n: int) -> str:
    """``64G`` when exact, else ``24684084k (23.5 GiB)``."""
    if n == 0:
        return "unlimited"  # a tmpfs mounted with size=0
    exact = mount_size(n)
    return exact if exact[-1:] in ("M", "G", "T") else f"{exact} ({format_size(n)})"


def plan_remount(
    size: str | int,
    path: str = "/dev/shm",
    *,
    persist: bool = False,
    fstab: str = "/etc/fstab",
    force: bool = False,
    shrink: bool = False,
    memory: system.Memory | None = None,
    proc: str = "/proc",
) -> RemountPlan:
    """Check a resize of the tmpfs at ``path`` to ``size`` and say exactly what it takes.

    ``size`` is bytes, ``"64G"``-style, or ``"N%"`` of the memory this node/cgroup
    can hold (``system.memory().ceiling``).  Raises :class:`RefusedError` (exit 2)
    for a shrink below what is used, any shrink without ``shrink`` (``--size 75%`` on a
    bigger tmpfs is easy to type by mistake), a size beyond RAM/the cgroup limit without
    ``force``, or a path that is not a tmpfs mount point."""
    mount = _tmpfs_mount(path, proc)
    mem = memory if memory is not None else system.memory()
    ceiling = mem.ceiling
    requested = str(size).strip()
    new = parse_size(size, percent_of=ceiling)
    # The kernel keeps whole pages; a percentage is rounded down to a MiB so the
    # command reads well (size=12053M rather than size=12638957568).
    new = (new // _MIB) * _MIB if is_percent(requested) else _round_up(new, PAGE_SIZE)
    if new <= 0:
        raise RefusedError(
            f"invalid size {requested!r}: it must be more than 0 (size=0 would make the tmpfs unlimited)"
        )
    option = mount_size(new)
    where = mount.mountpoint
    current = current_size(mount, where)
    if current == 0:
        raise RefusedError(
            f"{where} is a tmpfs without a size limit (size=0) and the kernel cannot add one by "
            f"remounting; unmount it and mount it again: mount -t tmpfs -o size={option} tmpfs {where}"
        )
    used = system.disk_usage(where).used
    if new < used:
        raise RefusedError(
            f"refusing to shrink {where} to {option}: {format_size(used)} is in use; "
            f"free space first (e.g. `shmstage evict`) or choose at least {mount_size(_round_up(used, _MIB))}"
        )
    warnings: list[str] = []
    if new < _round_up(current, PAGE_SIZE):
        if not shrink:
            of = f" ({requested} of {format_size(ceiling)})" if is_percent(requested) else ""
            raise RefusedError(
                f"refusing to shrink {where} from {format_size(current)} to {option}{of}; "
                "pass --shrink to make it smaller"
            )
        warnings.append(f"shrinks {where} from {format_size(current)} to {option} (--shrink)")
    if new > ceiling:
        if not force:
            raise RefusedError(
                f"refusing to size {where} to {option}: more than the {format_size(ceiling)} of "
                f"{_ram_words(mem)}; tmpfs pages live in RAM, so filling it would swap or OOM-kill "
                "processes; pass --force to do it anyway"
            )
        warnings.append(
            f"{option} is more than the {format_size(ceiling)} of {_ram_words(mem)} (--force)"
        )
    remount_needed = _round_up(current, PAGE_SIZE) != new
    commands = (
        (shlex.join(["mount", "-o", f"remount,size={option}", where]),) if remount_needed else ()
    )

    fstab_path: str | None = None
    fstab_changed, diff, backup = False, "", None
    if persist:
        fstab_path = fstab
        before = read_fstab(fstab)
        after = edit_fstab(before, where, option, fstab=fstab)
        fstab_changed = after != before
        if fstab_changed:
            diff = fstab_diff(before, after, fstab)
            backup = backup_path(fstab)
    if (remount_needed or fstab_changed) and not system.has_cap_sys_admin(proc):
        warnings.append("applying this needs root (CAP_SYS_ADMIN)")
    return RemountPlan(
        path=where,
        requested=requested,
        current_size=current,
        new_size=new,
        size_option=option,
        used=used,
        ceiling=ceiling,
        remount_needed=remount_needed,
        commands=commands,
        persist=persist,
        fstab=fstab_path,
        fstab_changed=fstab_changed,
        fstab_diff=diff,
        backup=backup,
        warnings=tuple(warnings),
    )


# --- applying ---------------------------------------------------------------


def _k8s(option: str) -> str:
    return (
        option[:-1] + {"k": "Ki", "M": "Mi", "G": "Gi", "T": "Ti"}[option[-1]]
        if option[-1:] in "kMGT"
        else option
    )


def not_permitted_message(path: str, option: str) -> str:
    return (
        f"cannot resize {path}: changing a mount needs root with CAP_SYS_ADMIN, which this process lacks. "
        f"On the host run it as root (sudo shmstage remount --size {option}); in a container the size is "
        f"set when it starts: `docker run --shm-size={option.lower()}`, or on Kubernetes mount an "
        f"`emptyDir: {{medium: Memory, sizeLimit: {_k8s(option)}}}` volume at {path}"
    )


def _remount(plan: RemountPlan) -> None:
    argv = ["mount", "-o", f"remount,size={plan.size_option}", plan.path]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise ShmstageError("mount(8) is not installed; install util-linux") from None
    if done.returncode == 0:
        return
    # util-linux appends "dmesg(1) may have more information..." lines: keep the reason.
    lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
    reason = [ln for ln in lines if "dmesg(1)" not in ln] or lines
    text = " ".join(reason) if reason else f"exit code {done.returncode}"
    lowered = text.lower()
    if "permission denied" in lowered or "superuser" in lowered or "not permitted" in lowered:
        # e.g. root in a container whose seccomp/AppArmor profile forbids mount(2)
        raise PermissionDenied(not_permitted_message(plan.path, plan.size_option))
    raise ShmstageError(f"`{shlex.join(argv)}` failed: {text}")


def apply_remount(plan: RemountPlan, *, proc: str = "/proc") -> RemountResult:
    """Remount (when the size differs), then persist in fstab (when asked and it differs)."""
    if not plan.changed:
        return plan_result(plan)
    new_fstab: str | None = None
    if plan.fstab_changed and plan.fstab is not None:
        # Re-read: fstab may have changed since the plan; other lines stay as they are now.
        new_fstab = edit_fstab(
            read_fstab(plan.fstab), plan.path, plan.size_option, fstab=plan.fstab
        )
        if not os.access(os.path.dirname(os.path.realpath(plan.fstab)), os.W_OK):
            raise PermissionDenied(
                f"cannot write {plan.fstab}: permission denied; run as root (sudo shmstage remount ... --persist)"
            )
    if plan.remount_needed:
        if not system.has_cap_sys_admin(proc):
            raise PermissionDenied(not_permitted_message(plan.path, plan.size_option))
        _remount(plan)
    backup = write_fstab(plan.fstab, new_fstab) if new_fstab is not None and plan.fstab else None
    mount = system.mount_of(plan.path, proc)
    after = current_size(mount, plan.path) if mount is not None else plan.new_size
    parts = []
    if plan.remount_needed:
        parts.append(f"resized {plan.path} from {human(plan.current_size)} to {human(after)}")
    else:
        parts.append(f"{plan.path} is already {human(after)}")
    if backup:
        parts.append(f"persisted size={plan.size_option} in {plan.fstab} (backup: {backup})")
    return RemountResult(
        path=plan.path,
        dry_run=False,
        changed=True,
        old_size=plan.current_size,
        new_size=after,
        size_option=plan.size_option,
        used=plan.used,
        remounted=plan.remount_needed,
        commands=plan.commands,
        fstab=plan.fstab,
        fstab_changed=backup is not None,
        fstab_diff=plan.fstab_diff,
        backup=backup,
        warnings=plan.warnings,
        message="; ".join(parts),
    )


def plan_result(plan: RemountPlan, *, dry_run: bool = False) -> RemountResult:
    """The result of a plan that is not carried out: nothing to do, or ``--dry-run``."""
    if not plan.changed:
        where = f"{plan.path} and {plan.fstab}" if plan.persist else plan.path
        message = f"{where}: already {human(plan.current_size)}, nothing to do"
    else:
        parts = []
        if plan.remount_needed:
            parts.append(
                f"would resize {plan.path} from {human(plan.current_size)} to {human(plan.new_size)}"
            )
        else:
            parts.append(f"{plan.path} is already {human(plan.current_size)}")
        if plan.fstab_changed:
            parts.append(
                f"would persist size={plan.size_option} in {plan.fstab} (backup: {plan.backup})"
            )
        message = "dry run, nothing changed: " + "; ".join(parts)
    return RemountResult(
        path=plan.path,
        dry_run=dry_run,
        changed=plan.changed and dry_run,  # in a dry run: what would change
        old_size=plan.current_size,
        new_size=plan.new_size if dry_run else plan.current_size,
        size_option=plan.size_option,
        used=plan.used,
        remounted=False,
        commands=plan.commands,
        fstab=plan.fstab,
        fstab_changed=False,
        fstab_diff=plan.fstab_diff,
        backup=None,
        warnings=plan.warnings,
        message=message,
    )
