"""Pipeline nodes for tf.data's combining and reshaping transformations.

``zip``, ``concatenate``, ``enumerate``, ``padded_batch``, ``unbatch``,
``flat_map``, ``interleave`` and a parallel ``map``. Like the nodes in
``_pipeline``, ``build()`` returns a fresh ``grain.IterDataset`` for one
iteration; the element order is tf.data's (TensorFlow 2.21).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import grain
import numpy as np

import distribute.data._spec as _spec
import distribute.data._structure as _structure
from distribute.data._pipeline import Node, _PyIterDataset


@dataclasses.dataclass
class ZipNode:
    """``Dataset.zip``: one element from each dataset, in ``template``'s structure; stops at the shortest."""

    parents: list[Node]
    template: Any  # the structure of datasets, leaves replaced by their positions

    def build(self) -> grain.IterDataset:
        return _PyIterDataset(self._elements)

    def _elements(self) -> Iterator[Any]:
        iterators = [iter(parent.build()) for parent in self.parents]
        while True:
            values = []
            for iterator in iterators:
                try:
                    values.append(next(iterator))
                except StopIteration:
                    return
            yield _structure.map_structure(values.__getitem__, self.template)


@dataclasses.dataclass
class ConcatenateNode:
    """``concatenate``: every element of ``first``, then every element of ``second``."""

    first: Node
    second: Node

    def build(self) -> grain.IterDataset:
        return _PyIterDataset(lambda: itertools.chain(self.first.build(), self.second.build()))


@dataclasses.dataclass
class EnumerateNode:
    """``enumerate``: ``(int64 index, element)`` pairs."""

    parent: Node
    start: int

    def build(self) -> grain.IterDataset:
        return _PyIterDataset(lambda: ((np.int64(i), e) for i, e in enumerate(self.parent.build(), self.start)))


@dataclasses.dataclass
class UnbatchNode:
    """``unbatch``: every row of every element, in order."""

    parent: Node

    def build(self) -> grain.IterDataset:
        return _PyIterDataset(self._elements)

    def _elements(self) -> Iterator[Any]:
        for element in self.parent.build():
            leaves, _ = _structure.flatten(element)
            sizes = {np.shape(leaf)[0] if np.ndim(leaf) else -1 for leaf in leaves}
            if -1 in sizes or len(sizes) != 1:
                raise ValueError(f"unbatch() needs every component of an element to have the same size in dim 0, "
                                 f"got shapes {[np.shape(leaf) for leaf in leaves]}; batch components together.")
            for row in range(sizes.pop()):
                yield _structure.unflatten(element, [_row(leaf, row) for leaf in leaves])


def _row(leaf: Any, row: int) -> Any:
    value = leaf[row]
    return value.copy() if isinstance(value, np.ndarray) else value


@dataclasses.dataclass
class PaddedBatchNode:
    """``padded_batch``: pads every component to one shape per batch, then stacks.

    ``padded_shapes`` and ``padding_values`` are flat lists, one entry per
    component in flatten order; a None shape or dim pads to the largest size in
    the batch.
    """

    parent: Node
    batch_size: int
    drop_remainder: bool
    padded_shapes: list[tuple[int | None, ...] | None]
    padding_values: list[Any]

    def build(self) -> grain.IterDataset:
        return self.parent.build().batch(self.batch_size, drop_remainder=self.drop_remainder, batch_fn=self._pad)

    def _pad(self, elements: list[Any]) -> Any:
        columns = [_structure.flatten(e)[0] for e in elements]
        out = []
        for component, (shape, value) in enumerate(zip(self.padded_shapes, self.padding_values)):
            arrays = [np.asarray(column[component]) for column in columns]
            ranks = {a.ndim for a in arrays}
            if len(ranks) != 1 or (shape is not None and ranks != {len(shape)}):
                raise ValueError(f"padded_batch(): component {component} has shapes {[a.shape for a in arrays]}, "
                                 f"which do not match padded_shapes {shape}; every element needs the same rank.")
            target = [max(a.shape[d] for a in arrays) for d in range(ranks.pop())]
            for d, want in enumerate(shape or ()):
                if want is not None:
                    if target[d] > want:
                        raise ValueError(f"padded_batch(): component {component} has size {target[d]} in dim {d}, "
                                         f"larger than padded_shapes {shape}; raise the padded size or use None "
                                         "(pad to the largest in the batch).")
                    target[d] = want
            dtype = _common_dtype(arrays)
            batch = np.full((len(arrays), *target), value, dtype=dtype)
            for position, a in enumerate(arrays):
                batch[(position, *[slice(0, n) for n in a.shape])] = a
            out.append(batch)
        return _structure.unflatten(elements[0], out)


def _common_dtype(arrays: list[np.ndarray]) -> np.dtype:
    if arrays[0].dtype.kind == "S":
        return np.dtype(f"S{max(a.dtype.itemsize for a in arrays) or 1}")
    return arrays[0].dtype


def default_padding(spec: _spec.TensorSpec) -> Any:
    """tf.data's default padding value: 0 of the dtype, ``b""`` for strings."""
    return b"" if spec.dtype == _spec.STRING else spec.dtype.type(0)


@dataclasses.dataclass
class FlatMapNode:
    """``flat_map``: the elements of ``map_func(element)``'s dataset, for every element in order."""

    parent: Node
    make_dataset: Callable[[Any], Any]

    def build(self) -> grain.IterDataset:
        return _PyIterDataset(lambda: (e for element in self.parent.build() for e in self.make_dataset(element)))


@dataclasses.dataclass
class InterleaveNode:
    """``interleave``: ``cycle_length`` inner datasets open at once, ``block_length`` elements from each in turn.

    The order is tf.data's deterministic one: an empty slot opens the next
    input element when the cycle reaches it; a slot whose dataset ends hands
    over to the next slot.
    """

    parent: Node
    make_dataset: Callable[[Any], Any]
    cycle_length: int
    block_length: int

    def build(self) -> grain.IterDataset:
        return _PyIterDataset(self._elements)

    def _elements(self) -> Iterator[Any]:
        # TF 2.21's InterleaveDatasetOp: an empty slot opens the next input element when visited;
        # a slot whose dataset ends (or whose block is done) hands over to the next slot.
        source = iter(self.parent.build())
        slots: list[Iterator[Any] | None] = [None] * self.cycle_length
        end_of_input, slot = False, 0
        while not end_of_input or any(s is not None for s in slots):
            if slots[slot] is None and not end_of_input:
                try:
                    slots[slot] = iter(self.make_dataset(next(source)))
                except StopIteration:
                    end_of_input = True
            iterator = slots[slot]
            if iterator is not None:
                for _ in range(self.block_length):
                    try:
                        value = next(iterator)
                    except StopIteration:
                        slots[slot] = None
                        break
                    yield value
            slot = (slot + 1) % self.cycle_length


@dataclasses.dataclass
class ParallelMapNode:
    """``map(num_parallel_calls=N)``: ``map_func`` on N threads, at most ``2 N`` elements in flight.

    ``deterministic`` True (or None): outputs in input order; False: in the
    order they finish (a slow element does not hold back the others).
    """

    parent: Node
    map_func: Callable[[Any], Any]
    num_threads: int
    deterministic: bool

    def build(self) -> grain.IterDataset:
        return _PyIterDataset(self._elements)

    def _elements(self) -> Iterator[Any]:
        window = 2 * self.num_threads
        with concurrent.futures.ThreadPoolExecutor(self.num_threads, thread_name_prefix="distribute-map") as pool:
            pending: collections.deque[concurrent.futures.Future] = collections.deque()
            source = iter(self.parent.build())
            for element in source:
                pending.append(pool.submit(self.map_func, element))
                if len(pending) >= window:
                    yield self._take(pending)
            while pending:
                yield self._take(pending)

    def _take(self, pending: collections.deque) -> Any:
        if self.deterministic:
            return pending.popleft().result()
        done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        future = next(f for f in pending if f in done)
        pending.remove(future)
        return future.result()
