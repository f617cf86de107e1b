"""InputPolicy: how a worker's input pipeline is split between replicas, and when workers agree on end-of-data.

A strategy's extended holds one (``extended.input_policy``).  This one is for a
single worker: the worker's pipeline is the whole dataset, each global batch is
split between its replicas, and there is nobody to agree with.
MultiWorkerMirroredStrategy's policy (``multi_worker.py``) shards the dataset
by its ``AutoShardPolicy``, splits every global batch over all workers'
replicas, agrees on unseeded shuffles' seeds and on end-of-data at each step.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import jax
import numpy as np

from distribute.input.splitting import split_batch

Batches = Iterator[tuple[list, Any, "np.ndarray | None"]]


class InputPolicy:
    """The single-worker input policy.

    Args:
        replica_mesh: the strategy's ``ReplicaMesh``.
    """

    # Worker 0's seeds on every worker (None: one worker, nothing to agree on).
    agree_on_seeds: Callable[[list[int]], list[int]] | None = None

    def __init__(self, replica_mesh: Any):
        self.replica_mesh = replica_mesh

    def input_pipelines(self) -> tuple[int, int]:
        """(number of input pipelines, this worker's pipeline id): one per worker."""
        return 1, 0

    def shard_dataset(self, dataset: Any) -> Any:
        """This worker's share of a dataset (all of it with one worker)."""
        return dataset

    def dataset_batches(self, dataset: Any, rows_per_replica: int) -> Batches:
        """This worker's batches of a globally batched dataset, split between its replicas.

        Yields ``(stacked, treedef, lengths)``: arrays ``(num_local_replicas,
        rows, ...)``, the element structure, and the real row count of every
        replica in the job (None when the shares are equal).
        """
        num_local = len(self.replica_mesh.local_devices)
        for element in self.shard_dataset(dataset):
            leaves, treedef = jax.tree_util.tree_flatten(element)
            stacked, lengths = split_batch(leaves, num_local, rows_per_replica)
            yield stacked, treedef, lengths

    def dataset_cardinality(self, dataset: Any) -> int:
        """Steps in one pass of ``experimental_distribute_dataset(dataset)``."""
        return dataset.cardinality()

    def distributed_batches(self, dataset: Any, rows_per_replica: int) -> Batches:
        """The steps of one pass over a globally batched dataset: ``agree(dataset_batches(...))``."""
        return self.agree(self.dataset_batches(dataset, rows_per_replica))

    def agree(self, batches: Batches) -> Batches:
        """Makes every worker take the same number of steps (one worker: nothing to agree on)."""
        return batches
