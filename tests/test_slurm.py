"""shmstage under a real Slurm (issue 24): the cluster of tests/slurmcluster.py (munge,
slurmctld, 4 slurmd nodes in namespaces of their own, each with its own /dev/shm, store and
loop device of the shared source), jobs submitted by a non-root user with sbatch/srun.  Every
Slurm recipe in docs/ runs here as the docs print it (read from the docs, so they cannot
drift), and each test checks what the recipe promises."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.slurmcluster import SlurmCluster, missing

pytestmark = pytest.mark.root

ROOT = Path(__file__).resolve().parent.parent


def _dataset(root: Path, classes: int = 4, per_class: int = 24) -> int:
    """An ImageFolder-shaped tree of small files; its size in bytes."""
    rng = random.Random(24)
    total = 0
    for c in range(classes):
        d = root / f"class{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            data = rng.randbytes(rng.randint(1_000, 40_000))
            (d / f"img{i:03}.jpg").write_bytes(data)
            total += len(data)
    return total


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """One cluster for the module (it starts in about a second, but jobs are what cost)."""
    why = missing()
    if why:
        pytest.skip(why)
    data = tmp_path_factory.mktemp("nfs")
    # the docs' two source paths, under the cluster's "NFS" mount
    sizes = {
        "datasets/imagenet/train": _dataset(data / "datasets" / "imagenet" / "train"),
        "imagenet": _dataset(data / "imagenet"),
    }
    c = SlurmCluster(data)
    c.sizes = sizes
    c.start()
    try:
        yield c
    finally:
        pids = c.pids()
        c.stop()
        left = c.leftovers(pids)
        assert not left, f"the Slurm cluster left {left} behind"


def _user_file(c: SlurmCluster, name: str, text: str) -> Path:
    path = c.user_home / name
    path.write_text(text)
    os.chown(path, c.uid, c.gid)
    return path


# --- the cluster itself -----------------------------------------------------------------------


def test_a_step_runs_as_the_user_on_four_nodes_that_share_no_dev_shm_and_no_store(slurm):
    """A file each node's task writes to /dev/shm and to the store is seen on that node only,
    and the step runs as the submitting user, not root."""
    c = slurm
    write = (
        'echo "$(hostname)" > /dev/shm/mark-$SLURM_NODEID && '
        f'echo "$(hostname)" > {c.store}/mark-$SLURM_NODEID && id -u'
    )
    out = c.as_user(["srun", "-N", "4", "--ntasks-per-node=1", "sh", "-c", write])
    assert out.stdout.split() == [str(c.uid)] * 4
    look = f'echo "$SLURM_NODEID $(hostname) $(ls /dev/shm | grep mark) $(ls {c.store})"'
    out = c.as_user(["srun", "-N", "4", "--ntasks-per-node=1", "sh", "-c", look])
    seen = sorted(line.split() for line in out.stdout.splitlines())
    assert seen == [[str(r), f"node{r + 1}", f"mark-{r}", f"mark-{r}"] for r in range(4)]
    c.as_user(["srun", "-N", "4", "--ntasks-per-node=1", "sh", "-c",
               f"rm -f /dev/shm/mark-* {c.store}/mark-*"])  # fmt: skip


def test_an_sbatch_job_reads_the_shared_source_through_each_nodes_own_device(slurm):
    """sbatch as the user; the job's srun reads the source on every node: each node's loop
    device is read (the bytes add up to about 4x the data)."""
    c = slurm
    before = c.read()
    src = f"{c.nfs}/imagenet"
    job = c.sbatch(f"srun --ntasks-per-node=1 sh -c 'cat {src}/*/* | wc -c'\n", "--nodes=4")
    assert c.wait_job(job) == "COMPLETED", c.output(job)
    assert c.output(job).split() == [str(c.sizes["imagenet"])] * 4
    assert c.read() - before >= 4 * c.sizes["imagenet"]


# --- issue 24 items 4-5: job_container/tmpfs, a cancelled job, a node that hangs ----------------


def _edge_data(root: Path) -> dict[str, int]:
    """``ds`` (small files), ``big`` and ``big2`` (8 MiB: seconds through _slow_source)."""
    sizes = {"ds": _dataset(root / "ds")}
    rng = random.Random(5)
    (root / "big").mkdir()
    for i in range(32):
        (root / "big" / f"{i:02}.bin").write_bytes(rng.randbytes(256 << 10))
    sizes["big"] = 32 * (256 << 10)
    shutil.copytree(root / "big", root / "big2")  # another source of the same size
    sizes["big2"] = sizes["big"]
    return sizes


@contextlib.contextmanager
def _cluster(data: Path, sizes: dict[str, int], **kw):
    c = SlurmCluster(data, **kw)
    prolog = c.base / "prolog.sh"  # root, on the node, before the job (outside its namespace)
    prolog.write_text("#!/bin/sh\necho $SLURM_JOB_ID > /dev/shm/prolog-mark\n")
    prolog.chmod(0o755)
    c.conf_extra += f"\nProlog={prolog}\n"
    c.sizes = sizes
    c.start()
    try:
        yield c
    finally:
        pids = c.pids()
        c.stop()
        left = c.leftovers(pids)
        assert not left, f"the Slurm cluster left {left} behind"


@pytest.fixture(scope="module")
def slurm_edges(tmp_path_factory):
    """4 nodes of their own (the source's page cache cold for _slow_source) and a prolog."""
    why = missing()
    if why:
        pytest.skip(why)
    data = tmp_path_factory.mktemp("nfs-edges")
    with _cluster(data, _edge_data(data)) as c:
        yield c


@contextlib.contextmanager
def _slow_source(c: SlurmCluster, nodes, bps: int):
    """Steps started on ``nodes`` from now on read the source at ``bps`` bytes/s at most."""
    from shmstage.bench.throttle import blkio_throttle

    with contextlib.ExitStack() as stack:
        for i in nodes:
            init = c.init_pid(i)
            # the node's mount of its loop device, seen through its PID 1's root
            t = stack.enter_context(
                blkio_throttle(f"/proc/{init}/root{c.nfs}", bps, name=f"shmstage-slurm-{i}")
            )
            for p in psutil.Process(init).children():
                if p.name() == "slurmd":
                    t.add(p.pid)
        yield


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _stagers(c: SlurmCluster, i: int) -> list[psutil.Process]:
    """The `shmstage stage` processes running on node i (the step's and their children)."""
    out = []
    for p in psutil.Process(c.init_pid(i)).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "stage" in p.cmdline() and any("shmstage" in a for a in p.cmdline()):
                out.append(p)
    return out


def _sources_staged(c: SlurmCluster, i: int) -> set[str]:
    """The sources (base names) that stagers on node i read now (srun itself left out)."""
    names = set()
    for p in _stagers(c, i):
        with contextlib.suppress(psutil.Error):
            if p.name() != "srun":
                names |= {os.path.basename(a) for a in p.cmdline() if a.startswith(str(c.nfs))}
    return names


def _tree(c: SlurmCluster, i: int, path: str) -> str:
    """Every file under ``path`` on node i with its checksum, sorted ("" if none)."""
    script = f"cd {path} 2>/dev/null && find . -type f -exec md5sum {{}} + | sort -k2"
    return c.on_node(i, ["sh", "-c", script]).stdout


def _srun(c: SlurmCluster, argv: list[str]):
    """``srun ARGV`` as the user, once more when Slurm 22.05's job_container/tmpfs fails to
    set up the job's namespace ("ns base mount failed: Invalid argument" in slurmd's log, about
    1 job in 20 here: the job is refused with "Something is wrong with the boot of the nodes")."""
    for _ in range(3):
        out = c.as_user(["srun", *argv], check=False)
        if "wrong with the boot of the nodes" not in out.stderr:
            break
    assert out.returncode == 0, (out.stdout, out.stderr)
    return out


def test_job_container_tmpfs_loses_a_dev_shm_copy_between_jobs_the_store_keeps_it(
    tmp_path_factory,
):
    """Under job_container/tmpfs each job starts with an empty /dev/shm of its own (the
    prolog's /dev/shm is the node's, which the job never sees): a dataset staged there is
    copied again by the next job, one staged in a store outside /dev/shm is reused."""
    why = missing()
    if why:
        pytest.skip(why)
    data = tmp_path_factory.mktemp("nfs-jc")
    with _cluster(data, {"ds": _dataset(data / "ds")}, nodes=1, job_container=True) as c:
        src = f"{c.nfs}/ds"
        script = (
            "set -e; ls -A /dev/shm > $HOME/shm-$1.ls; "
            f"shmstage stage {src} --dest /dev/shm/shmstage-$USER --json --no-service > $HOME/shm-$1.json; "
            f"shmstage stage {src} --dest {c.store}/shmstage-$USER --json --no-service > $HOME/store-$1.json"
        )  # fmt: skip
        copied = []
        for job in range(2):
            _srun(c, ["sh", "-c", script, "sh", str(job)])
            assert (c.user_home / f"shm-{job}.ls").read_text() == ""  # no prolog mark, no copy
            shm, store = (json.loads((c.user_home / f"{d}-{job}.json").read_text())
                          for d in ("shm", "store"))  # fmt: skip
            assert (shm["bytes"], store["bytes"]) == (c.sizes["ds"], c.sizes["ds"])
            copied.append((shm["copied_bytes"], store["copied_bytes"]))
        assert copied == [(c.sizes["ds"], c.sizes["ds"]), (c.sizes["ds"], 0)]
        # the node's own /dev/shm: the prolog's mark, none of the jobs' copies
        assert c.on_node(0, ["ls", "-A", "/dev/shm"]).stdout.split() == ["prolog-mark"]
        assert "ds" in c.on_node(0, ["ls", "-A", f"{c.store}/shmstage-{c.user}"]).stdout.split()


def test_a_job_cancelled_mid_stage_publishes_nothing_and_the_next_job_stages(slurm_edges):
    """scancel (SIGTERM, SIGKILL after KillWait) and scancel --signal=KILL in the middle of a
    2-node stage (--nodes from the step): no node publishes, no stager is left running, and
    the next job's same stage completes with copies identical to the source."""
    c = slurm_edges
    dest = f"{c.store}/cancel"
    stage = f"srun shmstage stage {c.nfs}/big --dest {dest} --no-service -q --timeout 30\n"
    want = subprocess.run(
        ["sh", "-c", "find . -type f -exec md5sum {} + | sort -k2"],
        cwd=c.data / "big", capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for how in ([], ["--signal=KILL"]):
        with _slow_source(c, range(2), 256 << 10):
            before = c.read()
            job = c.sbatch(stage, "--nodes=2", "--ntasks-per-node=1", "-w", "node[1-2]")
            _wait(lambda b=before: c.read() - b > 256 << 10, 120, "the stage to read the source")
            c.as_user(["scancel", *how, job])
            state = c.wait_job(job)
            assert c.read() - before < c.sizes["big"]  # cancelled before it was all read
        assert state in ("CANCELLED", "FAILED"), (how, state, c.output(job))
        for i in range(2):
            assert _stagers(c, i) == [], (how, i)
            listing = c.on_node(i, ["ls", "-A", dest]).stdout.split()
            assert "big" not in listing, (how, i, listing)
    job = c.sbatch(stage, "--nodes=2", "--ntasks-per-node=1", "-w", "node[1-2]")
    assert c.wait_job(job) == "COMPLETED", c.output(job)
    assert [_tree(c, i, f"{dest}/big") for i in range(2)] == [want, want]


def test_a_node_that_hangs_mid_stage_fails_the_step_on_every_node(slurm_edges):
    """`srun -N 4 --ntasks-per-node=1 shmstage stage SRC --timeout 5`: node 3's stager is
    stopped (SIGSTOP) mid-exchange.  The other three fail within the timeout, each with one
    line naming node 3; continued, node 3 fails too, in one line; nobody publishes."""
    c = slurm_edges
    dest = f"{c.store}/hang"
    stage = f"srun -l shmstage stage {c.nfs}/big --dest {dest} --no-service -q --timeout 5\n"
    with _slow_source(c, range(4), 256 << 10):
        before = c.read()
        job = c.sbatch(stage, "--nodes=4", "--ntasks-per-node=1")
        _wait(lambda: c.read() - before > 512 << 10, 120, "the stage to read the source")
        stopped = _stagers(c, 3)
        assert stopped
        for p in stopped:
            p.suspend()
        try:

            def errors():
                lines = c.output(job).splitlines()
                return [x for x in lines if x[:1].isdigit() and "Error" in x]

            _wait(lambda: len(errors()) >= 3, 90, f"three nodes to fail: {c.output(job)}")
        finally:
            for p in stopped:
                with contextlib.suppress(psutil.Error):
                    p.resume()
        state = c.wait_job(job)
    assert state == "FAILED", c.output(job)
    tasks = [x for x in c.output(job).splitlines() if x[:1].isdigit()]
    by_task = {r: [x for x in tasks if x.startswith(f"{r}: ")] for r in range(4)}
    assert all(len(lines) == 1 for lines in by_task.values()), c.output(job)
    for r in range(3):
        assert "Error:" in by_task[r][0] and "node 3" in by_task[r][0], by_task
    assert "Error:" in by_task[3][0], by_task
    for i in range(4):
        assert "big" not in c.on_node(i, ["ls", "-A", dest]).stdout.split(), i


def _read_by_node(c: SlurmCluster) -> list[int]:
    """Bytes read so far from each node's loop device (its source traffic)."""
    return [512 * int(Path(f"/sys/block/{os.path.basename(d)}/stat").read_text().split()[2])
            for d in c.devs]  # fmt: skip


def test_only_a_step_of_one_task_per_node_stages_together(slurm_edges):
    """--nodes comes from Slurm only in a step with one task per node: the batch script's
    own `shmstage stage` stages alone on its node (it waits for no other), and a step of 2
    tasks per node stages alone on each node (node2 reads the whole source, not half)."""
    c = slurm_edges
    src, size = f"{c.nfs}/ds", c.sizes["ds"]
    script = (
        f"shmstage stage {src} --dest {c.store}/alone-batch --no-service -q\n"
        f"srun shmstage stage {src} --dest {c.store}/alone-tasks --no-service -q\n"
    )
    before = _read_by_node(c)
    job = c.sbatch(script, "--nodes=2", "--ntasks-per-node=2", "-w", "node[1-2]")
    assert c.wait_job(job) == "COMPLETED", c.output(job)
    read = [now - then for now, then in zip(_read_by_node(c), before)]
    assert read[0] >= size and read[1] >= size, read  # node1 by the batch shell, node2 alone
    assert (
        c.output(job).split() == [f"{c.store}/alone-batch/ds"] + [f"{c.store}/alone-tasks/ds"] * 4
    )
    for i in range(2):
        assert "ds" in c.on_node(i, ["ls", "-A", f"{c.store}/alone-tasks"]).stdout.split()


def test_two_jobs_staging_on_the_same_nodes_at_once_meet_on_ports_of_their_own(slurm_edges):
    """Two 2-node jobs on node1-2 at the same time, each `srun shmstage stage SRC` taking
    --nodes, rank, node 0 and the port from its step: both publish (the port comes from the
    job id; on one fixed port the second job's node 0 would find it in use and fail)."""
    c = slurm_edges
    with _slow_source(c, range(2), 1 << 20):
        jobs = [
            c.sbatch(f"srun shmstage stage {c.nfs}/{name} --dest {c.store}/jobs --no-service -q\n",
                     "--nodes=2", "--ntasks-per-node=1", "-w", "node[1-2]")
            for name in ("big", "big2")
        ]  # fmt: skip
        _wait(lambda: _sources_staged(c, 0) == {"big", "big2"}, 120, "both jobs to stage at once")
        states = [c.wait_job(job) for job in jobs]
    assert states == ["COMPLETED", "COMPLETED"], [c.output(job) for job in jobs]
    for i in range(2):
        listing = c.on_node(i, ["ls", "-A", f"{c.store}/jobs"]).stdout.split()
        assert {"big", "big2"} <= set(listing), (i, listing)
