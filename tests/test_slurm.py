"""shmstage under a real Slurm (issue 24): the cluster of tests/slurmcluster.py (munge,
slurmctld, 4 slurmd nodes in namespaces of their own, each with its own /dev/shm, store and
loop device of the shared source), jobs submitted by a non-root user with sbatch/srun.  Every
Slurm recipe in docs/ runs here as the docs print it (read from the docs, so they cannot
drift), and each test checks what the recipe promises.  Long because issue 24 keeps the
Slurm tests in one file: one section per page of docs/."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.slurmcluster import SlurmCluster, cgroup_missing, missing

pytestmark = pytest.mark.root

ROOT = Path(__file__).resolve().parent.parent


def _dataset(root: Path, classes: int = 4, per_class: int = 24, big: int = 0) -> int:
    """An ImageFolder-shaped tree of small files (and one of ``big`` bytes); its size."""
    rng = random.Random(24)
    total = 0
    for c in range(classes):
        d = root / f"class{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            data = rng.randbytes(rng.randint(1_000, 40_000))
            (d / f"img{i:03}.jpg").write_bytes(data)
            total += len(data)
    if big:
        (root / "class0" / "big.jpg").write_bytes(rng.randbytes(big))
    return total + big


def block(doc: str, line: str) -> str:
    """The fenced code block of docs/``doc`` holding ``line``, exactly as printed."""
    text = (ROOT / "docs" / doc).read_text()
    for body in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
        if line in body.splitlines() or any(line in b for b in body.splitlines()):
            return body
    raise AssertionError(f"docs/{doc} has no code block with {line!r}")


def job_script(doc: str, line: str) -> str:
    """The job script of docs/``doc`` holding ``line``, for sbatch as printed: it must start
    with #! (sbatch refuses any other: "This does not look like a batch script")."""
    script = block(doc, line)
    assert script.startswith("#!/bin/bash\n"), f"docs/{doc}: sbatch refuses {script!r}"
    return script


def inline(doc: str, start: str) -> str:
    """The `inline code` of docs/``doc`` that starts with ``start`` (lines joined)."""
    text = " ".join((ROOT / "docs" / doc).read_text().split())
    found = re.findall(r"`(" + re.escape(start) + r"[^`]*)`", text)
    assert found, f"docs/{doc} has no `{start}...`"
    return found[0]


# The docs' site paths: the shared file system is the cluster's (each node's loop device)
NFS = "/nfs/"

# What a training script of the docs' recipes does here: reads every file of --data and says
# what it saw, with the loader's defaults as the job sees them (run from the user's home).
TRAIN = """\
import argparse, json, os, subprocess
from pathlib import Path
from shmstage import system
from shmstage.loader import default_num_workers, global_rank, loader_kwargs, local_ranks
p = argparse.ArgumentParser()
p.add_argument("--data")
args, _ = p.parse_known_args()
files = sorted(f for f in Path(args.data).rglob("*") if f.is_file())
# the leases on --data's copy, as `shmstage list` shows them while the job runs
listed = subprocess.run(["shmstage", "list", "--json"], capture_output=True, text=True).stdout
leases = [d["leased_by"] for d in json.loads(listed or "[]") if d["path"] == args.data]
# one file per process: many ranks' lines on one stdout may interleave
out = Path(os.environ["HOME"], "trained", os.environ["SLURM_JOB_ID"])
out.mkdir(parents=True, exist_ok=True)
(out / f"{os.uname().nodename}-{os.getpid()}.json").write_text(json.dumps({
    "host": os.uname().nodename, "uid": os.getuid(), "data": args.data,
    "procid": os.environ.get("SLURM_PROCID"), "localid": os.environ.get("SLURM_LOCALID"),
    "files": len(files), "bytes": sum(len(f.read_bytes()) for f in files),
    "workers": default_num_workers(), "ranks": local_ranks(),
    "loader_workers": loader_kwargs()["num_workers"], "cpus": len(os.sched_getaffinity(0)),
    "container_cpus": system.cpu_set().container, "leases": leases,
    "tasks_per_node": os.environ.get("SLURM_STEP_TASKS_PER_NODE"), "rank": global_rank(),
    "torch_rank": os.environ.get("RANK"),
}))
"""


def trained(c: SlurmCluster, job: str) -> list[dict]:
    """What each training process of ``job`` saw, sorted by host then Slurm rank."""
    files = (c.user_home / "trained" / job).glob("*.json")
    rows = [json.loads(f.read_text()) for f in files]
    return sorted(rows, key=lambda r: (r["host"], r["procid"] or "", r["localid"] or ""))


def make_cluster(tmp_path_factory, service: bool = False, **kw) -> SlurmCluster:
    """A started cluster with the docs' datasets on its "NFS", a node config and the docs'
    install path on each node, a train.py in the user's home; ``service``: each node runs
    `shmstage serve` as root (as the unit would), on a socket of the node's own."""
    why = missing()
    if why:
        pytest.skip(why)
    data = tmp_path_factory.mktemp("nfs")
    # the docs' two source paths, under the cluster's "NFS" mount
    sizes = {  # big enough that reading it once or 4 times differs by far more than metadata
        "datasets/imagenet/train": _dataset(data / "datasets/imagenet/train", big=8 << 20),
        "imagenet": _dataset(data / "imagenet" / "train"),
    }
    c = SlurmCluster(data, **kw)
    c.sizes = sizes
    c.dest = f"{c.store}/shmstage"
    # the node config and the install the docs name, on every node (as a site's would be)
    c.node_files["/etc/shmstage.yaml"] = (
        f"version: 1\nshm: {{path: /dev/shm, size: 300M}}\ndest: {c.dest}\nreserve: 0\n"
        f"datasets:\n  - {c.nfs}/datasets/imagenet/train\n"
    )
    if service:
        run = c.base / "run"
        run.mkdir()
        c.node_files["/etc/shmstage.yaml"] += f"service: {{socket: {run}/shmstage.sock}}\n"
        c.node_setup += (
            f"\nmount -t tmpfs -o size=1M,mode=755 run-{{name}} {run}\n"
            # each node's lease keeper its own state (the host's /var/lib/shmstage is shared)
            f"SHMSTAGE_STATE_DIR={c.base}/state-{{name}} "
            f"{c.bin}/shmstage serve --config /etc/shmstage.yaml >>{c.base}/log/serve-{{name}}.log 2>&1 &\n"
            f"for _ in $(seq 200); do [ -S {run}/shmstage.sock ] && break; sleep 0.05; done\n"
        )
    c.node_files["/opt/shmstage/venv/bin/shmstage"] = f'#!/bin/sh\nexec {c.bin}/shmstage "$@"\n'
    c.start()
    train = c.user_home / "train.py"
    train.write_text(TRAIN)
    os.chown(train, c.uid, c.gid)
    return c


def stop_cluster(c: SlurmCluster) -> None:
    pids = c.pids()
    c.stop()
    left = c.leftovers(pids)
    assert not left, f"the Slurm cluster left {left} behind"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """One cluster for the module (it starts in seconds; jobs are what cost)."""
    c = make_cluster(tmp_path_factory)
    try:
        yield c
    finally:
        stop_cluster(c)


def recipe(c: SlurmCluster, text: str) -> str:
    """A docs recipe as this cluster runs it: only the shared file system's path differs."""
    return text.replace(NFS, f"{c.nfs}/")


def on_nodes(c: SlurmCluster, cmd: str, nodes: int | None = None) -> list[str]:
    """``cmd`` (shell) as root on every node (the first ``nodes``): its stdout, node by node."""
    outs = []
    for i in range(c.n if nodes is None else nodes):
        r = c.on_node(
            i, ["sh", "-c", cmd], env=c.env(PATH=f"{c.bin}:/usr/sbin:/usr/bin:/sbin:/bin")
        )
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    return outs


def wipe_stores(c: SlurmCluster) -> None:
    on_nodes(c, f"rm -rf {c.store}/* {c.store}/.[!.]* /dev/shm/*")


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
    src = f"{c.nfs}/imagenet/train"
    job = c.sbatch(f"srun --ntasks-per-node=1 sh -c 'cat {src}/*/* | wc -c'\n", "--nodes=4")
    assert c.wait_job(job) == "COMPLETED", c.output(job)
    assert c.output(job).split() == [str(c.sizes["imagenet"])] * 4
    assert c.read() - before >= 4 * c.sizes["imagenet"]


# --- docs/cluster.md: the Slurm prolog ------------------------------------------------------

# The docs' job scripts ask for more than this cluster has (8 nodes, 8 tasks per node, 64
# CPUs per task); sbatch's command line overrides #SBATCH lines, so the scripts run as printed
# with the sizes scaled down.  `--gpus-per-node=8` stays: each node has 8 (stand-in) GPUs.


def test_cluster_md_job_script_on_nodes_root_prepared_runs_on_the_prepared_copy(slurm):
    """docs/cluster.md's job script, submitted by the user, on nodes root has prepared:
    the in-job `prepare` (as the user) finds every node converged and changes nothing, and
    every task trains on the node's copy, leased while it runs and released after."""
    c = slurm
    wipe_stores(c)
    for out in on_nodes(c, "shmstage prepare --config /etc/shmstage.yaml --json", nodes=2):
        assert json.loads(out)["failed"] is False  # the 2 nodes the job gets (node1, node2)
    script = job_script("cluster.md", "#SBATCH --nodes=8 --ntasks-per-node=8 --gpus-per-node=8")
    assert "shmstage prepare --config /etc/shmstage.yaml" in script
    job = c.sbatch(recipe(c, script), "--nodes=2", "--ntasks-per-node=2")
    assert c.wait_job(job) == "COMPLETED", c.output(job)
    out = c.output(job)
    assert "Error" not in out and out.count("nothing changed") == 2, out
    rows = trained(c, job)
    copy = f"{c.dest}/train"
    assert [(r["host"], r["data"], r["files"], r["bytes"], r["uid"]) for r in rows] == [
        (host, copy, 97, c.sizes["datasets/imagenet/train"], c.uid)
        for host in ("node1", "node1", "node2", "node2")
    ]
    assert all(r["leases"] and r["leases"][0] for r in rows), rows  # leased while it ran
    for out in on_nodes(c, f"shmstage list --json --dest {c.dest}", nodes=2):
        (listed,) = json.loads(out)
        assert listed["path"] == copy and listed["leased_by"] == [], listed  # and released


def test_cluster_md_job_script_on_unprepared_nodes_fails_naming_the_root_step(slurm):
    """The same script on nodes nobody prepared, with a config that resizes /dev/shm: the
    user's `prepare` cannot, says so in one line per node, and the job fails before
    training (the script's `set -e`)."""
    c = slurm
    wipe_stores(c)
    on_nodes(c, "mount -o remount,size=256M /dev/shm")  # as the cluster started: not converged
    script = job_script("cluster.md", "#SBATCH --nodes=8 --ntasks-per-node=8 --gpus-per-node=8")
    job = c.sbatch(recipe(c, script), "--nodes=2", "--ntasks-per-node=2")
    assert c.wait_job(job) == "FAILED"
    out = c.output(job)
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 2 and all("cannot resize /dev/shm" in e for e in errors), out
    assert "Traceback" not in out and not trained(c, job)


@pytest.fixture(scope="module")
def prolog_slurm(tmp_path_factory):
    """A cluster whose slurm.conf runs docs/cluster.md's prolog, installed where it says, at
    allocation (PrologFlags=Alloc, as the page suggests)."""
    prolog = block("cluster.md", "# /etc/slurm/prolog.d/50-shmstage.sh")
    c = make_cluster(
        tmp_path_factory,
        conf_extra=inline("cluster.md", "Prolog=") + "\n" + inline("cluster.md", "PrologFlags="),
        node_files={"/etc/slurm/prolog.d/50-shmstage.sh": prolog},
    )
    try:
        yield c
    finally:
        stop_cluster(c)


def test_cluster_md_prolog_prepares_each_allocated_node_as_root_before_the_job(prolog_slurm):
    """The prolog of docs/cluster.md (Prolog=/etc/slurm/prolog.d/* in slurm.conf) stages the
    config's dataset as root on each allocated node before the job (with PrologFlags=Alloc:
    on every node before the batch script starts); the job's `run` finds it there, copies
    nothing, leases it while the job runs; the lease is gone after."""
    c = prolog_slurm
    line = block("cluster.md", "#SBATCH --nodes=8 --ntasks-per-node=8 --gpus-per-node=8")
    run = next(x for x in line.splitlines() if x.startswith("srun shmstage run"))
    job = c.sbatch("echo START $(date +%s.%N)\n" + recipe(c, run + "\n"), "--nodes=2")
    assert c.wait_job(job) == "COMPLETED", c.output(job)
    out = c.output(job)
    start = float(re.search(r"^START (\S+)$", out, re.M)[1])
    ends = on_nodes(c, "stat -c %.9Y /var/log/shmstage-prolog.log 2>/dev/null || echo inf")
    assert all(float(t) < start for t in ends[:2]), (ends, start)  # both prologs, then the job
    assert out.count("train is up to date") == 2 and "copied" not in out, out
    rows = trained(c, job)
    assert [(r["host"], r["files"], r["bytes"]) for r in rows] == [
        (h, 97, c.sizes["datasets/imagenet/train"]) for h in ("node1", "node2")
    ]
    assert all(r["leases"] and r["leases"][0] for r in rows), rows
    outs = on_nodes(c, f"cat /var/log/shmstage-prolog.log 2>/dev/null; echo @; stat -c %u "
                    f"{c.dest}/train 2>/dev/null; echo @; shmstage list --json --dest {c.dest}")  # fmt: skip
    for i, out in enumerate(outs):
        log, owner, listed = out.split("@\n")
        if i < 2:  # allocated: root prepared it before the job (root's copy); no lease left
            assert re.search(r"^stage train +changed +copied", log, re.M), log
            assert owner == "0\n" and json.loads(listed)[0]["leased_by"] == [], out
        else:  # not allocated: the prolog never ran there
            assert (log, json.loads(listed)) == ("", []), out


def test_on_a_prolog_prepared_node_a_dataset_root_did_not_stage_is_refused_in_one_line(
    prolog_slurm,
):
    """After the prolog, the store is root's: a job's `run --stage` of a dataset the node
    config does not list cannot publish there without the node service, and says so in one
    line per task, naming the way out (docs/cluster.md says it too)."""
    c = prolog_slurm
    job = c.sbatch(f"srun shmstage run --stage {c.nfs}/imagenet -- true\n", "--nodes=1")
    assert c.wait_job(job) == "FAILED"
    errors = [x for x in c.output(job).splitlines() if not x.startswith("srun: ")]
    assert len(errors) == 1 and "Traceback" not in c.output(job), c.output(job)
    assert re.fullmatch(
        rf"Error: imagenet is not staged in {c.dest}; {c.dest} is managed by root and no "
        r"shmstage service answers on .*: ask an admin to start it .* or stage into a "
        r"directory of your own with --dest, .*",
        errors[0],
    )
    doc = " ".join((ROOT / "docs" / "cluster.md").read_text().split())
    assert "a job staging a dataset the config does not list needs the node service" in doc


def test_cluster_md_prolog_that_fails_drains_the_node(prolog_slurm):
    """docs/cluster.md: "a prolog that exits non-zero drains the node".  A node whose dataset
    source is missing is drained by Slurm with the prolog named, and the job does not run."""
    c = prolog_slurm
    bad = f"version: 1\ndest: {c.dest}\ndatasets:\n  - {c.nfs}/no/such/dataset\n"
    r = c.on_node(2, ["sh", "-c", f"printf '{bad}' > /etc/shmstage.yaml"])
    assert r.returncode == 0, r.stderr
    job = c.sbatch("srun hostname\n", "--nodes=1", "-w", "node3")
    try:
        node = c.until(lambda: (n := c.show("node", "node3")) and "DRAIN" in n["State"] and n)
        assert node["Reason"].startswith("Prolog error"), node
        info = c.show("job", job)  # Slurm requeues it, held: it never ran on node3
        assert (info["JobState"], info["Reason"]) == ("PENDING", "launch_failed_requeued_held")
        assert c.output(job) == ""  # with PrologFlags=Alloc the batch script never started
        log = c.on_node(2, ["cat", "/var/log/shmstage-prolog.log"]).stdout
        assert re.search(r"^Error: .*no/such/dataset", log, re.M) and "Traceback" not in log, log
    finally:
        subprocess.run(["scancel", job], env=c.env(), check=False)
        c.on_node(2, ["cp", str(c.base / "nodefiles/etc/shmstage.yaml"), "/etc/shmstage.yaml"])
        subprocess.run(["scontrol", "update", "nodename=node3", "state=resume"], env=c.env())


# --- docs/cluster-staging.md and docs/bench.md: one read of the source for N nodes -------------


def digests(c: SlurmCluster, path: str, nodes: int) -> list[str]:
    """Every node's sha1 of every file under ``path`` (one string per node)."""
    cmd = f"cd {path} && find . -type f -print0 | sort -z | xargs -0 sha1sum"
    return on_nodes(c, cmd, nodes)


def test_cluster_staging_md_recipe_reads_the_source_once_across_the_nodes(slurm):
    """docs/cluster-staging.md's Slurm recipe on 2 nodes (each alone would read 2x): `stage
    --nodes` with the rank and node 0 from Slurm's variables reads the source about once in
    all (the loop devices together), every node publishes the same copy, and the job's `run`
    copies nothing."""
    c = slurm
    wipe_stores(c)
    script = job_script(
        "cluster-staging.md", "srun --ntasks-per-node=1 --ntasks=$SLURM_JOB_NUM_NODES \\"
    )
    size = c.sizes["datasets/imagenet/train"]
    before = c.read()
    job = c.sbatch(recipe(c, script), "--nodes=2", "--ntasks-per-node=1")
    assert c.wait_job(job) == "COMPLETED", c.output(job)
    read = c.read() - before
    out = c.output(job)
    # once, plus what each node reads of the image's metadata; 2 separate copies read >= 2x
    assert size <= read < 1.5 * size, (read, size, out)
    assert out.count("train is up to date") == 2 and "Error" not in out, out
    assert len(trained(c, job)) == 2
    sums = digests(c, f"/dev/shm/shmstage-{c.user}/train", 2)  # the recipe's DEST
    assert len(set(sums)) == 1 and sums[0].count("\n") == 97


def test_cluster_staging_md_prepare_nodes_reads_the_source_once(slurm):
    """`srun --ntasks-per-node=1 shmstage prepare --nodes $SLURM_JOB_NUM_NODES` (same page),
    as the user on nodes whose /dev/shm root sized already: the config's dataset is read about
    once across the 2 nodes (each alone: 2x) and published on each."""
    c = slurm
    wipe_stores(c)
    on_nodes(c, "mount -o remount,size=300M /dev/shm")  # root's part of the config, done
    line = inline("cluster-staging.md", "srun --ntasks-per-node=1 shmstage prepare --nodes")
    size = c.sizes["datasets/imagenet/train"]
    before = c.read()
    job = c.sbatch(recipe(c, line + "\n"), "--nodes=2")
    assert c.wait_job(job) == "COMPLETED", c.output(job)
    read = c.read() - before
    assert size <= read < 1.5 * size, (read, size, c.output(job))
    sums = digests(c, f"{c.dest}/train", 2)
    assert len(set(sums)) == 1 and sums[0].count("\n") == 97


def test_cluster_staging_md_srun_one_task_per_node_reads_the_source_once(slurm):
    """`srun -N 4 --ntasks-per-node=1 shmstage stage SRC` (cluster-staging.md), run by the
    user from the submit host: --nodes, the rank and node 0 come from the step, the 4 nodes
    read the source about once between them and each publishes the same copy."""
    c = slurm
    wipe_stores(c)
    line = inline("cluster-staging.md", "srun -N 4 --ntasks-per-node=1 shmstage")
    assert line == "srun -N 4 --ntasks-per-node=1 shmstage stage SRC"
    size = c.sizes["datasets/imagenet/train"]
    before = c.read()
    out = c.as_user(line.replace("SRC", f"{c.nfs}/datasets/imagenet/train").split())
    read = c.read() - before
    assert out.stdout.split() == [f"{c.dest}/train"] * 4, (out.stdout, out.stderr)
    assert size <= read < 1.5 * size, (read, size, out.stderr)
    sums = digests(c, f"{c.dest}/train", 4)
    assert len(set(sums)) == 1 and sums[0].count("\n") == 97


def test_cluster_staging_md_two_stages_in_one_step_meet_their_own_node_0(slurm):
    """cluster-staging.md's `srun -N2 --ntasks-per-node=1 bash -c 'shmstage stage A &
    shmstage stage B; wait'`: two cluster stages of one step derive the same port; each
    finds its own node 0 and both publish on both nodes."""
    c = slurm
    wipe_stores(c)
    line = inline("cluster-staging.md", "srun -N2 --ntasks-per-node=1 bash -c")
    assert line.endswith("'shmstage stage A & shmstage stage B; wait'")
    a, b = f"{c.nfs}/imagenet", f"{c.nfs}/datasets/imagenet/train"
    argv = line.replace("stage A", f"stage {a}").replace("stage B", f"stage {b}")
    out = c.as_user(["sh", "-c", argv])
    assert sorted(out.stdout.split()) == sorted([f"{c.dest}/imagenet", f"{c.dest}/train"] * 2)
    for i in range(2):
        listing = c.on_node(i, ["ls", "-A", c.dest]).stdout.split()
        assert {"imagenet", "train"} <= set(listing), (i, listing)


def test_cluster_staging_md_sallocs_shell_stages_alone(slurm):
    """cluster-staging.md: `salloc`'s shell (an allocation of 2 nodes, no step) takes no
    --nodes from Slurm: `salloc -N 2 shmstage stage SRC` stages on the submit host alone
    instead of waiting for a node 1 that never comes."""
    c = slurm
    src = c.user_home / "salloc-src"
    _dataset(src, classes=1, per_class=4)
    subprocess.run(["chown", "-R", f"{c.uid}:{c.gid}", str(src)], check=True)
    dest = c.user_home / "salloc-dest"
    out = c.as_user(["salloc", "-N", "2", "shmstage", "stage", str(src), "--dest", str(dest),
                     "-q"], timeout=60)  # fmt: skip
    assert out.stdout.split() == [f"{dest}/salloc-src"], (out.stdout, out.stderr)
    assert "Granted job allocation" in out.stderr and "Error" not in out.stderr, out.stderr


def test_bench_md_cluster_bench_runs_on_every_node(slurm):
    """docs/bench.md's `srun ... shmstage bench stage ... --nodes $SLURM_JOB_NUM_NODES`: it
    runs to the end on 2 nodes as the user and reports each mode's source bytes (one run per
    mode, not the line's 3: each run is the same two stages, seconds each on 2 CPUs)."""
    c = slurm
    script = block(
        "bench.md", "# Slurm, one task per node: --nodes, the rank and node 0 from the step"
    )
    line = next(x for x in script.splitlines() if x.startswith("srun "))
    assert line.endswith(" --runs 3"), line
    job = c.sbatch(recipe(c, line.removesuffix("3") + "1\n"), "--nodes=2")
    assert c.wait_job(job) == "COMPLETED", c.output(job)
    out = c.output(job)
    naive = re.search(r"^naive \(each node alone\) .* ([\d.]+)x ", out, re.M)
    once = re.search(r"^read-once \(--nodes\) .* ([\d.]+)x", out, re.M)
    assert naive and once and "on 2 nodes" in out, out
    assert float(naive[1]) > 1.5 > float(once[1]), out  # 2 nodes: 2x the source, or ~1x


# --- issue 24 item 3: the loader's workers per task, from inside the job ----------------------


def expected_workers(row: dict, tasks: int) -> int:
    """The documented rule, from what Slurm gave the task: its own CPUs when srun bound it
    (affinity narrower than the node's), else the node's CPUs shared by the step's tasks on
    the node; one CPU stays with the rank's main process."""
    cpus = row["cpus"] if row["cpus"] < row["container_cpus"] else row["cpus"] // tasks
    return max(1, cpus - 1)


@pytest.mark.parametrize("bind", ["", "--cpu-bind=none "])
def test_run_under_srun_gives_each_task_the_workers_of_its_cpus_and_ranks(slurm, bind):
    """`srun --ntasks-per-node=2 shmstage run ...` (the run.md form, 2 tasks per node here):
    each task's loader counts the step's 2 tasks on its node (no torchrun variables) and its
    own CPUs: bound to one each by default, sharing the node's with --cpu-bind=none (one
    node: what a task counts is its own node's)."""
    c = slurm
    wipe_stores(c)
    k = 2
    cmd = f"srun {bind}--ntasks-per-node={k} shmstage run --stage {c.nfs}/imagenet -- "
    job = c.sbatch(cmd + "python train.py --data {staged}\n", "--nodes=1", f"--ntasks-per-node={k}")
    assert c.wait_job(job) == "COMPLETED", c.output(job)
    rows = trained(c, job)
    assert [(r["host"], r["localid"]) for r in rows] == [("node1", str(i)) for i in range(k)]
    for r in rows:
        assert (r["ranks"], r["tasks_per_node"]) == (k, str(k)), r
        assert r["rank"] == int(r["procid"]), r  # loader.md: SLURM_PROCID without torchrun
        assert r["cpus"] == (c.cpus // k if not bind else c.cpus), r  # what Slurm gave it
        assert r["workers"] == r["loader_workers"] == expected_workers(r, k), r


# --- docs/run.md and docs/quickstart.md: one `shmstage run` and one torchrun per node ----------


def shell_lines(script: str) -> list[str]:
    """A script's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", "", script)
    return [" ".join(x.split()) for x in joined.splitlines() if x.strip() and not x.startswith("#")]


def test_torchrun_recipe_stages_once_per_node_and_each_rank_counts_the_nodes_ranks(slurm):
    """The torchrun recipe (#SBATCH ... --cpus-per-task=64, `head` from scontrol, srun
    shmstage run -- torchrun --nproc-per-node 8 ...), on 2 nodes with 2 CPUs per task: the
    nodes' runs stage together (one task per node), reading the source about once between
    them, torchrun's 8 ranks per node read the node's copy, and each counts 8 local ranks
    (torchrun's LOCAL_WORLD_SIZE) sharing the task's CPUs."""
    c = slurm
    wipe_stores(c)
    head = 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)'
    script = job_script("run.md", head)
    # quickstart.md prints the same script, wrapped differently
    assert shell_lines(job_script("quickstart.md", head)) == shell_lines(script)
    assert "#SBATCH --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 --cpus-per-task=64" in script
    before = c.read()
    job = c.sbatch(recipe(c, script), "--nodes=2", f"--cpus-per-task={c.cpus}")
    assert c.wait_job(job, timeout=240) == "COMPLETED", c.output(job)
    read, size = c.read() - before, c.sizes["imagenet"]
    assert size <= read < 1.5 * size, (read, size, c.output(job))  # each alone: 2x the source
    rows = trained(c, job)
    assert sorted(r["host"] for r in rows) == ["node1"] * 8 + ["node2"] * 8, rows
    for r in rows:
        assert (r["files"], r["bytes"]) == (96, c.sizes["imagenet"]), r
        assert r["ranks"] == 8 and r["cpus"] == c.cpus, r
        assert r["workers"] == r["loader_workers"] == max(1, c.cpus // 8 - 1), r
    assert sorted(r["rank"] for r in rows) == list(range(16))  # torchrun's RANK, not srun's
    assert all(r["rank"] == int(r["torch_rank"]) for r in rows)


def test_run_md_srun_cpus_per_task_matters_to_an_exact_step_only(slurm):
    """run.md: `srun` does not pass sbatch's `--cpus-per-task` on, yet a step that is not
    `--exact` gets all the job's CPUs on the node anyway; an `--exact` step's task gets one
    CPU unless `--cpus-per-task=$SLURM_CPUS_PER_TASK` or `SRUN_CPUS_PER_TASK` says it again."""
    c = slurm
    if c.cpus < 2:
        pytest.skip("needs nodes of 2 CPUs or more")
    doc = " ".join((ROOT / "docs" / "run.md").read_text().split())
    assert "`srun` does not pass `sbatch`'s `--cpus-per-task` on to its step" in doc
    assert "an `--exact` step's task gets one CPU" in doc and "`SRUN_CPUS_PER_TASK`" in doc
    script = (
        "srun nproc\n"
        "srun --exact nproc\n"
        "srun --exact --cpus-per-task=$SLURM_CPUS_PER_TASK nproc\n"
        "SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK srun --exact nproc\n"
    )
    job = c.sbatch(script, "--nodes=1", f"--cpus-per-task={c.cpus}")
    assert c.wait_job(job) == "COMPLETED", c.output(job)
    want = [str(c.cpus), "1", str(c.cpus), str(c.cpus)]
    assert c.output(job).split() == want, c.output(job)


@pytest.fixture(scope="module")
def wide_slurm(tmp_path_factory):
    """A node that declares 8 CPUs (tasks unbound, sharing the machine's), so the docs' 8 tasks
    per node fit (the lines name no node count: one node shows them)."""
    c = make_cluster(tmp_path_factory, nodes=1, cpus=8, task_plugin="task/none")
    try:
        yield c
    finally:
        stop_cluster(c)


def test_run_md_eight_tasks_per_node_stage_one_copy_and_count_eight_ranks(wide_slurm):
    """`srun --ntasks-per-node=8 shmstage run --stage /nfs/imagenet -- python train.py --data
    {staged}` (quickstart.md; run.md prints it with the source elided), on a node: one task
    copies, the other 7 reuse that copy, and each task's loader counts 8 ranks sharing the
    node's CPUs (no torchrun, so from SLURM_STEP_TASKS_PER_NODE)."""
    c = wide_slurm
    line = inline("quickstart.md", "srun --ntasks-per-node=8 shmstage run")
    assert (
        line
        == "srun --ntasks-per-node=8 shmstage run --stage /nfs/imagenet -- python train.py --data {staged}"
    )
    short = inline("run.md", "srun --ntasks-per-node=8 shmstage run")
    assert short == line.replace("/nfs/imagenet", "...")
    job = c.sbatch(recipe(c, line + "\n"), "--nodes=1", "--ntasks-per-node=8")
    assert c.wait_job(job, timeout=240) == "COMPLETED", c.output(job)
    out = c.output(job)
    assert out.count("staged imagenet:") == 1 and "Error" not in out, out  # one copy
    assert len(re.findall(r"imagenet is up to date", out)) == 7, out
    rows = trained(c, job)
    assert [r["host"] for r in rows] == ["node1"] * 8
    machine = len(os.sched_getaffinity(0))
    for r in rows:
        assert (r["files"], r["bytes"]) == (96, c.sizes["imagenet"]), r
        assert (r["ranks"], r["tasks_per_node"], r["cpus"]) == (8, "8", machine), r
        assert r["workers"] == r["loader_workers"] == max(1, machine // 8 - 1), r


# A train.py that only says what the loader counts (8 of TRAIN's full ones cost seconds here)
RANKS = """\
import json, os
from pathlib import Path
from shmstage.loader import default_num_workers, local_ranks
out = Path(os.environ["HOME"], "ranks", os.environ["SLURM_JOB_ID"])
out.mkdir(parents=True, exist_ok=True)
(out / os.environ["SLURM_PROCID"]).write_text(json.dumps({
    "ranks": local_ranks(), "workers": default_num_workers(),
    "cpus": len(os.sched_getaffinity(0)), "torchrun": "LOCAL_WORLD_SIZE" in os.environ,
}))
"""


def test_loader_md_plain_srun_tasks_count_the_steps_tasks_on_their_node(wide_slurm):
    """loader.md: in a task of `srun --ntasks-per-node=8 python train.py` (no shmstage run,
    no torchrun) the loader counts the step's 8 tasks on its node, sharing its CPUs."""
    c = wide_slurm
    line = inline("loader.md", "srun --ntasks-per-node=8 python train.py")
    assert line == "srun --ntasks-per-node=8 python train.py"
    light = c.user_home / "light"
    light.mkdir(exist_ok=True)
    os.chown(light, c.uid, c.gid)
    _user_file(c, "light/train.py", RANKS)
    job = c.sbatch(line + "\n", "--nodes=1", "--ntasks-per-node=8", f"--chdir={light}")
    assert c.wait_job(job, timeout=240) == "COMPLETED", c.output(job)
    rows = {f.name: json.loads(f.read_text()) for f in (c.user_home / "ranks" / job).iterdir()}
    machine = len(os.sched_getaffinity(0))
    want = {"ranks": 8, "workers": max(1, machine // 8 - 1), "cpus": machine, "torchrun": False}
    assert rows == {str(r): want for r in range(8)}, rows


# --- docs/service.md: the node service under Slurm ----------------------------------------------


@pytest.fixture(scope="module")
def service_slurm(tmp_path_factory):
    """One node running the node service (`shmstage serve` as root), as `prepare` would."""
    c = make_cluster(tmp_path_factory, service=True, nodes=1, cpus=8, task_plugin="task/none")
    try:
        yield c
    finally:
        stop_cluster(c)


def test_service_md_job_stages_through_the_service_leased_until_the_batch_script_exits(
    service_slurm,
):
    """docs/service.md's job: `DATA=$(shmstage stage /nfs/imagenet --lease-for $$ -q)` as
    the user goes through the service (the store stays root's), torchrun's 8 ranks read $DATA,
    the lease holds while the batch script runs and is gone once it exits."""
    c = service_slurm
    script = job_script("service.md", "#SBATCH --nodes=1 --gres=gpu:8")
    job = c.sbatch(recipe(c, script))
    assert c.wait_job(job, timeout=240) == "COMPLETED", c.output(job)
    rows = trained(c, job)
    copy = f"{c.dest}/imagenet"
    assert len(rows) == 8 and all(r["ranks"] == 8 for r in rows), rows
    for r in rows:
        assert (r["data"], r["files"], r["bytes"]) == (copy, 96, c.sizes["imagenet"]), r
        assert r["leases"] and r["leases"][0], r  # the batch script's lease, while it ran
    (out,) = on_nodes(c, f"stat -c %u {c.dest}; shmstage list --json --dest {c.dest}")
    owner, listed = out.split("\n", 1)
    assert owner == "0"  # the service published it: the store stays root's
    (row,) = [d for d in json.loads(listed) if d["path"] == copy]
    assert row["leased_by"] == []  # the batch script exited: its lease went with it
    log = (c.base / "log" / "serve-node1.log").read_text()
    assert "Traceback" not in log and "Error" not in c.output(job), (log, c.output(job))


def test_service_md_or_run_form_stages_through_the_service_leased_for_the_job(service_slurm):
    """docs/service.md's other form, `srun shmstage run --stage /nfs/imagenet -- torchrun ...
    --data {staged}` (the `...` as in the line above it): on a node where the dataset is not
    staged, the user's run has the service copy it (the copy is root's, in root's store),
    torchrun's 8 ranks read {staged}, leased while the job runs, released when it ends."""
    c = service_slurm
    script = job_script("service.md", "#SBATCH --nodes=1 --gres=gpu:8")
    lines = script.splitlines()
    torchrun = next(x for x in lines if x.startswith("srun torchrun "))
    args = re.fullmatch(r"srun torchrun (.*) --data \"\$DATA\"", torchrun)[1]
    other = next(x for x in lines if x.startswith("# or: srun shmstage run"))
    assert " torchrun ... --data {staged}" in other
    run = other.removeprefix("# or: ").replace("torchrun ...", f"torchrun {args}")
    head = [x for x in lines if x.startswith(("#!", "#SBATCH"))]
    copy = f"{c.dest}/imagenet"
    evict = f"shmstage evict imagenet --dest {c.dest} --force >/dev/null 2>&1"
    (out,) = on_nodes(c, f"{evict}; ls -A {c.dest} 2>/dev/null; true")  # whatever ran before
    assert "imagenet" not in out.split(), out
    job = c.sbatch(recipe(c, "\n".join([*head, run]) + "\n"))
    assert c.wait_job(job, timeout=240) == "COMPLETED", c.output(job)
    assert re.search(r"staged imagenet: 96 files, .* copied\)", c.output(job)), c.output(job)
    rows = trained(c, job)
    assert len(rows) == 8 and all(r["ranks"] == 8 for r in rows), rows
    for r in rows:
        assert (r["data"], r["files"], r["bytes"]) == (copy, 96, c.sizes["imagenet"]), r
        assert r["leases"] and r["leases"][0], r  # the run's lease, while the job ran
    (out,) = on_nodes(c, f"stat -c %u {c.dest} {copy}; shmstage list --json --dest {c.dest}")
    store_owner, copy_owner, listed = out.split("\n", 2)
    assert (store_owner, copy_owner) == ("0", "0")  # the service copied it: the user cannot
    (row,) = [d for d in json.loads(listed) if d["path"] == copy]
    assert row["leased_by"] == []  # shmstage run exited with the job: its lease went too
    log = (c.base / "log" / "serve-node1.log").read_text()
    assert "Traceback" not in log and "Error" not in c.output(job), (log, c.output(job))


# The batch script's shell function: the job's memory cgroup (task/cgroup, cgroup v1) and the
# tmpfs pages charged to it and its steps, in bytes.
JOB_SHMEM = """\
shmem() {
  m=$(grep ':memory:' /proc/self/cgroup | cut -d: -f3)
  grep '^total_shmem ' "/sys/fs/cgroup/memory${m%%/step_*}/memory.stat" | cut -d' ' -f2
}
"""


@pytest.fixture(scope="module")
def cgroup_slurm(tmp_path_factory):
    """One node running the node service, with task/cgroup's ConstrainRAMSpace (cgroup v1) and
    memory a consumable resource (RealMemory, CR_CPU_Memory): a job's `--mem` is its memory
    cgroup's limit."""
    why = missing() or cgroup_missing()
    if why:
        pytest.skip(why)
    conf = "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nConstrainRAMSpace=yes\n"
    c = make_cluster(tmp_path_factory, service=True, nodes=1, proctrack="proctrack/cgroup",
                     task_plugin="task/cgroup,task/affinity", files={"cgroup.conf": conf},
                     memory=2048)  # fmt: skip
    try:
        yield c
    finally:
        stop_cluster(c)


def test_service_md_under_constrainramspace_only_a_copy_made_in_the_job_is_charged_to_it(
    cgroup_slurm,
):
    """service.md and cluster.md under task/cgroup with ConstrainRAMSpace: the service's copy
    (service.md's `DATA=$(shmstage stage ... --lease-for $$ -q)`) is not charged to the job's
    memory cgroup; a copy the job makes itself (an `srun shmstage stage` step) is, all of it."""
    c = cgroup_slurm
    doc = " ".join((ROOT / "docs" / "service.md").read_text().split())
    assert "The pages land in `shmstage.slice`, not in the job's cgroup" in doc
    doc = " ".join((ROOT / "docs" / "cluster.md").read_text().split())
    assert "unless the copy runs inside the job (`srun` form above), where they are charged " \
        "to the job" in doc  # fmt: skip
    stage = next(x for x in job_script("service.md", "#SBATCH --nodes=1 --gres=gpu:8")
                 .splitlines() if x.startswith("DATA=$(shmstage stage"))  # fmt: skip
    script = recipe(c, (
        f"#!/bin/bash\n{JOB_SHMEM}echo start $(shmem)\n{stage}\necho service $(shmem) $DATA\n"
        "srun shmstage stage /nfs/imagenet --dest /dev/shm/shmstage-$USER -q\n"
        "echo job $(shmem)\n"
    ))  # fmt: skip
    job = c.sbatch(script, "--nodes=1")
    assert c.wait_job(job) == "COMPLETED", c.output(job)
    lines = c.output(job).splitlines()
    assert f"/dev/shm/shmstage-{c.user}/imagenet" in lines, lines  # the job's own copy
    out = dict(x.split(" ", 1) for x in lines if x.startswith(("start ", "service ", "job ")))
    size = c.sizes["imagenet"]
    service, data = out["service"].split()
    assert data == f"{c.dest}/imagenet", out  # the service's copy, in root's store
    assert int(service) - int(out["start"]) < size // 4, out  # not charged to the job
    assert int(out["job"]) - int(service) >= size, out  # the job's own copy: charged


def test_concepts_md_a_job_staging_more_than_its_mem_into_dev_shm_is_refused_in_one_line(
    cgroup_slurm,
):
    """concepts.md: staging checks the job cgroup's headroom, not only /dev/shm's free space.
    A job of `--mem=96M` (its memory cgroup's limit under ConstrainRAMSpace) staging 160 MiB
    into the node's /dev/shm (256M: room enough) is refused in one line naming the memory
    cgroup limit, and copies nothing."""
    c = cgroup_slurm
    doc = " ".join((ROOT / "docs" / "concepts.md").read_text().split())
    assert "staging checks the cgroup's headroom (limit minus usage), not only `/dev/shm`'s " \
        "free space" in doc  # fmt: skip
    src = c.user_home / "huge"
    src.mkdir()
    with open(src / "big.bin", "wb") as f:  # sparse: 160 MiB to stage, no disk
        f.truncate(160 << 20)
    subprocess.run(["chown", "-R", f"{c.uid}:{c.gid}", str(src)], check=True)
    limit = "m=$(grep ':memory:' /proc/self/cgroup | cut -d: -f3)\n" \
        'echo limit $(cat "/sys/fs/cgroup/memory${m%%/step_*}/memory.limit_in_bytes")\n'  # fmt: skip
    dest = f"/dev/shm/shmstage-{c.user}"
    job = c.sbatch(f"{limit}shmstage stage {src} --dest {dest} -q\n", "--nodes=1", "--mem=96M")
    assert c.wait_job(job) == "FAILED", c.output(job)
    lines = c.output(job).splitlines()
    assert lines[0] == f"limit {96 << 20}", lines  # Slurm made --mem the job's limit
    assert len(lines) == 2 and "Traceback" not in c.output(job), lines
    assert lines[1].startswith("Error: ") and "(the memory cgroup limit)" in lines[1], lines
    assert "huge" not in c.on_node(0, ["ls", "-A", dest]).stdout.split()


def test_cluster_staging_md_on_service_nodes_only_a_given_nodes_stages_together(tmp_path_factory):
    """cluster-staging.md (run.md too): on 4 nodes whose service serves the store, the user's
    `srun -N 4 --ntasks-per-node=1 shmstage stage SRC` stages through each node's service,
    each node alone (root's copies; every node reads all of SRC); with `--nodes` given (as
    root: the store is root's) it stages together in the step's own processes, says so in
    one line per node, and reads SRC about once between them."""
    c = make_cluster(tmp_path_factory, service=True)
    try:
        line = inline("cluster-staging.md", "srun -N 4 --ntasks-per-node=1 shmstage")
        before = c.read()
        out = c.as_user(line.replace("SRC", f"{c.nfs}/imagenet").split())
        read, size = c.read() - before, c.sizes["imagenet"]
        assert out.stdout.split() == [f"{c.dest}/imagenet"] * 4, (out.stdout, out.stderr)
        assert read >= 4 * size and "note:" not in out.stderr, (read, size, out.stderr)
        assert on_nodes(c, f"stat -c %u {c.dest}/imagenet") == ["0\n"] * 4  # the services'
        src, size = f"{c.nfs}/datasets/imagenet/train", c.sizes["datasets/imagenet/train"]
        before = c.read()
        out = subprocess.run(
            [*line.replace("SRC", src).split(), "--nodes", "4"], capture_output=True,
            text=True, timeout=120, env=c.env(HOME=str(c.base), USER="root", LOGNAME="root"),
        )  # fmt: skip
        read = c.read() - before
        assert out.stdout.split() == [f"{c.dest}/train"] * 4, (out.stdout, out.stderr)
        assert size <= read < 1.5 * size, (read, size, out.stderr)
        notes = [x for x in out.stderr.splitlines() if x.startswith("note: staging with --nodes")]
        assert len(notes) == 4 and "runs in this process" in notes[0], out.stderr
    finally:
        stop_cluster(c)


# --- docs/run.md: Slurm's signals and `shmstage run` --------------------------------------------

# Counts each delivery of SIGUSR1 and SIGTERM (the wakeup fd gets a byte per delivery, even
# when two land before the handler runs), in a file; exits when FILE.stop appears.
SIGJOB = """\
import os, select, signal, sys
from pathlib import Path
out = Path(sys.argv[1])
r, w = os.pipe()
os.set_blocking(w, False)
signal.set_wakeup_fd(w)
got = {signal.SIGUSR1: 0, signal.SIGTERM: 0}
for sig in got:
    signal.signal(sig, lambda *_: None)
out.write_text("USR1=0 TERM=0\\n")
while not out.with_suffix(".stop").exists():
    if select.select([r], [], [], 0.2)[0]:
        for b in os.read(r, 64):
            got[signal.Signals(b)] += 1
        out.write_text(f"USR1={got[signal.SIGUSR1]} TERM={got[signal.SIGTERM]}\\n")
"""

SIG_FORMS = {  # run.md's table's columns, as a batch script's last line
    "`srun shmstage run ...` in the batch script": "srun shmstage run --stage {src} -- python sigjob.py {out}",
    "`exec shmstage run ...` (shmstage is the batch shell)": "exec shmstage run --stage {src} -- python sigjob.py {out}",
}  # fmt: skip
# "twice": two that land together merge into one (run.md)
TIMES = {"never": {0}, "once": {1}, "once or twice": {1, 2}, "twice": {1, 2}}
RUNNING = (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


def signal_table() -> list[list[str]]:
    """docs/run.md's table of Slurm's signals: [sender, srun form, exec form] per row."""
    text = (ROOT / "docs" / "run.md").read_text()
    lines = [x.strip() for x in text.splitlines() if x.strip().startswith("| ")]
    head = next(i for i, x in enumerate(lines) if x.startswith("| Sent with |"))
    assert [c.strip() for c in lines[head].strip("|").split("|")][1:] == list(SIG_FORMS)
    rows = []
    for line in lines[head + 1 :]:  # the |---| line is not among them
        if not line.startswith("| `"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _count(out: Path, sig: str) -> int:
    """-1 until the job wrote it (or while it rewrites it: write_text truncates first)."""
    m = re.search(rf"{sig}=(\d+)", out.read_text()) if out.exists() else None
    return int(m[1]) if m else -1


def test_run_md_slurm_signals_reach_the_job_as_its_table_says(slurm):
    """Every row of docs/run.md's table of Slurm's signals (scancel's step, -b and --full
    signals, sbatch's timed --signal=USR1@60 and B:USR1@60, scancel's and the time limit's
    SIGTERM), sent to a job of each form (`srun shmstage run`, `exec shmstage run`), all at
    once: the job's process counts each delivery, and the job ends as the table says."""
    c = slurm
    (c.user_home / "sigjob.py").write_text(SIGJOB)
    rows = signal_table()
    assert len(rows) == 7, rows
    jobs = []  # (row, form, job id, count file, signal, want times, want state)
    for r, row in enumerate(rows):
        sender = re.match(r"`([^`]*)`", row[0])[1]
        for f, form in enumerate(SIG_FORMS.values()):
            out = c.user_home / f"sig-{r}-{f}.count"
            out.unlink(missing_ok=True)
            out.with_suffix(".stop").unlink(missing_ok=True)
            body = form.format(src=f"{c.nfs}/imagenet", out=out) + "\n"
            # a timed signal: --time=10 (minutes) until the test brings the limit near
            head = f"#!/bin/bash\n{sender}\n#SBATCH --time=10\n" if "--signal=" in sender else ""
            head = f"#!/bin/bash\n{sender}\n" if "--time=" in sender else head
            sig = re.search(r"--signal=(?:B:)?(\w+)", sender)
            cell = row[1 + f]
            state = "FAILED" if "bash dies" in cell else "COMPLETED"
            state = {"scancel JOB": "CANCELLED"}.get(sender, state)
            state = "TIMEOUT" if "--time=" in sender else state
            times = TIMES[re.match(r"once or twice|\w+", cell)[0]]
            job = c.sbatch(head + body, "--nodes=1")
            jobs.append((sender, f, job, out, sig[1] if sig else "TERM", times, state))
    log = c.base / "log" / "slurmctld.log"
    env = c.env()
    try:
        for _, _, job, out, *_ in jobs:
            c.until(lambda o=out: _count(o, "USR1") == 0, 180, f"job {job} to start")
        # slurmctld logs the timed warnings it sends at debug level only
        subprocess.run(["scontrol", "setdebug", "debug"], env=env, check=True)
        timed = []
        for sender, _, job, *_ in jobs:
            if "--time=" in sender:  # the limit reached at slurmctld's next check (30 s)
                _scontrol_update(c, job, "TimeLimit=0")
            elif "--signal=" in sender and sender.startswith("#SBATCH"):
                _bring_warning_near(c, job)
                timed.append(job)
            else:
                c.as_user([x if x != "JOB" else job for x in sender.split()])
        warned = f"warning signal {int(signal.SIGUSR1)} to JobId="

        def all_warned():
            text = log.read_text()
            return all(f"{warned}{job}\n" in text for job in timed)

        c.until(all_warned, 120, "slurmctld's timed warnings (checked every 30 s)")
        for job in timed:  # the warning is out: the limit back, the job stops when told
            _scontrol_update(c, job, "TimeLimit=10", check=False)  # (or it ended: bash died)

        def settled():  # the jobs the table ends have ended; the others got their signal
            for _, _, job, out, sig, times, state in jobs:
                if state != "COMPLETED" and c.show("job", job).get("JobState") in RUNNING:
                    return False
                if state == "COMPLETED" and _count(out, sig) < min(times):
                    return False
            return True

        deadline = time.monotonic() + 120  # then the assertion below says what is missing
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2)  # a second or a late delivery would land by now
        got = {(s, f): _count(out, sig) for s, f, _, out, sig, *_ in jobs}
    finally:
        subprocess.run(["scontrol", "setdebug", "info"], env=env, check=False)
        for *_, out, _, _, _ in jobs:
            out.with_suffix(".stop").touch()
    states = {(s, f): c.wait_job(job) for s, f, job, *_ in jobs}
    want = {(s, f): (times, state) for s, f, _, _, _, times, state in jobs}
    wrong = {k: (got[k], states[k]) for k, (times, state) in want.items()
             if got[k] not in times or states[k] != state}  # fmt: skip
    assert not wrong, (wrong, want, [c.output(j[2]) for j in jobs])


@pytest.mark.parametrize("proctrack", ["proctrack/cgroup", "proctrack/pgid"])
def test_run_md_step_wide_signals_under_proctrack_cgroup_and_pgid(tmp_path_factory, proctrack):
    """run.md: proctrack/cgroup signals only a step's tasks (SIGKILL excepted), shmstage
    here, which forwards them: the job of `srun shmstage run ...` gets `scancel
    --signal=USR1` and scancel's SIGTERM once each, as the table says of linuxproc, and is
    killed with its step.  proctrack/pgid signals the task's process group only, which the
    job's own session is outside: the job never gets the USR1, gets the SIGTERM only when
    Slurm SIGKILLs shmstage (KillWait later: the kernel's parent-death signal), and,
    handling it, outlives its Slurm job."""
    why = missing() or (proctrack == "proctrack/cgroup" and cgroup_missing())
    if why:
        pytest.skip(why)
    doc = " ".join((ROOT / "docs" / "run.md").read_text().split())
    assert "proctrack/cgroup signals only a step's tasks, the processes slurmstepd started " \
        "(SIGKILL excepted)" in doc  # fmt: skip
    assert "With the deprecated proctrack/pgid, Slurm signals only the process group of a " \
        "step's task" in doc and "do not `srun` shmstage under proctrack/pgid." in doc  # fmt: skip
    pgid = proctrack == "proctrack/pgid"
    data = tmp_path_factory.mktemp("nfs-proctrack")
    with _cluster(data, {"ds": _dataset(data / "ds", 1, 4)}, nodes=1, proctrack=proctrack) as c:
        _user_file(c, "sigjob.py", SIGJOB)
        out = c.user_home / "proctrack.count"
        form = SIG_FORMS["`srun shmstage run ...` in the batch script"]
        job = c.sbatch(form.format(src=f"{c.nfs}/ds", out=out) + "\n", "--nodes=1")

        def sigjob() -> list[psutil.Process]:  # the job's python (srun's argv names it too)
            procs = psutil.Process(c.init_pid(0)).children(recursive=True)
            return [
                p for p in procs if p.name().startswith("python") and "sigjob.py" in p.cmdline()
            ]

        try:
            c.until(lambda: _count(out, "USR1") == 0, 120, f"job {job} to start")
            shmstage = sigjob()[0].parent()
            assert shmstage.name() == "shmstage", shmstage
            c.as_user(["scancel", "--signal=USR1", job])
            c.as_user(["scancel", job])
            time.sleep(2)  # both would have landed by now
            assert out.read_text() == ("USR1=0 TERM=0\n" if pgid else "USR1=1 TERM=1\n")
            shmstage.wait(timeout=30)  # Slurm's SIGKILL, KillWait (5 s) after the SIGTERM
            if pgid:
                c.until(lambda: _count(out, "TERM") == 1, 10, "the parent-death SIGTERM")
                time.sleep(1)
                assert sigjob() and out.read_text() == "USR1=0 TERM=1\n"  # handled: goes on
            else:
                c.until(lambda: not sigjob(), 10, "the job to be killed with its step")
        finally:
            out.with_suffix(".stop").touch()
        c.until(lambda: not sigjob(), 30, "the job to stop when told")
        assert c.wait_job(job) == "CANCELLED"


def _scontrol_update(c: SlurmCluster, job: str, what: str, check: bool = True) -> None:
    """``scontrol update JobId=JOB WHAT`` as root (only root may lengthen a time limit)."""
    subprocess.run(["scontrol", "update", f"JobId={job}", what], env=c.env(), check=check,
                   capture_output=True, timeout=30)  # fmt: skip


def _bring_warning_near(c: SlurmCluster, job: str) -> None:
    """Shorten ``job``'s time limit so that slurmctld's next time-limit check (every 30 s)
    sends its 60 s warning, and the check after cannot reach the limit first: the end 50 to
    90 s away (a warning goes out once the end is within its 60 s plus the 30 s period)."""
    start = time.mktime(time.strptime(c.show("job", job)["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    ran = time.time() - start
    minutes = -(-(ran + 50) // 60)
    time.sleep(max(0.0, 60 * minutes - ran - 90))
    _scontrol_update(c, job, f"TimeLimit={int(minutes)}")


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
        stop_cluster(c)


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
    1 job in 20 here, more under load: the job is refused with "Something is wrong with the
    boot of the nodes")."""
    for _ in range(6):  # more often on a loaded machine: up to 3 in a row seen in a full run
        out = c.as_user(["srun", *argv], check=False)
        if "wrong with the boot of the nodes" not in out.stderr:
            break
        c.wait_idle()  # the node is back (idle) before the next try
    assert out.returncode == 0, (out.stdout, out.stderr)
    return out


def test_job_container_tmpfs_loses_a_dev_shm_copy_between_jobs_the_store_keeps_it(
    tmp_path_factory,
):
    """Under job_container/tmpfs, set up as cluster.md says (JobContainerType=, PrologFlags=
    Contain, which implies Alloc, a job_container.conf with BasePath=), each job starts with
    an empty /dev/shm and /tmp of its own, removed at its end (the prolog's /dev/shm is the
    node's, which the job never sees): a dataset staged there is copied again by the next
    job, one staged in a store outside /dev/shm is reused."""
    why = missing()
    if why:
        pytest.skip(why)
    data = tmp_path_factory.mktemp("nfs-jc")
    with _cluster(data, {"ds": _dataset(data / "ds")}, nodes=1, job_container=True) as c:
        conf = c.conf.read_text().splitlines()
        for start in ("JobContainerType=", "PrologFlags=Contain"):
            assert inline("cluster.md", start) in conf, start
        assert (
            inline("cluster.md", "BasePath=") in (c.conf.parent / "job_container.conf").read_text()
        )
        shown = subprocess.run(["scontrol", "show", "config"], env=c.env(), capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
        flags = re.search(r"^PrologFlags\s*=\s*(\S+)$", shown, re.M)[1]
        assert "Alloc" in flags.split(","), flags  # Slurm's own view: Contain implies Alloc
        src = f"{c.nfs}/ds"
        script = (
            "set -e; ls -A /dev/shm > $HOME/shm-$1.ls; ls -A /tmp > $HOME/tmp-$1.ls; "
            "touch /tmp/left-by-$1; echo $SLURM_JOB_ID > $HOME/job-$1; "
            "stat -f -c '%b %S' /dev/shm > $HOME/shm-$1.size; "
            f"shmstage stage {src} --dest /dev/shm/shmstage-$USER --json --no-service > $HOME/shm-$1.json; "
            f"shmstage stage {src} --dest {c.store}/shmstage-$USER --json --no-service > $HOME/store-$1.json"
        )  # fmt: skip
        copied = []
        for job in range(2):
            _srun(c, ["sh", "-c", script, "sh", str(job)])
            assert (c.user_home / f"shm-{job}.ls").read_text() == ""  # no prolog mark, no copy
            assert (c.user_home / f"tmp-{job}.ls").read_text() == ""  # nor the last job's file
            # a tmpfs of the kernel's default size (half the RAM), not the node's 256M one
            blocks, size = map(int, (c.user_home / f"shm-{job}.size").read_text().split())
            assert blocks * size == psutil.virtual_memory().total // 2 // size * size
            shm, store = (json.loads((c.user_home / f"{d}-{job}.json").read_text())
                          for d in ("shm", "store"))  # fmt: skip
            assert (shm["bytes"], store["bytes"]) == (c.sizes["ds"], c.sizes["ds"])
            copied.append((shm["copied_bytes"], store["copied_bytes"]))
        assert copied == [(c.sizes["ds"], c.sizes["ds"]), (c.sizes["ds"], 0)]
        # the node's own /dev/shm: the prolog's mark, none of the jobs' copies
        assert c.on_node(0, ["ls", "-A", "/dev/shm"]).stdout.split() == ["prolog-mark"]
        assert "ds" in c.on_node(0, ["ls", "-A", f"{c.store}/shmstage-{c.user}"]).stdout.split()
        # the jobs' own /tmp and /dev/shm (under BasePath, a directory per job) are gone
        # (a job whose namespace Slurm failed to set up, retried by _srun, leaves its own)
        ran = [(c.user_home / f"job-{job}").read_text().strip() for job in range(2)]

        def left():
            out = c.on_node(0, ["ls", "-A", f"{c.base}/jc/node1"]).stdout.split()
            return set(out) & set(ran)

        c.until(lambda: not left(), 30, "the jobs' directories under BasePath to go")


def test_cluster_md_without_prologflags_alloc_a_nodes_prolog_waits_for_its_first_step(
    slurm_edges,
):
    """cluster.md's case for PrologFlags=Alloc: without it (this cluster's slurm.conf has a
    Prolog= and no PrologFlags) the prolog runs on the batch script's node before the script,
    and on another node only when the job's first srun step reaches it."""
    c = slurm_edges
    assert "PrologFlags" not in c.conf.read_text()
    doc = " ".join((ROOT / "docs" / "cluster.md").read_text().split())
    assert (
        "Without it the prolog runs on the batch script's node before the script, and on each "
        "other node only when the first `srun` step reaches it" in doc
    )
    go = c.user_home / "prolog-go"
    go.unlink(missing_ok=True)
    script = (
        f"echo batch $(cat /dev/shm/prolog-mark)\ntouch {go}.started\n"
        f"while [ ! -e {go} ]; do sleep 0.1; done\nsrun -l cat /dev/shm/prolog-mark\n"
    )
    job = c.sbatch(script, "--nodes=2", "--ntasks-per-node=1", "-w", "node[1-2]")
    try:
        c.until(lambda: Path(f"{go}.started").exists(), 60, "the batch script to start")
        mark = c.on_node(1, ["cat", "/dev/shm/prolog-mark"]).stdout.strip()
        assert mark != job  # node2: allocated, its prolog not run yet
    finally:
        go.touch()
    assert c.wait_job(job) == "COMPLETED", c.output(job)
    lines = sorted(c.output(job).splitlines())
    assert lines == [f"0: {job}", f"1: {job}", f"batch {job}"], lines


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
            c.until(lambda b=before: c.read() - b > 256 << 10, 120, "the stage to read the source")
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


@pytest.mark.parametrize("proctrack", ["proctrack/cgroup", "proctrack/linuxproc"])
def test_cluster_staging_md_two_stages_in_one_step_without_the_wait(tmp_path_factory, proctrack):
    """cluster-staging.md's `srun -N2 --ntasks-per-node=1 bash -c 'shmstage stage A & shmstage
    stage B; wait'` without its `wait`, A slower than B: the step ends when B's shell exits.
    Under proctrack/cgroup Slurm kills A then, on both nodes (A publishes nowhere); under
    proctrack/linuxproc A outlives its step (it publishes; srun waits for its output)."""
    why = missing() or (proctrack == "proctrack/cgroup" and cgroup_missing())
    if why:
        pytest.skip(why)
    data = tmp_path_factory.mktemp("nfs-nowait")
    sizes = _edge_data(data)
    (data / "tiny").mkdir()
    (data / "tiny" / "one").write_bytes(b"x" * 4096)
    with _cluster(data, sizes, nodes=2, proctrack=proctrack) as c:
        line = inline("cluster-staging.md", "srun -N2 --ntasks-per-node=1 bash -c")
        assert line.endswith("; wait'")
        dest = f"{c.store}/nowait"
        a, b = (f"stage {c.nfs}/{name} --dest {dest} --no-service -q" for name in ("big", "tiny"))
        argv = line.replace("stage A", a).replace("stage B", b).replace("; wait'", "'")
        killed = proctrack == "proctrack/cgroup"
        # 4 MiB a node: killed, A is far from done when B is (32 s); outliving, done in 4 s
        with _slow_source(c, range(2), (128 << 10) if killed else (1 << 20)):
            out = c.as_user(["sh", "-c", argv])
        want = ["tiny"] if killed else ["big", "tiny"]
        assert sorted(out.stdout.split()) == sorted([f"{dest}/{x}" for x in want] * 2), out
        for i in range(2):
            assert _stagers(c, i) == [], (i, _stagers(c, i))
            listing = c.on_node(i, ["ls", dest]).stdout.split()
            assert listing == want, (i, listing)


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
        c.until(lambda: c.read() - before > 512 << 10, 120, "the stage to read the source")
        stopped = _stagers(c, 3)
        assert stopped
        for p in stopped:
            p.suspend()
        try:

            def errors():
                lines = c.output(job).splitlines()
                return [x for x in lines if x[:1].isdigit() and "Error" in x]

            c.until(lambda: len(errors()) >= 3, 90, "three nodes to fail")
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
    --nodes, rank, node 0 and the port from its step: node 0 listens on each job's port of
    cluster-staging.md's formula, and both publish (on one fixed port the second job's node 0
    would find it in use and fail)."""
    c = slurm_edges
    doc = " ".join((ROOT / "docs" / "cluster-staging.md").read_text().split())
    assert "`30000 + ($SLURM_JOB_ID × 16 + $SLURM_STEP_ID) mod 2048`" in doc

    def listening() -> set[int]:
        out = c.on_node(0, ["ss", "-Htln"]).stdout  # State Recv-Q Send-Q Local:Port Peer
        return {int(x.split()[3].rsplit(":", 1)[1]) for x in out.splitlines()}

    with _slow_source(c, range(2), 1 << 20):
        jobs = [
            c.sbatch(f"srun shmstage stage {c.nfs}/{name} --dest {c.store}/jobs --no-service -q\n",
                     "--nodes=2", "--ntasks-per-node=1", "-w", "node[1-2]")
            for name in ("big", "big2")
        ]  # fmt: skip
        c.until(lambda: _sources_staged(c, 0) == {"big", "big2"}, 120, "both jobs to stage at once")
        ports = {30000 + (int(job) * 16 + 0) % 2048 for job in jobs}  # step 0: the first srun
        c.until(lambda: ports <= listening(), 60, f"node 0 to listen on {ports}")
        states = [c.wait_job(job) for job in jobs]
    assert states == ["COMPLETED", "COMPLETED"], [c.output(job) for job in jobs]
    for i in range(2):
        listing = c.on_node(i, ["ls", "-A", f"{c.store}/jobs"]).stdout.split()
        assert {"big", "big2"} <= set(listing), (i, listing)


# --- the fixture itself: nothing left behind ------------------------------------------------

UP = """\
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.slurmcluster import SlurmCluster
c = SlurmCluster(Path({data!r}), nodes=1).start()
print(c.base, flush=True)
time.sleep(600)
"""


def _killed_cluster(tmp_path: Path, sig: int) -> tuple[dict, int]:
    """A 1-node cluster started by a process of its own, which gets ``sig`` once the cluster
    is up: what the cluster recorded it made, and how the process ended."""
    why = missing()
    if why:
        pytest.skip(why)
    data = tmp_path / "data"
    data.mkdir()
    (data / "file").write_bytes(b"x" * 4096)
    root = str(Path(__file__).resolve().parent.parent)
    up = subprocess.Popen(
        [sys.executable, "-c", UP.format(root=root, data=str(data))],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        base = Path(up.stdout.readline().strip())
        state = json.loads((base / "cluster-state.json").read_text())
    finally:
        os.kill(up.pid, sig)
        up.wait(timeout=120)
        up.stdout.close()
    return state, up.returncode


def _what_is_left(state: dict) -> list[str]:
    left = [f"pid {p[0]}" for p in state["pids"] if _same_process(p)]
    if subprocess.run(["ip", "link", "show", state["bridge"]], capture_output=True).returncode == 0:
        left.append(f"bridge {state['bridge']}")
    out = subprocess.run(["losetup", "-j", state["image"]], capture_output=True, text=True)
    left += [f"loop device {line}" for line in out.stdout.splitlines()]
    if subprocess.run(["id", state["user"]], capture_output=True).returncode == 0:
        left.append(f"user {state['user']}")
    return left + [d for d in (state["base"], *state["dirs"]) if os.path.exists(d)]


def _same_process(ident: list[float]) -> bool:
    try:
        p = psutil.Process(int(ident[0]))
        return p.create_time() == ident[1] and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_sighup_stops_the_cluster_then_kills_the_process(tmp_path, sig) -> None:
    """A CI timeout (SIGTERM) or a closed terminal (SIGHUP) to the process holding a cluster:
    the cluster is stopped (daemons, node, loop device, bridge, user, directory), then the
    process dies of the signal as it would have (before: all of it stayed behind)."""
    state, rc = _killed_cluster(tmp_path, sig)
    assert rc == -sig
    assert state["pids"] and not _what_is_left(state)


def test_a_cluster_killed_outright_is_swept_by_the_next_ones_start(tmp_path) -> None:
    """SIGKILL (no handler, no finalizer runs) leaves everything; the next cluster's start
    removes it (its owner is dead), then starts as usual."""
    state, rc = _killed_cluster(tmp_path, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    assert _what_is_left(state)  # the daemons, the node, the bridge... outlived it
    c = SlurmCluster(tmp_path / "data", nodes=1)
    try:
        c.start()
        assert not _what_is_left(state)
    finally:
        stop_cluster(c)


def test_make_slurm_starts_a_cluster_its_printed_line_submits_to_and_ctrl_c_removes_it():
    """README's `make slurm` (the Makefile's recipe, run from the checkout as make runs it):
    it prints a cluster whose `su ... srun -N 4 hostname` line, run as printed, answers from
    the 4 nodes as the user; Ctrl-C (SIGINT to its process group) removes all it made."""
    why = missing()
    if why:
        pytest.skip(why)
    makefile = (ROOT / "Makefile").read_text()
    (recipe_line,) = re.findall(r"^slurm:.*\n\t(.*)$", makefile, re.M)
    argv = recipe_line.replace("$(BIN)/python", sys.executable).split()
    up = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True)  # fmt: skip
    try:
        printed = []
        while not printed or not printed[-1].startswith("Stop it with"):
            line = up.stdout.readline()
            assert line, (printed, up.stderr.read())
            printed.append(line)
        text = "".join(printed)
        base = Path(re.search(r"^  logs: (\S+)/log$", text, re.M)[1])
        state = json.loads((base / "cluster-state.json").read_text())
        submit = re.search(r"^  submit as its user: +(su .*)$", text, re.M)[1]
        out = subprocess.run(submit, shell=True, capture_output=True, text=True, timeout=60)
        assert sorted(out.stdout.split()) == ["node1", "node2", "node3", "node4"], out
        user = re.fullmatch(r"su -s /bin/sh (\S+) -c .*", submit)[1]
        assert user == state["user"]
    finally:
        os.killpg(up.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground group
        _, err = up.communicate(timeout=60)
    assert up.returncode == 0 and err.endswith("stopped; nothing left behind\n"), err
    assert state["pids"] and not _what_is_left(state)
