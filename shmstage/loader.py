"""Torch data-loading helpers that keep an accelerator fed from a staged copy.

``DatasetFiles`` and ``FolderDataset`` (torch-less: :mod:`shmstage.datasetfiles`) read a copy
still being staged or only partly in RAM.  ``make_loader`` sizes a DataLoader to the CPUs
this rank really has and leases the staged copy it reads; ``staged_path`` finds that copy.
The prefetchers (``CudaPrefetcher``, ``BackgroundLoader``) live in :mod:`shmstage.prefetch`
and the batch walk in :mod:`shmstage.batches`; both are importable from here.  This module imports torch;
``import shmstage`` and the CLI never import it.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    import torch
    from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
except ImportError:  # pragma: no cover - exercised only on a torch-less install
    raise ImportError(
        "shmstage.loader needs torch: pip install torch (or 'shmstage[torch]')"
    ) from None

from shmstage import system
from shmstage.askahead import AskAhead
from shmstage.batches import batch_tensors, hides_tensors, move_batch
from shmstage.datasetfiles import DatasetFiles
from shmstage.errors import ShmstageError, ShmstageWarning
from shmstage.folderdataset import FolderDataset, decode_image
from shmstage.prefetch import BackgroundLoader, CudaPrefetcher

__all__ = [
    "BackgroundLoader",
    "CudaPrefetcher",
    "DatasetFiles",
    "FolderDataset",
    "ShmstageWarning",
    "cpus_per_rank",
    "default_num_workers",
    "global_rank",
    "local_ranks",
    "rank_generator",
    "batch_tensors",
    "decode_image",
    "hides_tensors",
    "loader_kwargs",
    "make_loader",
    "move_batch",
    "hold_lease",
    "staged_path",
]

DEFAULT_PREFETCH_FACTOR = 4

ENV_NUM_WORKERS = "SHMSTAGE_NUM_WORKERS"
ENV_PIN_MEMORY = "SHMSTAGE_PIN_MEMORY"
ENV_PREFETCH_FACTOR = "SHMSTAGE_PREFETCH_FACTOR"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


# --- DataLoader settings ----------------------------------------------------


def _env_int(var: str, minimum: int) -> int | None:
    text = os.environ.get(var, "").strip()
    if not text or text.lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ShmstageError(
            f"{var}={text!r} is not a valid value: use an integer >= {minimum}"
            + (" or 'auto'" if var == ENV_NUM_WORKERS else "")
        )
    return value


def _env_bool(var: str) -> bool | None:
    text = os.environ.get(var, "").strip().lower()
    if not text or text == "auto":
        return None
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ShmstageError(f"{var}={os.environ[var]!r} is not a valid value: use 1 or 0 (or auto)")


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """Ranks on this node, from torchrun's ``LOCAL_WORLD_SIZE`` (1 when unset)."""
    text = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "").strip()
    if not text:
        return 1
    if not text.isdigit() or int(text) < 1:
        raise ShmstageError(f"LOCAL_WORLD_SIZE={text!r} is not a positive integer")
    return int(text)


def tasks_on_this_node(text: str, node: str | None) -> int:
    """This node's entry of a Slurm tasks-per-node list (``"8(x2),4"``: nodes 0-1 run 8 tasks,
    node 2 runs 4), ``node`` being ``SLURM_NODEID``; the largest entry when the node is not
    known (fewer workers, never too many).  ValueError when ``text`` is malformed."""
    counts: list[int] = []
    for part in text.strip().split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None or int(m.group(1)) < 1:
            raise ValueError(text)
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if node is not None and node.strip().isdigit() and int(node) < len(counts):
        return counts[int(node)]
    return max(counts)


def local_ranks(environ: Mapping[str, str] | None = None) -> int:
    """Ranks on this node: torchrun's ``LOCAL_WORLD_SIZE``; else, in a task of a Slurm step
    (``SLURM_STEP_ID`` set: ``srun --ntasks-per-node=8 python train.py``), the step's tasks on
    this node (``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_NTASKS_PER_NODE``, else
    ``SLURM_TASKS_PER_NODE``); else 1.  A batch script (no ``SLURM_STEP_ID``) is one process
    whatever the job's tasks per node."""
    env = os.environ if environ is None else environ
    if env.get("LOCAL_WORLD_SIZE", "").strip():
        return local_world_size(env)
    if not env.get("SLURM_STEP_ID", "").strip():
        return 1
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        text = env.get(var, "").strip()
        if text:
            try:
                return tasks_on_this_node(text, env.get("SLURM_NODEID"))
            except ValueError:
                raise ShmstageError(
                    f"{var}={text!r} is not a Slurm tasks-per-node list such as '8' or '8(x2),4'"
                ) from None
    return 1


def rank_cpus(cpus: system.CpuSet, ranks: int) -> int:
    """CPUs one rank may use, at least 1.

    An affinity set its launcher narrowed for this rank (``cpus.bound``: torchrun
    --numa-binding, srun --cpu-bind) is this rank's, shared only by as many ranks as cannot
    each have a disjoint one in the container (--numa-binding=node gives the 4 ranks of a
    NUMA node that node's CPUs).  Any other (as wide as the container's, or inherited from a
    launcher started under ``numactl``/``taskset``) is shared by the node's ``ranks``.  The
    cgroup CPU quota is the container's, shared by every rank in it either way."""
    ranks = max(1, ranks)
    if cpus.bound:
        sharers = min(ranks, max(1, math.ceil(ranks * cpus.affinity / cpus.container)))
        share = cpus.affinity // sharers
    else:
        share = cpus.affinity // ranks
    if cpus.quota is not None:
        share = min(share, max(1, math.ceil(cpus.quota)) // ranks)
    return max(1, share)


def cpus_per_rank(ranks: int | None = None) -> int:
    """CPUs this rank may use: :func:`rank_cpus` of this process's CPUs and :func:`local_ranks`."""
    return rank_cpus(system.cpu_set(), local_ranks() if ranks is None else ranks)


def default_num_workers(cpus: int | None = None, ranks: int | None = None) -> int:
    """Loader workers per rank: this rank's CPUs (:func:`cpus_per_rank`) minus one, at least 1.

    The CPUs are the affinity set capped by the cgroup CPU quota (not ``os.cpu_count()``,
    which on a 128-core node in a 16-CPU container would start 8 ranks x 127 workers), divided
    among the node's ranks unless the affinity was bound to this rank already.  One CPU per
    rank stays with the rank's main process, which collates, pins and launches kernels.
    ``cpus``: a CPU count shared by ``ranks`` ranks, instead of this process's.
    """
    if cpus is None:
        return max(1, cpus_per_rank(ranks) - 1)
    ranks = local_ranks() if ranks is None else ranks
    return max(1, cpus // max(1, ranks) - 1)


def _accelerator_present() -> bool:
    if torch.cuda.is_available():
        return True
    accel = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accel is None or not accel.is_available():
        return False
    current = accel.current_accelerator()
    # MPS shares memory with the host: there is nothing to pin.
    return current is not None and current.type != "mps"


def seed_worker(worker_id: int) -> None:
    """Deprecated, does nothing: torch's DataLoader already seeds each worker.

    Every worker gets ``base_seed + worker_id`` for ``random`` and torch, and a seed derived
    from both (numpy's SeedSequence scheme) for numpy (torch >= 1.9).  This function used to
    re-seed ``random`` and numpy from ``torch.initial_seed()``, which added nothing and gave
    numpy the same seed as ``random``.  Kept so ``worker_init_fn=seed_worker`` still works.
    """
    warnings.warn(
        "shmstage.loader.seed_worker is deprecated and does nothing: torch already seeds "
        "random, torch and numpy in each DataLoader worker; drop worker_init_fn=seed_worker",
        DeprecationWarning,
        stacklevel=2,
    )


def global_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank in the job: torchrun's ``RANK``, else Slurm's ``SLURM_PROCID``
    (``srun python train.py``), else 0."""
    env = os.environ if environ is None else environ
    for var in ("RANK", "SLURM_PROCID"):
        text = env.get(var, "").strip()
        if text:
            if not text.isdigit():
                raise ShmstageError(f"{var}={text!r} is not a rank: use an integer >= 0")
            return int(text)
    return 0


def rank_generator(rank: int | None = None) -> torch.Generator:
    """A DataLoader ``generator`` seeded from torch's seed (``torch.manual_seed``'s, else
    torch's default) plus this rank.

    The DataLoader draws each epoch's ``base_seed`` from it, and torch seeds ``random``,
    torch and numpy in worker ``i`` from ``base_seed + i``: so workers of different ranks
    draw different augmentations, and a rank re-run with the same seed draws the same ones.
    Without it every rank that seeded alike (or not at all) has the same base seed, and
    worker ``i`` of every rank draws identical "random" crops and flips."""
    generator = torch.Generator()
    generator.manual_seed(
        (torch.initial_seed() + (global_rank() if rank is None else rank)) % 2**64
    )
    return generator


def loader_kwargs(**overrides: Any) -> dict[str, Any]:
    """DataLoader keyword arguments tuned for this node and rank.

    Precedence: explicit ``overrides`` > ``SHMSTAGE_NUM_WORKERS`` / ``SHMSTAGE_PIN_MEMORY`` /
    ``SHMSTAGE_PREFETCH_FACTOR`` (set by ``shmstage run``) > defaults.  Any other DataLoader
    argument (``shuffle``, ``sampler``, ``collate_fn``...) passes through unchanged.
    With workers, ``generator`` defaults to :func:`rank_generator` (a per-rank seed).
    """
    # read (and validate) every variable, even one an argument overrides: a typo in the
    # job's environment should surface, not lie dormant until the argument goes away
    env_workers = _env_int(ENV_NUM_WORKERS, 0)
    env_pin = _env_bool(ENV_PIN_MEMORY)
    env_prefetch = _env_int(ENV_PREFETCH_FACTOR, 1)

    if "num_workers" in overrides:
        workers = overrides.pop("num_workers")
        if not isinstance(workers, int) or workers < 0:
            raise ShmstageError(f"num_workers={workers!r}: use an integer >= 0")
    else:
        workers = default_num_workers() if env_workers is None else env_workers

    pin = overrides.pop("pin_memory", None)
    if pin is None:
        pin = env_pin
    if pin is None:
        pin = _accelerator_present()

    kwargs: dict[str, Any] = {"num_workers": workers, "pin_memory": bool(pin)}
    if workers > 0:
        prefetch = overrides.pop("prefetch_factor", None)
        if prefetch is None:
            prefetch = env_prefetch
        kwargs["prefetch_factor"] = DEFAULT_PREFETCH_FACTOR if prefetch is None else prefetch
        if overrides.get("generator") is None:  # see rank_generator: distinct ranks draw apart
            overrides.pop("generator", None)
            kwargs["generator"] = rank_generator()
        # persistent_workers stays torch's default (False) unless asked for: see make_loader
    else:
        # DataLoader rejects these without workers; an env default does not apply either.
        for key in ("prefetch_factor", "persistent_workers"):
            if overrides.get(key):
                raise ShmstageError(f"{key} needs num_workers > 0 (got num_workers=0)")
            overrides.pop(key, None)
    kwargs.update(overrides)
    return kwargs


def make_loader(
    dataset: Any,
    batch_size: int | None = 1,
    *,
    lease: str | os.PathLike[str] | bool | None = None,
    persistent_workers: bool = False,
    **overrides: Any,
) -> DataLoader:
    """A ``DataLoader`` over ``dataset`` with ``loader_kwargs(**overrides)``.

    ``persistent_workers`` is torch's default, False: each epoch starts fresh workers with a
    copy of ``dataset`` as it is then, so whatever the job sets on it between epochs
    (progressive resizing, a curriculum, ``dataset.set_epoch(e)``) reaches the workers.
    ``persistent_workers=True`` saves the workers' start-up at each epoch (worth it when
    that is seconds: a heavy ``__init__``, many workers) but the workers keep the dataset
    they were started with: a change made on it afterwards is never seen.  It is ignored
    when the loader has no workers.

    When the dataset reads a staged copy, the process takes a lease on it (held until it
    exits) so ``shmstage evict`` refuses to remove it: ``lease=PATH`` names the staged path;
    by default ``dataset.root`` / ``.root_dir`` / ``.data_dir`` / ``.path`` (or those of
    ``dataset.dataset``, e.g. a ``Subset``) are looked at; ``lease=False`` takes none.
    """
    if lease is not False:
        for path in [lease] if lease not in (None, True) else _dataset_paths(dataset):
            hold_lease(path, required=lease not in (None, True))  # type: ignore[arg-type]
    _warn_not_all_in_ram(dataset)
    kwargs = loader_kwargs(**overrides)
    if persistent_workers and kwargs["num_workers"] > 0:  # none to keep when there are none
        kwargs["persistent_workers"] = True
    _ask_ahead(dataset, batch_size, kwargs)
    return DataLoader(dataset, batch_size=batch_size, **kwargs)


def _ask_ahead(dataset: Any, batch_size: int | None, kwargs: dict[str, Any]) -> None:
    """A dataset on a copy still being staged (``FolderDataset`` on a live view) gets its
    sampler wrapped in ``AskAhead``: the main process hints the files of the batches the
    workers will load next (workers x prefetch_factor of them, and as many again), so the
    stager copies those first and the workers rarely wait on a demand (docs/loader.md)."""
    want = getattr(dataset, "want", None)
    files = getattr(dataset, "files", None)
    if not callable(want) or getattr(files, "kind", None) != "live":
        return
    if kwargs.get("batch_sampler") is not None or isinstance(dataset, IterableDataset):
        return
    sampler = kwargs.pop("sampler", None)
    shuffle = kwargs.pop("shuffle", None)
    if sampler is None:
        sampler = (
            RandomSampler(dataset, generator=kwargs.get("generator"))
            if shuffle
            else SequentialSampler(dataset)
        )
    elif shuffle:  # DataLoader's own refusal, kept
        kwargs["shuffle"] = shuffle
    batch = batch_size or 1
    batches = max(1, kwargs["num_workers"]) * kwargs.get("prefetch_factor", 2)
    kwargs["sampler"] = AskAhead(sampler, want, ahead=2 * batches * batch, step=batch)


_LEASE_ATTRS = ("root", "root_dir", "data_dir", "path")


def _warn_not_all_in_ram(dataset: Any) -> None:
    """A dataset that walks and opens its copy itself (ImageFolder and the like) on a copy
    only part of which is in RAM (``--partial``) or still being copied (``--no-wait``) sees
    only that part, silently: warn, as ``staged_path`` does.  Datasets reading through
    ``DatasetFiles`` (``FolderDataset``) see every file and are not warned about."""
    from shmstage.stage.store.leases import locate  # the staging engine, only when asked
    from shmstage.stage.store.views import read_view

    if any(
        isinstance(getattr(obj, "files", None), DatasetFiles)
        for obj in (dataset, getattr(dataset, "dataset", None))
    ):
        return
    for path in dict.fromkeys(_dataset_paths(dataset)):
        where = locate(path)
        view = read_view(*where) if where is not None else None
        if view is not None:
            how = "holds only part of" if view.kind == "partial" else "is still being copied from"
            warnings.warn(
                f"{path}: the staged copy {how} {view.source} ({view.kind}): a dataset "
                "that walks it sees only the files in RAM; read it through "
                "shmstage.loader.DatasetFiles or FolderDataset, which read the rest",
                ShmstageWarning,
                stacklevel=3,
            )


def _dataset_paths(dataset: Any) -> list[str]:
    out = []
    for obj in (dataset, getattr(dataset, "dataset", None)):
        for attr in _LEASE_ATTRS:
            value = getattr(obj, attr, None) if obj is not None else None
            if isinstance(value, (str, os.PathLike)):
                out.append(os.fspath(value))
    return out


_held: dict[tuple[str, str], Any] = {}  # (dest, name) -> leases.Lease, for the process lifetime


def hold_lease(path: str | os.PathLike[str], *, required: bool = True) -> bool:
    """Lease the staged dataset ``path`` lies in until this process exits (once per dataset);
    False when ``path`` is not in a staged copy (``required``: raise instead)."""
    from shmstage.stage.store.leases import acquire, locate  # the staging engine, only when leasing

    where = locate(path)
    if where is None:
        if required:
            raise ShmstageError(
                f"{os.fspath(path)} is not inside a staged dataset; nothing to lease"
            )
        return False
    if where not in _held:
        try:
            _held[where] = acquire(where[1], where[0])
        except ShmstageError as e:
            if required:
                raise
            warnings.warn(f"cannot lease {where[1]}: {e}", ShmstageWarning, stacklevel=3)
            return False
    return True


# --- staged copies ----------------------------------------------------------


def staged_path(
    source_or_name: str | os.PathLike[str], dest: str | os.PathLike[str] | None = None
) -> Path:
    """The staged copy of a dataset when it is staged and complete, else the source (with a warning).

    Lets a training script name its dataset once (``staged_path("/nfs/imagenet")``) and run
    unchanged on a node where nothing was staged.
    """
    from shmstage.service import api  # the engine, or the node's service; only when asked for

    found = api.find(os.fspath(source_or_name), dest=None if dest is None else os.fspath(dest))
    if found is not None:
        hold_lease(found.path, required=False)  # so nobody evicts it while this job reads it
        if getattr(found, "total_bytes", None) is not None:
            warnings.warn(
                f"{found.path} holds only part of {found.source} ({found.resident:.0%}, "
                "stage --partial): read it through shmstage.loader.DatasetFiles or "
                "FolderDataset, which read the rest from the source",
                ShmstageWarning,
                stacklevel=2,
            )
        return Path(found.path)
    warnings.warn(
        f"{os.fspath(source_or_name)} is not staged on this node; reading it from its source "
        f"(stage it first: shmstage stage {os.fspath(source_or_name)})",
        ShmstageWarning,
        stacklevel=2,
    )
    return Path(source_or_name)
