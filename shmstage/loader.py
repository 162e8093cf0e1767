"""Torch data-loading helpers that keep an accelerator fed from a staged copy.

``make_loader`` sizes a DataLoader to the CPUs this rank really has; ``CudaPrefetcher``
overlaps host-to-device copies with compute; ``BackgroundLoader`` runs any iterable in a
thread.  This module imports torch; ``import shmstage`` and the CLI never import it.
Long because the three helpers share the DataLoader settings and the batch walk, and each
keeps its lifecycle NOTE next to its code.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import os
import queue
import re
import threading
import types
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any, Callable

try:
    import torch
    from torch.utils.data import DataLoader
except ImportError:  # pragma: no cover - exercised only on a torch-less install
    raise ImportError(
        "shmstage.loader needs torch: pip install torch (or 'shmstage[torch]')"
    ) from None

from shmstage import system
from shmstage.errors import ShmstageError, ShmstageWarning

__all__ = [
    "BackgroundLoader",
    "CudaPrefetcher",
    "ShmstageWarning",
    "cpus_per_rank",
    "default_num_workers",
    "global_rank",
    "local_ranks",
    "rank_generator",
    "batch_tensors",
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
    kwargs = loader_kwargs(**overrides)
    if persistent_workers and kwargs["num_workers"] > 0:  # none to keep when there are none
        kwargs["persistent_workers"] = True
    return DataLoader(dataset, batch_size=batch_size, **kwargs)


_LEASE_ATTRS = ("root", "root_dir", "data_dir", "path")


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
    from shmstage.stage.store.leases import acquire, locate

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


# --- nested batches ---------------------------------------------------------


def _movable(obj: Any) -> bool:
    """An object that moves itself (``.to(device)``): not a class, not a container we walk."""
    return not isinstance(obj, type) and callable(getattr(obj, "to", None))


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def move_batch(batch: Any, move: Callable[[Any], Any]) -> Any:
    """``batch`` with ``move`` applied to every tensor in it, and to every other object with a
    ``.to()`` method, even one that is also a container (a PackedSequence is a namedtuple
    whose ``.to()`` keeps ``batch_sizes`` on the CPU); containers keep their types.

    Walked: mappings (``dict`` subclasses such as ``OrderedDict``, ``defaultdict`` with its
    ``default_factory``, your own, or any ``Mapping``), namedtuples, dataclasses (every
    field, ``init=False`` ones too), tuples and lists.  A ``dict`` subclass (or a mapping
    with its own ``__copy__``, as ``UserDict``) and a dataclass are shallow-copied, so their
    type and extra attributes stay; a dataclass's ``__init__``/``__post_init__`` is not run
    again.  Any other mapping is rebuilt as ``type(m)(dict_of_moved_items)``, or is a plain
    ``dict`` when its constructor takes no dict.  Other leaves (strings, ids, None) are
    returned as they are.  Pure: ``batch`` is not changed, and no device is touched here,
    ``move`` does it (CudaPrefetcher passes ``x.to(device, non_blocking=True)``).
    """
    if isinstance(batch, torch.Tensor):
        return move(batch)
    if _movable(batch):
        # before the container checks: an object that moves itself knows what may move
        # (PackedSequence, a namedtuple, keeps its batch_sizes on the CPU; walking it as a
        # tuple would move them and it refuses that)
        return move(batch)
    if isinstance(batch, Mapping):
        return _rebuilt_mapping(batch, {k: move_batch(v, move) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_batch(v, move) for v in batch))
    if _is_dataclass_instance(batch):
        # A copy with each field set, not dataclasses.replace(): that would run __init__ and
        # __post_init__ again (an InitVar cannot be given twice, a normalisation would apply
        # twice).  object.__setattr__ sets frozen dataclasses' fields too.
        try:
            clone = copy.copy(batch)
        except Exception:  # a class that refuses copying: rebuild it through __init__
            clone = dataclasses.replace(batch)
        for f in dataclasses.fields(batch):
            if hasattr(batch, f.name):  # an init=False field without default may be unset
                object.__setattr__(clone, f.name, move_batch(getattr(batch, f.name), move))
        return clone
    if isinstance(batch, (tuple, list)):
        values = [move_batch(v, move) for v in batch]
        try:
            return type(batch)(values)
        except TypeError:
            return values if isinstance(batch, list) else tuple(values)
    return batch


def _rebuilt_mapping(batch: Mapping[Any, Any], items: dict[Any, Any]) -> Mapping[Any, Any]:
    """A mapping of ``batch``'s type holding ``items``, sharing no storage with ``batch``."""
    if isinstance(batch, MutableMapping) and (
        isinstance(batch, dict) or hasattr(type(batch), "__copy__")
    ):
        # a dict subclass (its items are the object: a copy has its own) or a mapping that
        # copies itself (UserDict copies its data): keeps the class, default_factory, other
        # attributes and the order.  Any other mapping keeps its items in an attribute, which
        # copy.copy would share: the caller's batch would get the moved tensors.
        try:
            clone = copy.copy(batch)
            for k, v in items.items():
                clone[k] = v
            return clone
        except Exception:  # cannot be copied: built from the items below
            pass
    try:
        return type(batch)(items)  # the Mapping convention: built from a dict
    except Exception:
        return items  # a constructor that takes no dict: a plain dict


def batch_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor :func:`move_batch` would reach in ``batch`` (each once), and those held by
    an object that moved itself: in its attributes (``vars(obj)`` and its ``__slots__``, as
    an attrs ``@define`` class keeps them), in plain objects those hold (an ``inner.t``), and,
    when it is a container too (a PackedSequence is a tuple), in its items."""
    yield from _TensorWalk().tensors(batch)


def hides_tensors(obj: Any) -> bool:
    """Whether ``obj`` moves itself (``.to()``) but :func:`batch_tensors` may not find all of
    its tensors: none found (kept in a C++ object, a closure...), or its attributes nest
    deeper (or wider) than the walk follows.  CudaPrefetcher cannot ``record_stream`` what it
    cannot see, so it copies such an object on the consumer stream (see its NOTE)."""
    if not _movable(obj):
        return False
    walk = _TensorWalk()
    found = sum(1 for _ in walk.tensors(obj))  # the whole walk: ``cut`` is known only at its end
    return not found or walk.cut


def _slot_values(obj: Any) -> Iterator[Any]:
    """The values of ``obj``'s ``__slots__``, every class of its MRO; unset ones skipped."""
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):  # name-mangled
                name = f"_{cls.__name__.lstrip('_')}{name}"
            try:
                yield getattr(obj, name)
            except AttributeError:
                continue


_NOT_HOLDERS = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


class _TensorWalk:
    """One walk of a batch for its tensors.  Below an object that moves itself, plain objects
    in its attributes are followed too (their tensors moved with it), at most ``DEPTH``
    attribute hops deep and ``BUDGET`` values in all: where the walk stops short, ``cut`` is
    set (the caller must then assume tensors it did not see)."""

    DEPTH = 8
    BUDGET = 100_000

    def __init__(self) -> None:
        self.cut = False
        self._visiting: set[int] = set()
        self._seen: set[int] = set()
        self._values = 0

    def tensors(self, batch: Any) -> Iterator[torch.Tensor]:
        """Each tensor once."""
        for t in self._walk(batch, 0):
            if id(t) not in self._seen:
                self._seen.add(id(t))
                yield t

    def _walk(self, batch: Any, hops: int) -> Iterator[torch.Tensor]:
        if isinstance(batch, torch.Tensor):
            yield batch
            return
        if id(batch) in self._visiting:  # an attribute that refers back (obj.parent)
            return
        self._values += 1
        if self._values > self.BUDGET:
            self.cut = True
            return
        holder = _movable(batch) or (
            hops > 0
            and not isinstance(batch, _NOT_HOLDERS)
            and (hasattr(batch, "__dict__") or hasattr(type(batch), "__slots__"))
        )
        if holder:
            if hops >= self.DEPTH:
                self.cut = True
                return
            self._visiting.add(id(batch))
            for v in [*getattr(batch, "__dict__", {}).values(), *_slot_values(batch)]:
                yield from self._walk(v, hops + 1)
        values: Iterable[Any]
        if isinstance(batch, Mapping):
            values = batch.values()
        elif _is_dataclass_instance(batch):
            values = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
        elif isinstance(batch, (tuple, list)):
            values = batch
        else:
            return
        for v in values:
            yield from self._walk(v, hops)


def _to(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    """``obj.to(device, non_blocking=...)``; a plain ``.to(device)`` for a ``.to`` without it."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    try:
        params = inspect.signature(obj.to).parameters.values()
        takes = any(p.name == "non_blocking" or p.kind is p.VAR_KEYWORD for p in params)
    except (TypeError, ValueError):  # no signature (a builtin): try it
        takes = True
    return obj.to(device, non_blocking=non_blocking) if takes else obj.to(device)


# --- CudaPrefetcher ---------------------------------------------------------

# NOTE [CudaPrefetcher lifecycle]
#
#   first iter(): resolve the device (the current CUDA device *now*, not at __init__: a
#                 prefetcher built before set_device(local_rank) must follow it) and make
#                 one side stream on it for the prefetcher's life (one per epoch leaks).
#
#   __iter__:  copy(b0) on side ──┐
#   next():    consumer.wait_stream(side); b0.record_stream(consumer); copy(b1) on side; yield b0
#   next():    consumer.wait_stream(side); b1.record_stream(consumer); copy(b2) on side; yield b1
#
# b(k+1) is enqueued on the side stream before the consumer launches work on b(k), so the
# host-to-device copy overlaps compute.  wait_stream orders the consumer's kernels after the
# copy.  record_stream is what keeps this safe: b(k) was allocated on the side stream, so
# without it the caching allocator would hand b(k)'s memory to the next copy as soon as the
# Python tensor is freed, while kernels queued on the consumer stream may still read it.
# record_stream makes the allocator wait for the consumer stream's pending work first.
# It needs the tensors (batch_tensors): an object that moves itself but keeps them where
# they cannot be found (hides_tensors) is copied on the consumer stream instead, whose own
# allocations need no record_stream; only that object's copy loses the overlap.


_IN_PRODUCER = threading.local()  # .active: this thread is a BackgroundLoader's producer
_PREFETCHER_IN_BACKGROUND = (
    "BackgroundLoader(CudaPrefetcher(...)) would copy to the GPU from the background "
    "thread, with that thread's device and stream: wrap it the other way round, "
    "CudaPrefetcher(BackgroundLoader(loader))"
)


def _refuse_other_thread(owner: int) -> None:
    """Refuse to iterate a CudaPrefetcher in a BackgroundLoader's producer thread, or in a
    thread other than the one that called ``iter()`` on it: its copies would use that
    thread's current device and stream, with no ordering against the training loop's."""
    if getattr(_IN_PRODUCER, "active", False):
        raise ShmstageError(_PREFETCHER_IN_BACKGROUND)
    if threading.get_ident() != owner:
        raise ShmstageError(
            "a CudaPrefetcher is iterated in the thread that called iter() on it (its copies "
            "use that thread's device and stream): iterate it in the training loop's thread; "
            "to read ahead in a thread, CudaPrefetcher(BackgroundLoader(loader))"
        )


class CudaPrefetcher:
    """Iterate ``loader`` with each batch already on ``device``, copied one batch ahead.

    Tensors anywhere in tuples, lists, mappings, namedtuples and dataclasses are moved, and
    objects with a ``.to()`` method move themselves (``non_blocking`` passed when their
    ``.to`` takes it); other leaves and the container types are kept (see :func:`move_batch`).  Without CUDA (or with ``device="cpu"``) batches pass through
    unchanged; for another device type they are moved with a plain ``.to(device)``.
    ``device=None`` or ``"cuda"`` means the current CUDA device *at the first iteration*, so
    a prefetcher built before ``torch.cuda.set_device(local_rank)`` still copies to this
    rank's GPU.  It is iterated in the thread that called ``iter()`` on it, never in a
    BackgroundLoader's (wrap the other way round: ``CudaPrefetcher(BackgroundLoader(...))``).
    See NOTE [CudaPrefetcher lifecycle].
    """

    def __init__(
        self, loader: Iterable[Any], device: Any = None, non_blocking: bool = True
    ) -> None:
        self.loader = loader
        self.non_blocking = non_blocking
        self._requested = None if device is None else torch.device(device)
        if (
            self._requested is not None
            and self._requested.type == "cuda"
            and not torch.cuda.is_available()
        ):
            raise ShmstageError(
                f"device {device} was asked for but CUDA is not available: "
                "leave device=None to pass batches through on CPU"
            )
        self._device: torch.device | None = None  # resolved at first use
        self._stream: Any = None

    @property
    def device(self) -> torch.device:
        """The device batches are copied to; fixed at the first iteration (or first access)."""
        if self._device is None:
            device = self._requested
            if device is None:
                device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            if device.type == "cuda":
                self._stream = torch.cuda.Stream(device=device)
            self._device = device
        return self._device

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        owner = threading.get_ident()
        _refuse_other_thread(owner)
        return self._epoch(owner)

    def _epoch(self, owner: int) -> Iterator[Any]:
        # each next() checks its thread: iter() ran here, but islice()/a generator may hand
        # the iterator to BackgroundLoader's producer (the isinstance check cannot see it)
        batches = self._batches()
        while True:
            _refuse_other_thread(owner)
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch

    def _batches(self) -> Iterator[Any]:
        device = self.device
        if device.type == "cpu":
            yield from self.loader
        elif self._stream is None:
            for batch in self.loader:
                yield move_batch(batch, lambda t: _to(t, device, self.non_blocking))
        else:
            yield from self._prefetch()

    def _copy(self, batch: Any) -> Any:
        assert self._stream is not None
        device, consumer = self.device, torch.cuda.current_stream(self.device)

        def move(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) or not hides_tensors(obj):
                return _to(obj, device, self.non_blocking)
            with torch.cuda.stream(consumer):  # see NOTE [CudaPrefetcher lifecycle]
                return _to(obj, device, self.non_blocking)

        with torch.cuda.stream(self._stream):
            return move_batch(batch, move)

    def _prefetch(self) -> Iterator[Any]:
        end = object()
        source = iter(self.loader)
        nxt = next(source, end)
        if nxt is end:
            return
        nxt = self._copy(nxt)
        while nxt is not end:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_stream(self._stream)
            batch = nxt
            for t in batch_tensors(batch):
                # not what stayed on the CPU (a PackedSequence's batch_sizes)
                if t.device == self.device:
                    t.record_stream(consumer)
            nxt = next(source, end)
            if nxt is not end:
                nxt = self._copy(nxt)
            yield batch


# --- BackgroundLoader -------------------------------------------------------

# NOTE [ BackgroundLoader lifecycle ]
#
#   consumer thread                          producer thread (daemon, one per epoch)
#   ───────────────                          ────────────────────────────────────────
#   iter(bg): join the previous producer
#             (it was told to stop) ─ start ─▶ it = iter(source)
#   next()  ◀── q.get(timeout) ◀── put ────  for item in it: put(item), retried while not done
#   next()  ◀── _End ──────────────────────  put(_End)                  (normal end)
#   next()  ◀── _Raised(exc) ──────────────  put(_Raised(exc))          (source raised)
#           raise exc (its own traceback)
#   close() ── done.set(); drain q ───────▶  put() sees done, gives up; it.close() runs the
#           join(short timeout); return      generator's `finally` in this thread; exit
#   __del__ ── done.set() only ───────────▶  (same)
#
# - One producer at a time: the next iter() joins the previous epoch's producer before it
#   starts a new one.  With persistent_workers (make_loader's opt-in) iter(DataLoader)
#   returns the same iterator every epoch, so two producers would call its __next__ at
#   once.  The old producer was told to stop; the wait is the rest of the one item it is
#   reading (it cannot be interrupted inside next(source)).
# - close() must not stall a training loop: it sets `done`, drains the queue (waking a
#   producer blocked in put) and joins for at most join_timeout (0.1 s by default); a
#   producer still inside next(source) then finishes on its own and exits.
# - __del__ only sets `done`: it may run in any thread, even the producer's (GC), where
#   taking the queue's lock or joining could deadlock.  The producer notices within _POLL.
# - The queue is bounded (max_prefetch); put() and get() use timeouts and re-check `done`
#   / the thread, so neither side blocks forever on a peer that went away.
# - End and errors travel as private sentinels, so a `None` item is just an item.
# - The producer closes its own iterator: a running generator cannot be closed from
#   another thread ("generator already executing").
# - The producer holds no reference to the epoch object, so dropping it (GC) stops it.
#   close() is idempotent, on the epoch and on the loader.

_POLL = 0.05  # seconds between `done` checks
DEFAULT_JOIN_TIMEOUT = 0.1  # seconds close() waits for the producer before returning


class _End:
    pass


class _Raised:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _put(q: queue.Queue[Any], item: Any, done: threading.Event) -> bool:
    while not done.is_set():
        try:
            q.put(item, timeout=_POLL)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterable[Any], q: queue.Queue[Any], done: threading.Event) -> None:
    it: Iterator[Any] | None = None
    _IN_PRODUCER.active = True  # a CudaPrefetcher refuses to run here
    try:
        it = iter(source)
        for item in it:
            if not _put(q, item, done):
                return
            if done.is_set():  # told to stop: do not start another next(source)
                return
        _put(q, _End, done)
    except BaseException as exc:  # sent across: the consumer re-raises it
        _put(q, _Raised(exc), done)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):  # the consumer has gone; nobody to tell
                close()


class _BackgroundIterator:
    """One epoch of a BackgroundLoader: a producer thread and its queue."""

    def __init__(self, source: Iterable[Any], max_prefetch: int, join_timeout: float) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_prefetch)
        self._done = threading.Event()
        self._finished = False
        self._join_timeout = join_timeout
        self._thread = threading.Thread(
            target=_produce,
            args=(source, self._queue, self._done),
            name="shmstage-background",
            daemon=True,
        )
        self._thread.start()

    def __iter__(self) -> _BackgroundIterator:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()  # producer gone without a word (stopped): end
                    raise StopIteration from None
        if item is _End:
            self.close()
            raise StopIteration
        if isinstance(item, _Raised):
            self.close()
            raise item.exc
        return item

    def close(self) -> None:
        """Tell the producer to stop and wait briefly for it (idempotent, never blocks long).

        A producer still inside ``next(source)`` finishes that item on its own, then runs the
        source's ``finally`` and exits; the next ``iter()`` of the loader waits for it.
        """
        self._finished = True
        self._done.set()
        try:
            while True:  # wake a producer blocked in put()
                self._queue.get_nowait()
        except queue.Empty:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(self._join_timeout)

    def __enter__(self) -> _BackgroundIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # signal only: no lock, no join (see NOTE [ BackgroundLoader lifecycle ])
        done = getattr(self, "_done", None)
        if done is not None:
            done.set()


class BackgroundLoader:
    """Iterate ``iterable`` in a background thread, up to ``max_prefetch`` items ahead.

    Each ``iter()`` stops the previous epoch, waits until its producer thread has exited
    (at most the rest of the item it is reading) and starts one daemon thread, so the
    source is never read by two threads at once.  An exception in the source is re-raised
    in the consumer with its type and traceback; ``None`` items pass through; ``close()``,
    leaving a ``with`` block or dropping the iterator stops the thread and runs the source
    generator's ``finally``; ``close()`` waits at most ``join_timeout`` seconds.
    See NOTE [ BackgroundLoader lifecycle ].
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        max_prefetch: int = 2,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT,
    ) -> None:
        if isinstance(iterable, CudaPrefetcher):
            # Its copies would run in the producer thread, on that thread's current device
            # and stream, not the training loop's: wrong GPU, and no ordering with compute.
            # (Wrapped in islice() or a generator it is refused by the prefetcher itself.)
            raise ShmstageError(_PREFETCHER_IN_BACKGROUND)
        if max_prefetch < 1:
            raise ShmstageError(f"max_prefetch={max_prefetch}: use an integer >= 1")
        if join_timeout < 0:
            raise ShmstageError(f"join_timeout={join_timeout}: use a number of seconds >= 0")
        self.iterable = iterable
        self.max_prefetch = max_prefetch
        self.join_timeout = join_timeout
        self._current: weakref.ref[_BackgroundIterator] | None = None
        # the last producer and its `done` event: strong references to these (not to the
        # epoch, which may be dropped) let iter() and close() reach a producer still running
        self._producer: tuple[threading.Thread, threading.Event] | None = None

    def __iter__(self) -> _BackgroundIterator:
        self.close()
        if self._producer is not None:
            thread, _ = self._producer
            if thread is not threading.current_thread():
                thread.join()  # told to stop; finishing the item it is reading
            self._producer = None
        epoch = _BackgroundIterator(self.iterable, self.max_prefetch, self.join_timeout)
        self._current = weakref.ref(epoch)
        self._producer = (epoch._thread, epoch._done)
        return epoch

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop the current epoch's thread, if any (idempotent; waits at most join_timeout)."""
        epoch = self._current() if self._current is not None else None
        self._current = None
        if epoch is not None:
            epoch.close()
        elif self._producer is not None:  # the epoch was dropped: its producer may live on
            self._producer[1].set()

    def __enter__(self) -> BackgroundLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # No __del__ here: `it = iter(BackgroundLoader(src))` drops the loader at once while the
    # epoch lives on; each epoch stops itself when it is collected.


# --- staged copies ----------------------------------------------------------


def staged_path(
    source_or_name: str | os.PathLike[str], dest: str | os.PathLike[str] | None = None
) -> Path:
    """The staged copy of a dataset when it is staged and complete, else the source (with a warning).

    Lets a training script name its dataset once (``staged_path("/nfs/imagenet")``) and run
    unchanged on a node where nothing was staged.
    """
    from shmstage.stage import find  # the staging engine; imported only when asked for

    found = find(os.fspath(source_or_name), dest=None if dest is None else os.fspath(dest))
    if found is not None:
        hold_lease(found.path, required=False)  # so nobody evicts it while this job reads it
        return Path(found.path)
    warnings.warn(
        f"{os.fspath(source_or_name)} is not staged on this node; reading it from its source "
        f"(stage it first: shmstage stage {os.fspath(source_or_name)})",
        ShmstageWarning,
        stacklevel=2,
    )
    return Path(source_or_name)
