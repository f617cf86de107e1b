"""Cardinality arithmetic, the same rules as tf.data's C++ kernels.

Every function takes the input's cardinality ``n`` (a count, or
``INFINITE_CARDINALITY`` / ``UNKNOWN_CARDINALITY``) and returns the output's.
"""

from __future__ import annotations

from distribute.data.options import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY


def _is_count(n: int) -> bool:
    return n >= 0


def batch(n: int, batch_size: int, drop_remainder: bool) -> int:
    if not _is_count(n):
        return n
    return n // batch_size if drop_remainder else -(-n // batch_size)


def repeat(n: int, count: int) -> int:
    """``count`` -1 means forever; an empty input stays empty."""
    if count < 0:
        return 0 if n == 0 else INFINITE_CARDINALITY
    if count == 0:
        return 0
    return n if not _is_count(n) else n * count


def take(n: int, count: int) -> int:
    if count < 0:
        return n
    if n == UNKNOWN_CARDINALITY:
        return UNKNOWN_CARDINALITY
    if n == INFINITE_CARDINALITY:
        return count
    return min(n, count)


def skip(n: int, count: int) -> int:
    """``count`` -1 skips everything (0 elements, even from an infinite input)."""
    if count < 0:
        return 0
    if not _is_count(n):
        return n
    return max(0, n - count)


def shard(n: int, num_shards: int, index: int) -> int:
    if not _is_count(n):
        return n
    return n // num_shards + (1 if index < n % num_shards else 0)
