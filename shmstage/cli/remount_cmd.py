"""``shmstage remount``: grow (or shrink) a tmpfs such as /dev/shm, optionally in fstab too."""

from __future__ import annotations

import click

from shmstage import shm
from shmstage.cli.output import emit, json_option, log
from shmstage.cli.params import SIZE_OR_PERCENT


def _render(result: shm.RemountResult) -> None:
    for warning in result.warnings:
        log(f"Warning: {warning}")
    if result.dry_run and result.changed:
        click.echo("Dry run: nothing changed.")
        if result.commands:
            click.echo("Would run:")
            for command in result.commands:
                click.echo(f"  {command}")
        if result.fstab_diff:
            click.echo(
                f"Would change {result.fstab} (old copy kept as {shm.backup_path(result.fstab or '')}):"
            )
            click.echo(result.fstab_diff, nl=False)
        return
    click.echo(result.message)


@click.command("remount")
@click.option(
    "--size",
    required=True,
    type=SIZE_OR_PERCENT,
    help="New size: 64G, 64GiB, 512M, bytes, or N% of the memory this node/cgroup can hold.",
)
@click.option(
    "--path",
    default="/dev/shm",
    metavar="DIR",
    show_default=True,
    help="Mount point of the tmpfs to resize.",
)
@click.option(
    "--persist", is_flag=True, help="Also write the size into fstab (atomically, with a backup)."
)
@click.option(
    "--fstab",
    default=None,
    metavar="PATH",
    help="fstab file to edit with --persist.  [default: /etc/fstab]",
)
@click.option(
    "--dry-run", is_flag=True, help="Print the exact commands and fstab diff; change nothing."
)
@click.option(
    "--force", is_flag=True, help="Allow a size beyond physical RAM or the cgroup memory limit."
)
@click.option(
    "--shrink",
    is_flag=True,
    help="Allow a size smaller than the tmpfs is now (never below what it holds).",
)
@json_option
def remount_cmd(
    size: str | int,
    path: str,
    persist: bool,
    fstab: str | None,
    dry_run: bool,
    force: bool,
    shrink: bool,
    as_json: bool,
) -> None:
    """Resize /dev/shm (or any tmpfs), optionally in fstab too.

    \b
    Examples:
      shmstage remount --size 64G                 # grow /dev/shm to 64 GiB
      shmstage remount --size 75% --persist       # 75% of RAM (or the cgroup limit), in fstab too
      shmstage remount --size 32G --dry-run       # show the command and fstab diff only

    Refuses (exit 2, nothing changed) to shrink without --shrink (a size such
    as 75% can be smaller than a big /dev/shm), below what is in use, to go
    beyond RAM or the cgroup memory limit without --force, and to touch a path
    that is not a tmpfs mount point.  Needs root (CAP_SYS_ADMIN); inside a
    container set the size at start instead (docker run --shm-size, or a
    Kubernetes emptyDir with medium: Memory).
    """
    if fstab is not None and not persist:
        raise click.UsageError("--fstab only applies with --persist")
    plan = shm.plan_remount(
        size, path, persist=persist, fstab=fstab or "/etc/fstab", force=force, shrink=shrink
    )
    result = shm.plan_result(plan, dry_run=True) if dry_run else shm.apply_remount(plan)
    emit(result, as_json, _render)
