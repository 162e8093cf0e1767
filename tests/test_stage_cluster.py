"""Cluster staging with real "nodes": 4 processes, each in its own mount namespace with its
own tmpfs at DEST and its own read-only direct-I/O loop device of one ext4 image mounted at
SRC, so no two nodes share a page cache for the source (as NFS clients do not).  The
sectors read from the loop devices are the source traffic."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shmstage.cluster import PORT_PROBE, first_host, resolve, slurm_port
from shmstage.cluster.plan import CRC, make_plan
from shmstage.errors import RefusedError

NODES = 4


# --- pure logic --------------------------------------------------------------------------


def test_plan_shares_are_equal_bytes_and_cover_every_byte_once() -> None:
    """Shares differ by at most a byte; every byte of every file is in exactly one segment."""
    files = [(f"f{i}", (i * 7919) % 50_000) for i in range(200)] + [("big", 3_000_000)]
    plan = make_plan(files, 3, 256 << 10)
    sizes = [e - s for s, e in (plan.share(r) for r in range(3))]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == plan.total
    covered: dict[int, int] = {}
    for r in range(3):
        for k in range(plan.pieces):
            a, b = plan.piece_range(r, k)
            segs = plan.segments(r, k)
            assert sum(s.length for s in segs) == b - a
            assert plan.size(r, k) == b - a + CRC * len(segs)
            for s in segs:
                covered[s.file] = covered.get(s.file, 0) + s.length
    assert covered == {i: size for i, (_, size) in enumerate(plan.files)}
    big = plan.files.index(("big", 3_000_000))
    owners = {
        r
        for r in range(3)
        for k in range(plan.pieces)
        for s in plan.segments(r, k)
        if s.file == big
    }
    assert len(owners) > 1  # a big file is read by several nodes


def test_a_gloo_error_becomes_a_line_without_its_source_location_or_sign_off() -> None:
    from shmstage.cluster.waits import first_line

    loc = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] "
    assert first_line(RuntimeError(loc + "Connection closed by peer [1.2.3.4]:5")) == (
        "Connection closed by peer [1.2.3.4]:5"
    )
    assert first_line(RuntimeError(f"Gloo connectFullMesh failed with {loc}timed out")) == (
        "Gloo connectFullMesh failed with timed out"
    )
    assert first_line(RuntimeError(loc + "Read error [1.2.3.4]:5: GLHF! x\nmore")) == (
        "Read error [1.2.3.4]:5"
    )
    assert first_line(RuntimeError("")) == "RuntimeError"


def test_resolve_defaults_from_slurm_and_refuses_what_is_missing() -> None:
    """--nodes 1 / unset is today's single-node path; Slurm fills in the rank and the host."""
    assert resolve(None, None, None, environ={}) is None
    assert resolve(1, None, None, environ={"SLURM_NODEID": "3"}) is None
    env = {"SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1"}
    spec = resolve(4, None, None, environ=env)
    assert (spec.rank, spec.host, spec.port) == (2, "gpu07", 29450)
    assert resolve(4, 1, "10.0.0.5:1234", environ=env).port == 1234
    with pytest.raises(RefusedError, match="needs this node's --node-rank"):
        resolve(4, None, "h", environ={})
    with pytest.raises(RefusedError, match="needs --rendezvous"):
        resolve(4, 0, None, environ={})
    with pytest.raises(RefusedError, match="must be 0 to 3"):
        resolve(4, 4, "h", environ={})
    assert first_host("n1,n2") == "n1" and first_host("a[3]") == "a3"
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}
    assert resolve(4, 1, "h", environ=slurm).job == "Slurm job 7 step 0"


# A task of `srun -N 4 --ntasks-per-node=1` on nodes gpu[07-10] (job 7, step 2), node 1.
_STEP = {
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_ID": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[05-10]",
    "SLURM_STEP_NODELIST": "gpu[07-10]",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
}


@pytest.mark.parametrize(
    ("change", "nodes"),
    [
        ({}, 4),  # one task per node on 4 nodes: all 4 stage together
        ({"SLURM_STEP_NUM_TASKS": None}, 4),  # the per-node count alone says 1
        ({"SLURM_STEP_NUM_TASKS": "32", "SLURM_STEP_TASKS_PER_NODE": "8(x4)"}, None),  # run --stage
        ({"SLURM_STEP_NUM_TASKS": "5", "SLURM_STEP_TASKS_PER_NODE": "2,1(x3)"}, None),
        ({"SLURM_STEP_NUM_TASKS": None, "SLURM_STEP_TASKS_PER_NODE": "2,1(x3)"}, None),
        ({"SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1"}, None),  # one node
        ({"SLURM_STEP_ID": None}, None),  # a batch script's shell (no step)
        ({"SLURM_STEP_ID": "batch"}, None),
        ({"SLURM_STEP_ID": "interactive"}, None),  # salloc's interactive step
    ],
)
def test_nodes_default_to_a_slurm_step_with_one_task_per_node(change, nodes) -> None:
    """--nodes unset: a step's one task per node on several nodes stages together, ranked
    and met by the step's list; anything else (several tasks on a node, a batch script's
    shell, one node) stages alone as without Slurm."""
    env = {k: v for k, v in {**_STEP, **change}.items() if v is not None}
    spec = resolve(None, None, None, environ=env)
    if nodes is None:
        assert spec is None
        return
    assert (spec.nodes, spec.rank, spec.host) == (nodes, 1, "gpu07")  # the step's node 0
    assert spec.port == slurm_port(env) == 30000 + (7 * 16 + 2) % 2048
    assert spec.job == "Slurm job 7 step 2"
    assert spec.ports == PORT_PROBE  # derived: where node 0 starts looking


def test_a_derived_port_is_probed_and_a_given_one_is_exact() -> None:
    """Jobs 128 apart (or step 16 and the next job's step 0) derive one port: the port is
    only the first node 0 tries.  A port given (flag or environment) is exactly that one."""
    jobs = [slurm_port({"SLURM_JOB_ID": str(j), "SLURM_STEP_ID": "0"}) for j in (521, 649)]
    assert jobs[0] == jobs[1]
    assert resolve(None, None, None, environ=_STEP).ports == PORT_PROBE
    assert resolve(2, 0, "head", environ={}).ports == PORT_PROBE  # 29450 and after
    assert resolve(None, None, "head:1234", environ=_STEP).ports == 1
    assert resolve(2, 0, "head:29450", environ={}).ports == 1


def test_slurm_defaults_yield_to_the_flags() -> None:
    """--nodes 1 stages alone in a step; given flags win over Slurm's variables; a port
    given wins over the job's; the port differs between jobs and between steps."""
    assert resolve(1, None, None, environ=_STEP) is None
    spec = resolve(2, 0, "head", environ=_STEP)
    assert (spec.nodes, spec.rank, spec.host) == (2, 0, "head")
    assert resolve(None, None, "head:1234", environ=_STEP).port == 1234
    assert resolve(None, 3, None, environ=_STEP).rank == 3
    ports = {slurm_port({"SLURM_JOB_ID": str(j), "SLURM_STEP_ID": str(s)})
             for j in range(100, 228) for s in range(16)}  # fmt: skip
    assert len(ports) == 2048 and min(ports) >= 30000 and max(ports) < 32768
    # a batch script's --nodes (no step): the job's list, the job's port (step 0)
    batch = {k: v for k, v in _STEP.items() if not k.startswith("SLURM_STEP")}
    spec = resolve(6, None, None, environ=batch)
    assert (spec.host, spec.port) == ("gpu05", 30000 + 7 * 16)


def test_a_slurm_node_count_yields_to_the_nodes_service(monkeypatch) -> None:
    """stage/run: a node count only the step gave stages through a service that answers
    (each node alone, as the job's user could not write root's store in-process); a
    --nodes given, or --no-service, still stages together."""
    from shmstage.cli.params import cluster_spec
    from shmstage.service import api

    for k, v in _STEP.items():
        monkeypatch.setenv(k, v)
    answers = {"yes": True}
    monkeypatch.setattr(
        api, "service_for", lambda dest, service: "conn" if answers["yes"] and service else None
    )
    assert cluster_spec(None, None, None, 60.0, 1 << 20, None, True) is None
    assert cluster_spec(4, None, None, 60.0, 1 << 20, None, True).nodes == 4
    assert cluster_spec(None, None, None, 60.0, 1 << 20, None, False).nodes == 4
    answers["yes"] = False
    assert cluster_spec(None, None, None, 60.0, 1 << 20, "/d", True).nodes == 4


def test_run_takes_a_slurm_node_count_only_to_stage_and_not_for_no_wait(
    monkeypatch, runner, cli
) -> None:
    """`run --stage` in a step of one task per node stages together; `run` with nothing to
    stage, and `run --no-wait` (its job reads the copy as it is made), only with --nodes."""
    from types import SimpleNamespace

    from shmstage import launch
    from shmstage.service import api

    for k, v in _STEP.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(api, "service_for", lambda dest, service: None)
    seen = []

    def run(command, **kw):
        seen.append(kw["cluster"].nodes if kw["cluster"] is not None else None)
        return SimpleNamespace(signal=None, returncode=0)

    monkeypatch.setattr(launch, "run", run)
    for args in (["--stage", "/src"], ["--stage", "/src", "--no-wait"], [],
                 ["--stage", "/src", "--no-wait", "--nodes", "2", "--node-rank", "1"]):  # fmt: skip
        result = runner.invoke(cli, ["run", *args, "--", "true"])
        assert result.exit_code == 0, result.output
    assert seen == [4, None, None, 2]


def test_a_rank_claimed_twice_makes_every_node_of_the_job_refuse() -> None:
    """Two processes started as node 1 of one job (real sockets, node 0's store): the
    second is refused, and node 0 stops with the same line instead of mixing them in."""
    from shmstage.cluster.kv import Mismatch
    from shmstage.cluster.rendezvous import Rendezvous

    port = _free_ports(1)[0]
    node0 = Rendezvous("127.0.0.1", port, 2, 0, timeout=5.0)
    first = Rendezvous("127.0.0.1", port, 2, 1, timeout=5.0)
    second = Rendezvous("127.0.0.1", port, 2, 1, timeout=5.0)
    try:
        node0.connect(job="source /src")
        first.connect(job="source /src")
        with pytest.raises(Mismatch, match="two nodes started as node 1 of 2"):
            second.connect(job="source /src")
        with pytest.raises(Mismatch, match="two nodes started as node 1 of 2"):
            node0.allgather("tree", b"x")
        other = Rendezvous("127.0.0.1", port, 2, 1, timeout=5.0)
        with pytest.raises(Mismatch, match="belongs to another job"):
            other.connect(job="source /elsewhere")
    finally:
        for rv in (second, first, node0):
            rv.close(failed=True)


def test_two_jobs_that_derive_one_port_each_find_their_own_node_0() -> None:
    """Real sockets: job A's node 0 holds the derived port; job B's node 0 takes the next
    free one (a third listener holds one more in between); each job's node 1 joins its
    own store, whatever the order.  With an exact port, B's node 0 is refused as before."""
    from shmstage.cluster.rendezvous import Rendezvous

    port = _free_ports(1)[0]
    squatter = socket.create_server(("127.0.0.1", port + 1))  # something else holds port + 1
    a0, b0, a1, b1 = (
        Rendezvous("127.0.0.1", port, 2, rank, timeout=20.0, ports=4) for rank in (0, 0, 1, 1)
    )
    exact = Rendezvous("127.0.0.1", port, 2, 0, timeout=5.0)
    try:
        b1_joined = threading.Thread(target=b1.connect, kwargs={"job": "source /b Slurm job 2"})
        b1_joined.start()  # before its node 0: it keeps looking along the range
        a0.connect(job="source /a Slurm job 1")
        a1.connect(job="source /a Slurm job 1")
        b0.connect(job="source /b Slurm job 2")
        b1_joined.join(30)
        assert (a0.port, a1.port, b0.port, b1.port) == (port, port, port + 2, port + 2)
        assert sorted(a0.server.claimed) == sorted(b0.server.claimed) == [0, 1]
        with pytest.raises(Exception, match=f"port {port} in use"):
            exact.connect(job="source /c")
    finally:
        squatter.close()
        for rv in (b1, b0, a1, a0):
            rv.close(failed=True)


def test_a_hung_node_is_named_as_soon_as_the_exchange_fails() -> None:
    """Node 2 stops beating (hung); node 1's exchange fails: node 1 names node 2 at once.
    Before, it went on looking for 3 heartbeats (on every node of a ring, one after the
    other: ~7 s past --timeout), and a failure node 0 reported meanwhile was named instead."""
    pytest.importorskip("torch.distributed", reason="cluster staging needs torch")
    from shmstage.cluster.rendezvous import HEARTBEAT, Rendezvous

    port = _free_ports(1)[0]
    rvs = [Rendezvous("127.0.0.1", port, 3, r, timeout=10.0) for r in range(3)]
    try:
        for rv in rvs:
            rv.connect(job="source /src")
        rvs[2].beating.set()  # node 2 hangs: its heartbeat stops
        deadline = time.monotonic() + 60
        while (rvs[1].store.status()[2]["quiet"] or 0) <= 2 * HEARTBEAT:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        later = threading.Timer(1.5, rvs[0].report, ("a failure of node 0's own",))
        later.start()
        try:
            line = str(rvs[1].lost(RuntimeError("gloo: timed out")))
        finally:
            later.join()
        assert "lost node 2 of 3" in line and "no sign of life" in line, line
    finally:
        for rv in reversed(rvs):
            rv.close(failed=True)


# --- real nodes --------------------------------------------------------------------------


def _free_ports(n: int) -> list[int]:
    """``n`` different ports free right now (bound together, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _sectors_read(dev: str) -> int:
    return int(Path(f"/sys/block/{os.path.basename(dev)}/stat").read_text().split()[2])


class Cluster:
    """An ext4 image of ``data`` attached as NODES read-only direct-I/O loop devices."""

    def __init__(self, base: Path, data: Path, procs) -> None:
        self.base, self.procs = base, procs
        self.src = base / "src"  # every node mounts its loop device here
        self.dest = base / "shm"  # every node mounts its own tmpfs here
        self.src.mkdir()
        self.dest.mkdir()
        self.image = base / "image.ext4"
        subprocess.run(
            [
                "mkfs.ext4",
                "-q",
                "-F",
                "-d",
                str(data),
                "-O",
                "^has_journal",
                str(self.image),
                "96M",
            ],
            check=True,
        )
        self.devs: list[str] = []
        self.bytes = sum(p.stat().st_size for p in data.rglob("*") if p.is_file())

    def attach(self) -> None:
        for _ in range(NODES):
            out = subprocess.run(
                ["losetup", "--find", "--show", "--read-only", "--direct-io=on", str(self.image)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            self.devs.append(out.stdout.strip())

    def detach(self) -> None:
        for dev in self.devs:
            subprocess.run(["losetup", "-d", dev], check=False)

    def start(self, body: str, nodes: int = NODES, env=None, per_node=None, args="", port=None):
        """Start ``nodes`` nodes: each mounts its loop device at SRC and a tmpfs at DEST in a
        mount namespace of its own, then runs the shell ``body`` there, in which $STAGE is
        the `shmstage stage` of that node (``args`` added), $ALONE the same without
        --nodes, $EXE shmstage, $RANK the node's rank and $CLUSTER its cluster flags.
        ``per_node``: shell run first on that rank (e.g. to set variables).  The unshare happens in a wrapper before exec: unshare(2) in a threaded
        Python process would move only the calling thread."""
        free, port2 = _free_ports(2)
        self.port = port = port or free  # ``port``: node 0's rendezvous, else a free one
        exe = shutil.which("shmstage", path=os.path.dirname(sys.executable)) or "shmstage"
        alone = f"{exe} stage {self.src} --name data --dest {self.dest} --reserve 0 --quiet {args}"
        out = []
        for rank in range(nodes):
            stage = f"{alone} --nodes {nodes} --node-rank {rank} --rendezvous 127.0.0.1:{port}"
            script = (
                f"mount -o ro,noload {self.devs[rank]} {self.src} || exit 90; "
                f"mount -t tmpfs -o size=256M shmstage-test {self.dest} || exit 91; "
                f"{(per_node or {}).get(rank, '')}"
                f'STAGE="{stage}"; ALONE="{alone}"; PORT2={port2}; EXE={exe}; RANK={rank}; '
                f'CLUSTER="--nodes {nodes} --node-rank {rank} --rendezvous 127.0.0.1:{port}"; '
                f"{body}"
            )
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
            out.append(
                self.procs.start(
                    argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    env={**os.environ, **(env or {})},
                    start_new_session=True,  # killed with its shmstage when the test ends
                )
            )  # fmt: skip
        return out

    def read(self) -> int:
        """Bytes read from all loop devices so far."""
        return 512 * sum(_sectors_read(d) for d in self.devs)

    def source_digest(self) -> str:
        """DIGEST of the source as the nodes see it (the image keeps mtimes to the second)."""
        script = f"mount -o ro,noload {self.devs[0]} {self.src} && " + DIGEST.format(root=self.src)
        return subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip

    def metadata(self) -> int:
        """Bytes every node reads whatever it stages: mounting and walking the image
        (bitmaps, inode tables, directories; ~1.2 MB here, a fixed cost per node)."""
        before = self.read()
        for dev in self.devs:
            script = (
                f"mount -o ro,noload {dev} {self.src} && find {self.src} -printf '%s %m %T@\\n'"
            )
            subprocess.run(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                check=True, capture_output=True,
            )  # fmt: skip
        return self.read() - before


# What a node prints about its copy: every file's checksum, every entry's kind, mode, mtime
# and link target (not the root's mode: a copy of a source under a 0700 directory is 0700).
DIGEST = (
    "(cd {root} && find . -type f -print0 | sort -z | xargs -0 sha1sum && "
    "find . -mindepth 1 -printf '%p %y %m %T@ %l\\n' | sort)"
)


@pytest.fixture
def cluster(tmp_path: Path, procs):
    if os.geteuid() != 0 or not shutil.which("losetup") or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root, losetup and mkfs.ext4")
    pytest.importorskip("torch.distributed", reason="cluster staging needs torch")
    data = tmp_path / "data"
    rng = __import__("random").Random(13)
    for d in range(8):
        (data / f"class{d}").mkdir(parents=True)
        for i in range(40):
            (data / f"class{d}" / f"img{i}.jpg").write_bytes(rng.randbytes(rng.randint(1, 60_000)))
    (data / "big.bin").write_bytes(rng.randbytes(6 << 20))
    (data / "empty").write_bytes(b"")
    (data / "link").symlink_to("class0/img1.jpg")
    c = Cluster(tmp_path, data, procs)
    try:
        c.attach()
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot attach loop devices: {e.stderr}")
    c.data = data
    yield c
    c.detach()


def _when_writing(cluster: Cluster, node) -> int:
    """The pid of ``node``'s shmstage once it has written data into its partial copy of the
    dataset (``data``), which only the exchange does: blocks allocated (a big file is created
    at its full size, sparse, before), in partial/data (partial/.data.source, its record, is
    written before the exchange too)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{node.pid}/task/{node.pid}/children").read_text().split()
        if kids:
            top = f"{cluster.dest}/.shmstage/partial/data"
            find = ["find", top, "-type", "f", "-printf", "%b\n"]
            blocks = subprocess.run(
                ["nsenter", "-t", kids[0], "-m", *find], capture_output=True, text=True
            ).stdout.split()
            if any(int(b) > 0 for b in blocks):
                return int(kids[0])
        time.sleep(0.1)
    raise AssertionError("the node never started writing")


def _wait_all(nodes, timeout: float = 120) -> list[tuple[int, str, str]]:
    out = []
    for p in nodes:
        so, se = p.communicate(timeout=timeout)
        out.append((p.returncode, so, se))
    return out


@pytest.mark.root
def test_four_nodes_read_the_source_once_and_publish_identical_copies(cluster) -> None:
    """Each node's copy equals the source; the four loop devices together read ~1x the data,
    while four nodes staging alone read ~4x (so the nodes really share no page cache)."""
    want = cluster.source_digest()
    digest = DIGEST.format(root=f"{cluster.dest}/data")

    metadata = cluster.metadata()
    before = cluster.read()
    results = _wait_all(cluster.start(f"$ALONE >/dev/null || exit 1; {digest}"))
    assert all(rc == 0 for rc, _, _ in results), results
    alone_read = cluster.read() - before - metadata
    assert alone_read > 3.5 * cluster.bytes, (alone_read, cluster.bytes)

    before = cluster.read()
    body = f"$STAGE >/dev/null || exit 1; {digest}"
    results = _wait_all(cluster.start(body, args="--verify checksum"))
    assert [rc for rc, _, _ in results] == [0] * NODES, results
    read = cluster.read() - before - metadata  # the data, read by the four nodes together
    assert read <= 1.1 * cluster.bytes, (read, cluster.bytes, alone_read, metadata)
    for _, out, _ in results:
        assert out == want

    # a second run on unchanged data: one round of agreement, nothing read, nothing copied
    body = f"$STAGE >/dev/null || exit 1; $STAGE --json || exit 2; {digest}"
    results = _wait_all(cluster.start(body))
    assert [rc for rc, _, _ in results] == [0] * NODES, results
    for _, out, _ in results:
        report, end = json.JSONDecoder().raw_decode(out)
        assert (report["changed"], report["copied_bytes"]) == (False, 0)
        assert out[end:].lstrip("\n") == want


@pytest.mark.root
def test_nodes_that_hold_the_copy_serve_their_share_to_those_that_do_not(cluster) -> None:
    """Nodes 0-2 evict their copy, node 3 keeps it: the next run copies nothing on node 3
    (its share comes from SRC as before) and the others end with the same copy as node 3."""
    body = (
        "$STAGE >/dev/null || exit 1; "
        f"[ $RANK = 3 ] || $EXE evict data --dest {cluster.dest} >/dev/null || exit 2; "
        "$STAGE --rendezvous 127.0.0.1:$PORT2 --json || exit 3; "
        + DIGEST.format(root=f"{cluster.dest}/data")
    )
    want = cluster.source_digest()
    for rank, (rc, out, err) in enumerate(_wait_all(cluster.start(body))):
        assert rc == 0, err
        report, end = json.JSONDecoder().raw_decode(out)
        assert report["changed"] is (rank != 3), report
        assert out[end:].lstrip("\n") == want


@pytest.mark.root
def test_a_killed_node_makes_every_node_fail_and_publish_nothing_then_a_rerun_completes(
    cluster,
) -> None:
    """SIGKILL node 2 mid-exchange: the others exit non-zero naming it in one line, no node
    publishes; the same nodes run again (their partial copies in place) and complete."""
    body = (
        "$STAGE --timeout 30 >/dev/null; echo first=$?; "
        f"test -e {cluster.dest}/data && echo published; "
        "SHMSTAGE_TEST_SLOW_COPY= $STAGE --timeout 30 "
        "--rendezvous 127.0.0.1:$PORT2 >/dev/null; echo second=$?; "
        + DIGEST.format(root=f"{cluster.dest}/data")
    )
    nodes = cluster.start(body, env={"SHMSTAGE_TEST_SLOW_COPY": "0.3"}, args="--inflight 8M")
    os.kill(_when_writing(cluster, nodes[2]), signal.SIGKILL)
    results = _wait_all(nodes)
    want = cluster.source_digest()
    for rank, (_rc, out, err) in enumerate(results):
        first, _, rest = out.partition("\n")
        assert first == ("first=137" if rank == 2 else "first=1"), (rank, out, err)
        assert not rest.startswith("published"), (rank, out)
        if rank != 2:  # the killed node, not node 0 (gone by the time some looked)
            assert "lost node 2 of 4" in _one_line(err), (rank, err)
        second, _, copy = rest.partition("\n")
        assert second == "second=0", (rank, out, err)
        assert copy == want


@pytest.mark.root
def test_a_hung_node_makes_every_node_fail_within_the_timeout_naming_it(cluster) -> None:
    """SIGSTOP node 2 mid-exchange: the others give up after --timeout (no connection breaks:
    only the timeout and the stopped heartbeat show it) and name node 2; nothing published."""
    body = (
        "$STAGE --timeout 4 >/dev/null; echo rc=$?; "
        f"test -e {cluster.dest}/data && echo published; true"
    )
    nodes = cluster.start(body, env={"SHMSTAGE_TEST_SLOW_COPY": "0.3"}, args="--inflight 8M")
    victim = _when_writing(cluster, nodes[2])
    os.kill(victim, signal.SIGSTOP)
    try:
        results = [_wait_all([p])[0] for i, p in enumerate(nodes) if i != 2]
    finally:
        os.kill(victim, signal.SIGKILL)
    for out_err in results:
        _, out, err = out_err
        assert out == "rc=1\n", out_err
        assert _one_line(err).startswith("Error: lost node 2 of 4"), err


@pytest.mark.root
def test_a_node_that_sees_a_different_source_makes_every_node_refuse(cluster) -> None:
    """Node 3 sees an empty class3/ (a tmpfs over it): all four refuse (exit 2), naming node 3
    and the first difference; nothing is published anywhere."""
    body = f"$STAGE >/dev/null; echo rc=$?; test -e {cluster.dest}/data && echo published; true"
    nodes = cluster.start(body, per_node={3: f"mount -t tmpfs x {cluster.src}/class3; "})
    for _rc, out, err in _wait_all(nodes):
        assert out == "rc=2\n", (out, err)
        assert err.startswith("Error: node 3 sees a different"), err
        assert "class3/img0.jpg is missing" in err or "class3 differs" in err, err


@pytest.mark.root
def test_run_stages_cluster_wide_then_starts_the_job_on_every_node(cluster) -> None:
    """`shmstage run --nodes 2 --stage SRC -- CMD {staged}`: both nodes stage together, then
    each starts its job on its own complete copy."""
    body = (
        f"$EXE run $CLUSTER --dest {cluster.dest} --stage {cluster.src} --name data -- "
        "sh -c 'cat {staged}/big.bin | sha1sum'"
    )
    want = subprocess.run(
        ["sha1sum"], input=(cluster.data / "big.bin").read_bytes(), capture_output=True, check=True
    ).stdout.decode()
    for rc, out, err in _wait_all(cluster.start(body, nodes=2)):
        assert (rc, out) == (0, want), err


# --- failures: every node ends, with one line, and nothing is published -----------------

# What a failed node may print on stderr: its one error line, nothing from the C++ side.
NOISE = ("[W", "[E", "terminate called", "Traceback", "Exception ignored")


def _one_line(err: str) -> str:
    """The single line a failed node printed (asserting it is one, and no C++ noise)."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert not any(n in err for n in NOISE), err
    return lines[0]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _shmstage_of(node) -> int:
    """The pid of ``node``'s shmstage (the child of its shell), once it runs."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{node.pid}/task/{node.pid}/children").read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.05)
    raise AssertionError("the node never started shmstage")


@pytest.mark.root
def test_ctrl_c_on_one_node_is_named_as_such_on_the_other(cluster) -> None:
    """--nodes 2, ^C on node 1 mid-copy: node 1 dies of SIGINT; node 0 says node 1 was
    interrupted by SIGINT (not "KeyboardInterrupt: "), in one line, and publishes nothing."""
    body = (
        "$STAGE --timeout 60 >/dev/null; echo rc=$?; "
        f"test -e {cluster.dest}/data && echo published; true"
    )
    nodes = cluster.start(body, nodes=2, env={"SHMSTAGE_TEST_SLOW_COPY": "0.2"})
    os.kill(_when_writing(cluster, nodes[1]), signal.SIGINT)
    (_, out0, err0), (_, out1, _) = _wait_all(nodes, timeout=100)
    assert out1 == "rc=130\n", out1  # died of SIGINT: the shell's 128+2
    assert out0 == "rc=1\n", (out0, err0)
    assert _one_line(err0) == (
        "Error: node 1 of 2 failed: interrupted by SIGINT; nothing was published"
    ), err0


@pytest.mark.root
def test_a_frozen_node_0_makes_every_other_node_fail_within_the_timeout(cluster) -> None:
    """SIGSTOP node 0 (the rendezvous' host) mid-exchange: its store answers nothing, its
    links stay open; every other node gives up after --timeout with one line naming node
    0, and nothing is published (before, they hung forever: no client-side deadline)."""
    body = (
        "$STAGE --timeout 4 >/dev/null; echo rc=$?; "
        f"test -e {cluster.dest}/data && echo published; true"
    )
    nodes = cluster.start(body, env={"SHMSTAGE_TEST_SLOW_COPY": "0.3"}, args="--inflight 8M")
    victim = _when_writing(cluster, nodes[0])
    os.kill(victim, signal.SIGSTOP)
    try:
        results = _wait_all(nodes[1:])
    finally:
        os.kill(victim, signal.SIGKILL)
    for _, out, err in results:
        assert out == "rc=1\n", (out, err)
        assert "node 0" in _one_line(err), err


@pytest.mark.root
def test_a_node_0_frozen_before_the_others_arrive_makes_them_fail_within_the_timeout(
    cluster,
) -> None:
    """Node 0 listens, then freezes before nodes 1-3 start: the kernel still accepts their
    connections, nobody answers; each fails after --timeout naming node 0."""
    body = (
        "$STAGE --timeout 4 >/dev/null; echo rc=$?; "
        f"test -e {cluster.dest}/data && echo published; true"
    )
    node0 = cluster.start(body, nodes=4, per_node={1: "exit 0; ", 2: "exit 0; ", 3: "exit 0; "})[0]
    deadline = time.monotonic() + 60
    while not _listening(cluster.port):
        assert time.monotonic() < deadline, "node 0 never listened"
        time.sleep(0.05)
    victim = _shmstage_of(node0)
    os.kill(victim, signal.SIGSTOP)
    try:
        others = cluster.start(body, port=cluster.port, per_node={0: "exit 0; "})[1:]
        results = _wait_all(others)
    finally:
        os.kill(victim, signal.SIGKILL)
    for _, out, err in results:
        assert out == "rc=1\n", (out, err)
        assert "node 0" in _one_line(err), err


@pytest.mark.root
def test_a_listener_that_never_answers_makes_the_nodes_fail_within_the_timeout(cluster) -> None:
    """Something that accepts connections on the rendezvous port and never answers (not a
    shmstage): nodes 1-3 fail after --timeout with one line, instead of hanging."""
    fake = socket.socket()
    fake.bind(("127.0.0.1", 0))
    fake.listen(16)
    accepted: list[socket.socket] = []
    try:
        port = fake.getsockname()[1]
        body = "$STAGE --timeout 3 >/dev/null; echo rc=$?; true"
        nodes = cluster.start(body, port=port, per_node={0: "exit 0; "})[1:]
        fake.settimeout(60)
        for _ in nodes:
            accepted.append(fake.accept()[0])  # accept, then say nothing
        results = _wait_all(nodes)
    finally:
        for s in accepted:
            s.close()
        fake.close()
    for _, out, err in results:
        assert out == "rc=1\n", (out, err)
        assert "node 0" in _one_line(err) and "did not answer within 3 s" in err, err


@pytest.mark.root
def test_a_stranger_holding_every_silent_slot_does_not_keep_the_nodes_out(cluster) -> None:
    """Something holds 64 connections to node 0's rendezvous port that say nothing, and opens
    a new one whenever one is closed: the nodes still join at once and publish (the oldest
    silent connection makes room, not the newcomer; before, the nodes were turned away until
    the silent ones timed out after 10 s, so a --timeout of 6 s failed)."""
    import select

    body = f"$STAGE --timeout 6 >/dev/null; echo rc=$?; test -e {cluster.dest}/data && echo published; true"
    first = cluster.start(body, per_node={r: "exit 0; " for r in range(1, NODES)})
    held: list[socket.socket] = []
    full, stop = threading.Event(), threading.Event()

    def stranger() -> None:
        while not stop.is_set():
            while len(held) < 64 and not stop.is_set():
                try:
                    held.append(socket.create_connection(("127.0.0.1", cluster.port), timeout=1))
                except OSError:
                    time.sleep(0.02)
            full.set()
            for s in select.select(held, [], [], 0.05)[0]:  # closed by node 0: open another
                held.remove(s)
                s.close()

    thread = threading.Thread(target=stranger, daemon=True)
    thread.start()
    try:
        assert full.wait(30), "node 0 never listened"
        time.sleep(0.5)
        others = cluster.start(
            body, per_node={0: "exit 0; "}, port=cluster.port
        )[1:]  # fmt: skip
        results = _wait_all([first[0], *others], timeout=100)
    finally:
        stop.set()
        thread.join(5)
        for s in held:
            s.close()
    for rank, (_, out, err) in enumerate(results):
        assert out == "rc=0\npublished\n", (rank, out, err)


@pytest.mark.root
def test_sigterm_mid_exchange_dies_of_it_at_once_and_the_others_name_that_node(cluster) -> None:
    """Node 1 freezes once node 2 writes pieces, so the ring waits on gloo for node 1;
    SIGTERM node 2 then: it dies of SIGTERM (not exit 1 "exchange failed") without waiting for
    node 1 or --timeout (300 s here, beyond the test's patience), and nodes 0 and 3, whose
    gloo waits node 1 holds up (a send to it), fail naming node 2 (the rendezvous's watch
    runs in their waits), and exit 1, not aborted by the gloo wait they leave pending;
    nothing is published."""
    body = (
        "$STAGE --timeout 300 >/dev/null; echo rc=$?; "
        f"test -e {cluster.dest}/data && echo published; true"
    )
    nodes = cluster.start(body, env={"SHMSTAGE_TEST_SLOW_COPY": "0.3"}, args="--inflight 8M")
    term = _when_writing(cluster, nodes[2])
    frozen = _shmstage_of(nodes[1])
    os.kill(frozen, signal.SIGSTOP)
    try:
        time.sleep(3)  # node 2 writes what it holds, then waits on gloo for node 1
        os.kill(term, signal.SIGTERM)
        results = _wait_all([nodes[0], nodes[2], nodes[3]], timeout=100)
    finally:
        os.kill(frozen, signal.SIGKILL)
    for rank, (_, out, err) in zip((0, 2, 3), results):
        if rank == 2:
            assert out == "rc=143\n", (out, err)  # died of SIGTERM, which sh reports in one line
            assert err.endswith("\nTerminated\n"), err
            assert "SIGTERM" in _one_line(err[: -len("Terminated\n")]), err
        else:
            assert out == "rc=1\n", (rank, out, err)
            assert "node 2 of 4" in _one_line(err), (rank, err)


@pytest.mark.root
def test_a_node_arriving_once_the_job_started_is_refused_alone_and_the_job_publishes(
    cluster,
) -> None:
    """While the four nodes move pieces, a fifth process of the same job starts as node 1 of
    4, and a sixth as node 2 with --nodes 3: each exits 2 with one line saying the job
    already runs without it; a seventh, node 3, fails before joining (its DEST holds
    another dataset), and its failure report is refused, not read by the job; the job goes
    on and publishes on all four nodes (before, the newcomer poisoned the running job: every
    node failed, some blaming node 0, and one that arrived after node 0's commit split the
    publish)."""
    body = (
        "$STAGE $EXTRA --timeout 300 >/dev/null; echo rc=$?; "
        f"test -e {cluster.dest}/data && echo published; true"
    )
    slow = {"SHMSTAGE_TEST_SLOW_COPY": "0.3"}
    slower = {3: "export SHMSTAGE_TEST_SLOW_COPY=2; "}  # the others wait for it, watching
    nodes = cluster.start(body, env=slow, args="--inflight 8M", per_node=slower)
    _when_writing(cluster, nodes[2])
    other = cluster.base / "other"  # node 3's newcomer fails before joining: its DEST
    other.mkdir()  # holds another dataset named data; its failure report is not the job's
    (other / "f").write_text("x")
    exe = shutil.which("shmstage", path=os.path.dirname(sys.executable)) or "shmstage"
    holds = f"{exe} stage {other} --name data --dest {cluster.dest} --reserve 0 -q >/dev/null; "
    late = {0: "exit 0; ", 1: "", 2: 'EXTRA="--nodes 3"; ', 3: holds}
    newcomers = cluster.start(body, per_node=late, port=cluster.port, args="--inflight 8M")
    refused = _wait_all(newcomers[1:], timeout=100)
    _wait_all(newcomers[:1])
    assert all(p.poll() is None for p in nodes), "a newcomer stopped the running job"
    assert refused[2][1].startswith("rc=2\n"), refused[2]  # (then its own, other data)
    assert "already holds" in _one_line(refused[2][2]), refused[2]
    for rank, (_, out, err) in zip((1, 2), refused[:2]):
        assert out == "rc=2\n", (rank, out, err)
        line = _one_line(err)
        assert "this node is not part of it" in line and "the job goes on" in line, line
    assert "node 1 of 4 of this job is already running" in _one_line(refused[0][2])
    assert "started with all its 4 nodes (--nodes 4)" in _one_line(refused[1][2])
    for rank, (_, out, err) in enumerate(_wait_all(nodes, timeout=200)):
        assert out == "rc=0\npublished\n", (rank, out, err)


@pytest.mark.root
def test_nodes_started_with_different_node_counts_all_refuse_naming_it(cluster) -> None:
    """Nodes 0 and 2 run --nodes 3, node 1 --nodes 2: every node refuses (exit 2) with one
    line naming the mismatch, instead of some publishing and others timing out.  Node 2
    starts only once node 1 has refused: node 0 keeps its store up to tell it why (before,
    node 0 was gone, and node 2 waited --timeout, then blamed node 0)."""
    body = (
        f"$STAGE $EXTRA >/dev/null; echo rc=$?; test -e {cluster.dest}/data && echo published; true"
    )
    first = cluster.start(
        body, nodes=3, per_node={1: 'EXTRA="--nodes 2"; ', 2: "exit 0; "}, args="--timeout 60"
    )
    results = _wait_all(first[1:2], timeout=100)  # node 1: refused at once
    time.sleep(2)  # node 0 has seen the refusal by now, and would have exited
    late = cluster.start(
        body, nodes=3, per_node={0: "exit 0; ", 1: "exit 0; "}, port=cluster.port,
        args="--timeout 20",
    )  # fmt: skip
    results += _wait_all([late[2], first[0]], timeout=100)
    for _, out, err in results:
        assert out == "rc=2\n", (out, err)
        assert "different --nodes" in _one_line(err), err


@pytest.mark.root
def test_two_jobs_on_one_rendezvous_port_do_not_mix(cluster) -> None:
    """Two 2-node jobs (Slurm jobs 101 and 202) given the same rendezvous port: the job whose
    node 0 holds the port stages; the other's nodes fail at once, each with one line (port
    in use; the rendezvous belongs to another job), and publish nothing."""
    body = (
        'CLUSTER="--nodes 2 --node-rank $JOBRANK --rendezvous 127.0.0.1:$PORT"; '
        "$ALONE $CLUSTER >/dev/null; echo rc=$?; "
        f"test -e {cluster.dest}/data && echo published; true"
    )
    port = _free_ports(1)[0]
    per_node = {
        r: f"export SLURM_JOB_ID={101 if r < 2 else 202}; JOBRANK={r % 2}; PORT={port}; "
        for r in range(4)
    }
    results = _wait_all(cluster.start(body, per_node=per_node, port=port), timeout=100)
    jobs = [results[:2], results[2:]]
    done = [all(out == "rc=0\npublished\n" for _, out, _ in job) for job in jobs]
    assert sorted(done) == [False, True], results
    for _, out, err in jobs[done.index(False)]:
        assert out in ("rc=1\n", "rc=2\n"), (out, err)
        line = _one_line(err)
        assert "in use" in line or "belongs to another job" in line, err


@pytest.mark.root
@pytest.mark.parametrize("pair", ["jobs 128 apart", "two stages of one step"])
def test_two_jobs_whose_derived_ports_collide_both_publish(cluster, pair) -> None:
    """Slurm jobs J and J+128 (or two stages of other datasets in one step) derive one
    rendezvous port: the second node 0 takes the next free port, each node finds its own
    job's node 0, and all four nodes publish (before: one job failed, "port in use" on
    its node 0, "belongs to another job" on its node 1)."""
    job = next(j for j in range(3000, 3128) if _free_from(slurm_port({"SLURM_JOB_ID": str(j)})))
    other = job + 128 if pair == "jobs 128 apart" else job
    assert slurm_port({"SLURM_JOB_ID": str(job)}) == slurm_port({"SLURM_JOB_ID": str(other)})
    body = (
        f'$EXE stage {cluster.src} --name "$NAME" --dest {cluster.dest} --reserve 0 --quiet '
        "--nodes 2 --node-rank $JOBRANK >/dev/null; echo rc=$?; "
        f'test -e {cluster.dest}/"$NAME" && echo published; true'
    )
    per_node = {
        r: f"export SLURM_JOB_ID={job if r < 2 else other} SLURM_STEP_ID=0 "
        f"SLURM_JOB_NODELIST=127.0.0.1; JOBRANK={r % 2}; NAME={'a' if r < 2 else 'b'}; "
        for r in range(4)
    }
    for _, out, err in _wait_all(cluster.start(body, per_node=per_node), timeout=150):
        assert out == "rc=0\npublished\n", (out, err)


def _free_from(port: int, count: int = 4) -> bool:
    """Whether ``port`` and the ``count - 1`` after it are free on 127.0.0.1 now."""
    return not any(_listening(p) for p in range(port, port + count))


def _job_body(cluster: Cluster) -> str:
    """A node staging $SRC (default the cluster's) under --name $NAME (default data)."""
    return (
        f'$EXE stage "${{SRC:-{cluster.src}}}" --name "${{NAME:-data}}" --dest {cluster.dest} '
        "--reserve 0 --quiet $CLUSTER >/dev/null; echo rc=$?; "
        f'test -e {cluster.dest}/"${{NAME:-data}}" && echo published; true'
    )


def _wait_listening(port: int) -> None:
    deadline = time.monotonic() + 60
    while not _listening(port):
        assert time.monotonic() < deadline, "node 0 never listened"
        time.sleep(0.05)


@pytest.mark.root
def test_a_node_of_another_job_that_fails_before_joining_does_not_touch_this_job(cluster) -> None:
    """Job B's node 1 (a mistyped source, the same --nodes 2 and port as job A) fails
    before joining and reports why: job A's node 0 ignores it, and A's nodes publish
    (before, A's node 0 failed with "node 1 of 2 failed: source ... does not exist")."""
    body = _job_body(cluster)
    node0 = cluster.start(body, nodes=2, per_node={1: "exit 0; "})[0]
    _wait_listening(cluster.port)
    other = cluster.start(
        body, nodes=2, port=cluster.port, per_node={0: "exit 0; ", 1: "SRC=/nonexistent/jobB; "}
    )[1]
    (rc, out, err) = _wait_all([other])[0]
    assert out == "rc=2\n" and "does not exist" in _one_line(err), (out, err)
    time.sleep(2)  # node 0 looks for reports while it waits: give it time to find that one
    node1 = cluster.start(body, nodes=2, port=cluster.port, per_node={0: "exit 0; "})[1]
    for _rc, out, err in _wait_all([node0, node1], timeout=100):
        assert out == "rc=0\npublished\n", (out, err)


@pytest.mark.root
def test_two_jobs_staging_one_source_under_other_names_do_not_mix(cluster) -> None:
    """No Slurm: job B stages the same source under another --name on job A's port; B's
    node is refused as another job's (exit 2, one line) and A's nodes publish (before,
    B's node 1 joined A's node 0 and both published)."""
    body = _job_body(cluster)
    node0 = cluster.start(body, nodes=2, per_node={1: "exit 0; "})[0]
    _wait_listening(cluster.port)
    other = cluster.start(
        body, nodes=2, port=cluster.port, per_node={0: "exit 0; ", 1: "NAME=other; "}
    )[1]
    (rc, out, err) = _wait_all([other], timeout=100)[0]
    assert out == "rc=2\n" and "belongs to another job" in _one_line(err), (out, err)
    node1 = cluster.start(body, nodes=2, port=cluster.port, per_node={0: "exit 0; "})[1]
    for _rc, out, err in _wait_all([node0, node1], timeout=100):
        assert out == "rc=0\npublished\n", (out, err)


FREEZE_HOOK = """\
import os, signal, time
if os.environ.get("SHMSTAGE_TEST_FREEZE_AT"):  # SIGSTOP ourselves at that engine step
    import shmstage.stage.staging as engine
    kill_at = engine._kill_at
    def _freeze_at(step):
        if step == os.environ["SHMSTAGE_TEST_FREEZE_AT"]:
            time.sleep(2)  # the other nodes catch up: they post "ready" and wait
            os.kill(os.getpid(), signal.SIGSTOP)
        kill_at(step)
    engine._kill_at = _freeze_at
"""


def _stopped_child(pid: int) -> int | None:
    """The child of ``pid`` that is stopped (SIGSTOP), if any."""
    for kid in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            if Path(f"/proc/{kid}/stat").read_text().rpartition(") ")[2][0] == "T":
                return int(kid)
        except FileNotFoundError:
            pass
    return None


@pytest.mark.root
def test_a_node_0_frozen_before_publishing_a_change_that_moves_no_bytes_publishes_nothing(
    cluster, tmp_path: Path
) -> None:
    """Only empty files (no bytes move, no gloo group): node 0 freezes just before the
    final agreement; node 1 posts "ready", gives up after --timeout and fails.  Node 0,
    resumed, must not publish alone (before, it found every "ready" and published)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FREEZE_HOOK)
    empty = f"{cluster.src}/class0"
    setup = (
        f"mount -t tmpfs -o mode=755 empty {empty} && touch {empty}/a {empty}/b && "
        f"touch -d @1600000000 {empty}/a {empty}/b {empty} || exit 92; SRC={empty}; "
    )
    body = _job_body(cluster).replace("$CLUSTER", "$CLUSTER --timeout 4")
    nodes = cluster.start(
        body,
        nodes=2,
        per_node={
            0: setup + f"export SHMSTAGE_TEST_FREEZE_AT=manifest PYTHONPATH={hook}:$PYTHONPATH; ",
            1: setup,
        },
    )
    deadline = time.monotonic() + 60
    while (frozen := _stopped_child(nodes[0].pid)) is None:
        assert time.monotonic() < deadline and nodes[0].poll() is None, "node 0 never froze"
        time.sleep(0.05)
    try:
        results = _wait_all([nodes[1]], timeout=100)
    finally:
        os.kill(frozen, signal.SIGCONT)
    results += _wait_all([nodes[0]], timeout=100)
    for rank, (_, out, err) in enumerate(reversed(results)):
        assert out == "rc=1\n", (rank, out, err)
        _one_line(err)


ACK_FREEZE_HOOK = """\
import os, signal
if os.environ.get("SHMSTAGE_TEST_FREEZE_AFTER_ACK"):  # SIGSTOP ourselves once we acked
    from shmstage.cluster.kv import client
    plain_set = client.Client.set
    def set_then_freeze(self, key, value, deadline=None):
        plain_set(self, key, value, deadline)
        if "/ack/" in key:
            os.kill(os.getpid(), signal.SIGSTOP)
    client.Client.set = set_then_freeze
"""


@pytest.mark.root
def test_a_node_frozen_between_its_ack_and_the_decision_publishes_with_the_others(
    cluster, tmp_path: Path
) -> None:
    """Node 1 acks the publish, then freezes longer than node 0's heartbeat grace (3 s):
    node 0 commits and publishes, and keeps its store up until node 1, resumed, has read
    the decision (bounded by --timeout); node 1 then publishes too.  Before, node 0 exited
    once node 1 stopped beating, and node 1 failed while node 0 had published."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(ACK_FREEZE_HOOK)
    body = _job_body(cluster).replace("$CLUSTER", "$CLUSTER --timeout 60")
    nodes = cluster.start(
        body,
        nodes=2,
        per_node={1: f"export SHMSTAGE_TEST_FREEZE_AFTER_ACK=1 PYTHONPATH={hook}:$PYTHONPATH; "},
    )
    deadline = time.monotonic() + 60
    while (frozen := _stopped_child(nodes[1].pid)) is None:
        assert time.monotonic() < deadline and nodes[1].poll() is None, "node 1 never froze"
        time.sleep(0.05)
    try:
        time.sleep(6)  # twice the heartbeat grace: node 0 has committed and waits
    finally:
        os.kill(frozen, signal.SIGCONT)
    for rank, (_, out, err) in enumerate(_wait_all(nodes, timeout=100)):
        assert out == "rc=0\npublished\n", (rank, out, err)


@pytest.mark.root
def test_node_0_listens_only_on_the_rendezvous_address(cluster) -> None:
    """--rendezvous 127.0.0.1: node 0's store is reachable there, and not on the
    machine's other addresses (127.0.0.2, ::1; before, it listened on every address)."""
    # (node 1 never comes: node 0 gives up after --timeout, long after the two probes)
    body = _job_body(cluster).replace("$CLUSTER", "$CLUSTER --timeout 4")
    node0 = cluster.start(body, nodes=2, per_node={1: "exit 0; "})[0]
    _wait_listening(cluster.port)
    elsewhere = []
    for family, addr in ((socket.AF_INET, "127.0.0.2"), (socket.AF_INET6, "::1")):
        with socket.socket(family) as s:
            if s.connect_ex((addr, cluster.port)) == 0:
                elsewhere.append(addr)
    (_rc, out, err) = _wait_all([node0], timeout=100)[0]
    assert elsewhere == [], elsewhere
    assert out == "rc=1\n", (out, err)


@pytest.mark.root
def test_a_burst_of_idle_connections_does_not_shut_node_0s_store(cluster) -> None:
    """Node 0 runs with `ulimit -n 256`; something opens 300 idle connections to its port
    (no hello), then closes them; the real node 1 then joins and both publish (before,
    one EMFILE ended node 0's accept loop for good and both failed)."""
    body = _job_body(cluster).replace("$CLUSTER", "$CLUSTER --timeout 60")
    node0 = cluster.start(body, nodes=2, per_node={0: "ulimit -n 256; ", 1: "exit 0; "})[0]
    _wait_listening(cluster.port)
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", cluster.port), timeout=10))
        time.sleep(1)  # node 0 accepts what it can meanwhile
    finally:
        for s in idle:
            s.close()
    node1 = cluster.start(body, nodes=2, port=cluster.port, per_node={0: "exit 0; "})[1]
    for _rc, out, err in _wait_all([node0, node1], timeout=100):
        assert out == "rc=0\npublished\n", (out, err)


def _dropped(sock: socket.socket) -> bool:
    """True once the other end closed ``sock`` (False: still open after 60 s)."""
    sock.settimeout(60)
    try:
        while sock.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except OSError:  # reset: closed with our bytes unread
        pass
    return True


@pytest.mark.root
def test_node_0_drops_connections_that_send_a_big_frame_or_no_hello(cluster) -> None:
    """Before any hello: a frame announced as 512 MiB is refused (the connection closed
    after its first bytes, not buffered up to 1 GiB), and a connection that says nothing
    is closed after a deadline; node 0 still serves the real node 1 afterwards."""
    body = _job_body(cluster).replace("$CLUSTER", "$CLUSTER --timeout 90")
    node0 = cluster.start(body, nodes=2, per_node={1: "exit 0; "})[0]
    _wait_listening(cluster.port)
    with socket.create_connection(("127.0.0.1", cluster.port), timeout=10) as big:
        with contextlib.suppress(OSError):  # closed while we sent: as it should
            big.sendall((512 << 20).to_bytes(4, "big") + b"\0" * (2 << 20))
        assert _dropped(big), "node 0 kept reading a 512 MiB frame before any hello"
    with socket.create_connection(("127.0.0.1", cluster.port), timeout=10) as quiet:
        assert _dropped(quiet), "node 0 kept a connection that never said hello"
    node1 = cluster.start(body, nodes=2, port=cluster.port, per_node={0: "exit 0; "})[1]
    for _rc, out, err in _wait_all([node0, node1], timeout=100):
        assert out == "rc=0\npublished\n", (out, err)


def _hello(port: int, hello: dict) -> dict | None:
    """Send one hello frame as a raw client; node 0's answer (None: it closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        data = json.dumps(hello).encode()
        s.sendall(len(data).to_bytes(4, "big") + data)
        head = s.recv(4, socket.MSG_WAITALL)
        if len(head) < 4:
            return None
        return json.loads(s.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL))


@pytest.mark.root
def test_hellos_that_do_not_name_the_job_do_not_affect_it(cluster) -> None:
    """Raw hellos without the job's identity (another --nodes; a claim of rank 1) are
    refused and change nothing: node 0 and the real node 1 then publish (before, every
    node exited 2 with a false "different --nodes" or "two nodes started as node 1")."""
    body = _job_body(cluster).replace("$CLUSTER", "$CLUSTER --timeout 60")
    node0 = cluster.start(body, nodes=2, per_node={1: "exit 0; "})[0]
    _wait_listening(cluster.port)
    for hello in (
        {"op": "hello", "job": None, "nodes": 3, "rank": 1, "main": True},
        {"op": "hello", "nodes": 2, "rank": 1, "main": True},
        {"op": "hello", "job": "source /elsewhere", "nodes": 2, "rank": 1, "main": True},
    ):
        answer = _hello(cluster.port, hello)
        assert answer is not None and answer.get("error") == "job", (hello, answer)
    node1 = cluster.start(body, nodes=2, port=cluster.port, per_node={0: "exit 0; "})[1]
    for _rc, out, err in _wait_all([node0, node1], timeout=100):
        assert out == "rc=0\npublished\n", (out, err)


@pytest.mark.root
def test_with_a_rendezvous_token_a_node_without_it_is_refused(cluster) -> None:
    """SHMSTAGE_RENDEZVOUS_TOKEN on node 0: a node 1 started without it (the same command
    line otherwise, e.g. someone posing as node 1) is refused (exit 2, one line naming the
    token) and changes nothing; the real node 1, with the token, joins and both publish."""
    body = _job_body(cluster).replace("$CLUSTER", "$CLUSTER --timeout 60")
    token = "export SHMSTAGE_RENDEZVOUS_TOKEN=s3cret; "
    node0 = cluster.start(body, nodes=2, per_node={0: token, 1: "exit 0; "})[0]
    _wait_listening(cluster.port)
    intruder = cluster.start(body, nodes=2, port=cluster.port, per_node={0: "exit 0; "})[1]
    (_rc, out, err) = _wait_all([intruder], timeout=100)[0]
    assert out == "rc=2\n" and "SHMSTAGE_RENDEZVOUS_TOKEN" in _one_line(err), (out, err)
    node1 = cluster.start(body, nodes=2, port=cluster.port, per_node={0: "exit 0; ", 1: token})[1]
    for _rc, out, err in _wait_all([node0, node1], timeout=100):
        assert out == "rc=0\npublished\n", (out, err)
