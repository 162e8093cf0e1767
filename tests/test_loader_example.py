"""examples/train.py: trains on CPU from .npy and JPEG folders, with AMP and torch.compile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("PIL")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.py"


def train(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.timeout(300)
def test_example_trains_from_jpeg_folder_via_shmstage_data(tmp_path):
    """--make-data writes a JPEG folder; the script trains on it read from $SHMSTAGE_DATA."""
    data = tmp_path / "toy"
    made = train(
        "--make-data", str(data), "--format", "jpeg", "--classes", "2", "--per-class", "16"
    )
    assert made.returncode == 0, made.stderr
    assert len(list(data.glob("class*/*.jpg"))) == 32
    r = train(
        "--max-steps", "2", "--batch-size", "8", "--workers", "1", env={"SHMSTAGE_DATA": str(data)}
    )
    assert r.returncode == 0, r.stderr
    assert f"rank 0: data={data} samples=32 num_workers=1" in r.stdout
    assert "done: 2 steps" in r.stdout


@pytest.mark.timeout(300)
def test_example_seeds_each_rank_apart(tmp_path):
    """Rank r seeds with --seed + r: ranks never share the augmentations' random numbers."""
    data = tmp_path / "toy"
    assert train("--make-data", str(data), "--classes", "2", "--per-class", "4").returncode == 0
    for rank, seed in (("0", "7"), ("3", "10")):
        r = train(
            "--data", str(data), "--max-steps", "1", "--batch-size", "2", "--workers", "0",
            "--seed", "7", env={"RANK": rank, "WORLD_SIZE": "1"},
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert f"rank {rank}: " in r.stdout and f" seed={seed}\n" in r.stdout, r.stdout


@pytest.mark.timeout(300)
def test_example_reuses_one_prefetcher_across_epochs(tmp_path, monkeypatch):
    """As docs/loader.md says: one CudaPrefetcher for the run, iterated every epoch."""
    import importlib.util

    data = tmp_path / "toy"
    assert train("--make-data", str(data), "--classes", "2", "--per-class", "4").returncode == 0
    spec = importlib.util.spec_from_file_location("shmstage_example_train", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    built, epochs = [], []

    class Counting(example.CudaPrefetcher):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

        def __iter__(self):
            epochs.append(self)
            return super().__iter__()

    monkeypatch.setattr(example, "CudaPrefetcher", Counting)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    argv = ["--data", str(data), "--epochs", "3", "--batch-size", "4", "--workers", "0"]
    assert example.main(argv) == 0
    assert len(built) == 1 and epochs == built * 3


def test_example_without_data_is_a_clear_error(tmp_path):
    """No --data and no $SHMSTAGE_DATA: one `Error:` line, exit 2."""
    env = {k: v for k, v in os.environ.items() if k != "SHMSTAGE_DATA"}
    r = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 2
    assert (
        r.stderr == "Error: no dataset: pass --data DIR or run under `shmstage run --stage DIR`\n"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_example_with_torch_compile(tmp_path):
    """--compile (inductor on CPU) trains too; takes minutes for the C++ build."""
    data = tmp_path / "toy"
    assert train("--make-data", str(data), "--classes", "2", "--per-class", "8").returncode == 0
    r = train(
        "--data", str(data), "--max-steps", "2", "--batch-size", "4", "--workers", "0", "--compile"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: 2 steps" in r.stdout
