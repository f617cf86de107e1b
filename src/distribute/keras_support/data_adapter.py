"""Lets Keras ``fit`` / ``evaluate`` / ``predict`` read a ``distribute.data.Dataset``.

Keras accepts any ``DataAdapter`` as ``x``; this one iterates the dataset anew
each epoch (so ``shuffle`` reshuffles, as with a ``tf.data.Dataset`` in TF).
Elements are ``(x, y)`` / ``(x, y, sample_weight)`` tuples or ``x`` alone, batched.
"""

from __future__ import annotations

from typing import Any, Iterator

from keras.src.trainers.data_adapters.data_adapter import DataAdapter


class DatasetAdapter(DataAdapter):
    """A Keras DataAdapter over a batched ``distribute.data.Dataset``.

    Raises:
        ValueError: the dataset is not batched (Keras needs batches, as TF).
    """

    def __init__(self, dataset: Any):
        if dataset._batch_info is None:
            raise ValueError(
                "Keras fit/evaluate/predict got an unbatched distribute.data.Dataset; call "
                ".batch(global_batch_size) on it first."
            )
        self._dataset = dataset

    def get_numpy_iterator(self) -> Iterator:
        return iter(self._dataset)

    def get_jax_iterator(self) -> Iterator:
        return iter(self._dataset)

    def get_tf_dataset(self) -> Any:
        raise NotImplementedError("a distribute.data.Dataset has no tf.data form; use the JAX backend.")

    def get_torch_dataloader(self) -> Any:
        raise NotImplementedError("a distribute.data.Dataset has no torch form; use the JAX backend.")

    @property
    def num_batches(self) -> int | None:
        cardinality = self._dataset.cardinality()
        return cardinality if cardinality >= 0 else None

    @property
    def batch_size(self) -> int:
        return self._dataset._batch_info[0]

    @property
    def has_partial_batch(self) -> bool | None:
        return None

    @property
    def partial_batch_size(self) -> int | None:
        return None


def adapt(value: Any) -> Any:
    """Wraps a ``distribute.data.Dataset`` (or a DistributedDataset made from one, which
    tf.keras also accepts) in a DatasetAdapter; anything else passes through.

    Raises:
        ValueError: a DistributedDataset from ``distribute_datasets_from_function``
            (fit splits global batches itself; pass a dataset of global batches).
    """
    from distribute.data import Dataset
    from distribute.input.distributed_dataset import DistributedDataset

    if isinstance(value, DistributedDataset):
        if value._source is None:
            raise ValueError(
                "Keras fit/evaluate/predict cannot read a dataset made by "
                "distribute_datasets_from_function; pass a distribute.data.Dataset batched with the "
                "global batch size (fit splits it between the replicas)."
            )
        value = value._source
    return DatasetAdapter(value) if isinstance(value, Dataset) else value
