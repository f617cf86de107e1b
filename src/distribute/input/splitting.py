"""Splitting a global batch between replicas.

TF's rule (measured on TF 2.21): a batch of ``n`` rows gives each replica
``ceil(n / num_replicas)`` consecutive rows, in replica order, until the rows run
out: 2 replicas, 7 rows -> 4 | 3; 2 rows -> 1 | 1; 1 row -> 1 | 0.

A batch that splits into equal shares is stacked as ``(replicas, rows, ...)``.
An uneven one is stored padded to the full batch's share, with every replica's
real row count; the padding stays inside ``PerReplica`` storage (every consumer sees
the real rows: ``strategy.run`` runs the exact uneven step, ``uneven.py``).
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
        rows_per_replica: the full batch's share (``>= ceil(n/R)``): the capacity.

    Returns:
        The stacked arrays and the real row count of each replica, or None when
        the shares are equal (then the arrays are ``(R, n / R, ...)``).

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
    if num_rows % num_replicas == 0:
        share = num_rows // num_replicas
        return [np.asarray(x).reshape(num_replicas, share, *np.shape(x)[1:]) for x in leaves], None
    counts = split_counts(num_rows, num_replicas)
    share = int(counts.max())
    out = []
    for x in leaves:
        x = np.asarray(x)
        # Padded to the capacity: every worker's part of the global array has one shape.
        padded = np.zeros((num_replicas, rows_per_replica, *x.shape[1:]), dtype=x.dtype)
        for r, count in enumerate(counts.tolist()):
            if count:
                padded[r, :count] = x[r * share : r * share + count]
        out.append(padded)
    return out, counts


def stack_elements(elements: list[list[np.ndarray]], num_replicas: int, rows_per_replica: int) -> tuple[list[np.ndarray], np.ndarray | None]:
    """Stacks one element per replica (PER_WORKER input from a function).

    ``elements[r]`` is replica ``r``'s flattened element (arrays ``(b_r, ...)``);
    missing replicas (the input ran out) get no rows.  Returns the stacked
    arrays (padded to the largest ``b_r``) and the row counts, or None when all
    replicas have the same rows.
    """
    counts = np.zeros(num_replicas, np.int64)
    for r, element in enumerate(elements):
        counts[r] = np.shape(element[0])[0] if np.ndim(element[0]) else 0
        if counts[r] > rows_per_replica:
            raise ValueError(
                f"An element of {counts[r]} rows is larger than the per-replica batch size "
                f"{rows_per_replica}; batch the dataset with the per-replica batch size."
            )
    width = int(counts.max())
    out = []
    for j in range(len(elements[0])):
        first = np.asarray(elements[0][j])
        shapes = [tuple(np.shape(element[j])[1:]) for element in elements]
        if len(set(shapes)) > 1:
            raise NotImplementedError(
                f"distribute_datasets_from_function: the replicas' elements differ beyond the batch dimension "
                f"(per-replica shapes after the batch dimension: {shapes}); TF runs such replicas with different "
                "shapes, this strategy needs them equal. Pad every replica's batches to one shape, e.g. "
                "dataset.padded_batch(batch_size, padded_shapes=...) with the largest shape."
            )
        padded = np.zeros((num_replicas, width, *first.shape[1:]), dtype=first.dtype)
        for r, element in enumerate(elements):
            x = np.asarray(element[j])
            padded[r, : x.shape[0]] = x
        out.append(padded)
    if len(elements) == num_replicas and len(set(counts.tolist())) == 1:
        return out, None
    return out, counts
