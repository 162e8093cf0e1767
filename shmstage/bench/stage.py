"""Staging speed: ``shmstage stage`` against ``cp -a``, ``rsync -a``, ``tar | tar`` and parallel ``cat``.

    from shmstage.bench.stage import run_stage_benchmark, format_markdown
    result = run_stage_benchmark("/data/imagenet", "/dev/shm/bench", runs=5, drop_caches=True)
    print(format_markdown(result))           # result.get("rsync").vs_shmstage -> 2.4

``run_stage_benchmark(src, dest_root, tools=TOOLS, runs=5, drop_caches=False, throttle_bps=None,
*, workers=None, cat_jobs=None, shmstage_cmd=None, check=True, progress=None) -> StageBenchResult``

Every tool copies SRC into a fresh directory under a private work directory in DEST_ROOT, as a
subprocess, timed from start to exit.  Tools run interleaved (round-robin, the order rotated each
round) so drift on a noisy machine hits them alike; each tool is summarized by the median of its
runs.  Before every run the page cache is dropped (``drop_caches=True``, root: every tool reads
from disk) or warmed by reading SRC once (every tool reads from RAM; needed because ``shmstage
stage`` evicts the source's pages after copying).  After every run the copy is checked against
SRC (``check``: same files, links, directories, bytes) and deleted, outside the timed region.
``cat`` reads every file into /dev/null in parallel: it writes nothing, so it is the reference
for reading (the targets compare against it), not a peer; nor is it the disk's own limit (fewer,
bigger reads can beat it on big files).

``tool_argv(tool, src, dest)`` gives the exact command each tool runs; ``format_markdown(result)``
renders a result as a Markdown table; ``tree_summary(path)`` counts what a copy must match.

``blkio_throttle(path, bps)`` (:mod:`shmstage.bench.throttle`, importable from here) is a context
manager that caps the read bandwidth of the block device under ``path`` for the processes put
into it (a cgroup v1 ``blkio`` group or a cgroup v2 ``io.max`` rule; root only);
``throttle_bps=N`` runs every tool inside one.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path

from shmstage.bench.throttle import Throttle as Throttle
from shmstage.bench.throttle import blkio_throttle
from shmstage.bench.throttle import block_device as block_device
from shmstage.bench.throttle import whole_disk as whole_disk
from shmstage.errors import PermissionDenied, RefusedError, ShmstageError
from shmstage.system import usable_cpus

TOOLS: tuple[str, ...] = ("cp", "rsync", "tar", "cat", "shmstage")
PEERS: tuple[str, ...] = ("cp", "rsync", "tar")  # copiers shmstage must beat; cat only reads
LABELS: dict[str, str] = {
    "cp": "cp -a",
    "rsync": "rsync -a",
    "tar": "tar | tar",
    "cat": "cat (reads only)",
    "shmstage": "shmstage stage",
    "baseline": "shmstage (baseline)",
}
_NEEDS = {
    "cp": ("cp",),
    "rsync": ("rsync",),
    "tar": ("tar", "bash"),
    "cat": ("find", "xargs", "cat", "bash"),
}
MB = 1_000_000  # MB/s as disks and throttles count it


class BenchError(ShmstageError):
    """A tool failed or produced a wrong copy during a benchmark."""


# --- results ------------------------------------------------------------------


@dataclass(frozen=True)
class TreeSummary:
    files: int
    bytes: int  # regular files only
    dirs: int  # below the root
    links: int


@dataclass(frozen=True)
class ToolResult:
    tool: str  # key in TOOLS
    label: str  # "rsync -a"
    command: str  # the shell form of what ran, with SRC and DEST as placeholders
    times: tuple[float, ...]  # seconds per run, in run order
    median_s: float
    mb_per_s: float  # source bytes / median, MB = 10**6
    files_per_s: float
    vs_shmstage: float | None  # this tool's median / shmstage's: > 1 means shmstage is faster


@dataclass(frozen=True)
class StageBenchResult:
    source: str
    dest: str
    files: int
    bytes: int
    runs: int
    drop_caches: bool
    throttle_bps: int | None
    tools: tuple[ToolResult, ...]

    def get(self, tool: str) -> ToolResult:
        for result in self.tools:
            if result.tool == tool:
                return result
        raise KeyError(tool)


# --- the benchmark ------------------------------------------------------------


def run_stage_benchmark(
    src: str | os.PathLike[str],
    dest_root: str | os.PathLike[str],
    tools: Sequence[str] = TOOLS,
    runs: int = 5,
    drop_caches: bool = False,
    throttle_bps: int | None = None,
    *,
    workers: int | None = None,
    cat_jobs: int | None = None,
    shmstage_cmd: Sequence[str] | None = None,
    check: bool = True,
    progress: Callable[[str], None] | None = None,
    baseline: str | os.PathLike[str] | None = None,
) -> StageBenchResult:
    """Time each tool copying ``src`` into ``dest_root`` ``runs`` times, interleaved; medians and
    ratios.  ``baseline``: a checkout whose ``shmstage`` the tool ``baseline`` runs (this one's
    earlier version, side by side)."""
    source = Path(src).resolve()
    dest_base = Path(dest_root).resolve()
    tools = tuple(tools)
    _validate(source, dest_base, tools, runs, drop_caches, throttle_bps)
    if "baseline" in tools and not (baseline and Path(baseline, "shmstage").is_dir()):
        raise RefusedError(
            f"the baseline tool needs baseline=CHECKOUT with a shmstage package, not {baseline}"
        )
    cmd_prefix = list(shmstage_cmd) if shmstage_cmd else default_shmstage_cmd()
    jobs = cat_jobs or max(8, 4 * usable_cpus())
    summary = tree_summary(source)
    per = cat_batch(summary.files, jobs)
    say = progress or (lambda _msg: None)
    times: dict[str, list[float]] = {t: [] for t in tools}

    created = not dest_base.exists()
    dest_base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".shmstage-bench-", dir=dest_base))
    with ExitStack() as stack:
        if created:
            stack.callback(_rmdir_quietly, dest_base)
        stack.callback(shutil.rmtree, work, True)
        throttle = (
            stack.enter_context(blkio_throttle(source, throttle_bps)) if throttle_bps else None
        )
        preexec = throttle.enter if throttle else None
        for i in range(runs):
            k = i % len(tools)
            for tool in tools[k:] + tools[:k]:
                dest = work / tool
                dest.mkdir()
                if drop_caches:
                    drop_page_cache()
                else:
                    _run(tool_argv("cat", source, dest, cat_jobs=jobs, cat_per=per), "cat", None)
                argv = tool_argv(
                    tool,
                    source,
                    dest,
                    cat_jobs=jobs,
                    cat_per=per,
                    shmstage_cmd=cmd_prefix,
                    workers=workers,
                    baseline=baseline,
                )
                seconds, out = _timed(argv, tool, preexec)
                if check and tool != "cat":
                    staged = tool in ("shmstage", "baseline")
                    copy = _staged_path(out, tool) if staged else dest
                    _check_copy(tool, summary, copy)
                shutil.rmtree(dest)
                times[tool].append(seconds)
                say(f"run {i + 1}/{runs}  {LABELS[tool]:<16} {seconds:8.3f} s")

    commands = {t: _display(t, jobs, per, workers) for t in tools}
    results = tool_results(times, LABELS, commands, summary.bytes, summary.files)
    return StageBenchResult(
        source=str(source),
        dest=str(dest_base),
        files=summary.files,
        bytes=summary.bytes,
        runs=runs,
        drop_caches=drop_caches,
        throttle_bps=throttle_bps,
        tools=tuple(results),
    )


def tool_results(
    times: dict[str, list[float]],
    labels: dict[str, str],
    commands: dict[str, str],
    nbytes: int,
    files: int,
) -> list[ToolResult]:
    """Medians, rates and each tool's ratio to shmstage's median, in ``times``' order."""
    base = statistics.median(times["shmstage"]) if "shmstage" in times else None
    results = []
    for tool, runs in times.items():
        med = statistics.median(runs)
        results.append(
            ToolResult(
                tool=tool,
                label=labels[tool],
                command=commands[tool],
                times=tuple(runs),
                median_s=med,
                mb_per_s=nbytes / med / MB if med > 0 else float("inf"),
                files_per_s=files / med if med > 0 else float("inf"),
                vs_shmstage=(med / base) if base else None,
            )
        )
    return results


def _validate(
    source: Path, dest: Path, tools: tuple[str, ...], runs: int, drop: bool, throttle: int | None
) -> None:
    if not source.is_dir():
        raise RefusedError(f"{source} is not a directory: give the dataset directory to benchmark")
    if dest == source or source in dest.parents:
        raise RefusedError(
            f"destination {dest} is inside the source {source}: pick a destination outside it"
        )
    unknown = [t for t in tools if t not in LABELS]
    if unknown or not tools or len(set(tools)) != len(tools):
        raise RefusedError(
            f"bad tool list {list(tools)}: choose distinct tools from {', '.join(TOOLS)}"
        )
    if runs < 1:
        raise RefusedError(f"runs must be at least 1, not {runs}")
    for tool in tools:
        for exe in _NEEDS.get(tool, ()):
            if shutil.which(exe) is None:
                raise RefusedError(
                    f"{exe} is not installed: install it or leave '{tool}' out of the tools"
                )
    if drop and os.geteuid() != 0:
        raise PermissionDenied(
            "dropping the page cache needs root: run as root or without drop_caches"
        )
    if throttle is not None:
        if throttle <= 0:
            raise RefusedError(
                f"throttle must be a positive number of bytes per second, not {throttle}"
            )
        if not drop:
            raise RefusedError(
                "a read throttle only shows with a cold page cache: also pass drop_caches=True"
            )


def default_shmstage_cmd() -> list[str]:
    exe = shutil.which("shmstage", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "shmstage"]


def tool_argv(
    tool: str,
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    cat_jobs: int = 8,
    cat_per: int = 64,
    shmstage_cmd: Sequence[str] | None = None,
    workers: int | None = None,
    baseline: str | os.PathLike[str] | None = None,
) -> list[str]:
    """The command that copies ``src`` into the existing directory ``dest`` with ``tool`` (cat: reads only,
    ``cat_jobs`` processes at once, ``cat_per`` files each: :func:`cat_batch`; baseline:
    the ``shmstage`` package of the checkout ``baseline``, by this interpreter)."""
    s, d = os.fspath(src), os.fspath(dest)
    if tool == "cp":
        return ["cp", "-a", f"{s}/.", d]
    if tool == "rsync":
        return ["rsync", "-a", f"{s}/", f"{d}/"]
    if tool == "tar":
        return [
            "bash",
            "-c",
            'set -o pipefail; tar -C "$1" -cf - . | tar -C "$2" -xf -',
            "bash",
            s,
            d,
        ]
    if tool == "cat":
        script = 'set -o pipefail; find "$1" -type f -print0 | xargs -0 -r -P "$2" -n "$3" cat > /dev/null'
        return ["bash", "-c", script, "bash", s, str(cat_jobs), str(cat_per)]
    if tool == "baseline":  # first on sys.path: ahead of the current directory's checkout
        prefix = [sys.executable, "-c", _FROM_CHECKOUT, os.fspath(baseline or ".")]
    elif tool != "shmstage":
        raise RefusedError(f"unknown tool '{tool}': choose from {', '.join(TOOLS)}")
    else:
        prefix = list(shmstage_cmd) if shmstage_cmd else default_shmstage_cmd()
    argv = [*prefix, "stage", s, "--dest", d, "--name", "bench", "--quiet"]
    return argv + (["--workers", str(workers)] if workers else [])


_FROM_CHECKOUT = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
    "runpy.run_module('shmstage', run_name='__main__', alter_sys=True)"
)


def cat_batch(files: int, jobs: int) -> int:
    """Files per ``cat`` so that ``jobs`` of them read at once: at most 64 (few processes to
    start), fewer where the tree has few files (4 shards: one each, all four read in parallel;
    64 would give one ``cat`` reading them one after the other)."""
    return max(1, min(64, -(-files // jobs)))


def _display(tool: str, jobs: int, per: int, workers: int | None) -> str:
    return {
        "cp": "cp -a SRC/. DEST",
        "rsync": "rsync -a SRC/ DEST/",
        "tar": "tar -C SRC -cf - . | tar -C DEST -xf -",
        "cat": f"find SRC -type f -print0 | xargs -0 -P {jobs} -n {per} cat > /dev/null",
        "shmstage": "shmstage stage SRC --dest DEST --quiet"
        + (f" --workers {workers}" if workers else ""),
        "baseline": "python -m shmstage stage SRC --dest DEST --quiet (BASELINE's shmstage)"
        + (f" --workers {workers}" if workers else ""),
    }[tool]


def _run(argv: list[str], tool: str, preexec: Callable[[], None] | None) -> str:
    proc = subprocess.run(argv, capture_output=True, preexec_fn=preexec)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        detail = err[-1] if err else f"exit status {proc.returncode}"
        raise BenchError(f"{LABELS[tool]} failed: {detail}")
    return proc.stdout.decode(errors="replace")


def _timed(argv: list[str], tool: str, preexec: Callable[[], None] | None) -> tuple[float, str]:
    start = time.perf_counter()
    out = _run(argv, tool, preexec)
    return time.perf_counter() - start, out


def _staged_path(stdout: str, tool: str) -> Path:
    lines = stdout.strip().splitlines()
    if not lines:
        raise BenchError(f"{LABELS[tool]} printed no staged path on stdout")
    return Path(lines[-1].strip())


def _check_copy(tool: str, want: TreeSummary, copy: Path) -> None:
    got = tree_summary(copy)
    if got != want:
        raise BenchError(
            f"{LABELS[tool]} made a wrong copy at {copy}: {got.files} files, {got.bytes} bytes, "
            f"{got.dirs} dirs, {got.links} links; the source has {want.files}, {want.bytes}, "
            f"{want.dirs}, {want.links}"
        )


def tree_summary(root: str | os.PathLike[str]) -> TreeSummary:
    """Count regular files (and their bytes), directories and symlinks below ``root``; links not followed."""
    files = size = dirs = links = 0
    stack = [os.fspath(root)]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_symlink():
                    links += 1
                elif entry.is_dir(follow_symlinks=False):
                    dirs += 1
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    files += 1
                    size += entry.stat(follow_symlinks=False).st_size
    return TreeSummary(files, size, dirs, links)


def drop_page_cache(proc: str = "/proc") -> None:
    """Write dirty pages back, then drop clean page cache, dentries and inodes (root only)."""
    os.sync()
    try:
        Path(proc, "sys/vm/drop_caches").write_text("3\n")
    except PermissionError:
        raise PermissionDenied(
            "dropping the page cache needs root: run as root or without drop_caches"
        ) from None


def _rmdir_quietly(path: Path) -> None:
    with suppress(OSError):  # not empty: someone else put files there
        path.rmdir()


# --- rendering ----------------------------------------------------------------


def format_markdown(result: StageBenchResult) -> str:
    """One Markdown table: a row per tool with median, spread, MB/s, files/s and shmstage's speedup."""
    lines = [
        "| tool | median s | runs min–max s | MB/s | files/s | shmstage speedup |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result.tools:
        ratio = "—" if r.tool == "shmstage" or r.vs_shmstage is None else f"{r.vs_shmstage:.2f}×"
        lines.append(
            f"| {_md(r.label)} | {r.median_s:.2f} | {min(r.times):.2f}–{max(r.times):.2f} | "
            f"{r.mb_per_s:,.0f} | {r.files_per_s:,.0f} | {ratio} |"
        )
    return "\n".join(lines)


def _md(text: str) -> str:
    return text.replace("|", r"\|")  # a bare pipe would split the table cell
