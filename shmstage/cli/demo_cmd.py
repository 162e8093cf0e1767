"""``shmstage demo``: the whole flow on a synthetic dataset, measured, in about a minute."""

from __future__ import annotations

import click

from shmstage.cli.output import emit, json_option, log
from shmstage.demo import DEFAULT_IMAGES, DEFAULT_SLOW_SOURCE_MBPS, DEFAULT_STEPS, MB
from shmstage.sizes import format_size


def _inspect_row(facts) -> str:  # noqa: ANN001 (InspectFacts | None)
    if facts is None:
        return "skipped (the inspection could not run)"
    text = facts.verdict
    if facts.findings:
        names = ", ".join(f.split(":", 1)[0] for f in facts.findings)
        text += f" ({names}: `shmstage inspect` explains each)"
    if facts.fit:
        text += f"; dataset {facts.fit}"
    return text


def _payback_row(pb, staging_s: float) -> str:  # noqa: ANN001 (Payback)
    epoch = (
        f"an epoch of {pb.epoch_images:,} images takes {pb.original_epoch_s:.1f} s from the "
        f"original, {pb.staged_epoch_s:.1f} s from the staged copy"
    )
    if pb.epochs is None:
        return f"staging {staging_s:.1f} s does not pay back here ({epoch})"
    return f"staging {staging_s:.1f} s pays back after {pb.epochs:.1f} epochs ({epoch})"


def _first_step_row(report) -> str:  # noqa: ANN001 (DemoReport)
    """How long the GPU waited before its first step, run by run."""

    def secs(run) -> str:  # noqa: ANN001 (DemoRun)
        return "?" if run.first_step_s is None else f"{run.first_step_s:.1f} s"

    text = (
        f"after {secs(report.original)} reading the original; {secs(report.staged)} staging "
        f"first ({report.staging.seconds:.1f} s of copy)"
    )
    if report.nowait is not None:
        text += f"; {secs(report.nowait)} with --no-wait"
    return text


def _rows(report) -> list[tuple[str, str]]:  # noqa: ANN001 (DemoReport)
    ds, node, st, pil = report.dataset, report.node, report.staging, report.pillow
    orig, staged = report.original.result, report.staged.result
    shm = (
        f"/dev/shm {format_size(node.shm_free)} free of {format_size(node.shm_total)}"
        if node.shm_total is not None
        else "no /dev/shm"
    )
    gpu = node.accelerator or "no GPU"
    if orig.device == "cpu":
        gpu += " (the CNN runs on 1 CPU core)"
    pillow = f"{pil.flavor} {pil.version or ''}".strip()
    if pil.libjpeg_turbo:
        pillow += ", libjpeg-turbo"
    pillow += "; CPU has AVX2" if pil.cpu_avx2 else "; CPU lacks AVX2"
    cache = report.original.cached_share
    if cache is None:
        warmth = "page cache state unknown"
    elif report.cold:
        warmth = f"{cache:.0%} in page cache: cold"
    elif cache > 0.5:
        warmth = f"{cache:.0%} in page cache: warm (--warm)"
    else:
        warmth = f"{cache:.0%} in page cache: mostly read from disk"
    pin = "on" if staged.pin_memory else "off"
    if not staged.pin_memory and staged.device == "cpu":
        pin += " (no GPU)"
    prefetch = f", prefetch_factor={staged.prefetch_factor}" if staged.prefetch_factor else ""
    mbps = report.slow_source.mbps
    throttled = (
        f"; reads throttled to {mbps:g} MB/s, standing in for network storage "
        "(--slow-source 0 to disable)"
        if mbps
        else ""
    )
    source = (
        f"{report.source_fstype} through the {mbps:g} MB/s throttle"
        if mbps
        else report.source_fstype
    )
    staging_rate = (
        f"{st.bytes_per_s / MB:.1f} MB/s from the throttled source"
        if mbps
        else f"{format_size(st.bytes_per_s)}/s"
    )

    def run(r) -> str:  # noqa: ANN001 (TrainResult)
        wait_ms = r.wait_seconds / max(1, r.steps) * 1000
        return (
            f"{r.images_per_s:,.0f} images/s, data stall {r.stall_share:.0%} "
            f"(waited {wait_ms:.0f} ms per step for data)"
        )

    rows = [
        ("node", f"{node.cpus} CPUs, {format_size(node.memory_usable)} RAM usable, {shm}, {gpu}"),
        ("inspect", _inspect_row(report.inspect)),
        ("Pillow", pillow),
        (
            "dataset",
            f"{ds.images:,} JPEGs in {ds.classes} classes, {format_size(ds.bytes)} "
            f"(avg {format_size(ds.bytes / ds.images)}) on {report.source_fstype}, "
            f"generated in {ds.seconds:.1f} s{throttled}",
        ),
        (
            "staging",
            f"{format_size(st.bytes)}, {st.files:,} files in {st.seconds:.2f} s = "
            f"{staging_rate} -> {st.dest} ({st.dest_fstype})",
        ),
        ("original run", f"{run(orig)}; read from {source}, {warmth}"),
        ("", f"$ {report.original.command}"),
        ("staged run", f"{run(staged)}; read from {st.dest_fstype}"),
        ("", f"$ {report.staged.command}"),
    ]
    if report.nowait is not None:
        rows += [
            (
                "no-wait run",
                f"{run(report.nowait.result)}; staged afresh while training: each file from "
                f"{st.dest_fstype} once landed, the rest asked of the copy first",
            ),
            ("", f"$ {report.nowait.command}"),
        ]
    rows += [
        ("first step", _first_step_row(report)),
        ("speed-up", f"{report.speedup:.2f}x images/s reading the staged copy"),
        ("pays back", _payback_row(report.payback, st.seconds)),
        (
            "loader settings",
            f"num_workers={staged.num_workers}, pin_memory={pin}{prefetch} "
            f"(make_loader's choice for {node.cpus} CPUs)",
        ),
    ]
    rows += [("note", note) for note in report.notes]
    rows += [("next" if n == 0 else "", line) for n, line in enumerate(report.next_steps)]
    if report.kept:
        rows.append(
            ("cleanup", f"kept {report.workdir} and {st.dest} (shmstage evict, rm -r to remove)")
        )
    else:
        rows.append(("cleanup", "removed the generated dataset and the staged copy"))
    return rows


def _render(report) -> None:  # noqa: ANN001 (DemoReport)
    orig = report.original.result
    click.echo(
        f"shmstage demo: {report.dataset.images:,} synthetic JPEGs; a tiny CNN trained "
        f"{orig.steps} steps x {orig.batch_size} images, once from the original, once "
        "from the staged copy"
        + (", once while staging (run --no-wait)" if report.nowait else "")
        + ".\n"
        "data stall = the share of each training step spent waiting for the next batch.\n"
    )
    rows = _rows(report)
    width = max(len(label) for label, _ in rows)
    click.echo(f"{'step'.ljust(width)}  result")
    click.echo(f"{'-' * width}  {'-' * 60}")
    for label, value in rows:
        click.echo(f"{label.ljust(width)}  {value}")


@click.command("demo")
@click.option(
    "--images",
    type=click.IntRange(min=32),
    default=DEFAULT_IMAGES,
    show_default=True,
    help="Synthetic JPEGs to generate (about 85 KB each).",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=DEFAULT_STEPS,
    show_default=True,
    help="Measured training steps per run (32 images each, after 3 warm-up steps).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    help="Where to generate the dataset. Default: a new directory under /var/tmp (on disk, not tmpfs).",
)
@click.option(
    "--keep",
    is_flag=True,
    help="Keep the generated dataset and the staged copy (a re-run with the same --workdir reuses them).",
)
@click.option(
    "--cold/--warm",
    default=True,
    show_default=True,
    help="--cold (default): evict the dataset's pages from the page cache before the original run and before staging, so both read the disk like a first epoch from NFS (only the demo's files; no root needed). --warm: leave them cached, so both runs read RAM.",
)
@click.option(
    "--slow-source",
    type=click.FloatRange(min=0),
    metavar="MBPS",
    help=f"Throttle every read of the original (staging and the original run) to MBPS MB/s "
    f"(10^6 bytes/s) with a cgroup read limit, standing in for network storage; 0: off. "
    f"Default: {DEFAULT_SLOW_SOURCE_MBPS:g} as root on a disk a blkio/io controller can throttle, "
    "else off (the table says why). Needs root and --cold.",
)
@json_option
def demo_cmd(
    images: int,
    steps: int,
    workdir: str | None,
    keep: bool,
    cold: bool,
    slow_source: float | None,
    as_json: bool,
) -> None:
    """Try the whole flow, measured, on a synthetic dataset.

    Generates a JPEG dataset on disk, inspects the node, stages the dataset
    (into /dev/shm/shmstage when it fits), and trains a tiny CNN three times
    through `shmstage run` with make_loader: once reading the original, once
    reading the staged copy, and once with `run --no-wait`, training while the
    copy is made. Prints one table: staging rate, images/s and data stall of
    each run, each run's time to its first step, after how many epochs staging
    pays back, the loader settings chosen, the Pillow build, and what to do
    next. As root the original is
    read through a cgroup read throttle (--slow-source), standing in for
    network storage. About a minute on 2 CPUs; needs torch, numpy and Pillow;
    works without root (unthrottled).
    """
    from shmstage.demo import run_demo  # imports nothing heavy; torch loads in the trainer

    report = run_demo(
        images=images,
        steps=steps,
        workdir=workdir,
        keep=keep,
        cold=cold,
        slow_source=slow_source,
        log=log,
    )
    emit(report, as_json, _render)
