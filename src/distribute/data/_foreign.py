"""Bring your own pipeline: a ``tf.data.Dataset`` or a grain ``MapDataset``/``IterDataset`` as a ``Dataset``.

``wrap(value)`` returns a ``Dataset`` that iterates ``value`` anew every pass
and yields numpy elements; everything downstream (splitting between replicas,
auto-sharding, Keras fit) then treats it like any ``distribute.data.Dataset``.
TensorFlow is never imported here: a tf.data dataset is recognised by its
class, and it already carries TensorFlow with it.

* tf.data: elements come from ``as_numpy_iterator()`` (numeric arrays share
  the tensor's memory, no copy); string tensors become ``bytes`` arrays; the
  ``element_spec``, cardinality and ``auto_shard_policy`` are tf.data's own.
* grain: elements are converted like ``from_generator`` values; the
  cardinality is ``len()`` of a MapDataset, unknown for an IterDataset; the
  ``element_spec`` reads the first element.

A batched foreign dataset's batch size is its static batch dim, else the
first element's dim 0 (read once, when first needed).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

import distribute.data._kind as _kind
import distribute.data._plan as _plan
import distribute.data._spec as _spec
import distribute.data._structure as _structure
from distribute.data.options import UNKNOWN_CARDINALITY, AutoShardPolicy, Options


def is_tf_dataset(value: Any) -> bool:
    return any(cls.__name__ == "DatasetV2" and cls.__module__.startswith("tensorflow.") for cls in type(value).__mro__)


def is_grain_dataset(value: Any) -> bool:
    return any(cls.__name__ in ("MapDataset", "IterDataset") and cls.__module__.startswith("grain.")
               for cls in type(value).__mro__)


def wrap(value: Any) -> Any | None:
    """``value`` as a ``Dataset``, or None when it is neither a tf.data nor a grain dataset."""
    if is_tf_dataset(value):
        return _from_tf(value)
    if is_grain_dataset(value):
        return _from_grain(value)
    return None


def _create(node: Any, cardinality: int, spec: Any, options: Options) -> Any:
    Dataset = _kind.dataset_class()

    dataset = Dataset._create(node, cardinality, None, options, None, spec=spec)
    dataset._batch_info_value = _LazyBatchInfo(dataset)
    return dataset


class _LazyBatchInfo:
    """``(batch_size, drop_remainder)`` of a foreign dataset, found when first asked (None: not batched)."""

    def __init__(self, dataset: Any) -> None:
        self._dataset, self._value, self._known = dataset, None, False

    def get(self) -> tuple[int, bool] | None:
        if not self._known:
            self._value, self._known = infer_batch_info(self._dataset), True
        return self._value


def infer_batch_info(dataset: Any) -> tuple[int, bool] | None:
    """``(dim 0 size, static)`` when every component has rank >= 1 (a batch as TF sees it), else None."""
    leaves, _ = _structure.flatten(dataset.element_spec)
    if not leaves or any(s.shape is not None and len(s.shape) == 0 for s in leaves):
        return None
    static = {s.shape[0] for s in leaves if s.shape is not None}
    if len(static) == 1 and None not in static:
        return static.pop(), True
    with _plan.peeking():
        for element in dataset:
            first = _structure.flatten(element)[0]
            return int(np.shape(first[0])[0]), False
    return None


class _IterableNode:
    """A node over ``make_iterator()`` (called anew for every pass), elements converted by ``convert``."""

    def __init__(self, make_iterator: Any, convert: Any) -> None:
        self._make_iterator, self._convert = make_iterator, convert

    def build(self) -> Any:
        from distribute.data._pipeline import _PyIterDataset

        return _PyIterDataset(self._elements)

    def _elements(self) -> Iterator[Any]:
        convert = self._convert
        for element in self._make_iterator():
            yield convert(element)


# -- tf.data ---------------------------------------------------------------------------------


def _from_tf(dataset: Any) -> Any:
    spec = _tf_spec(dataset.element_spec)
    options = Options()
    policy = int(dataset.options().experimental_distribute.auto_shard_policy)
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy(policy)
    wrapped = _create(_IterableNode(dataset.as_numpy_iterator, _tf_element), int(dataset.cardinality()), spec, options)
    wrapped._tf_source = dataset
    return wrapped


def _tf_spec(spec: Any) -> Any:
    def convert(leaf: Any) -> _spec.TensorSpec:
        if type(leaf).__name__ != "TensorSpec":
            raise TypeError(f"a tf.data element component of type {type(leaf).__name__} ({leaf}) is not supported; "
                            "only dense tensors are. Convert it in the tf.data pipeline, e.g. "
                            ".map(lambda x: x.to_tensor()) for a ragged or sparse tensor.")
        return _spec.TensorSpec(None if leaf.shape.rank is None else tuple(leaf.shape.as_list()), leaf.dtype)

    return _structure.map_structure(convert, spec)


def _tf_element(element: Any) -> Any:
    return _structure.map_structure(_tf_leaf, element)


def _tf_leaf(leaf: Any) -> Any:
    if isinstance(leaf, np.ndarray) and leaf.dtype == object:
        return np.array(leaf.tolist(), dtype=bytes).reshape(leaf.shape)
    if isinstance(leaf, bytes):
        return np.bytes_(leaf)
    return leaf


def tf_shard_by_files(dataset: Any, num_shards: int, index: int, num_replicas: int) -> Any | None:
    """A wrapped tf.data dataset split by file with TensorFlow's own FILE auto-shard rewrite (None if not tf.data)."""
    source = getattr(dataset, "_tf_source", None)
    if source is None:
        return None
    from tensorflow.python.data.experimental.ops.distribute import (
        _AutoShardDataset,  # TF's rewrite
    )

    return _from_tf(_AutoShardDataset(source, num_shards, index, num_replicas))


# -- grain -----------------------------------------------------------------------------------


def _from_grain(dataset: Any) -> Any:
    try:
        cardinality = len(dataset)
    except TypeError:  # IterDataset, or an infinite MapDataset
        cardinality = UNKNOWN_CARDINALITY
    wrapped = _create(_IterableNode(lambda: iter(dataset), _grain_element), cardinality, None, Options())
    wrapped._spec_source = lambda: _first_spec(wrapped)
    return wrapped


def _grain_element(element: Any) -> Any:
    return _structure.normalize(element, "grain dataset element")


def _first_spec(dataset: Any) -> Any:
    with _plan.peeking():
        for element in dataset:
            return _spec.spec_of_element(element)
    raise ValueError("element_spec of an empty grain dataset is unknown; it has no element to read it from.")
