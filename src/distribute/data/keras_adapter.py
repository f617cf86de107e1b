"""Lets Keras ``fit`` / ``evaluate`` / ``predict`` read a ``distribute.data.Dataset``.

Keras accepts any ``DataAdapter`` as ``x``; :class:`DatasetAdapter` iterates the
dataset anew each epoch (so ``shuffle`` reshuffles, as with a ``tf.data.Dataset``
in TF). Elements are ``(x, y)`` / ``(x, y, sample_weight)`` tuples or ``x``
alone, batched.

``GET_DATA_ADAPTER`` (a row of ``keras_support/patches.py``'s table) teaches
Keras' ``get_data_adapter`` the ``Dataset`` type, so ``model.fit(dataset)``
works with no strategy created, as with a tf.data dataset in TF. It is installed
when the first ``Dataset`` is built (:func:`install`), the one install that no
strategy makes. Under a strategy, ``keras_support/data_adapter.py`` adapts
datasets before Keras sees them (splitting, seeds shared by the workers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax

from distribute import _keras
from distribute._keras import DataAdapter, Patch, data_adapters
import distribute.data._kind as _kind
from distribute.data._structure import is_host_leaf


class DatasetAdapter(DataAdapter):
    """A Keras DataAdapter over a batched ``distribute.data.Dataset``.

    Args:
        dataset: a batched ``distribute.data.Dataset``.
        before_first_epoch: called once, when the first epoch starts (a strategy
            agrees on the dataset's shuffle seeds there).

    Raises:
        ValueError: the dataset is not batched (Keras needs batches, as TF).
    """

    def __init__(self, dataset: Any, before_first_epoch: Callable[[], None] | None = None):
        if dataset._batch_info is None:
            raise ValueError(
                "Keras fit/evaluate/predict got an unbatched distribute.data.Dataset; call "
                ".batch(global_batch_size) on it first."
            )
        self._dataset = dataset
        self._before_first_epoch = before_first_epoch

    def _iterate(self) -> Iterator:
        if self._before_first_epoch is not None:
            self._before_first_epoch()
            self._before_first_epoch = None
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
    for path, leaf in jax.tree_util.tree_flatten_with_path(element)[0]:
        if is_host_leaf(leaf):
            name = "".join(str(k) for k in path) or "element"
            raise TypeError(
                f"Keras fit/evaluate/predict got the non-numeric input feature {name} (dtype "
                f"{getattr(leaf, 'dtype', type(leaf).__name__)}); a compiled step computes on numbers. Turn it into "
                "numbers in the input pipeline, e.g. dataset.map(...) with a vocabulary lookup, or drop it."
            )


def _get_data_adapter(original: Callable) -> Callable:
    def get_data_adapter(x: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, (_kind.dataset_class(), DatasetAdapter)):
            _refuse_separate_arrays(args, kwargs)
            return x if isinstance(x, DatasetAdapter) else DatasetAdapter(x)
        return original(x, *args, **kwargs)

    return get_data_adapter


def _refuse_separate_arrays(args: tuple, kwargs: dict) -> None:
    """TF's (and Keras') ValueError for ``y`` or ``sample_weight`` given beside a dataset ``x``."""
    y = kwargs.get("y", args[0] if args else None)
    sample_weight = kwargs.get("sample_weight", args[1] if len(args) > 1 else None)
    if y is not None:
        data_adapters.raise_unsupported_arg("y", "the targets", "distribute.data.Dataset")
    if sample_weight is not None:
        data_adapters.raise_unsupported_arg("sample_weights", "the sample weights", "distribute.data.Dataset")


GET_DATA_ADAPTER = Patch(
    data_adapters, "get_data_adapter", _get_data_adapter,
    "(x, y=None, sample_weight=None, batch_size=None, steps_per_epoch=None, shuffle=False, class_weight=None)",
    "a distribute.data.Dataset is read by Keras fit/evaluate/predict with no strategy (DatasetAdapter)",
)


def install() -> None:
    """Installs ``GET_DATA_ADAPTER`` (idempotent; called when the first Dataset is built)."""
    _keras.install((GET_DATA_ADAPTER,))
