"""The store's own tmpfs (``store_tmpfs`` in the node config): mounted by ``prepare`` with a
size, a mode and, on a node with several NUMA nodes, ``mpol=interleave``, persisted in fstab.
Beside :mod:`shmstage.shm`, which resizes an existing tmpfs; these two change mounts.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass

from shmstage import system
from shmstage.errors import PermissionDenied, RefusedError, ShmstageError
from shmstage.fstab import edit_fstab, fstab_diff, has_tmpfs_line, read_fstab, write_fstab
from shmstage.paths import is_within, system_mount
from shmstage.shm import PAGE_SIZE, current_size, plan_remount
from shmstage.sizes import format_size, is_percent, mount_size, parse_size

_MIB = 1 << 20


@dataclass(frozen=True)
class StoreMountPlan:
    """What giving the store its own tmpfs takes: mount (or resize), mode, mpol, fstab."""

    path: str
    size_option: str  # size= ("64G")
    mode: str  # "0755"
    mpol: str | None  # "interleave" on a node with several NUMA nodes, else None
    commands: tuple[str, ...]  # mount(8) command lines, in order; () when the mount is right
    chmod: bool  # the mounted root's mode differs
    mkdir: bool  # the mount point does not exist yet
    fstab: str
    fstab_text: str | None  # the new fstab, None when it is right
    fstab_diff: str

    @property
    def changed(self) -> bool:
        return bool(self.commands or self.chmod or self.mkdir or self.fstab_text is not None)


def mpol_for(numa: system.Numa) -> str | None:
    """tmpfs's ``mpol=`` for the store: none on one NUMA node; ``interleave`` over all of them;
    ``interleave:A-B`` over the CPUs' nodes when other nodes hold memory too (a GPU's HBM).
    Those nodes in a list with gaps get none: a list with commas cannot sit in mount options."""
    nodes = sorted(numa.compute)
    if len(nodes) < 2:
        return None
    if nodes == sorted(numa.memory):
        return "interleave"
    if nodes != list(range(nodes[0], nodes[-1] + 1)):
        return None
    return f"interleave:{nodes[0]}-{nodes[-1]}"


def _same_mpol(current: str | None, wanted: str) -> bool:
    if current is None:
        return False
    policy, _, nodes = wanted.partition(":")
    return current.partition(":")[0] == policy and (not nodes or current == wanted)


def plan_store_mount(
    size: str | int,
    path: str,
    *,
    mode: str = "0755",
    mpol: str | None = None,
    fstab: str = "/etc/fstab",
    shm: str | None = None,
    memory: system.Memory | None = None,
    proc: str = "/proc",
) -> StoreMountPlan:
    """Check a tmpfs of ``size`` at ``path`` for the store, persisted in ``fstab``.

    A missing mount is mounted (the directory made); a tmpfs already there is resized with
    :func:`plan_remount`'s checks (no shrink, not beyond RAM), re-moded, given ``mpol``.
    Refuses (exit 2), with ``path`` resolved first (a symlink counts where it leads): a
    system mount or a path in one (/dev/shm, /run, /tmp; see paths.system_mount), the
    ``shm`` tmpfs or a path in it, another file system mounted at ``path``, a tmpfs there
    that ``fstab`` does not list (not ours: another's memory, mode and users), or a
    non-empty directory that a new mount would hide."""
    real = os.path.realpath(path)
    shm_real = os.path.realpath(shm) if shm else None
    if system_mount(real) or (shm_real is not None and is_within(real, shm_real)):
        shown = path if real == path else f"{path} (that is {real})"
        raise RefusedError(
            f"{shown} cannot hold the store's own tmpfs: it is a system mount or the shm "
            "tmpfs, or lies in one; pick another store_tmpfs.path, e.g. /var/cache/shmstage"
        )
    mem = memory if memory is not None else system.memory()
    new = parse_size(size, percent_of=mem.ceiling)
    new = (new // _MIB) * _MIB if is_percent(str(size)) else -(-new // PAGE_SIZE) * PAGE_SIZE
    if new > mem.ceiling:
        raise RefusedError(
            f"refusing a {mount_size(new)} tmpfs at {path}: more than the "
            f"{format_size(mem.ceiling)} of RAM this node (or cgroup) can hold; lower store_tmpfs.size"
        )
    option = mount_size(new)
    mount = system.mount_of(real, proc) if os.path.exists(real) else None
    mounted = mount is not None and mount.mountpoint == real
    commands: list[str] = []
    chmod = False
    if mounted and mount is not None:
        if mount.fstype != "tmpfs":
            raise RefusedError(
                f"{path} is a {mount.fstype} mount, not a tmpfs; point store_tmpfs.path at a "
                "directory of its own or unmount it"
            )
        before = read_fstab(fstab)
        if not has_tmpfs_line(before, real):
            # Mounted by someone else (or by hand): its size, mode and users are not ours to change.
            raise RefusedError(
                f"{path} is already a tmpfs mount prepare did not make; pick another "
                "store_tmpfs.path"
            )
        options = []
        if -(-current_size(mount, real) // PAGE_SIZE) * PAGE_SIZE != new:
            # The config is explicit, so a smaller size is applied; never below what is used.
            resize = plan_remount(size, real, shrink=True, memory=mem, proc=proc)
            options.append(f"size={resize.size_option}")
        if mpol is not None and not _same_mpol(mount.option("mpol"), mpol):
            options.append(f"mpol={mpol}")
        if options:
            commands.append(shlex.join(["mount", "-o", ",".join(["remount", *options]), real]))
        chmod = (os.stat(real).st_mode & 0o7777) != int(mode, 8)
    else:
        if os.path.isdir(real) and os.listdir(real):
            raise RefusedError(
                f"{path} is a directory with files in it; a tmpfs mounted there would hide them: "
                "empty it or choose another store_tmpfs.path"
            )
        if os.path.lexists(path) and not os.path.isdir(real):
            raise RefusedError(
                f"{path} exists and is not a directory; choose another store_tmpfs.path"
            )
        options = ["nosuid", "nodev", f"size={option}", f"mode={mode}"]
        options += [f"mpol={mpol}"] if mpol else []
        commands.append(
            shlex.join(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", real])
        )
    wanted = (("mode", mode),) + ((("mpol", mpol),) if mpol else ())
    before = read_fstab(fstab)
    after = edit_fstab(
        before, real, option, fstab=fstab, options=wanted, new_options="nosuid,nodev"
    )
    return StoreMountPlan(
        path=real,
        size_option=option,
        mode=mode,
        mpol=mpol,
        commands=tuple(commands),
        chmod=chmod,
        mkdir=not os.path.exists(real),
        fstab=fstab,
        fstab_text=after if after != before else None,
        fstab_diff=fstab_diff(before, after, fstab) if after != before else "",
    )


def apply_store_mount(plan: StoreMountPlan, *, proc: str = "/proc") -> None:
    """Carry out a :func:`plan_store_mount`: mount or remount, chmod, then fstab (atomically)."""
    if plan.commands and not system.has_cap_sys_admin(proc):
        raise PermissionDenied(
            f"mounting the store's tmpfs at {plan.path} needs root (CAP_SYS_ADMIN); run prepare as root"
        )
    if plan.mkdir:
        os.makedirs(plan.path, mode=0o755, exist_ok=True)
    for command in plan.commands:
        argv = shlex.split(command)
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False)
        except FileNotFoundError:
            raise ShmstageError("mount(8) is not installed; install util-linux") from None
        if done.returncode != 0:
            lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
            reason = (
                " ".join(ln for ln in lines if "dmesg(1)" not in ln) or f"exit {done.returncode}"
            )
            raise ShmstageError(f"`{command}` failed: {reason}")
    if plan.chmod:
        os.chmod(plan.path, int(plan.mode, 8))
    if plan.fstab_text is not None:
        write_fstab(plan.fstab, plan.fstab_text)
