"""Variable partitioners (tf.distribute.experimental.partitioners) and TF's "div" split.

A partitioner is called as ``partitioner(shape, dtype, axis=0)`` and returns one
partition count per dim; ParameterServerStrategy splits a variable along axis 0
only, with TF's "div" rule (``div_split``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

# The names of tf.distribute.experimental.partitioners (div_split and num_partitions serve the strategy).
__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"]


def _as_shape(shape: Any) -> list[int]:
    return [int(d) for d in (shape.as_list() if hasattr(shape, "as_list") else shape)]


def _item_bytes(dtype: Any, bytes_per_string: int) -> int:
    dtype = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
    if dtype.kind in ("U", "S", "O"):
        return bytes_per_string
    return dtype.itemsize


class Partitioner:
    """Base class of the partitioners (TF: ``tf.distribute.experimental.partitioners.Partitioner``)."""

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        """Returns the number of partitions for each dim of ``shape`` (only ``axis`` may exceed 1)."""
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """``num_shards`` shards on ``axis`` (fewer when the dim is smaller), as TF.

    ``FixedShardsPartitioner(2)([10, 3], "float32")`` is ``[2, 1]``.
    """

    def __init__(self, num_shards: int):
        self._num_shards = num_shards

    def __call__(self, shape, dtype, axis=0):
        shape = _as_shape(shape)
        result = [1] * len(shape)
        result[axis] = min(self._num_shards, shape[axis])
        return result


class MinSizePartitioner(Partitioner):
    """Shards of at least ``min_shard_bytes`` each, at most ``max_shards`` (TF's formula).

    ``parts = max(1, min(shape[axis], max_shards, ceil(total_bytes / min_shard_bytes)))``.

    Raises:
        ValueError: an argument is below 1 (TF's message).
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16):
        for name, value in (("min_shard_bytes", min_shard_bytes), ("max_shards", max_shards), ("bytes_per_string", bytes_per_string)):
            if value < 1:
                raise ValueError(f"Argument `{name}` must be positive. Received: {value}")
        self._min_shard_bytes = min_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape, dtype, axis=0):
        shape = _as_shape(shape)
        if axis >= len(shape):
            raise ValueError(f"Cannot partition variable along axis {axis} when shape is only {shape}")
        total = math.prod(shape) * _item_bytes(dtype, self._bytes_per_string)
        parts = max(1, min(shape[axis], self._max_shards, math.ceil(total / self._min_shard_bytes)))
        result = [1] * len(shape)
        result[axis] = parts
        return result


class MaxSizePartitioner(Partitioner):
    """Shards of at most ``max_shard_bytes`` each (whole rows), optionally capped by ``max_shards``.

    TF's formula: ``slices_per_shard = max(1, floor(max_shard_bytes / bytes_per_row))``,
    ``shards = ceil(shape[axis] / slices_per_shard)``.

    Raises:
        ValueError: an argument is below 1 (TF's messages).
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16):
        if max_shard_bytes < 1:
            raise ValueError(f"Argument `max_shard_bytes` must be positive. Received {max_shard_bytes}")
        if max_shards and max_shards < 1:  # TF accepts max_shards=0 (as no cap)
            raise ValueError(f"Argument `max_shards` must be positive. Received {max_shards}")
        if bytes_per_string < 1:
            raise ValueError(f"Argument `bytes_per_string` must be positive. Received: {bytes_per_string}")
        self._max_shard_bytes = max_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape, dtype, axis=0):
        shape = _as_shape(shape)
        if axis >= len(shape):
            raise ValueError(f"Cannot partition variable along axis {axis} when shape is only {shape}")
        rows = shape[axis]
        if rows == 0:
            result = [1] * len(shape)
            return result
        bytes_per_slice = math.prod(shape) / rows * _item_bytes(dtype, self._bytes_per_string)
        slices_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_slice))
        shards = math.ceil(rows / slices_per_shard)
        if self._max_shards:
            shards = min(shards, self._max_shards)
        result = [1] * len(shape)
        result[axis] = shards
        return result


def div_split(rows: int, num_shards: int) -> list[tuple[int, int]]:
    """TF's "div" split of ``rows`` into ``num_shards``: ``[(start, stop), ...]``.

    The first ``rows % num_shards`` shards get one more row: 13 rows in 5 shards are
    ``[0:3], [3:6], [6:9], [9:11], [11:13]``.
    """
    base, extra = divmod(rows, num_shards)
    bounds, start = [], 0
    for i in range(num_shards):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def num_partitions(partitioner: Any, shape: Sequence[int], dtype: Any) -> int:
    """Axis-0 shard count a strategy uses for a variable: TF's ``_create_variable`` rules.

    A scalar is never split; the count is capped by the rows.

    Raises:
        ValueError: the partitioner's result is not ``[n, 1, 1, ...]`` with ``n >= 1``
            (TF's message).
    """
    shape = list(shape)
    if partitioner is None or not shape:
        return 1
    parts = partitioner(shape, dtype)
    parts = list(parts) if parts is not None else []
    if not parts or int(parts[0]) == 0 or any(int(p) != 1 for p in parts[1:]):
        raise ValueError(
            "variable_partitioner must return a list/tuple whose elements are 1 besides "
            f"the first element (non-zero), got: {parts!r}"
        )
    return max(1, min(int(parts[0]), shape[0]))
