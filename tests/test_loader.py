"""shmstage.loader: DataLoader sizing, CudaPrefetcher on CPU, BackgroundLoader lifecycle."""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses
import gc
import random
import threading
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import Dataset, TensorDataset  # noqa: E402

from shmstage import loader, system  # noqa: E402
from shmstage.errors import ShmstageError  # noqa: E402
from shmstage.loader import (  # noqa: E402
    BackgroundLoader,
    CudaPrefetcher,
    default_num_workers,
    loader_kwargs,
    make_loader,
)

LOADER_ENV = (
    "SHMSTAGE_NUM_WORKERS",
    "SHMSTAGE_PIN_MEMORY",
    "SHMSTAGE_PREFETCH_FACTOR",
    "LOCAL_WORLD_SIZE",
    "RANK",
    "SLURM_PROCID",
    "SLURM_STEP_ID",
    "SLURM_NODEID",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in LOADER_ENV:
        monkeypatch.delenv(var, raising=False)


def fake_node(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    affinity: int,
    quota: str | None,
    container: int | None = None,
    launcher: int | None = None,
) -> None:
    """Affinity of ``affinity`` CPUs, a cgroup v2 ``cpu.max`` of ``quota``, a cpuset of
    ``container`` CPUs (default: the affinity's) and a parent process (the launcher) with
    ``launcher`` CPUs (default: the container's) in a fake tree."""
    import os

    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/job\n")
    (proc / str(os.getppid())).mkdir()
    (proc / str(os.getppid()) / "status").write_text(
        f"Name:\ttorchrun\nCpus_allowed_list:\t0-{(launcher or container or affinity) - 1}\n"
    )
    cg = tmp_path / "cgroup"
    (cg / "job").mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("cpuset cpu memory\n")
    (cg / "job" / "cpuset.cpus.effective").write_text(f"0-{(container or affinity) - 1}\n")
    if quota is not None:
        (cg / "job" / "cpu.max").write_text(quota + "\n")
    real, real_set = system.usable_cpus, getattr(system, "cpu_set", None)
    monkeypatch.setattr(
        loader.os, "sched_getaffinity", lambda pid: set(range(affinity)), raising=False
    )
    monkeypatch.setattr(
        system.os, "sched_getaffinity", lambda pid: set(range(affinity)), raising=False
    )
    monkeypatch.setattr(system, "usable_cpus", lambda: real(proc=str(proc), cgroup_root=str(cg)))
    monkeypatch.setattr(
        system, "cpu_set", lambda: real_set(proc=str(proc), cgroup_root=str(cg)), raising=False
    )


# --- worker count -----------------------------------------------------------


@pytest.mark.parametrize(
    ("affinity", "quota", "ranks", "expected"),
    [
        (16, None, None, 15),  # one CPU stays with the main process
        (16, None, "4", 3),  # 16 CPUs / 4 ranks - 1
        (16, "400000 100000", None, 3),  # cgroup quota of 4 CPUs caps the affinity set
        (16, "250000 100000", None, 2),  # 2.5 CPUs of quota -> 3 usable
        (16, "400000 100000", "2", 1),
        (2, None, "8", 1),  # never fewer than one worker
        (16, "max 100000", "2", 7),  # "max" = no quota
    ],
)
def test_default_workers_follow_affinity_quota_and_local_world_size(
    monkeypatch, tmp_path, affinity, quota, ranks, expected
):
    """num_workers = usable CPUs (affinity capped by cgroup quota) // LOCAL_WORLD_SIZE - 1, >= 1."""
    fake_node(monkeypatch, tmp_path, affinity, quota)
    if ranks is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    assert default_num_workers() == expected
    assert loader_kwargs()["num_workers"] == expected


@pytest.mark.parametrize(
    ("affinity", "container", "quota", "env", "expected"),
    [
        # torchrun --numa-binding: each of 2 ranks bound to its 16 of 32 CPUs, not halved again
        (16, 32, None, {"LOCAL_WORLD_SIZE": "2"}, 15),
        # srun --ntasks-per-node=8 (no binding): 64 CPUs shared by the step's 8 tasks
        (64, 64, None, {"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "8"}, 7),
        (64, 64, None, {"SLURM_STEP_ID": "0", "SLURM_NTASKS_PER_NODE": "8"}, 7),
        # this node (SLURM_NODEID 2) runs 2 of the job's tasks
        (
            16,
            16,
            None,
            {"SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "4(x2),2", "SLURM_NODEID": "2"},
            7,
        ),
        # srun --cpu-bind: each task already bound to its 8 CPUs
        (8, 64, None, {"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "8"}, 7),
        # the batch script itself is one process, whatever the job's tasks per node
        (16, 16, None, {"SLURM_NTASKS_PER_NODE": "8"}, 15),
        # a quota is the container's: 8 bound ranks share 16 CPUs of quota
        (8, 64, "1600000 100000", {"LOCAL_WORLD_SIZE": "8"}, 1),
        (16, 64, "1600000 100000", {"LOCAL_WORLD_SIZE": "2"}, 7),
        # torchrun --numa-binding=node, 8 ranks, 2 NUMA nodes: each node's 32 CPUs for 4 ranks
        (32, 64, None, {"LOCAL_WORLD_SIZE": "8"}, 7),
    ],
)
def test_default_workers_count_each_ranks_cpus_once(
    monkeypatch, tmp_path, affinity, container, quota, env, expected
):
    """A per-rank affinity set is not divided again; a shared one is divided by torchrun's or Slurm's local ranks."""
    fake_node(monkeypatch, tmp_path, affinity, quota, container)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert default_num_workers() == expected
    assert loader_kwargs()["num_workers"] == expected


@pytest.mark.parametrize("launcher", [32, None])
def test_a_launcher_bound_to_some_cpus_shares_them_among_its_ranks(monkeypatch, tmp_path, launcher):
    """numactl --cpunodebind=0 torchrun --nproc-per-node 4 on 64 CPUs: every rank inherits the
    launcher's 32 CPUs; they are the 4 ranks' together (7 workers each), not each rank's (31)."""
    fake_node(monkeypatch, tmp_path, 32, None, 64, launcher=launcher)
    if launcher is None:  # the parent is not visible (another PID namespace)
        monkeypatch.setattr(system.os, "getppid", lambda: 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_num_workers() == 7
    assert loader_kwargs()["num_workers"] == 7


@pytest.mark.parametrize(
    ("affinity", "container", "quota", "launcher", "ranks", "expected"),
    [
        (16, 16, None, 16, 1, 16),
        (16, 16, None, 16, 4, 4),  # shared: divided
        (4, 16, None, 16, 4, 4),  # bound to this rank by its launcher: kept
        (16, 16, 4.0, 16, 1, 4),
        (16, 16, 2.5, 16, 1, 3),
        (4, 16, 8.0, 16, 4, 2),  # the quota is shared even when the affinity is not
        (2, 2, None, 2, 8, 1),  # never below one
        # the launcher's own mask (numactl --cpunodebind=0 torchrun): every rank's, divided
        (32, 64, None, 32, 4, 8),
        (32, 64, None, None, 4, 8),  # launcher unknown: divided (fewer workers, not more)
        # torchrun --numa-binding=node, 8 ranks on 2 nodes: 4 ranks share each node's 32
        (32, 64, None, 64, 8, 8),
    ],
)
def test_rank_cpus(affinity, container, quota, launcher, ranks, expected):
    """rank_cpus: divide a shared affinity set by the ranks, a bound one only by the ranks that must share it; the quota always."""
    cpus = system.CpuSet(affinity, container, quota, launcher)
    assert loader.rank_cpus(cpus, ranks) == expected


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, 1),
        ({"LOCAL_WORLD_SIZE": "4", "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "8"}, 4),
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "8(x3)"}, 8),
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "8,4", "SLURM_NODEID": "1"}, 4),
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2,4"}, 4),  # node unknown: the most
        ({"SLURM_STEP_ID": "3", "SLURM_NTASKS_PER_NODE": "6", "SLURM_TASKS_PER_NODE": "2"}, 6),
        ({"SLURM_STEP_ID": "3", "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_NODEID": "3"}, 2),
        ({"SLURM_TASKS_PER_NODE": "8"}, 1),  # a batch script, not a step's task
    ],
)
def test_local_ranks(env, expected):
    """local_ranks: torchrun's LOCAL_WORLD_SIZE, else a Slurm step's tasks on this node, else 1."""
    assert loader.local_ranks(env) == expected


def test_bad_slurm_tasks_per_node_is_a_clear_error():
    """A malformed Slurm tasks-per-node value is refused with its name and value."""
    with pytest.raises(ShmstageError, match=r"^SLURM_STEP_TASKS_PER_NODE='eight' is not a Slurm"):
        loader.local_ranks({"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "eight"})


PROBE_CPUS = (
    "import json; from shmstage import system; from shmstage.loader import cpus_per_rank, "
    "default_num_workers; c = system.cpu_set(); print(json.dumps([c.affinity, c.container, "
    "c.bound, cpus_per_rank(), default_num_workers()]))"
)


@pytest.mark.timeout(60)
def test_real_taskset_binding_is_seen_as_this_ranks_share():
    """Under a real `taskset` (as torchrun --numa-binding does) the bound CPUs are not divided by the ranks."""
    import json
    import os
    import subprocess
    import sys

    n = len(os.sched_getaffinity(0))
    if n < 2:
        pytest.skip("needs at least 2 CPUs")
    env = {**os.environ, "LOCAL_WORLD_SIZE": "2"}
    for var in LOADER_ENV[4:]:
        env.pop(var, None)

    def probe(*prefix: str) -> list:
        out = subprocess.run(
            [*prefix, sys.executable, "-c", PROBE_CPUS],
            capture_output=True, text=True, env=env, timeout=60, check=True,
        )  # fmt: skip
        return json.loads(out.stdout)

    affinity, container, _, _, _ = probe()
    assert affinity == n and container >= n
    half = n // 2
    affinity, container, bound, cpus, workers = probe("taskset", "-c", f"0-{half - 1}")
    assert affinity == half and bound and container >= n
    assert cpus == half  # bound to this rank: its whole share, not half of it
    assert workers == max(1, half - 1)


@pytest.mark.timeout(60)
def test_real_taskset_around_the_launcher_is_shared_by_its_ranks():
    """A real `taskset` around a launcher: its rank inherits the launcher's mask and sees it as shared (not bound)."""
    import json
    import os
    import subprocess
    import sys

    n = len(os.sched_getaffinity(0))
    if n < 2:
        pytest.skip("needs at least 2 CPUs")
    env = {**os.environ, "LOCAL_WORLD_SIZE": "2"}
    for var in LOADER_ENV[4:]:
        env.pop(var, None)
    probe = (
        "import json; from shmstage import system; c = system.cpu_set(); "
        "print(json.dumps([c.affinity, c.launcher, c.bound]))"
    )
    launcher = (
        f"import subprocess, sys; subprocess.run([sys.executable, '-c', {probe!r}], check=True)"
    )

    def run(*argv: str) -> list:
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=True)
        return json.loads(out.stdout)

    # the rank bound by its launcher (what torchrun --numa-binding does): bound
    assert run("taskset", "-c", "0", sys.executable, "-c", probe) == [1, n, True]
    # the launcher bound (taskset/numactl around torchrun): the rank's mask is the launcher's
    assert run("taskset", "-c", "0", sys.executable, "-c", launcher) == [1, 1, False]


def test_bad_local_world_size_is_a_clear_error(monkeypatch):
    """A LOCAL_WORLD_SIZE that is not a positive integer is refused with its value."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "zero")
    with pytest.raises(ShmstageError, match=r"^LOCAL_WORLD_SIZE='zero' is not a positive integer$"):
        loader_kwargs()


def test_defaults_with_workers(monkeypatch, tmp_path):
    """With workers: torch's non-persistent workers, a prefetch factor in 2..4; seeding is torch's own."""
    fake_node(monkeypatch, tmp_path, 8, None)
    kw = loader_kwargs()
    assert kw["num_workers"] == 7
    assert "persistent_workers" not in kw  # torch's default (False): see make_loader
    assert 2 <= kw["prefetch_factor"] <= 4
    assert "worker_init_fn" not in kw  # torch seeds random/torch/numpy per worker itself
    init = lambda worker_id: None  # noqa: E731
    assert loader_kwargs(worker_init_fn=init)["worker_init_fn"] is init


def test_pin_memory_follows_the_accelerator(monkeypatch):
    """pin_memory is on exactly when CUDA is available (and off on this CPU-only node)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loader_kwargs(num_workers=0)["pin_memory"] is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(loader, "_accelerator_present", lambda: False)
    assert loader_kwargs(num_workers=0)["pin_memory"] is False


def test_env_overrides(monkeypatch):
    """SHMSTAGE_NUM_WORKERS / PIN_MEMORY / PREFETCH_FACTOR (set by `shmstage run`) apply."""
    monkeypatch.setenv("SHMSTAGE_NUM_WORKERS", "3")
    monkeypatch.setenv("SHMSTAGE_PIN_MEMORY", "1")
    monkeypatch.setenv("SHMSTAGE_PREFETCH_FACTOR", "2")
    kw = loader_kwargs()
    assert (kw["num_workers"], kw["pin_memory"], kw["prefetch_factor"]) == (3, True, 2)
    monkeypatch.setenv("SHMSTAGE_PIN_MEMORY", "off")
    assert loader_kwargs()["pin_memory"] is False


def test_auto_in_env_means_default(monkeypatch, tmp_path):
    """SHMSTAGE_NUM_WORKERS=auto (the node config's value) falls back to the computed default."""
    fake_node(monkeypatch, tmp_path, 6, None)
    monkeypatch.setenv("SHMSTAGE_NUM_WORKERS", "auto")
    assert loader_kwargs()["num_workers"] == 5


def test_arguments_win_over_env(monkeypatch):
    """Explicit arguments beat the environment; with num_workers=0 worker-only options are dropped."""
    monkeypatch.setenv("SHMSTAGE_NUM_WORKERS", "3")
    monkeypatch.setenv("SHMSTAGE_PIN_MEMORY", "1")
    monkeypatch.setenv("SHMSTAGE_PREFETCH_FACTOR", "2")
    kw = loader_kwargs(num_workers=0, pin_memory=False, shuffle=True)
    assert kw == {"num_workers": 0, "pin_memory": False, "shuffle": True}
    assert loader_kwargs(num_workers=1, prefetch_factor=3)["prefetch_factor"] == 3


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        (
            "SHMSTAGE_NUM_WORKERS",
            "many",
            "SHMSTAGE_NUM_WORKERS='many' is not a valid value: use an integer >= 0 or 'auto'",
        ),
        (
            "SHMSTAGE_NUM_WORKERS",
            "-1",
            "SHMSTAGE_NUM_WORKERS='-1' is not a valid value: use an integer >= 0 or 'auto'",
        ),
        (
            "SHMSTAGE_PREFETCH_FACTOR",
            "0",
            "SHMSTAGE_PREFETCH_FACTOR='0' is not a valid value: use an integer >= 1",
        ),
        (
            "SHMSTAGE_PIN_MEMORY",
            "maybe",
            "SHMSTAGE_PIN_MEMORY='maybe' is not a valid value: use 1 or 0 (or auto)",
        ),
    ],
)
def test_bad_env_values_are_clear_errors(monkeypatch, var, value, message):
    """A malformed loader variable raises ShmstageError naming the variable, value and fix."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ShmstageError) as e:
        loader_kwargs(num_workers=1)
    assert str(e.value) == message


def test_prefetch_factor_without_workers_is_refused():
    """Asking for prefetch_factor with num_workers=0 is a clear error, not DataLoader's ValueError."""
    with pytest.raises(ShmstageError, match="prefetch_factor needs num_workers > 0"):
        loader_kwargs(num_workers=0, prefetch_factor=2)


class RandomDataset(Dataset):
    """Returns numpy's and random's next draw: equal across workers unless they are seeded apart."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        import random

        import numpy as np

        info = torch.utils.data.get_worker_info()
        return torch.tensor(
            [info.id if info else -1, np.random.randint(1 << 30), random.randrange(1 << 30)]
        )


@pytest.mark.timeout(120)
def test_real_loader_with_workers_on_cpu():
    """make_loader builds a working multi-worker loader on CPU: every sample once, twice over."""
    data = TensorDataset(torch.arange(20).float())
    dl = make_loader(data, 4, num_workers=2)
    assert dl.num_workers == 2 and not dl.persistent_workers
    for _ in range(2):
        seen = sorted(int(v) for (batch,) in dl for v in batch)
        assert seen == list(range(20))


class EpochProbe(Dataset):
    """Returns, per item, the ``size`` the job set on the dataset (progressive resizing)."""

    def __init__(self) -> None:
        self.size = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return torch.tensor(self.size)


@pytest.mark.timeout(120)
def test_dataset_changes_between_epochs_reach_default_workers():
    """With make_loader's defaults, a dataset attribute set between epochs is what workers see."""
    data = EpochProbe()
    dl = make_loader(data, 2, num_workers=2)
    seen = []
    for size in (128, 160, 192):
        data.size = size
        seen.append(sorted({int(v) for batch in dl for v in batch}))
    assert seen == [[128], [160], [192]]


@pytest.mark.timeout(120)
def test_persistent_workers_are_an_explicit_choice():
    """persistent_workers=True is passed through (and its workers keep the first epoch's dataset)."""
    data = EpochProbe()
    dl = make_loader(data, 2, num_workers=2, persistent_workers=True)
    assert dl.persistent_workers
    data.size = 1
    assert {int(v) for batch in dl for v in batch} == {1}
    data.size = 2
    assert {int(v) for batch in dl for v in batch} == {1}  # the documented trade-off


def test_persistent_workers_without_workers_is_ignored_not_an_error():
    """The demo and bench ask for kept workers; a node whose count resolves to 0 still loads."""
    dl = make_loader(EpochProbe(), 2, num_workers=0, persistent_workers=True)
    assert dl.num_workers == 0 and not dl.persistent_workers
    assert len(list(dl)) > 0


class SeedProbe(Dataset):
    """Per call in a worker: (worker id, worker seed, call number in this worker, random draw)."""

    calls = 0

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        import random

        SeedProbe.calls += 1  # per worker process
        info = torch.utils.data.get_worker_info()
        return torch.tensor([info.id, info.seed, SeedProbe.calls, random.getrandbits(30)])


@pytest.mark.timeout(120)
def test_workers_keep_torchs_own_seeds():
    """make_loader's workers draw from the seeds torch gave them (nothing re-seeds them).

    torch seeds ``random`` with ``get_worker_info().seed`` in each worker, so a job can
    reproduce a worker's draws from that public seed; a worker_init_fn that re-seeds (as
    seed_worker did, from initial_seed() % 2**32) breaks that.
    """
    dl = make_loader(SeedProbe(), 1, num_workers=2)
    first = {}
    for (row,) in dl:
        worker, seed, call, draw = (int(v) for v in row)
        if call == 1:
            first[worker] = (seed, draw)
    assert set(first) == {0, 1}
    for seed, draw in first.values():
        assert draw == random.Random(seed).getrandbits(30)


def test_seed_worker_is_a_deprecated_no_op():
    """Old scripts passing worker_init_fn=seed_worker get a DeprecationWarning, not a re-seed."""
    random.seed(1234)
    expected = random.Random(1234).random()
    with pytest.warns(DeprecationWarning, match="seed_worker is deprecated and does nothing"):
        loader.seed_worker(0)
    assert random.random() == expected  # random's state untouched
    assert "seed_worker" not in loader.__all__


@pytest.mark.timeout(120)
def test_workers_draw_different_random_numbers():
    """torch's per-worker seeds give each worker its own numpy/random stream."""
    dl = make_loader(RandomDataset(), 1, num_workers=2)
    first = {}
    for (row,) in dl:
        first.setdefault(int(row[0]), (int(row[1]), int(row[2])))
    assert set(first) == {0, 1}
    assert first[0][0] != first[1][0] and first[0][1] != first[1][1]


RANK_DRAWS = """
import json, random, sys
import numpy as np, torch
from torch.utils.data import Dataset
from shmstage.loader import make_loader

class Augment(Dataset):  # one random crop offset per library, as an augmentation draws it
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return torch.tensor([random.randrange(1 << 30), np.random.randint(1 << 30),
                             int(torch.randint(1 << 30, ()))])

torch.manual_seed(0)  # every rank seeds alike, as examples/train.py used to
dl = make_loader(Augment(), 1, num_workers=2, lease=False)
print(json.dumps([[row.tolist() for row in batch] for epoch in range(2) for batch in dl]))
"""


@pytest.mark.timeout(120)
def test_ranks_draw_different_augmentations_and_each_rank_is_reproducible():
    """Ranks 0 and 1 (RANK env) seeded alike draw different random numbers in their workers; a re-run of a rank draws the same."""
    import json
    import os
    import subprocess
    import sys

    def draws(rank: str, var: str = "RANK") -> list:
        env = {k: v for k, v in os.environ.items() if k not in LOADER_ENV}
        out = subprocess.run(
            [sys.executable, "-c", RANK_DRAWS], env={**env, var: rank},
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        return json.loads(out.stdout)

    rank0, rank1 = draws("0"), draws("1")
    assert rank0 == draws("0")  # same seed, same rank: reproducible
    flat0 = {v for batch in rank0 for row in batch for v in row}
    flat1 = {v for batch in rank1 for row in batch for v in row}
    assert not flat0 & flat1  # no draw shared between the ranks, in any library
    assert draws("1", "SLURM_PROCID") == rank1  # srun without torchrun: Slurm's rank


def test_bad_rank_is_a_clear_error(monkeypatch):
    """A RANK that is not an integer is refused with its value."""
    monkeypatch.setenv("RANK", "first")
    with pytest.raises(ShmstageError, match=r"^RANK='first' is not a rank: use an integer >= 0$"):
        loader_kwargs(num_workers=1)


def test_real_loader_without_workers():
    """num_workers=0 gives a valid single-process loader."""
    dl = make_loader(TensorDataset(torch.arange(6)), 2, num_workers=0)
    assert [b[0].tolist() for b in dl] == [[0, 1], [2, 3], [4, 5]]


# --- CudaPrefetcher ---------------------------------------------------------


class Pair(NamedTuple):
    image: torch.Tensor
    meta: dict


def nested_batches() -> list:
    return [
        (
            torch.full((2, 3), float(i)),
            {"label": torch.tensor([i, i + 1]), "name": f"b{i}", "extra": [torch.ones(1) * i, 7]},
            Pair(torch.arange(3) + i, {"id": i}),
            None,
        )
        for i in range(3)
    ]


def assert_same_structure(got, want, device: str) -> None:
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.device.type == device
        if device != "meta":
            assert torch.equal(got.cpu(), want)
        assert got.shape == want.shape and got.dtype == want.dtype
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same_structure(got[k], want[k], device)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_structure(g, w, device)
    else:
        assert got == want


def test_prefetcher_on_cpu_passes_batches_through():
    """Without CUDA the prefetcher yields the loader's batches unchanged, nested types intact."""
    batches = nested_batches()
    got = list(CudaPrefetcher(batches))
    assert len(got) == 3
    for g, w in zip(got, batches):
        assert_same_structure(g, w, "cpu")
        assert g[0] is w[0]  # not copied


def test_prefetcher_moves_nested_tensors_to_another_device():
    """For a non-CUDA device every tensor in tuples/lists/dicts/namedtuples is moved; the rest kept."""
    batches = nested_batches()
    got = list(CudaPrefetcher(batches, device="meta"))
    for g, w in zip(got, batches):
        assert_same_structure(g, w, "meta")
        assert isinstance(g[2], Pair) and g[2].meta == {"id": g[2].meta["id"]}


class Tagged(dict):
    """A dict subclass that carries an attribute (dict.copy() would return a plain dict)."""

    source = "default"


class Frozen(collections.abc.Mapping):
    """A read-only Mapping built from a dict."""

    def __init__(self, data) -> None:
        self._data = dict(data)

    def __getitem__(self, k):
        return self._data[k]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


@dataclasses.dataclass(frozen=True)
class Sample:
    image: torch.Tensor
    meta: dict
    label: int = 0
    cache: torch.Tensor | None = dataclasses.field(default=None, init=False)


class Graph:
    """Moves itself, as torch_geometric's Data or a HF BatchEncoding do; records its calls."""

    def __init__(self, x: torch.Tensor, calls: list | None = None) -> None:
        self.x = x
        self.calls = [] if calls is None else calls

    def to(self, device, non_blocking: bool = False) -> Graph:
        self.calls.append((str(device), non_blocking))
        return Graph(self.x.to(device, non_blocking=non_blocking), self.calls)


class OldStyle:
    """A ``.to(device)`` that takes no non_blocking."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, device) -> OldStyle:
        return OldStyle(self.x.to(device))


def double(x):
    return x * 2 if isinstance(x, torch.Tensor) else ("moved", x)


def test_move_batch_keeps_every_container_type():
    """move_batch keeps dict subclasses, defaultdict, Mappings, namedtuples and dataclasses; moves .to() objects."""
    tagged = Tagged(x=torch.ones(1))
    tagged.source = "shard-7"
    dd = collections.defaultdict(list, {"x": torch.ones(1)})
    od = collections.OrderedDict(b=torch.zeros(1), a=torch.ones(1))
    sample = Sample(torch.ones(2), {"id": 3, "w": torch.ones(1)}, 5)
    object.__setattr__(sample, "cache", torch.ones(1))
    graph = Graph(torch.ones(1))
    out = loader.move_batch(
        [tagged, dd, od, Frozen({"y": torch.ones(1)}), Pair(torch.ones(1), {}), sample, graph, "s"],
        double,
    )
    two = torch.full((1,), 2.0)
    assert type(out[0]) is Tagged and out[0].source == "shard-7" and torch.equal(out[0]["x"], two)
    assert type(out[1]) is collections.defaultdict and out[1].default_factory is list
    assert type(out[2]) is collections.OrderedDict and list(out[2]) == ["b", "a"]
    assert torch.equal(out[2]["a"], two)
    assert type(out[3]) is Frozen and torch.equal(out[3]["y"], two)
    assert type(out[4]) is Pair and torch.equal(out[4].image, two)
    assert type(out[5]) is Sample and out[5].label == 5 and out[5].meta["id"] == 3
    assert torch.equal(out[5].image, torch.full((2,), 2.0)) and torch.equal(out[5].meta["w"], two)
    assert torch.equal(out[5].cache, two)  # an init=False field too
    assert out[6] == ("moved", graph)  # the object itself went to move
    assert out[7] == "s"
    assert torch.equal(tagged["x"], torch.ones(1)) and torch.equal(sample.image, torch.ones(2))


def test_batch_tensors_finds_what_was_moved():
    """batch_tensors (record_stream's list) reaches tensors in dataclasses and in .to() objects."""
    sample = Sample(torch.ones(2), {"w": torch.zeros(1)})
    found = list(
        loader.batch_tensors([sample, Graph(torch.full((3,), 7.0)), {"k": (torch.ones(4),)}])
    )
    assert sorted(t.numel() for t in found) == [1, 2, 3, 4]


def test_prefetcher_moves_dataclasses_and_to_objects_keeping_types():
    """Through CudaPrefetcher (device "meta"): subclass types kept, dataclasses and .to() objects moved."""
    calls: list = []
    tagged = Tagged(x=torch.ones(1))
    tagged.source = "shard-7"
    batch = {
        "tagged": tagged,
        "sample": Sample(torch.ones(2), {"w": torch.ones(1)}),
        "graph": Graph(torch.ones(1), calls),
        "old": OldStyle(torch.ones(1)),
    }
    (got,) = list(CudaPrefetcher([batch], device="meta"))
    assert type(got["tagged"]) is Tagged and got["tagged"].source == "shard-7"
    assert got["tagged"]["x"].device.type == "meta"
    assert type(got["sample"]) is Sample and got["sample"].image.device.type == "meta"
    assert got["sample"].meta["w"].device.type == "meta"
    assert type(got["graph"]) is Graph and got["graph"].x.device.type == "meta"
    assert calls == [("meta", True)]  # non_blocking passed to a .to() that takes it
    assert type(got["old"]) is OldStyle and got["old"].x.device.type == "meta"


def test_prefetcher_empty_loader_and_len():
    """An empty loader yields nothing; len() is the loader's length."""
    assert list(CudaPrefetcher([])) == []
    assert list(CudaPrefetcher([], device="meta")) == []
    dl = make_loader(TensorDataset(torch.arange(10)), 4, num_workers=0)
    assert len(CudaPrefetcher(dl)) == len(dl) == 3


def test_prefetcher_iterates_again():
    """Each iter() is a new epoch over the loader."""
    p = CudaPrefetcher([torch.ones(1), torch.zeros(1)], device="meta")
    assert len(list(p)) == 2 and len(list(p)) == 2


# --- BackgroundLoader -------------------------------------------------------


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_background_keeps_order_and_none_items():
    """Items, None included, arrive in order; None is not mistaken for the end."""
    items = [1, None, "x", None, 0]
    assert list(BackgroundLoader(items)) == items


@pytest.mark.timeout(10)
def test_background_reraises_producer_exception_with_traceback():
    """A producer exception reaches the consumer with its type and the producer's frames; no hang."""

    def failing_source():
        yield 1
        yield None
        raise KeyError("broken sample 3")

    it = iter(BackgroundLoader(failing_source()))
    assert next(it) == 1 and next(it) is None
    with pytest.raises(KeyError, match="broken sample 3") as e:
        next(it)
    assert "failing_source" in [f.name for f in traceback.extract_tb(e.value.__traceback__)]
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.timeout(10)
def test_background_reraises_error_from_iter():
    """An iterable whose iter() raises is reported in the consumer too."""

    class Broken:
        def __iter__(self):
            raise OSError("cannot open shard")

    with pytest.raises(OSError, match="cannot open shard"):
        list(BackgroundLoader(Broken()))


@pytest.mark.timeout(10)
def test_next_after_end_raises_stopiteration_at_once():
    """After the end, next() raises StopIteration immediately, every time."""
    it = iter(BackgroundLoader([1]))
    assert list(it) == [1]
    for _ in range(3):
        with pytest.raises(StopIteration):
            next(it)


def endless(flag: threading.Event, produced: list[int]):
    try:
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1
    finally:
        flag.set()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("how", ["close", "with", "gc", "loader-close", "new-epoch"])
def test_early_stop_runs_the_generator_finally(how):
    """close(), leaving `with`, dropping the iterator, loader.close() or a new epoch stop the thread and run `finally`."""
    flag, produced = threading.Event(), []
    bg = BackgroundLoader(endless(flag, produced), max_prefetch=2)
    before = threading.active_count()
    it = iter(bg)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    if how == "close":
        it.close()
    elif how == "with":
        with it:
            next(it)
    elif how == "gc":
        del it
        gc.collect()
    elif how == "loader-close":
        bg.close()
    else:
        bg.iterable = iter([])
        assert list(bg) == []
    assert flag.wait(5)
    assert wait_until(lambda: threading.active_count() == before)


@pytest.mark.timeout(10)
def test_queue_is_bounded():
    """The producer runs at most max_prefetch items ahead (+1 waiting in put)."""
    flag, produced = threading.Event(), []
    it = iter(BackgroundLoader(endless(flag, produced), max_prefetch=3))
    assert wait_until(lambda: len(produced) == 4)
    time.sleep(0.2)
    assert len(produced) == 4
    it.close()
    assert flag.is_set()


@pytest.mark.timeout(60)
def test_no_thread_leak_across_100_epochs():
    """100 epochs, full and abandoned, leave the thread count where it started."""
    before = threading.active_count()
    bg = BackgroundLoader(range(20), max_prefetch=4)
    for epoch in range(100):
        if epoch % 2:
            assert list(bg) == list(range(20))
        else:
            for x in bg:
                if x == 3:
                    break
    bg.close()
    assert threading.active_count() == before


def test_len_and_bad_max_prefetch():
    """len() is the source's; max_prefetch < 1 is refused."""
    assert len(BackgroundLoader([1, 2, 3])) == 3
    with pytest.raises(ShmstageError, match="max_prefetch=0"):
        BackgroundLoader([], max_prefetch=0)


def test_background_refuses_to_run_a_prefetcher_in_its_thread():
    """BackgroundLoader(CudaPrefetcher(...)) is refused, saying to wrap the other way round; that order works."""
    batches = [torch.ones(1), torch.zeros(1)]
    with pytest.raises(ShmstageError) as e:
        BackgroundLoader(CudaPrefetcher(batches))
    assert str(e.value) == (
        "BackgroundLoader(CudaPrefetcher(...)) would copy to the GPU from the background thread, "
        "with that thread's device and stream: wrap it the other way round, "
        "CudaPrefetcher(BackgroundLoader(loader))"
    )
    got = list(CudaPrefetcher(BackgroundLoader(batches)))
    assert [float(t) for t in got] == [1.0, 0.0]


@pytest.mark.parametrize(
    "wrap",
    [
        lambda p: __import__("itertools").islice(p, 2),
        iter,
        lambda p: (b for b in p),
        lambda p: (b for b in (lambda: (yield from p))()),  # iter() in the producer thread
    ],
    ids=["islice", "iter", "genexpr", "generator"],
)
def test_a_wrapped_prefetcher_is_refused_in_the_background_thread(wrap):
    """BackgroundLoader(islice(CudaPrefetcher(...))) and the like: the prefetcher refuses to copy in the producer thread."""
    threads: list[str] = []

    def source():
        for i in range(3):
            threads.append(threading.current_thread().name)
            yield torch.ones(1) * i

    class Source:
        def __iter__(self):
            return source()

    with pytest.raises(ShmstageError) as e:
        list(BackgroundLoader(wrap(CudaPrefetcher(Source(), device="meta"))))
    assert "CudaPrefetcher(BackgroundLoader(loader))" in str(e.value)
    assert threads == []  # refused before reading a batch there


def test_a_prefetcher_iterated_in_another_thread_than_iter_is_refused():
    """iter() in one thread, next() in another: refused; the whole loop in one thread (any) is fine."""
    p = CudaPrefetcher([torch.ones(1)], device="meta")
    it = iter(p)
    errors: list[BaseException] = []
    got: list = []

    def consume(iterable):
        try:
            got.extend(iterable)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=consume, args=(it,))
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ShmstageError)
    assert "thread that called iter()" in str(errors[0])
    t = threading.Thread(target=consume, args=(p,))
    t.start()
    t.join()
    assert len(errors) == 1 and [x.device.type for x in got] == ["meta"]


def test_background_over_a_real_loader():
    """BackgroundLoader composes with make_loader and CudaPrefetcher."""
    dl = make_loader(TensorDataset(torch.arange(8)), 2, num_workers=0)
    got = [b[0].tolist() for b in CudaPrefetcher(BackgroundLoader(dl))]
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7]]


# --- staged_path ------------------------------------------------------------


def test_staged_path_finds_the_staged_copy(tmp_path):
    """staged_path(source or name) is the published copy once the dataset is staged."""
    from shmstage import stage as engine

    src = tmp_path / "imagenet"
    (src / "train").mkdir(parents=True)
    (src / "train" / "0.jpg").write_bytes(b"x" * 100)
    dest = tmp_path / "shm"
    ds = engine.stage(str(src), dest=str(dest))
    assert loader.staged_path(src, dest=dest) == Path(ds.path) == dest / "imagenet"
    assert loader.staged_path("imagenet", dest=dest) == dest / "imagenet"


def test_staged_path_falls_back_to_the_source_with_a_warning(tmp_path):
    """Not staged: staged_path returns the source and warns (ShmstageWarning) how to stage it."""
    src = tmp_path / "imagenet"
    src.mkdir()
    with pytest.warns(loader.ShmstageWarning, match=r"is not staged on this node.*shmstage stage"):
        assert loader.staged_path(str(src), dest=tmp_path / "shm") == src


def test_prefetcher_asked_for_cuda_without_cuda():
    """device='cuda' on a machine without CUDA is a clear error, not a torch assertion."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ShmstageError, match="^device cuda was asked for but CUDA is not available"):
        CudaPrefetcher([], device="cuda")


class SlowPersistentSource:
    """Like a DataLoader with persistent workers: iter() is the same iterator every epoch.

    Each ``__next__`` takes up to ``slow`` seconds, ended early by ``gate``; it counts callers
    inside it at once, and ``finished`` is set when a slow call has run to its end.
    """

    def __init__(self, slow: float = 3.0) -> None:
        self.slow = slow
        self.lock = threading.Lock()
        self.inside = 0
        self.max_inside = 0
        self.count = 0
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.finished = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        with self.lock:
            self.inside += 1
            self.max_inside = max(self.max_inside, self.inside)
            self.count += 1
            n = self.count
        try:
            if n == 1:  # the first item is the slow one
                self.entered.set()
                if not self.gate.wait(self.slow):
                    self.finished.set()
            return n
        finally:
            with self.lock:
                self.inside -= 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["close", "loader-close", "del"])
def test_no_overlapping_next_across_close_and_a_new_epoch(how):
    """close()/del return while the producer is inside next(); the next epoch waits for it."""
    src = SlowPersistentSource()
    before = threading.active_count()
    bg = BackgroundLoader(src, max_prefetch=1)
    it = iter(bg)
    assert src.entered.wait(10)  # the producer is inside the slow next()
    if how == "close":
        it.close()
    elif how == "loader-close":
        bg.close()
    else:
        del it
        gc.collect()
    # close() and __del__ did not wait for the 3 s item: it is still being read
    assert not src.finished.is_set() and src.inside == 1

    second: list[object] = []
    started = threading.Event()

    def next_epoch() -> None:
        started.set()
        it2 = iter(bg)  # must wait for the old producer, not start a second one
        second.extend(next(it2) for _ in range(3))
        it2.close()

    t = threading.Thread(target=next_epoch)
    t.start()
    try:
        assert started.wait(10)
        time.sleep(0.2)  # give a wrongly started second producer the chance to enter next()
    finally:
        src.gate.set()
        t.join(20)
    assert not t.is_alive()
    assert src.max_inside == 1  # never two __next__ calls at once
    assert second == [2, 3, 4]  # the old producer dropped item 1: nothing read twice or lost
    bg.close()
    assert wait_until(lambda: threading.active_count() == before)


def test_prefetcher_resolves_the_cuda_device_at_first_use(monkeypatch):
    """Built while cuda:0 is current, iterated after set_device(1): it copies to cuda:1.

    Pure logic (no GPU here): is_available/current_device/Stream are stand-ins.
    """
    current = {"index": 0}
    streams: list[torch.device] = []

    class FakeStream:
        def __init__(self, device):
            streams.append(device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    for requested in (None, "cuda"):
        streams.clear()
        current["index"] = 0
        p = CudaPrefetcher([], device=requested)  # e.g. at import time, before set_device
        assert streams == []  # nothing bound to a device yet
        current["index"] = 1  # torch.cuda.set_device(local_rank)
        assert list(p) == []
        assert p.device == torch.device("cuda", 1)
        assert streams == [torch.device("cuda", 1)]
        current["index"] = 0
        assert list(p) == [] and p.device == torch.device("cuda", 1)  # fixed once resolved
        assert len(streams) == 1  # one stream for the prefetcher's life
    p = CudaPrefetcher([], device="cuda:1")
    current["index"] = 0
    assert p.device == torch.device("cuda", 1)  # an explicit index is kept


def test_prefetcher_moves_a_packed_sequence_by_its_own_to():
    """A PackedSequence (a namedtuple with its own .to()) keeps batch_sizes on the CPU through the prefetcher."""
    from torch.nn.utils.rnn import pack_sequence

    seqs = [torch.ones(n, 4) for n in (5, 3, 2, 4)]
    dl = torch.utils.data.DataLoader(
        seqs, batch_size=2, collate_fn=lambda b: pack_sequence(b, enforce_sorted=False)
    )
    got = list(CudaPrefetcher(dl, device="meta"))
    assert len(got) == 2
    for packed in got:
        assert type(packed).__name__ == "PackedSequence"
        assert packed.data.device.type == "meta" and packed.sorted_indices.device.type == "meta"
        assert packed.batch_sizes.device.type == "cpu"
    # record_stream's list reaches its tensors, each once
    found = list(loader.batch_tensors(got[0]))
    assert len(found) == len({id(t) for t in found}) == 4


class Store(collections.abc.MutableMapping):
    """A MutableMapping keeping its items in an attribute (copy.copy would share it)."""

    def __init__(self, data) -> None:
        self._data = data

    def __getitem__(self, k):
        return self._data[k]

    def __setitem__(self, k, v):
        self._data[k] = v

    def __delitem__(self, k):
        del self._data[k]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


@dataclasses.dataclass
class Scaled:
    x: torch.Tensor
    scale: dataclasses.InitVar[float]

    def __post_init__(self, scale: float) -> None:
        self.x = self.x * scale


@dataclasses.dataclass
class Offset:
    x: torch.Tensor
    tag: str = "t"

    def __post_init__(self) -> None:
        self.x = self.x - 1  # a normalisation done once, at construction


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenSlots:
    x: torch.Tensor


def test_move_batch_copies_containers_without_sharing_or_rebuilding():
    """move_batch leaves the caller's MutableMapping alone, handles InitVar, and never runs __post_init__ again."""
    store = Store({"x": torch.ones(2)})
    scaled = Scaled(torch.ones(2), 3.0)
    offset = Offset(torch.full((2,), 5.0), "keep")
    frozen = FrozenSlots(torch.ones(1))
    out = loader.move_batch([store, scaled, offset, frozen], double)
    assert type(out[0]) is Store and torch.equal(out[0]["x"], torch.full((2,), 2.0))
    assert torch.equal(store["x"], torch.ones(2))  # the input batch is unchanged
    assert type(out[1]) is Scaled and torch.equal(out[1].x, torch.full((2,), 6.0))
    assert type(out[2]) is Offset and out[2].tag == "keep"
    assert torch.equal(out[2].x, torch.full((2,), 8.0))  # (5 - 1) * 2: __post_init__ ran once
    assert torch.equal(offset.x, torch.full((2,), 4.0))
    assert type(out[3]) is FrozenSlots and torch.equal(out[3].x, torch.full((1,), 2.0))
    (got,) = list(CudaPrefetcher([{"s": store, "d": scaled}], device="meta"))
    assert got["s"]["x"].device.type == "meta" and got["d"].x.device.type == "meta"
    assert store["x"].device.type == "cpu"


class SlottedGraph:
    """Moves itself and keeps its tensors in __slots__ (a private one too), as attrs @define does."""

    __slots__ = ("x", "__y")

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x = x
        self.__y = y

    def to(self, device, non_blocking: bool = False) -> SlottedGraph:
        return SlottedGraph(self.x.to(device), self.__y.to(device))


class SlottedChild(SlottedGraph):
    __slots__ = ("z", "parent")


class Opaque:
    """Moves itself, keeping its tensor where nothing can see it (a closure)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.get = lambda: x

    def to(self, device) -> Opaque:
        return Opaque(self.get().to(device))


def test_batch_tensors_finds_tensors_in_slots_and_flags_hidden_ones():
    """record_stream's list reaches tensors in __slots__ (inherited, name-mangled); an object whose tensors stay hidden is flagged."""
    attrs = pytest.importorskip("attrs")

    @attrs.define
    class Batch:
        images: torch.Tensor
        labels: torch.Tensor

        def to(self, device, non_blocking: bool = False) -> Batch:
            return Batch(self.images.to(device), self.labels.to(device))

    child = SlottedChild(torch.ones(1), torch.ones(2))
    child.z = torch.ones(3)
    child.parent = child  # a cycle is walked once
    found = list(loader.batch_tensors([Batch(torch.ones(4), torch.ones(5)), child]))
    assert sorted(t.numel() for t in found) == [1, 2, 3, 4, 5]
    moved = next(iter(CudaPrefetcher([Batch(torch.ones(2, 3), torch.zeros(2))], "meta")))
    assert [t.device.type for t in loader.batch_tensors(moved)] == ["meta", "meta"]
    assert not loader.hides_tensors(child) and not loader.hides_tensors(moved)
    assert loader.hides_tensors(Opaque(torch.ones(1)))
    assert not loader.hides_tensors(torch.ones(1)) and not loader.hides_tensors({"a": 1})


class _Holder:  # no .to(), not a container: a plain object a moving object keeps
    def __init__(self, t, inner=None):
        self.t, self.inner = t, inner


class _Graph:
    def __init__(self, x, holder):
        self.x, self.holder = x, holder

    def to(self, device, non_blocking: bool = False) -> _Graph:
        return self  # what it moves does not matter here: what the walk finds does


def test_batch_tensors_follows_plain_objects_below_a_moving_one_and_flags_what_it_cannot_reach():
    """A tensor one attribute level down (``obj.holder.t``) is found, so record_stream covers
    it; plain objects in a top-level list are not walked (move_batch leaves them); a cycle is
    walked once; nesting beyond the walk's bound makes the object one that hides tensors."""
    g = _Graph(torch.ones(4), _Holder(torch.zeros(2, 8)))
    assert sorted(t.numel() for t in loader.batch_tensors(g)) == [4, 16]
    assert not loader.hides_tensors(g)
    loop = _Holder(torch.ones(3))
    loop.inner = loop
    assert sorted(t.numel() for t in loader.batch_tensors(_Graph(torch.ones(1), loop))) == [1, 3]
    assert list(loader.batch_tensors([_Holder(torch.ones(1))])) == []
    deep = None
    for _ in range(50):
        deep = _Holder(None, deep)
    deep.t = torch.ones(5)
    tail = deep
    while tail.inner is not None:
        tail = tail.inner
    tail.t = torch.ones(7)  # 50 hops down: beyond the bound
    assert loader.hides_tensors(_Graph(torch.ones(1), deep))


def test_prefetcher_copies_an_object_hiding_its_tensors_on_the_consumer_stream(monkeypatch):
    """Unit (streams faked): an object whose tensors record_stream cannot see is copied on the
    consumer stream; tensors and objects with visible tensors on the side stream."""
    active = ["consumer"]
    seen: dict[str, str] = {}

    @contextlib.contextmanager
    def stream(s):
        active.append(s)
        try:
            yield
        finally:
            active.pop()

    def recording(cls, name):
        def to(self, device, non_blocking=False):
            seen[name] = active[-1]
            return self

        return type(name, (cls,), {"to": to})

    monkeypatch.setattr(loader.torch.cuda, "stream", stream)
    monkeypatch.setattr(loader.torch.cuda, "current_stream", lambda device=None: "consumer")
    p = CudaPrefetcher([], device="meta")
    p._device, p._stream = torch.device("meta"), "side"
    opaque = recording(Opaque, "opaque")(torch.ones(1))
    slotted = recording(Graph, "visible")(torch.ones(1))
    p._copy([opaque, slotted])
    assert seen == {"opaque": "consumer", "visible": "side"}
