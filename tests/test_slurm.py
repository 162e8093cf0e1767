"""shmstage under a real Slurm (issue 24): the cluster of tests/slurmcluster.py (munge,
slurmctld, 4 slurmd nodes in namespaces of their own, each with its own /dev/shm, store and
loop device of the shared source), jobs submitted by a non-root user with sbatch/srun.  Every
Slurm recipe in docs/ runs here as the docs print it (read from the docs, so they cannot
drift), and each test checks what the recipe promises."""

from __future__ import annotations

import os
import random
from pathlib import Path

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
