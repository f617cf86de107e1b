"""Datasets handed to Keras ``fit`` / ``evaluate`` / ``predict`` of a model built in a strategy's scope.

``adapt`` wraps a ``distribute.data.Dataset``, a tf.data or grain dataset (read
as a ``Dataset``: split and sharded exactly like one), or a DistributedDataset
made from one (which tf.keras also accepts) in a ``DatasetAdapter``
(``data/keras_adapter.py``) whose first epoch makes the workers agree on the
dataset's shuffle seeds.
"""

from __future__ import annotations

from typing import Any

from distribute.data import Dataset
from distribute.data._foreign import wrap
from distribute.data.keras_adapter import DatasetAdapter
from distribute.input.distributed_dataset import DistributedDataset, agree_seeds


def adapt(value: Any, strategy: Any) -> Any:
    """``value`` as Keras reads it under ``strategy``: datasets wrapped, anything else unchanged.

    Raises:
        ValueError: a DistributedDataset from ``distribute_datasets_from_function``
            (fit splits global batches itself; pass a dataset of global batches).
    """
    if isinstance(value, DistributedDataset):
        if value._source is None:
            raise ValueError(
                "Keras fit/evaluate/predict cannot read a dataset made by "
                "distribute_datasets_from_function; pass a distribute.data.Dataset batched with the "
                "global batch size (fit splits it between the replicas)."
            )
        value = value._source
    if not isinstance(value, Dataset):
        value = wrap(value) or value
    if not isinstance(value, Dataset):
        return value
    return DatasetAdapter(value, before_first_epoch=None if strategy is None else (lambda: agree_seeds(strategy, value)))
