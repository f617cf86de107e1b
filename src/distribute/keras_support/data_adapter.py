"""Lets Keras ``fit`` / ``evaluate`` / ``predict`` read a ``distribute.data.Dataset``.

Keras accepts any ``DataAdapter`` as ``x``; this one iterates the dataset anew
each epoch (so ``shuffle`` reshuffles, as with a ``tf.data.Dataset`` in TF).
Elements are ``(x, y)`` / ``(x, y, sample_weight)`` tuples or ``x`` alone, batched.

``install()`` (run when ``distribute.data`` is imported) teaches Keras'
``get_data_adapter`` the ``Dataset`` type, so ``model.fit(dataset)`` works
with no strategy created, as with a tf.data dataset in TF. Under a strategy,
``adapt`` also wraps tf.data and grain datasets, so they are split and
sharded exactly like a ``distribute.data.Dataset``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from distribute._keras import DataAdapter, data_adapters

_INSTALLED: list[bool] = []


def install() -> None:
    """Wraps Keras' ``data_adapters.get_data_adapter`` to accept a ``distribute.data.Dataset`` (idempotent)."""
    if _INSTALLED:
        return
    original = data_adapters.get_data_adapter

    @functools.wraps(original)
    def get_data_adapter(x: Any, *args: Any, **kwargs: Any) -> Any:
        from distribute.data import Dataset

        if isinstance(x, (Dataset, DatasetAdapter)):
            _refuse_separate_arrays(args, kwargs)
            return x if isinstance(x, DatasetAdapter) else DatasetAdapter(x)
        return original(x, *args, **kwargs)

    data_adapters.get_data_adapter = get_data_adapter
    _INSTALLED.append(True)


def _refuse_separate_arrays(args: tuple, kwargs: dict) -> None:
    """TF's (and Keras') ValueError for ``y`` or ``sample_weight`` given beside a dataset ``x``."""
    y = kwargs.get("y", args[0] if args else None)
    sample_weight = kwargs.get("sample_weight", args[1] if len(args) > 1 else None)
    if y is not None:
        data_adapters.raise_unsupported_arg("y", "the targets", "distribute.data.Dataset")
    if sample_weight is not None:
        data_adapters.raise_unsupported_arg("sample_weights", "the sample weights", "distribute.data.Dataset")


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
        self._seeds_agreed = False

    def _iterate(self) -> Iterator:
        if not self._seeds_agreed:  # the first epoch runs inside the model's strategy scope
            from distribute.input.distributed_dataset import agree_seeds
            from distribute.strategy import get_strategy

            agree_seeds(get_strategy(), self._dataset)
            self._seeds_agreed = True
        for element in self._dataset:
            _check_numeric(element)
            yield element

    def get_numpy_iterator(self) -> Iterator:
        return self._iterate()

    def get_jax_iterator(self) -> Iterator:
        return self._iterate()

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


def _check_numeric(element: Any) -> None:
    """Raises TypeError naming a non-numeric feature (Keras models compute on numbers)."""
    import jax

    from distribute.input.host_values import is_host_leaf

    for path, leaf in jax.tree_util.tree_flatten_with_path(element)[0]:
        if is_host_leaf(leaf):
            name = "".join(str(k) for k in path) or "element"
            raise TypeError(
                f"Keras fit/evaluate/predict got the non-numeric input feature {name} (dtype "
                f"{getattr(leaf, 'dtype', type(leaf).__name__)}); a compiled step computes on numbers. Turn it into "
                "numbers in the input pipeline, e.g. dataset.map(...) with a vocabulary lookup, or drop it."
            )


def adapt(value: Any) -> Any:
    """Wraps a ``distribute.data.Dataset``, a tf.data / grain dataset, or a DistributedDataset made from one
    (which tf.keras also accepts) in a DatasetAdapter; anything else passes through.

    Raises:
        ValueError: a DistributedDataset from ``distribute_datasets_from_function``
            (fit splits global batches itself; pass a dataset of global batches).
    """
    from distribute.data import Dataset
    from distribute.data._foreign import wrap
    from distribute.input.distributed_dataset import DistributedDataset

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
    return DatasetAdapter(value) if isinstance(value, Dataset) else value
