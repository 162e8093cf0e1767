"""A real `torchrun --nproc-per-node 2` job (gloo, CPU) launched through `shmstage run`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.py"


def torchrun() -> list[str]:
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def toy_dataset(root: Path, classes: int = 2, per_class: int = 32) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            np.save(
                root / f"class{c}" / f"{i}.npy", rng.normal(c, 0.1, (3, 8, 8)).astype(np.float32)
            )
    return root


@pytest.mark.timeout(300)
def test_torchrun_trains_from_the_staged_copy(shmstage_bin, tmp_path):
    """Two gloo ranks train a few steps reading the staged copy with make_loader's workers."""
    src = toy_dataset(tmp_path / "toy")
    dest = tmp_path / "shm"
    cmd = [
        *shmstage_bin, "run", "--stage", str(src), "--dest", str(dest), "--workers", "1",
        "--", *torchrun(), "--standalone", "--nproc-per-node", "2",
        str(EXAMPLE), "--data", "{staged}", "--batch-size", "8", "--max-steps", "3",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    staged = dest / "toy"
    for rank in (0, 1):
        assert f"rank {rank}: data={staged} samples=64 num_workers=1" in r.stdout
    assert "done: 3 steps" in r.stdout
    assert (staged / "class1" / "31.npy").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_shuts_torchrun_down(shmstage_bin, tmp_path, procs):
    """SIGTERM to `shmstage run` reaches torchrun, which stops its ranks; its status is returned."""
    src = toy_dataset(tmp_path / "toy", per_class=256)
    cmd = [
        *shmstage_bin, "run", "--stage", str(src), "--dest", str(tmp_path / "shm"), "--workers", "0",
        "--", *torchrun(), "--standalone", "--nproc-per-node", "2",
        str(EXAMPLE), "--data", "{staged}", "--batch-size", "1", "--epochs", "1000",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = procs.start(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,  # torchrun and its ranks: killed as a group if the test fails
    )  # fmt: skip
    seen = []
    assert p.stdout is not None
    for line in p.stdout:  # wait until both ranks are training
        seen.append(line)
        if "step 1 loss" in line:
            break
    ranks = [
        c
        for c in psutil.Process(p.pid).children(recursive=True)
        if "train.py" in " ".join(c.cmdline())
    ]
    assert len(ranks) >= 2, "".join(seen)
    p.terminate()
    out = p.communicate(timeout=120)[0]
    assert "got signal: 15" in out, "".join(seen) + out  # torchrun's own SIGTERM handler ran
    assert p.returncode == 1  # torchrun's status after a handled SIGTERM, passed through
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive
