"""DistributedDataset and DistributedIterator: each global batch as PerReplica values.

The input pipeline runs on the host (numpy); each batch is split between the
replicas (``splitting.py``), padded to one shape, and placed on the replicas'
devices one batch ahead of the step that consumes it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import jax
import numpy as np

from distribute.input.input_context import InputContext, InputOptions, InputReplicationMode
from distribute.input.splitting import stack_elements
from distribute.values import PerReplica


def _batch_info(dataset: Any, what: str) -> tuple[int, bool]:
    from distribute.data import Dataset

    if not isinstance(dataset, Dataset):
        raise TypeError(
            f"{what} expects a distribute.data.Dataset, got {type(dataset).__name__}. Build one "
            "with distribute.data.Dataset.from_tensor_slices(...).batch(global_batch_size)."
        )
    info = dataset._batch_info
    if info is None:
        raise ValueError(
            f"{what} got an unbatched dataset: each element must be a batch. Call "
            ".batch(global_batch_size) on the dataset first (TF requires the same)."
        )
    return info


class DistributedDataset:
    """A dataset whose elements are PerReplica batches (tf.distribute.DistributedDataset).

    Iterate it (a new pass each time, like a dataset) or call ``iter`` and
    ``next`` on it.  Elements keep the dataset's structure (tuple or dict), with
    each array ``(global_batch, ...)`` replaced by a PerReplica of
    ``(per_replica_batch, ...)`` parts.
    """

    def __init__(self, strategy: Any, make_local_iterator: Callable[[], Iterator[tuple[list, Any, np.ndarray | None]]], rows_per_replica: int, options: InputOptions | None, cardinality: int):
        self._strategy = strategy
        self._make_local_iterator = make_local_iterator
        self._rows_per_replica = rows_per_replica
        self._options = options or InputOptions()
        self._cardinality = cardinality
        self._source = None

    @classmethod
    def from_dataset(cls, strategy: Any, dataset: Any, options: InputOptions | None) -> "DistributedDataset":
        batch_size, _ = _batch_info(dataset, "experimental_distribute_dataset")
        if options is not None and options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            raise ValueError(
                "InputReplicationMode.PER_REPLICA is only valid with "
                "distribute_datasets_from_function (as TF)."
            )
        rows = math.ceil(batch_size / strategy.num_replicas_in_sync)
        ext = strategy.extended

        def batches():
            return ext._agree(ext._dataset_batches(dataset, rows))

        cardinality = ext._dataset_cardinality(dataset)
        distributed = cls(strategy, batches, rows, options, cardinality)
        distributed._source = dataset  # Keras fit reads the dataset itself (see keras_support/data_adapter.py)
        return distributed

    @classmethod
    def from_function(cls, strategy: Any, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None) -> "DistributedDataset":
        ext = strategy.extended
        num_local = len(ext._local_devices)
        mode = (options or InputOptions()).experimental_replication_mode
        if mode is InputReplicationMode.PER_REPLICA:
            ids = [ext._devices.index(d) for d in ext._local_devices]
            datasets = [dataset_fn(InputContext(strategy.num_replicas_in_sync, i, strategy.num_replicas_in_sync)) for i in ids]
        else:
            num_workers, worker_id = ext._input_pipelines()
            datasets = [dataset_fn(InputContext(num_workers, worker_id, strategy.num_replicas_in_sync))]
        infos = [_batch_info(d, "distribute_datasets_from_function's dataset_fn result") for d in datasets]
        rows = max(b for b, _ in infos)

        def batches():
            iterators = [iter(d) for d in datasets]
            while True:
                elements, treedef = [], None
                for r in range(num_local):
                    it = iterators[r % len(iterators)]
                    try:
                        element = next(it)
                    except StopIteration:
                        break
                    leaves, treedef = jax.tree_util.tree_flatten(element)
                    elements.append(leaves)
                if not elements:
                    return
                stacked, lengths = stack_elements(elements, num_local, rows)
                yield stacked, treedef, lengths
                if len(elements) < num_local:
                    return

        local_batches = batches

        def batches():
            return ext._agree(local_batches())

        cardinality = datasets[0].cardinality() if len(datasets) == 1 else -2
        if len(datasets) == 1 and cardinality >= 0:
            cardinality = math.ceil(cardinality / num_local)
        return cls(strategy, batches, rows, options, cardinality)

    def __iter__(self) -> "DistributedIterator":
        return DistributedIterator(self)

    def cardinality(self) -> int:
        """Steps in one pass; -1 infinite, -2 unknown (as tf.data)."""
        return self._cardinality

    def __repr__(self) -> str:
        return f"DistributedDataset(strategy={self._strategy!r}, per_replica_batch={self._rows_per_replica})"


class DistributedIterator:
    """Iterator over PerReplica batches (tf.distribute.DistributedIterator).

    The next batch is placed on the devices while the current step runs.
    """

    def __init__(self, dataset: DistributedDataset):
        self._dataset = dataset
        self._strategy = dataset._strategy
        self._source = dataset._make_local_iterator()
        self._ahead = max(dataset._options.experimental_per_replica_buffer_size, 1)
        self._queue: list = []

    def _place(self, item: tuple) -> Any:
        stacked, treedef, lengths = item
        ext = self._strategy.extended
        arrays = ext._put_per_replica_all(stacked)
        values = [PerReplica._from_array(self._strategy, a, lengths) for a in arrays]
        return jax.tree_util.tree_unflatten(treedef, values)

    def _fill(self) -> None:
        while len(self._queue) < self._ahead + 1:
            try:
                item = next(self._source)
            except StopIteration:
                return
            self._queue.append(self._place(item))

    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> Any:
        self._fill()
        if not self._queue:
            raise StopIteration
        return self._queue.pop(0)

    def get_next(self) -> Any:
        """The next batch; raises StopIteration at the end (TF raises OutOfRangeError)."""
        return next(self)

    def get_next_as_optional(self) -> "Optional":
        """The next batch wrapped in an Optional that is empty at the end (TF: same name)."""
        try:
            return Optional(next(self))
        except StopIteration:
            return Optional(None, has_value=False)


class Optional:
    """A value that may be absent (tf.experimental.Optional, as returned by get_next_as_optional)."""

    def __init__(self, value: Any, has_value: bool = True):
        self._value, self._has_value = value, has_value

    def has_value(self) -> bool:
        return self._has_value

    def get_value(self) -> Any:
        if not self._has_value:
            raise ValueError("The Optional has no value: the iterator reached the end of the input.")
        return self._value
