"""Nested batches: move every tensor in a batch (tuples, lists, mappings, namedtuples,
dataclasses, objects with ``.to()``) and find the tensors an object holds.  Pure functions over
torch; the prefetchers in :mod:`shmstage.prefetch` use them to copy batches to a device.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import types
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any, Callable

import torch


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


_NOT_HOLDERS = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
)


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


def to_device(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    """``obj.to(device, non_blocking=...)``; a plain ``.to(device)`` for a ``.to`` without it."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    try:
        params = inspect.signature(obj.to).parameters.values()
        takes = any(p.name == "non_blocking" or p.kind is p.VAR_KEYWORD for p in params)
    except (TypeError, ValueError):  # no signature (a builtin): try it
        takes = True
    return obj.to(device, non_blocking=non_blocking) if takes else obj.to(device)
