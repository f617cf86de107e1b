"""Vectorised index plans for datasets backed by in-memory arrays.

A dataset made by ``from_tensor_slices`` or ``range``, followed only by index
transformations (shuffle, take, skip, shard, repeat, cache) and at most one
``batch``, is fully described by *which source rows come out in which order*.
A plan computes that order with numpy, a chunk at a time, and the source then
gathers a whole batch with one fancy-index per array: per-batch, not
per-element, Python work.

A plan's ``stream()`` yields 1-D numpy arrays ("chunks") whose concatenation
is one iteration of the dataset. Before ``batch`` a chunk holds int64 source
row numbers; after it, a chunk is an object array whose items are int64 arrays
of row numbers, one per batch. The index transformations work on either kind.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import functools
import itertools
import operator
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import distribute.data._checks as _checks
import distribute.data._spec as _spec
import distribute.data._structure as _structure

CHUNK_ROWS = 1 << 16  # source rows per chunk for sequential sources
_PEEKING: contextvars.ContextVar[bool] = contextvars.ContextVar("distribute_data_peeking", default=False)


@contextlib.contextmanager
def peeking() -> Any:
    """Within: iterations draw no new shuffle seeds (a look at the first element is not a pass)."""
    token = _PEEKING.set(True)
    try:
        yield
    finally:
        _PEEKING.reset(token)


class SeedStream:
    """The seed for each iteration of one ``shuffle`` (tf.data seed semantics).

    With ``reshuffle_each_iteration=True`` every new iteration (a new iterator,
    or a new epoch of an upstream ``repeat``) draws the next seed, so orders
    differ between iterations yet repeat exactly for a dataset rebuilt with the
    same ``seed``. With ``False`` every iteration uses the same order.
    """

    def __init__(self, seed: int | None, reshuffle: bool) -> None:
        self._base = secrets.randbits(63) if seed is None else int(seed) % (1 << 64)
        self._reshuffle = reshuffle
        self._count = itertools.count()
        self.agreed = seed is not None  # an unseeded stream's base is agreed between workers once

    @property
    def base(self) -> int:
        """The seed every iteration's seed derives from (random when no seed was given)."""
        return self._base

    def agree(self, base: int) -> None:
        """Uses ``base`` (the value every worker agreed on) from now on."""
        self._base, self.agreed = int(base), True

    def next(self) -> np.random.SeedSequence:
        """Returns the seed material for the next iteration (a peek gets the next one without using it up)."""
        if _PEEKING.get():
            iteration = 0
        else:
            iteration = next(self._count) if self._reshuffle else 0
        return np.random.SeedSequence([self._base, iteration])


class Source(abc.ABC):
    """Rows of an in-memory dataset, read one at a time or a batch at a time."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def element(self, row: int) -> Any:
        """Returns row ``row`` as an element (fresh arrays, numpy scalars)."""

    @abc.abstractmethod
    def gather(self, rows: np.ndarray) -> Any:
        """Returns rows ``rows`` stacked along a new first dim (fresh arrays)."""


class SliceSource(Source):
    """Rows of a structure of arrays sliced along dim 0 (``from_tensor_slices``)."""

    def __init__(self, arrays: Any, length: int) -> None:
        self._arrays = arrays
        self._leaves, _ = _structure.flatten(arrays)
        self._length = length
        self._assemble = _assembler(arrays, len(self._leaves))

    @classmethod
    def from_tensors(cls, tensors: Any) -> SliceSource:
        """Converts and checks ``from_tensor_slices``'s argument.

        Raises:
          ValueError: empty structure, a scalar component, or unequal sizes in dim 0.
        """
        arrays = _structure.map_with_path(
            lambda path, leaf: _structure.to_numpy(leaf, f"from_tensor_slices() component {path}"), tensors)
        sizes: dict[str, int] = {}

        def record(path: str, leaf: Any) -> None:
            if np.ndim(leaf) == 0:
                raise ValueError(f"from_tensor_slices() component {path} is a scalar ({leaf!r}); slicing "
                                 "needs rank >= 1. Wrap it in a list, or use from_tensor_slices([value]).")
            sizes[path] = len(leaf)

        _structure.map_with_path(record, arrays)
        if not sizes:
            raise ValueError(f"from_tensor_slices() got an empty structure {tensors!r}; pass at least one array.")
        if len(set(sizes.values())) > 1:
            listed = ", ".join(f"{path}: {size}" for path, size in sizes.items())
            raise ValueError(f"from_tensor_slices() needs every component to have the same size in dim 0, "
                             f"got {listed}; slice or pad them to one length.")
        return cls(arrays, next(iter(sizes.values())))

    def __len__(self) -> int:
        return self._length

    def element_spec(self) -> Any:
        """The spec of one row: each array's shape without dim 0, and its dtype."""
        return _spec.map_specs(lambda leaf: _spec.TensorSpec(leaf.shape[1:], _spec.as_dtype(leaf.dtype)), self._arrays)

    def element(self, row: int) -> Any:
        return self._assemble([_row(leaf, row) for leaf in self._leaves])

    def gather(self, rows: np.ndarray) -> Any:
        start = int(rows[0]) if len(rows) else 0
        if len(rows) and int(rows[-1]) - start == len(rows) - 1 and np.all(np.diff(rows) == 1):
            picked = [leaf[start:start + len(rows)].copy() for leaf in self._leaves]
        else:
            picked = [leaf[rows] for leaf in self._leaves]
        return self._assemble(picked)


def _assembler(arrays: Any, num_leaves: int) -> Callable[[list[Any]], Any]:
    """Returns a fast function from a list of leaves to an element shaped like ``arrays``."""
    if not _structure.is_structure(arrays):
        return operator.itemgetter(0)
    if type(arrays) is tuple and len(arrays) == num_leaves and not any(_structure.is_structure(a) for a in arrays):
        return tuple
    return functools.partial(_structure.unflatten, arrays)


def _row(leaf: np.ndarray, row: int) -> Any:
    value = leaf[row]
    return value.copy() if isinstance(value, np.ndarray) else value


class RangeSource(Source):
    """The integers ``start, start + step, ...`` (``Dataset.range``), never materialised."""

    def __init__(self, start: int, step: int, length: int, dtype: np.dtype) -> None:
        self._start, self._step, self._length, self._dtype = start, step, length, dtype

    @classmethod
    def from_args(cls, args: tuple[Any, ...], dtype: np.dtype) -> RangeSource:
        """Checks ``Dataset.range``'s arguments (as Python's ``range``).

        Raises:
          TypeError: not 1 to 3 ints.
          ValueError: ``step`` is 0.
        """
        if not 1 <= len(args) <= 3:
            raise TypeError(f"range() takes 1 to 3 ints (stop | start, stop | start, stop, step), got {len(args)}.")
        values = [_checks.integer(a, name, "range()") for a, name in zip(args, ("start/stop", "stop", "step"))]
        if len(values) == 3 and values[2] == 0:
            raise ValueError("range(): step=0 must not be zero; use a positive or negative step.")
        span = range(*values)
        return cls(span.start, span.step, len(span), dtype)

    def __len__(self) -> int:
        return self._length

    def element(self, row: int) -> Any:
        return self._dtype.type(self._start + int(row) * self._step)

    def gather(self, rows: np.ndarray) -> Any:
        return (self._start + rows.astype(np.int64) * self._step).astype(self._dtype)


class Plan(abc.ABC):
    """One iteration's order of source rows, produced in chunks."""

    @abc.abstractmethod
    def stream(self) -> Iterator[np.ndarray]:
        """Yields the chunks of one new iteration."""


class SourcePlan(Plan):
    """All rows ``0 .. n-1`` in order."""

    def __init__(self, num_rows: int) -> None:
        self._num_rows = num_rows

    def stream(self) -> Iterator[np.ndarray]:
        for start in range(0, self._num_rows, CHUNK_ROWS):
            yield np.arange(start, min(start + CHUNK_ROWS, self._num_rows), dtype=np.int64)


class ShufflePlan(Plan):
    """Shuffles windows of ``buffer_size`` items; one window covers a dataset no larger than it.

    When the buffer holds the whole dataset this is a uniform random
    permutation, exactly what tf.data's shuffle gives. A smaller buffer shuffles
    consecutive windows of ``buffer_size`` items (grain's window shuffle): every
    item still comes out exactly once, and no item moves further than one
    window, but the distribution differs from tf.data's sliding buffer.
    """

    def __init__(self, parent: Plan, buffer_size: int, seeds: SeedStream) -> None:
        self._parent, self._buffer_size, self._seeds = parent, buffer_size, seeds

    def stream(self) -> Iterator[np.ndarray]:
        rng = np.random.default_rng(self._seeds.next())
        pending: list[np.ndarray] = []
        num_pending = 0
        for chunk in self._parent.stream():
            pending.append(chunk)
            num_pending += len(chunk)
            if num_pending >= self._buffer_size:
                window = np.concatenate(pending)
                full = len(window) - len(window) % self._buffer_size
                for start in range(0, full, self._buffer_size):
                    yield rng.permutation(window[start:start + self._buffer_size])
                pending, num_pending = [window[full:]], len(window) - full
        if num_pending:
            yield rng.permutation(np.concatenate(pending))


class TakePlan(Plan):
    """The first ``count`` items (``count >= 0``)."""

    def __init__(self, parent: Plan, count: int) -> None:
        self._parent, self._count = parent, count

    def stream(self) -> Iterator[np.ndarray]:
        remaining = self._count
        if remaining == 0:
            return
        for chunk in self._parent.stream():
            yield chunk[:remaining]
            remaining -= min(remaining, len(chunk))
            if remaining == 0:
                return


class SkipPlan(Plan):
    """All but the first ``count`` items (``count >= 0``)."""

    def __init__(self, parent: Plan, count: int) -> None:
        self._parent, self._count = parent, count

    def stream(self) -> Iterator[np.ndarray]:
        to_skip = self._count
        for chunk in self._parent.stream():
            if to_skip >= len(chunk):
                to_skip -= len(chunk)
                continue
            yield chunk[to_skip:]
            to_skip = 0


class ShardPlan(Plan):
    """Items at positions ``index, index + num_shards, ...`` (``Dataset.shard``)."""

    def __init__(self, parent: Plan, num_shards: int, index: int) -> None:
        self._parent, self._num_shards, self._index = parent, num_shards, index

    def stream(self) -> Iterator[np.ndarray]:
        position = 0
        for chunk in self._parent.stream():
            first = (self._index - position) % self._num_shards
            position += len(chunk)
            if first < len(chunk):
                yield chunk[first::self._num_shards]


class RepeatPlan(Plan):
    """``count`` iterations of the parent back to back; ``None`` repeats until an iteration is empty."""

    def __init__(self, parent: Plan, count: int | None) -> None:
        self._parent, self._count = parent, count

    def stream(self) -> Iterator[np.ndarray]:
        epochs = itertools.count() if self._count is None else range(self._count)
        for _ in epochs:
            num_items = 0
            for chunk in self._parent.stream():
                num_items += len(chunk)
                yield chunk
            if num_items == 0:
                return


class BatchPlan(Plan):
    """Groups the parent's row numbers into batches of ``batch_size`` (object chunks)."""

    def __init__(self, parent: Plan, batch_size: int, drop_remainder: bool) -> None:
        self._parent, self._batch_size, self._drop_remainder = parent, batch_size, drop_remainder

    def stream(self) -> Iterator[np.ndarray]:
        carry = np.zeros(0, dtype=np.int64)
        for chunk in self._parent.stream():
            rows = np.concatenate([carry, chunk]) if len(carry) else chunk
            full = len(rows) - len(rows) % self._batch_size
            if full:
                yield _object_array(rows[:full].reshape(-1, self._batch_size))
            carry = rows[full:]
        if len(carry) and not self._drop_remainder:
            yield _object_array([carry])


def _object_array(rows: Any) -> np.ndarray:
    out = np.empty(len(rows), dtype=object)
    for position, row in enumerate(rows):
        out[position] = row
    return out


class CachePlan(Plan):
    """Replays the order of the first complete iteration (``Dataset.cache()`` in memory)."""

    def __init__(self, parent: Plan) -> None:
        self._parent = parent
        self._chunks: list[np.ndarray] | None = None

    def stream(self) -> Iterator[np.ndarray]:
        if self._chunks is not None:
            yield from self._chunks
            return
        recorded = []
        for chunk in self._parent.stream():
            recorded.append(chunk)
            yield chunk
        if self._chunks is None:
            self._chunks = recorded


def iterate(source: Source, plan: Plan, batched: bool) -> Iterator[Any]:
    """Yields the elements (or, if ``batched``, the gathered batches) of one iteration."""
    for chunk in plan.stream():
        if batched:
            for rows in chunk:
                yield source.gather(rows)
        else:
            for row in chunk:
                yield source.element(row)
