"""The grain pipeline behind a ``Dataset``.

Each ``Dataset`` owns a node; ``node.build()`` returns a fresh
``grain.IterDataset`` for one new iteration, so per-iteration state (shuffle
seeds, re-called generators) is drawn at build time, as tf.data does when it
creates an iterator. Where grain has the transformation it is used directly
(``map``, ``filter``, ``batch``, window ``shuffle``, ``take`` via
``LimitIterDataset``, thread ``prefetch``); the few tf.data behaviours grain
has no ``IterDataset`` form of (Python iterables as a source, skip/shard, a
repeat that starts a new iteration each epoch, an in-memory cache that only
completes on a full pass) are small ``grain.IterDataset`` subclasses here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grain
import numpy as np
from grain import experimental as grain_experimental

import distribute.data._plan as _plan
import distribute.data._structure as _structure

_NO_FILTER_WARNINGS = grain_experimental.DatasetOptions(filter_warn_threshold_ratio=None)


class Node(Protocol):
    """Builds the grain pipeline for one iteration of a dataset."""

    def build(self) -> grain.IterDataset: ...


class _PyIterDataset(grain.IterDataset):
    """A grain source over ``make_iterator()``, called anew for every iterator."""

    def __init__(self, make_iterator: Callable[[], Iterator[Any]]) -> None:
        super().__init__()
        self._make_iterator = make_iterator

    def __iter__(self) -> grain.DatasetIterator:
        return _PyIterator(self._make_iterator)

    def __str__(self) -> str:
        return "PyIterDataset"


class _PyIterator(grain.DatasetIterator):
    """Iterator of ``_PyIterDataset``; its state is the number of elements produced."""

    def __init__(self, make_iterator: Callable[[], Iterator[Any]]) -> None:
        super().__init__()
        self._make_iterator = make_iterator
        self._iterator = make_iterator()
        self._num_produced = 0

    def __next__(self) -> Any:
        value = next(self._iterator)
        self._num_produced += 1
        return value

    def get_state(self) -> dict[str, Any]:
        return {"num_produced": self._num_produced}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restarts a new iteration and skips ``num_produced`` elements of it."""
        self._iterator = self._make_iterator()
        self._num_produced = 0
        for _ in range(state["num_produced"]):
            next(self)


class _LazyIterDataset(grain.IterDataset):
    """Base for datasets whose iterator builds its own upstream pipeline(s)."""

    def __init__(self, make_iterator: Callable[[], grain.DatasetIterator]) -> None:
        super().__init__()
        self._make_iterator = make_iterator

    def __iter__(self) -> grain.DatasetIterator:
        return self._make_iterator()


class _SliceIterator(grain.DatasetIterator):
    """Elements at positions ``start, start + step, ...`` of the parent (skip and shard)."""

    def __init__(self, parent: grain.DatasetIterator, start: int, step: int) -> None:
        super().__init__(parent)
        self._next_wanted, self._step, self._position = start, step, 0

    def __next__(self) -> Any:
        while True:
            value = next(self._parent)
            self._position += 1
            if self._position - 1 == self._next_wanted:
                self._next_wanted += self._step
                return value

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parent.get_state(), "position": self._position,
                "next_wanted": self._next_wanted}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._position, self._next_wanted = state["position"], state["next_wanted"]


class _RepeatIterator(grain.DatasetIterator):
    """Runs a fresh iteration of the parent per epoch, so shuffles reshuffle and generators re-run.

    Stops after ``count`` epochs, or (``count`` None) at the first epoch that
    produces nothing, so repeating an empty dataset never hangs.
    """

    def __init__(self, build: Callable[[], grain.IterDataset], count: int | None) -> None:
        super().__init__()
        self._build, self._count = build, count
        self._epoch, self._num_in_epoch = 0, 0
        self._current: grain.DatasetIterator | None = iter(build()) if count != 0 else None

    def __next__(self) -> Any:
        while self._current is not None:
            try:
                value = next(self._current)
            except StopIteration:
                self._next_epoch()
                continue
            self._num_in_epoch += 1
            return value
        raise StopIteration

    def _next_epoch(self) -> None:
        assert self._current is not None
        self._current.close()
        self._epoch += 1
        finished = self._epoch == self._count or (self._count is None and self._num_in_epoch == 0)
        self._current = None if finished else iter(self._build())
        self._num_in_epoch = 0

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "num_in_epoch": self._num_in_epoch}

    def set_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("restoring a repeat() iterator is not supported; start a new iterator.")

    def close(self) -> None:
        if self._current is not None:
            self._current.close()
        super().close()


@dataclasses.dataclass
class PlanNode:
    """An in-memory source read through a vectorised index plan."""

    source: _plan.Source
    plan: _plan.Plan
    batched: bool

    def build(self) -> grain.IterDataset:
        return _PyIterDataset(lambda: _plan.iterate(self.source, self.plan, self.batched))


@dataclasses.dataclass
class GeneratorNode:
    """``from_generator``: calls ``generator()`` for every iteration."""

    generator: Callable[[], Any]
    output_signature: Any

    def build(self) -> grain.IterDataset:
        return _PyIterDataset(self._elements)

    def _elements(self) -> Iterator[Any]:
        signature = self.output_signature
        for index, value in enumerate(self.generator()):
            if signature is None:
                yield _structure.normalize(value, f"from_generator() element {index}")
            else:
                yield _structure.conform(value, signature, index)


@dataclasses.dataclass
class MapNode:
    """``map``: grain's map, with tf.data's argument unpacking and numpy outputs."""

    parent: Node
    map_func: Callable[..., Any]

    def build(self) -> grain.IterDataset:
        fn = self.map_func
        return self.parent.build().map(
            lambda element: _structure.normalize_fn_output(_structure.call_unpacked(fn, element)))


@dataclasses.dataclass
class FilterNode:
    """``filter``: grain's filter (its many-filtered warning is switched off)."""

    parent: Node
    predicate: Callable[..., Any]

    def build(self) -> grain.IterDataset:
        filtered = self.parent.build().filter(self._keep)
        return grain_experimental.WithOptionsIterDataset(filtered, _NO_FILTER_WARNINGS)

    def _keep(self, element: Any) -> bool:
        result = _structure.call_unpacked(self.predicate, element)
        value = np.asarray(result)
        if value.shape != () or value.dtype != np.bool_:
            raise TypeError(f"filter() predicate must return a scalar bool, got {type(result).__name__} "
                            f"with shape {value.shape} and dtype {value.dtype}; compare explicitly, "
                            "e.g. `lambda x: x % 2 == 0`.")
        return bool(value)


@dataclasses.dataclass
class BatchNode:
    """``batch``: grain's batch with tf.data's stacking and shape errors."""

    parent: Node
    batch_size: int
    drop_remainder: bool

    def build(self) -> grain.IterDataset:
        return self.parent.build().batch(self.batch_size, drop_remainder=self.drop_remainder,
                                         batch_fn=_structure.stack)


@dataclasses.dataclass
class ShuffleNode:
    """Window shuffle with the same permutations as ``_plan.ShufflePlan``, so one seed gives one order.

    Consecutive windows of ``buffer_size`` elements are each permuted by a
    numpy Generator seeded from the stream; a window as large as the dataset is
    a full shuffle.
    """

    parent: Node
    buffer_size: int
    seeds: _plan.SeedStream

    def build(self) -> grain.IterDataset:
        return _PyIterDataset(self._elements)

    def _elements(self) -> Iterator[Any]:
        rng = np.random.default_rng(self.seeds.next())
        window: list[Any] = []
        for element in self.parent.build():
            window.append(element)
            if len(window) == self.buffer_size:
                yield from (window[i] for i in rng.permutation(len(window)))
                window = []
        if window:
            yield from (window[i] for i in rng.permutation(len(window)))


@dataclasses.dataclass
class TakeNode:
    """``take``: grain's ``LimitIterDataset``."""

    parent: Node
    count: int

    def build(self) -> grain.IterDataset:
        if self.count == 0:
            return _PyIterDataset(lambda: iter(()))
        return grain_experimental.LimitIterDataset(self.parent.build(), self.count)


@dataclasses.dataclass
class SliceNode:
    """Skip (``start=count, step=1``) and shard (``start=index, step=num_shards``)."""

    parent: Node
    start: int
    step: int

    def build(self) -> grain.IterDataset:
        build = self.parent.build
        return _LazyIterDataset(lambda: _SliceIterator(iter(build()), self.start, self.step))


@dataclasses.dataclass
class RepeatNode:
    """``repeat``: a new pass of the parent per epoch."""

    parent: Node
    count: int | None

    def build(self) -> grain.IterDataset:
        return _LazyIterDataset(lambda: _RepeatIterator(self.parent.build, self.count))


@dataclasses.dataclass
class PrefetchNode:
    """``prefetch``: grain's thread prefetch."""

    parent: Node
    buffer_size: int

    def build(self) -> grain.IterDataset:
        return grain_experimental.ThreadPrefetchIterDataset(self.parent.build(),
                                                            prefetch_buffer_size=self.buffer_size)


@dataclasses.dataclass
class EmptyNode:
    """No elements (``skip(-1)`` and similar)."""

    def build(self) -> grain.IterDataset:
        return _PyIterDataset(lambda: iter(()))


class CacheNode:
    """In-memory cache: the first complete iteration is recorded and replayed afterwards.

    A partial first iteration records nothing (tf.data discards a partial
    cache too). Replayed array leaves are copies, so changing a yielded array
    in place cannot change later epochs.
    """

    def __init__(self, parent: Node) -> None:
        self.parent = parent
        self._elements: list[Any] | None = None

    def build(self) -> grain.IterDataset:
        if self._elements is not None:
            elements = self._elements
            return _PyIterDataset(lambda: (_structure.copy_element(e) for e in elements))
        return _PyIterDataset(self._record)

    def _record(self) -> Iterator[Any]:
        recorded = []
        for element in self.parent.build():
            recorded.append(_structure.copy_element(element))
            yield element
        if self._elements is None:
            self._elements = recorded
