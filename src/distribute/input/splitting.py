"""Splitting a global batch between replicas, with padding for partial batches.

TF's rule (measured on TF 2.21): a batch of ``n`` rows gives each replica
``ceil(n / num_replicas)`` consecutive rows, in replica order, until the rows run
out: 2 replicas, 7 rows -> 4 | 3; 2 rows -> 1 | 1; 1 row -> 1 | 0.

Every replica is padded to ``rows_per_replica`` rows (the full batch's share) so
that the compiled step sees one shape for the whole epoch; the real row counts go
with the value and become the replica context's example mask.
"""

from __future__ import annotations

import math

import numpy as np


def split_counts(num_rows: int, num_replicas: int) -> np.ndarray:
    """Rows each replica gets from a batch of ``num_rows``: ``ceil(n / R)`` each, in order."""
    share = math.ceil(num_rows / num_replicas) if num_rows else 0
    starts = np.arange(num_replicas) * share
    return np.clip(num_rows - starts, 0, share).astype(np.int64)


def split_batch(leaves: list[np.ndarray], num_replicas: int, rows_per_replica: int) -> tuple[list[np.ndarray], np.ndarray | None]:
    """Splits batch-major arrays into ``(num_replicas, rows_per_replica, ...)`` stacks.

    Args:
        leaves: arrays of shape ``(n, ...)``, all with the same ``n``.
        num_replicas: replicas to split between.
        rows_per_replica: rows each replica holds after padding (``>= ceil(n/R)``).

    Returns:
        The stacked arrays and the real row count of each replica, or None when
        no replica is padded.

    Raises:
        ValueError: the leaves disagree on ``n``, or ``n`` exceeds the capacity.
    """
    if not leaves:
        return [], None
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
    if len(sizes) != 1 or -1 in sizes:
        raise ValueError(
            f"The components of one batch have different batch sizes {sorted(sizes)} (or are "
            "scalars); every component must be batched along dim 0 with the same size."
        )
    num_rows = sizes.pop()
    if num_rows > num_replicas * rows_per_replica:
        raise ValueError(
            f"A batch of {num_rows} rows does not fit {num_replicas} replicas x "
            f"{rows_per_replica} rows; the dataset must be batched with the global batch size."
        )
    if num_rows == num_replicas * rows_per_replica:
        return [np.asarray(x).reshape(num_replicas, rows_per_replica, *np.shape(x)[1:]) for x in leaves], None
    counts = split_counts(num_rows, num_replicas)
    share = int(counts.max()) if num_rows else 0
    out = []
    for x in leaves:
        x = np.asarray(x)
        padded = np.zeros((num_replicas, rows_per_replica, *x.shape[1:]), dtype=x.dtype)
        for r, count in enumerate(counts.tolist()):
            if count:
                padded[r, :count] = x[r * share : r * share + count]
        out.append(padded)
    return out, counts


def stack_elements(elements: list[list[np.ndarray]], num_replicas: int, rows_per_replica: int) -> tuple[list[np.ndarray], np.ndarray | None]:
    """Stacks one element per replica (PER_WORKER input from a function).

    ``elements[r]`` is replica ``r``'s flattened element (arrays ``(b_r, ...)``);
    missing replicas (the input ran out) get empty, fully padded slots.
    """
    counts = np.zeros(num_replicas, np.int64)
    num_leaves = len(elements[0])
    out = []
    for j in range(num_leaves):
        first = np.asarray(elements[0][j])
        padded = np.zeros((num_replicas, rows_per_replica, *first.shape[1:]), dtype=first.dtype)
        for r, element in enumerate(elements):
            x = np.asarray(element[j])
            if x.shape[0] > rows_per_replica:
                raise ValueError(
                    f"An element of {x.shape[0]} rows is larger than the per-replica batch size "
                    f"{rows_per_replica}; batch the dataset with the per-replica batch size."
                )
            padded[r, : x.shape[0]] = x
            counts[r] = x.shape[0]
        out.append(padded)
    if len(elements) == num_replicas and bool(np.all(counts == rows_per_replica)):
        return out, None
    return out, counts
