"""``shmstage bench stage s3://...``: shmstage against s5cmd and ``aws s3 sync`` on your bucket.

Each tool copies the prefix into its own scratch directory under DEST, runs interleaved,
the median reported; every copy must hold the listed objects' count and bytes.  The tools
read the same AWS_* environment (the endpoint is passed to s5cmd and aws explicitly).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from shmstage.bench.stage import BenchError, StageBenchResult, tool_results, tree_summary
from shmstage.errors import RefusedError

S3_TOOLS: tuple[str, ...] = ("s5cmd", "aws", "shmstage")
S3_LABELS = {"s5cmd": "s5cmd cp", "aws": "aws s3 sync", "shmstage": "shmstage stage"}


def find_tool(tool: str) -> str | None:
    """The tool on PATH, else next to this Python (a venv with the bench-s3 extra)."""
    return shutil.which(tool) or shutil.which(tool, path=os.path.dirname(sys.executable))


def tool_argv(tool: str, url: str, dest: Path, exe: str, workers: int | None = None) -> list[str]:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    ep = ["--endpoint-url", endpoint] if endpoint else []
    if tool == "shmstage":
        w = ["--workers", str(workers)] if workers else []
        return [exe, "stage", url, "--dest", str(dest), "--name", "copy", "--quiet", *w]
    if tool == "s5cmd":
        return [exe, *ep, "cp", f"{url}/*", f"{dest}/copy/"]
    return [exe, "s3", "sync", "--quiet", *ep, url, f"{dest}/copy"]


def free_ports(n: int) -> list[int]:
    """``n`` consecutive free ports on 127.0.0.1 whose port + 10000 is free too (seaweedfs
    listens there for gRPC)."""
    import random
    import socket

    while True:
        base = random.randrange(20000, 35000)
        try:
            for p in range(base, base + n):
                for q in (p, p + 10000):
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", q))
            return list(range(base, base + n))
        except OSError:
            continue


def weed_server(weed: str, data: str | os.PathLike[str], *extra: str) -> tuple[list[str], int]:
    """The command line of a seaweedfs S3 server on 127.0.0.1 keeping its data in ``data``
    (``extra``: more flags, e.g. ``-s3.config=FILE``), and its S3 port."""
    s3, master, volume, filer = free_ports(4)
    argv = [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}", "-s3",
            f"-s3.port={s3}", f"-master.port={master}", f"-volume.port={volume}",
            f"-filer.port={filer}", "-volume.max=0", "-volume.preStopSeconds=0",
            "-s3.port.iceberg=0", "-s3.port.lance=0", *extra]  # fmt: skip
    return argv, s3


def _timed(argv: list[str], tool: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        detail = err[-1] if err else f"exit status {proc.returncode}"
        raise BenchError(f"{S3_LABELS[tool]} failed: {detail}")
    return time.perf_counter() - start


def run_s3_benchmark(
    url: str,
    dest_root: str | os.PathLike[str],
    tools: Sequence[str] = S3_TOOLS,
    runs: int = 3,
    *,
    workers: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> StageBenchResult:
    """Time each tool copying the prefix ``url`` ``runs`` times, interleaved."""
    from shmstage.stage.sources import kinds as sources

    kind, location = sources.resolve(url)
    if kind != "s3" and set(tools) - {"shmstage"}:
        raise RefusedError(
            f"s5cmd and aws read s3:// only: bench stage {kind}:// with --tools shmstage"
        )
    listing = sources.open_listed(kind, location).listing()  # the reference: count and bytes
    exes = {}
    for tool in tools:
        exe = find_tool(tool)
        if exe is None:
            raise RefusedError(f"{tool} is not installed: pip install 'shmstage[bench-s3]'")
        exes[tool] = exe
    say = progress or (lambda _msg: None)
    base = Path(dest_root).resolve()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".shmstage-bench-", dir=base))
    times: dict[str, list[float]] = {t: [] for t in tools}
    tools = tuple(tools)
    try:
        for i in range(runs):
            k = i % len(tools)
            for tool in tools[k:] + tools[:k]:
                dest = work / tool
                dest.mkdir()
                argv = tool_argv(tool, location, dest, exes[tool], workers)
                seconds = _timed(argv, tool)
                copy = dest / "copy"
                got = tree_summary(copy)
                if (got.files, got.bytes) != (listing.files, listing.bytes):
                    raise BenchError(
                        f"{S3_LABELS[tool]} made a wrong copy: {got.files} files, {got.bytes} bytes; "
                        f"{location} lists {listing.files}, {listing.bytes}"
                    )
                shutil.rmtree(dest)
                times[tool].append(seconds)
                say(f"run {i + 1}/{runs}  {S3_LABELS[tool]:<16} {seconds:8.3f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    commands = {t: " ".join(tool_argv(t, "SRC", Path("DEST"), t, workers)) for t in tools}
    results = tool_results(times, S3_LABELS, commands, listing.bytes, listing.files)
    return StageBenchResult(
        source=location, dest=str(base), files=listing.files, bytes=listing.bytes, runs=runs,
        drop_caches=False, throttle_bps=None, tools=tuple(results),
    )  # fmt: skip
