"""The node service's cost: the latency it adds to a no-op `stage` and to `run --stage`, and
staging throughput through it, each side by side with the same command in-process.

    .venv/bin/python benchmarks/service.py --runs 5 --write-docs    # as root

As root, in a private mount namespace: a tmpfs for the store, a node config naming it, and a
real `shmstage serve` on a socket in a temporary directory.  Commands are the real CLI, run as
a fresh process each time (what a job script pays); in-process runs pass `--no-service`.

- ``no-op stage``: the ImageNet-like tree (benchmarks/stage.py's generator) already staged;
  `shmstage stage SRC -q` again, warm page cache.  Root in-process vs root through the
  service, and an ordinary user through the service (reads as that user, plus the check that
  the user may read every file), interleaved.
- ``run --stage``: `shmstage run --stage SRC -- true` on the staged tree, the same pairs.
- ``throughput``: the first copy of the tree into an empty store, page cache dropped before
  each run; in-process vs through the service (as root, and as an ordinary user).

Medians of ``--runs``; the targets (issue 22): added latency under 50 ms, throughput within 5%.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stage as stage_bench  # noqa: E402  (benchmarks/stage.py: the datasets, the tmpfs)

from shmstage.bench.stage import drop_page_cache  # noqa: E402
from shmstage.sizes import format_size  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHMSTAGE = [str(Path(sys.executable).parent / "shmstage")]
USER = 65534  # nobody: an ordinary user with no rights on the source but o+r


def log(msg: str) -> None:
    print(f"[service-bench] {msg}", file=sys.stderr, flush=True)


def as_user(uid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"Error: {' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return took


class Service:
    """A real `shmstage serve` on a socket of its own, stopped with SIGTERM."""

    def __init__(self, config: Path, sock: Path) -> None:
        self.sock = sock
        self.proc = subprocess.Popen(
            [*SHMSTAGE, "serve", "--socket", str(sock), "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=open(sock.parent / "serve.log", "ab"),  # noqa: SIM115 - lives as long as it
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"Error: shmstage serve exited ({self.proc.returncode})")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(sock))
                return
            except OSError:
                time.sleep(0.05)
        raise SystemExit("Error: shmstage serve did not answer within 30 s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0, help="dataset size factor (1 = 20k files)")
    ap.add_argument("--workdir", default="/var/tmp/shmstage-bench", help="where the source tree lives")
    ap.add_argument("--write-docs", action="store_true", help="replace the section in docs/benchmarks.md")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("Error: run as root: the service and the private tmpfs need it")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ds = stage_bench.datasets(args.scale)["imagenet"]
    src = stage_bench.ensure_dataset(ds, workdir)
    for p in [workdir, *workdir.parents]:  # the ordinary user must reach the source
        os.chmod(p, os.stat(p).st_mode | 0o005)
    stage_bench.enter_private_mount_namespace()
    tmp = Path(tempfile.mkdtemp(prefix="shmstage-service-bench-"))
    os.chmod(tmp, 0o755)
    try:
        store = tmp / "tmpfs"
        stage_bench.mount_tmpfs(store, int(ds.approx_bytes * 2.5) + (512 << 20))
        dest = store / "shmstage"
        config = tmp / "node.yaml"
        config.write_text(f"dest: {dest}\nreserve: 0\n")
        sock = tmp / "run" / "shmstage.sock"
        sock.parent.mkdir()
        env = {**os.environ, "SHMSTAGE_CONFIG": str(config), "SHMSTAGE_SOCKET": str(sock)}
        rows = run_all(args.runs, str(src), str(dest), config, sock, env)
        text = render(rows, args, ds)
        print(text)
        if args.write_docs:
            write_docs(REPO / "docs" / "benchmarks.md", text)
    finally:
        subprocess.run(["umount", "-l", str(tmp / "tmpfs")], check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def run_all(
    runs: int, src: str, dest: str, config: Path, sock: Path, env: dict[str, str]
) -> list[tuple[str, float, float, float | None]]:
    svc = Service(config, sock)
    try:
        stage = [*SHMSTAGE, "stage", src, "--dest", dest, "-q"]
        run = [*SHMSTAGE, "run", "--stage", src, "--dest", dest, "--", "true"]
        timed(stage + ["--no-service"], env)  # staged once; the rest are no-ops
        timed(as_user(USER) + stage, env)  # the user's first check (then cached, if it is)
        lat: dict[str, list[float]] = {k: [] for k in ("si", "ss", "su", "ri", "rs", "ru")}
        for _ in range(runs):
            lat["si"].append(timed(stage + ["--no-service"], env))
            lat["ss"].append(timed(stage, env))
            lat["su"].append(timed(as_user(USER) + stage, env))
            lat["ri"].append(timed(run[:4] + ["--no-service"] + run[4:], env))
            lat["rs"].append(timed(run, env))
            lat["ru"].append(timed(as_user(USER) + run, env))
        thr: dict[str, list[float]] = {"i": [], "s": [], "u": []}
        size = sum(f.stat().st_size for f in Path(src).rglob("*") if f.is_file())
        for _ in range(runs):
            for key, argv in (
                ("i", stage + ["--no-service"]),
                ("s", stage),
                ("u", as_user(USER) + stage),
            ):
                subprocess.run([*SHMSTAGE, "evict", "--all", "--force", "--dest", dest,
                                "--no-service"], env=env, check=False,
                               stdout=subprocess.DEVNULL)  # fmt: skip
                drop_page_cache()
                thr[key].append(size / timed(argv, env))
        log(f"throughput (MB/s): {[round(x / 1e6) for x in thr['i']]} in-process, "
            f"{[round(x / 1e6) for x in thr['s']]} service, {[round(x / 1e6) for x in thr['u']]} user")  # fmt: skip
    finally:
        svc.stop()
    si, ri = median_ms(lat["si"]), median_ms(lat["ri"])
    ti = statistics.median(thr["i"])
    return [
        ("no-op `stage`, root, in-process", si, 0.0, None),
        ("no-op `stage`, root, through the service", median_ms(lat["ss"]), median_ms(lat["ss"]) - si, None),
        ("no-op `stage`, ordinary user, through the service", median_ms(lat["su"]),
         median_ms(lat["su"]) - si, None),  # fmt: skip
        ("`run --stage ... -- true`, root, in-process", ri, 0.0, None),
        ("`run --stage`, root, through the service", median_ms(lat["rs"]), median_ms(lat["rs"]) - ri, None),
        ("`run --stage`, ordinary user, through the service", median_ms(lat["ru"]),
         median_ms(lat["ru"]) - ri, None),  # fmt: skip
        ("first copy, root, in-process (MB/s)", ti / 1e6, 0.0, 1.0),
        ("first copy, root, through the service (MB/s)", statistics.median(thr["s"]) / 1e6, 0.0,
         statistics.median(thr["s"]) / ti),  # fmt: skip
        ("first copy, ordinary user, through the service (MB/s)", statistics.median(thr["u"]) / 1e6,
         0.0, statistics.median(thr["u"]) / ti),  # fmt: skip
    ]


def render(rows: list[tuple[str, float, float, float | None]], args: argparse.Namespace, ds) -> str:
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    out = [
        "## The node service (issue 22)",
        "",
        f"`benchmarks/service.py --runs {args.runs}` ({when}, {stage_bench.machine()}): "
        f"{ds.files} files, {format_size(ds.approx_bytes)} ImageNet-like tree; medians of "
        f"{args.runs} interleaved runs; each command a fresh process. Targets: under 50 ms "
        "added to a no-op `stage` and to `run --stage`; the first copy within 5% of in-process.",
        "",
        "| what | median | added by the service | vs in-process |",
        "|---|---:|---:|---:|",
    ]
    for what, value, added, ratio in rows:
        if ratio is None:
            out.append(f"| {what} | {value:.0f} ms | {added:+.0f} ms | |")
        else:
            out.append(f"| {what} | {value:.0f} | | {ratio:.1%} |")
    return "\n".join(out) + "\n"


def write_docs(path: Path, text: str) -> None:
    """Replace the section from its heading to the next '## ' (or append it)."""
    doc = path.read_text()
    head = text.splitlines()[0]
    if head in doc:
        start = doc.index(head)
        nxt = doc.find("\n## ", start + len(head))
        doc = doc[:start] + text + (doc[nxt + 1 :] if nxt != -1 else "")
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    path.write_text(doc)


if __name__ == "__main__":
    sys.exit(main())
