"""``shmstage stage``: copy a dataset into tmpfs and print where it is."""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import click

from shmstage.capacity import disk_note
from shmstage.cli.output import dumps, log, stderr_is_tty
from shmstage.cli.params import (
    RESERVE,
    cluster_options,
    cluster_spec,
    config_option,
    no_service_option,
)
from shmstage.config import configured, node_reserve
from shmstage.errors import CapacityError
from shmstage.sizes import format_size
from shmstage.stage import (
    DEFAULT_DEST,
    Placed,
    Plan,
    Progress,
    check_lease_for,
    resident,
    summary,
)
from shmstage.stage.cache.tiers import refusal

if TYPE_CHECKING:
    from shmstage.cluster.peers import ClusterSpec, Peers


class ProgressLine:
    """One self-overwriting line on stderr: bytes, files, rate, ETA (terminals only)."""

    def __init__(self) -> None:
        self.last = 0.0
        self.width = 0
        self.waiting = False

    def __call__(self, p: Progress) -> None:
        if p.phase == "waiting":
            if not self.waiting:
                self._write(
                    f"waiting for another shmstage (pid {p.holder or '?'}) staging this dataset..."
                )
                self.waiting = True
            return
        now = time.monotonic()
        if p.phase == "copying" and now - self.last < 0.1 and p.bytes_done < p.bytes_total:
            return
        self.last = now
        if p.phase != "copying":
            self._write(f"{p.phase}...")
            return
        rate = p.bytes_done / p.elapsed if p.elapsed > 0 else 0
        left = (p.bytes_total - p.bytes_done) / rate if rate > 0 else 0
        pct = 100 * p.bytes_done / p.bytes_total if p.bytes_total else 100
        self._write(
            f"{pct:5.1f}%  {format_size(p.bytes_done)} / {format_size(p.bytes_total)}  "
            f"{p.files_done}/{p.files_total} files  {format_size(rate)}/s  ETA {int(left) // 60}:{int(left) % 60:02d}"
        )

    def _write(self, text: str) -> None:
        pad = max(0, self.width - len(text))
        click.echo("\r" + text + " " * pad, err=True, nl=False)
        self.width = len(text)

    def close(self) -> None:
        if self.width:
            click.echo("\r" + " " * self.width + "\r", err=True, nl=False)


def _log_waiting(p: Progress) -> None:
    """Not a terminal: no bar, but say why nothing happens while another stager copies."""
    if p.phase == "waiting":
        log(f"waiting for another shmstage (pid {p.holder or '?'}) staging this dataset...")


@click.command("stage")
@click.argument("src", type=click.Path(exists=False))
@click.option("--name", help="Dataset name under DEST. Default: the source's base name.")
@click.option(
    "--dest",
    envvar="SHMSTAGE_DEST",
    help="Where staged datasets live (a tmpfs, or local NVMe for data larger than RAM), or "
    "tiers fastest first, separated by commas: the first where the dataset fits is used. "
    f"Default: the node config's dest, else {DEFAULT_DEST}.",
)
@click.option(
    "--make-room",
    is_flag=True,
    help="Evict least-recently-used datasets no running job leases until this one fits "
    "(in the fastest tier where that is enough); refuse, removing nothing, if it cannot fit.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print which tier would be used and what would be evicted; copy and remove nothing.",
)
@config_option(
    "Node config whose dest tiers, cache settings (max_size) and reserve apply. "
    "Default: /etc/shmstage.yaml if it exists."
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    help="Copy processes. Default: 2 per CPU from a local disk, 4 per CPU (8 to 32) from a "
    "network file system. For s3://, gs://, az://: requests in flight, default 32.",
)
@click.option(
    "--verify",
    type=click.Choice(["size", "checksum"]),
    default="size",
    show_default=True,
    help="After copying, check sizes and mtimes (size) or compare every byte with the source (checksum).",
)
@click.option(
    "--reserve",
    type=RESERVE,
    help="Room to keep free for DataLoader shared memory: a size, or N% of DEST's file system. "
    "Default: the node config's reserve, else 10% of DEST, at most 4G.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Copy everything again, and replace a dataset of the same name from another source.",
)
@click.option(
    "--strip-components",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="Tar archives only: drop the first N path components of every member, like tar's "
    "option (1 turns an archive of one top folder into that folder's contents).",
)
@click.option(
    "--partial",
    is_flag=True,
    help="A directory larger than DEST (after the reserve and max_size): keep the largest part "
    "that fits in RAM, evicting nothing, and read the rest from the source through "
    "shmstage.loader.DatasetFiles. A dataset that fits is staged as without it.",
)
@cluster_options
@no_service_option
@click.option(
    "--lease-for",
    type=click.IntRange(min=1),
    metavar="PID",
    help="Hold a lease on the staged dataset until process PID exits, so nobody evicts it "
    "under the job: DATA=$(shmstage stage SRC --lease-for $$ -q) protects a batch script. "
    "A process of your own (root: any).",
)
@click.option(
    "--quiet",
    "-q",
    is_flag=True,
    help="Print only the staged path (no progress or summary on stderr).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (and nothing else)."
)
def stage_cmd(
    src: str,
    name: str | None,
    dest: str | None,
    make_room: bool,
    dry_run: bool,
    config_path: str | None,
    workers: int | None,
    verify: str,
    reserve: int | str | None,
    force: bool,
    strip_components: int,
    partial: bool,
    nodes: int | None,
    node_rank: int | None,
    rendezvous: str | None,
    timeout: float,
    inflight: int,
    no_service: bool,
    lease_for: int | None,
    quiet: bool,
    as_json: bool,
) -> None:
    """Stage SRC (a directory, tar archive or object-store prefix) into tmpfs; print the staged path.

    \b
    The path is the last line of stdout, so scripts can write:
      DATA=$(shmstage stage /nfs/imagenet --quiet)
    Staging an unchanged source again is a no-op; a changed one copies only what
    changed.  Several processes staging the same source share one copy.
    s3://BUCKET/PREFIX reads credentials and the endpoint from AWS_* or a
    ~/.aws profile (pip install 'shmstage[s3]'; docs/s3.md); gs://BUCKET/PREFIX
    from GOOGLE_* or the metadata server, az://CONTAINER/PREFIX from AZURE_*
    (docs/object-stores.md).

    With --nodes N (one shmstage per node), the nodes read SRC once between
    them and exchange the rest; every node publishes, or none.
    """
    from shmstage.service import api

    spec = cluster_spec(nodes, node_rank, rendezvous, timeout, inflight, dest, not no_service)
    dest, policies = configured(dest, config_path)
    if reserve is None:  # the option and its variable win over the node config
        reserve = node_reserve(config_path)
    if lease_for is not None:
        check_lease_for(lease_for)  # refused before anything is copied (a dry run says it too)
    if dry_run:
        p = api.plan(
            src, name=name, dest=dest, reserve=reserve, make_room=make_room, policies=policies,
            force=force, strip_components=strip_components, service=not no_service,
        )  # fmt: skip
        why = refusal(p.name, p.skipped) if p.tier is None else None
        if partial and isinstance(why, CapacityError):  # what a real --partial would keep
            part = resident.preview(src, name=name, dest=dest, reserve=reserve, policies=policies)
            click.echo(dumps(part) if as_json else _render_partial(part, p.name))
            return
        click.echo(dumps(p) if as_json else _render_plan(p))
        if isinstance(why, CapacityError) and spec is None:  # what the real run would say
            why = resident.offer(why, src, dest, reserve)
        if why is not None:
            raise api.refused(why, dest, not no_service)
        return
    if spec is not None and not no_service and not quiet:
        conn = api.service_for(dest)
        if conn is not None:  # issue 22 item 7
            log(
                f"note: staging with --nodes runs in this process, not through the shmstage "
                f"service on {conn.path}"
            )
    bar = ProgressLine() if not quiet and stderr_is_tty() else None
    progress = bar if bar is not None or quiet else _log_waiting
    try:
        with _peers(spec) if spec is not None else nullcontext() as peers:
            ds = api.stage(
                src,
                name=name,
                dest=dest,
                make_room=make_room,
                policies=policies,
                workers=workers,
                verify=verify,
                reserve=reserve,
                force=force,
                progress=progress,
                strip_components=strip_components,
                peers=peers,
                service=not no_service,
                **({"partial": True} if partial else {}),
            )
    except CapacityError as e:
        if partial or spec is not None:  # --partial refuses --nodes (resident.stage)
            raise
        raise resident.offer(e, src, dest, reserve) from None
    finally:
        if bar is not None:
            bar.close()
    if lease_for is not None:
        api.lease_until(ds.name, ds.tier, lease_for, service=not no_service)
    if as_json:
        click.echo(dumps(ds))
        return
    if not quiet:
        for line in _placement(ds, dest):
            log(line)
        log(summary(ds))
        note = disk_note(ds.tier)
        if note:
            log(note)
    click.echo(ds.path)


def _peers(spec: ClusterSpec) -> Peers:
    """The cluster's peers for ``--nodes`` (cluster/peers.py and its exchange load only here:
    ~20 ms a one-node stage does not spend)."""
    from shmstage.cluster import Peers

    return Peers(spec)


def _placement(ds: Placed, dest: str) -> list[str]:
    """Which tier, why faster ones were skipped, and what was evicted to make room."""
    lines = [f"skipped tier {s.tier}: {s.reason}" for s in ds.skipped]
    lines += [
        f"evicted {v.name} from {v.tier} to make room ({format_size(v.bytes)}, last used "
        f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(v.last_used))})"
        for v in ds.evicted
    ]
    lines += [f"note: {n}" for n in ds.notes]
    if "," in dest:
        lines.append(f"tier {ds.tier_index + 1} of {dest.count(',') + 1}: {ds.tier}")
    return lines


def _render_partial(part: resident.PartialPlan, name: str) -> str:
    share = part.bytes / part.total_bytes if part.total_bytes else 1.0
    return (
        f"{name} does not fit: --partial would keep {format_size(part.bytes)} "
        f"({part.files} of {part.total_files} files, {share:.0%} of {format_size(part.total_bytes)}) "
        f"in RAM at {part.tier}; jobs read the rest from the source"
    )


def _render_plan(p: Plan) -> str:
    lines = [f"would skip tier {s.tier}: {s.reason}" for s in p.skipped]
    if p.tier is None:
        return "\n".join(lines)
    lines += [
        f"would evict {v.name} from {v.tier} ({format_size(v.bytes)}, last used "
        f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(v.last_used))})"
        for v in p.evict
    ]
    if p.already_staged:
        how = (
            f"restage in place ({format_size(p.needed)} to copy)"
            if p.needed
            else "restage in place"
        )
    else:
        how = f"stage {format_size(p.needed)}"
    lines.append(f"would {how} into tier {(p.tier_index or 0) + 1}: {p.tier}/{p.name}")
    return "\n".join(lines)
