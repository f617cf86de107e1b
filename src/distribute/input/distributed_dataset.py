"""DistributedDataset and DistributedIterator: each global batch as PerReplica values.

The input pipeline runs on the host (numpy); each batch is split between the
replicas (``splitting.py``) and placed on the replicas' devices one batch ahead
of the step that consumes it. Non-numeric features stay on the host
(``host_values.py``); file-based datasets are split by file between workers
under ``AutoShardPolicy.FILE`` (and AUTO), as TF does; every unseeded shuffle
gets the same seed on every worker (``_agree_seeds``), so DATA sharding sees
every example exactly once per epoch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

import distribute.input.host_values as host_values
import distribute.input.specs as specs
from distribute.input.input_context import (
    InputContext,
    InputOptions,
    InputReplicationMode,
)
from distribute.input.splitting import stack_elements
from distribute.values import PerReplica


def as_dataset(dataset: Any, what: str) -> Any:
    """``dataset`` as a ``distribute.data.Dataset``: tf.data and grain datasets are wrapped.

    Raises:
        TypeError: anything else.
    """
    from distribute.data import Dataset
    from distribute.data._foreign import wrap

    if isinstance(dataset, Dataset):
        return dataset
    wrapped = wrap(dataset)
    if wrapped is None:
        raise TypeError(
            f"{what} expects a distribute.data.Dataset (or a tf.data.Dataset, or a grain MapDataset/IterDataset), "
            f"got {type(dataset).__name__}. Build one with "
            "distribute.data.Dataset.from_tensor_slices(...).batch(global_batch_size)."
        )
    return wrapped


def agree_seeds(strategy: Any, dataset: Any) -> None:
    """Gives every unseeded shuffle of ``dataset`` worker 0's seed (a no-op with one worker).

    Under DATA sharding every worker reads every global batch and keeps its own
    replicas' rows, so all workers must shuffle alike.
    """
    agree = strategy.extended.input_policy.agree_on_seeds
    streams = [s for s in dataset._seeds if not s.agreed]
    if agree is None or not streams:
        return
    for stream, base in zip(streams, agree([s.base for s in streams])):
        stream.agree(base)


class _Encoded:
    """A dataset whose non-numeric leaves are replaced by row ids (``host_values.HostCodec``)."""

    def __init__(self, dataset: Any, codec: host_values.HostCodec) -> None:
        self._dataset, self._codec = dataset, codec

    def __iter__(self) -> Iterator[Any]:
        for element in self._dataset:
            leaves, treedef = jax.tree_util.tree_flatten(element)
            host = host_values.host_positions(leaves)
            if host:
                self._codec.host = host
                leaves = self._codec.encode(leaves, host)
            yield jax.tree_util.tree_unflatten(treedef, leaves)

    def options(self) -> Any:
        return self._dataset.options()

    def cardinality(self) -> int:
        return self._dataset.cardinality()

    def __getattr__(self, name: str) -> Any:  # what the strategy's shard policy reads (e.g. _files_root)
        return getattr(self._dataset, name)


class DistributedDataset:
    """A dataset whose elements are PerReplica batches (tf.distribute.DistributedDataset).

    Iterate it (a new pass each time, like a dataset) or call ``iter`` and
    ``next`` on it.  Elements keep the dataset's structure (tuple or dict), with
    each array ``(global_batch, ...)`` replaced by a PerReplica of
    ``(per_replica_batch, ...)`` parts.
    """

    def __init__(self, strategy: Any, make_local_iterator: Callable[[host_values.HostCodec], Iterator[tuple[list, Any, np.ndarray | None]]], rows_per_replica: int, options: InputOptions | None, cardinality: int, spec: Callable[[], Any] | None = None):
        self._strategy = strategy
        self._make_local_iterator = make_local_iterator
        self._rows_per_replica = rows_per_replica
        self._options = options or InputOptions()
        self._cardinality = cardinality
        self._spec = spec
        self._source = None

    @classmethod
    def from_dataset(cls, strategy: Any, dataset: Any, options: InputOptions | None) -> DistributedDataset:
        dataset = as_dataset(dataset, "experimental_distribute_dataset")
        if options is not None and options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            raise NotImplementedError(  # TF 2.21's class and text
                "InputReplicationMode.PER_REPLICA is only supported in "
                "`distribute_datasets_from_function`."
            )
        info = dataset._batch_info
        num_replicas = strategy.num_replicas_in_sync
        if info is None:
            info = _split_dim(dataset)  # TF splits any element of rank >= 1 along dim 0
        if info is None:
            raise ValueError(
                "experimental_distribute_dataset got an unbatched dataset (its elements have scalar components), "
                "which cannot be split between replicas: call .batch(global_batch_size) on it first, or use "
                "distribute_datasets_from_function, whose dataset_fn may return an unbatched dataset (one element "
                "per replica per step). TF 2.21 fails here with an IndexError on several replicas and hands each "
                "element through on one."
            )
        by_file = _file_sharded(strategy, dataset, info)
        if by_file is not None:
            return cls.from_function(strategy, lambda ctx: by_file, options)
        agree_seeds(strategy, dataset)
        rows = specs.rows_per_replica(info[0], num_replicas)
        ext = strategy.extended

        def batches(codec):
            return ext.input_policy.distributed_batches(_Encoded(dataset, codec), rows)

        cardinality = ext.input_policy.dataset_cardinality(dataset)
        spec = lambda: specs.per_replica(
            specs.split_global(dataset.element_spec, info, num_replicas), len(ext.replica_mesh.local_devices), num_replicas)
        distributed = cls(strategy, batches, rows, options, cardinality, spec)
        distributed._source = dataset  # Keras fit reads the dataset itself (see keras_support/data_adapter.py)
        return distributed

    @classmethod
    def from_function(cls, strategy: Any, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None) -> DistributedDataset:
        ext = strategy.extended
        num_local = len(ext.replica_mesh.local_devices)
        _check_function_options(options or InputOptions())
        mode = (options or InputOptions()).experimental_replication_mode
        if mode is InputReplicationMode.PER_REPLICA:
            ids = [ext.replica_mesh.devices.index(d) for d in ext.replica_mesh.local_devices]
            made = [dataset_fn(InputContext(strategy.num_replicas_in_sync, i, strategy.num_replicas_in_sync)) for i in ids]
        else:
            num_workers, worker_id = ext.input_policy.input_pipelines()
            made = [dataset_fn(InputContext(num_workers, worker_id, strategy.num_replicas_in_sync))]
        datasets = [as_dataset(d, "distribute_datasets_from_function's dataset_fn result") for d in made]
        infos = [d._batch_info for d in datasets]
        unbatched = any(info is None for info in infos)
        if unbatched and not all(info is None for info in infos):
            raise ValueError("distribute_datasets_from_function: some dataset_fn results are batched and some are "
                             "not; return datasets of one kind.")
        rows = 0 if unbatched else max(b for b, _ in infos)
        if unbatched and ext.input_policy.input_pipelines()[0] > 1:
            raise NotImplementedError(
                "distribute_datasets_from_function with an unbatched dataset_fn result is supported with one "
                "worker; with several, batch each worker's dataset with the per-replica batch size "
                "(input_context.get_per_replica_batch_size(global_batch_size)).")

        def local_batches(codec):
            iterators = [iter(_Encoded(d, codec)) for d in datasets]
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
                if unbatched:
                    if len(elements) < num_local:
                        return  # TF 2.21 drops a step that not every replica can fill
                    yield [np.stack([np.asarray(e[j]) for e in elements]) for j in range(len(elements[0]))], treedef, None
                    continue
                stacked, lengths = stack_elements(elements, num_local, rows)
                yield stacked, treedef, lengths
                if len(elements) < num_local:
                    return

        def batches(codec):
            return ext.input_policy.agree(local_batches(codec))

        cardinality = datasets[0].cardinality() if len(datasets) == 1 else -2
        if len(datasets) == 1 and cardinality >= 0:
            cardinality = cardinality // num_local if unbatched else math.ceil(cardinality / num_local)
        spec = lambda: specs.per_replica(datasets[0].element_spec, num_local, strategy.num_replicas_in_sync)
        return cls(strategy, batches, rows, options, cardinality, spec)

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(self)

    def cardinality(self) -> int:
        """Steps in one pass; -1 infinite, -2 unknown (as tf.data)."""
        return self._cardinality

    @property
    def element_spec(self) -> Any:
        """The type of each element (TF: same name).

        With one replica in sync, the dataset's per-replica spec (``TensorSpec``
        leaves); with more, a ``PerReplicaSpec`` per leaf with one spec per
        local replica. The batch dim is ``global_batch / replicas`` when every
        batch is full and divides evenly, else None (TF 2.21's answers).
        """
        return self._spec() if self._spec is not None else None

    def __repr__(self) -> str:
        return f"DistributedDataset(strategy={self._strategy!r}, per_replica_batch={self._rows_per_replica})"


def _split_dim(dataset: Any) -> tuple[int, bool] | None:
    """``(size, static)`` of dim 0 of an unbatched dataset whose components all have rank >= 1, else None."""
    from distribute.data._foreign import infer_batch_info

    try:
        return infer_batch_info(dataset)
    except ValueError:  # the spec cannot be inferred: treat it as unbatched
        return None


def _file_sharded(strategy: Any, dataset: Any, info: tuple[int, bool]) -> Any | None:
    """This worker's pipeline under FILE (or AUTO) sharding of a file-based dataset, batched per replica.

    TF reads each worker's files and rebatches the global batch ``B`` so that
    a step takes ``B`` rows in all: here every replica gets ``ceil(B / R)`` rows
    of its worker's files per step. None: one worker, or not split by file.
    """
    from distribute.data import AutoShardPolicy
    from distribute.data._files import shard_by_files
    from distribute.data._foreign import tf_shard_by_files

    num_workers, worker_id = strategy.extended.input_policy.input_pipelines()
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if num_workers == 1 or policy not in (AutoShardPolicy.FILE, AutoShardPolicy.AUTO):
        return None
    num_replicas = strategy.num_replicas_in_sync
    sharded = shard_by_files(dataset, num_workers, worker_id)
    if sharded is None:
        sharded = tf_shard_by_files(dataset, num_workers, worker_id, num_replicas)
    if sharded is None:
        return None  # AUTO falls back to DATA; FILE raises in the strategy's policy check
    agree_seeds(strategy, sharded)
    return sharded.unbatch().batch(specs.rows_per_replica(info[0], num_replicas), drop_remainder=info[1])


class DistributedIterator:
    """Iterator over PerReplica batches (tf.distribute.DistributedIterator).

    The next batch is placed on the devices while the current step runs.
    """

    def __init__(self, dataset: DistributedDataset):
        self._dataset = dataset
        self._strategy = dataset._strategy
        self._codec = host_values.HostCodec()
        self._source = dataset._make_local_iterator(self._codec)
        self._ahead = max(dataset._options.experimental_per_replica_buffer_size, 1)
        self._queue: list = []

    def _place(self, item: tuple) -> Any:
        stacked, treedef, lengths = item
        ext = self._strategy.extended
        arrays = ext.replica_mesh.put_per_replica_all(stacked)
        values = [PerReplica._from_array(self._strategy, a, lengths) for a in arrays]
        host = getattr(self._codec, "host", None)
        if host:
            names = host_values.feature_names(treedef)
            for position, j in enumerate(host):
                pieces = [self._codec.decode(ids, position) for ids in values[j]._local_values()]
                values[j] = host_values.HostPerReplica._from_host(self._strategy, pieces, names[j])
        return jax.tree_util.tree_unflatten(treedef, values)

    def _fill(self) -> None:
        while len(self._queue) < self._ahead + 1:
            try:
                item = next(self._source)
            except StopIteration:
                return
            self._queue.append(self._place(item))

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        self._fill()
        if not self._queue:
            raise StopIteration
        return self._queue.pop(0)

    def get_next(self) -> Any:
        """The next batch; raises StopIteration at the end (TF raises OutOfRangeError)."""
        return next(self)

    def get_next_as_optional(self) -> Optional:
        """The next batch wrapped in an Optional that is empty at the end (TF: same name)."""
        try:
            return Optional(next(self))
        except StopIteration:
            return Optional(None, has_value=False)

    @property
    def element_spec(self) -> Any:
        """The element_spec of the DistributedDataset iterated (TF: same name)."""
        return self._dataset.element_spec


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


def _check_function_options(options: InputOptions) -> None:
    """TF's checks of ``distribute_datasets_from_function``'s options (its messages).

    Raises:
        ValueError: ``experimental_place_dataset_on_device`` with the PER_WORKER mode, or
            with PER_REPLICA and ``experimental_fetch_to_device`` (default True).
    """
    if not options.experimental_place_dataset_on_device:
        return
    if options.experimental_replication_mode is not InputReplicationMode.PER_REPLICA:
        raise ValueError(
            "When `experimental_place_dataset_on_device` is set for dataset placement, you must also specify "
            "`PER_REPLICA` for the replication mode"
        )
    if options.experimental_fetch_to_device in (None, True):
        raise ValueError(
            "`experimental_place_dataset_on_device` can not be set to True when experimental_fetch_to_device is "
            "True and replication mode is set to `PER_REPLICA`"
        )
