"""Cross-replica reduce and gather of PerReplica values (``Strategy.reduce`` / ``gather``).

A PerReplica value is one ``(replicas, ...)`` array; when its replicas' rows differ
(an uneven batch) it carries the real row counts, and only real rows count here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from distribute.values import PerReplica, ReduceOp


def reduce_plain(op: ReduceOp, value: jax.Array, axis: int | None) -> jax.Array:
    if axis is None:
        return value
    return jnp.sum(value, axis=axis) if op is ReduceOp.SUM else jnp.mean(value, axis=axis)


def _check_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for per-replica values of rank {ndim}.")
    return axis % ndim


def _without_uniform_padding(value: PerReplica) -> tuple[jax.Array, np.ndarray | None]:
    """The backing array and lengths, with padding cut off when every replica has the same real rows."""
    array, lengths = value._array, value._lengths
    if lengths is not None and len(set(lengths.tolist())) == 1:
        return array[:, : int(lengths[0])], None
    return array, lengths


def reduce_per_replica(op: ReduceOp, value: PerReplica, axis: int | None) -> jax.Array:
    if axis is None and value._sum is not None:
        # Summed in the step's program already; one device's copy, as TF returns a
        # reduced value on one device (so `total += loss` is a one-device op).
        total = value._sum.addressable_shards[0].data
        return total if op is ReduceOp.SUM else total / value._array.shape[0]
    array, lengths = _without_uniform_padding(value)
    ndim = array.ndim - 1
    if axis is None:
        if lengths is not None:
            raise ValueError(
                f"Per-replica values have different batch sizes {lengths.tolist()}, so "
                "they cannot be combined element-wise (axis=None). Pass axis=0 to reduce "
                "the batch dim too."
            )
        return _jit_reduce_replicas(op.value, array)
    axis = _check_axis(axis, ndim)
    if lengths is not None and axis == 0:
        rows = gather_per_replica(value, 0)
        return jnp.sum(rows, axis=0) if op is ReduceOp.SUM else jnp.mean(rows, axis=0)
    if lengths is not None:
        raise ValueError(
            f"Per-replica values have different batch sizes {lengths.tolist()}; reducing "
            f"axis {axis} would leave differently shaped values. Reduce axis 0 as well."
        )
    return _jit_reduce_axis(op.value, array, axis + 1)


@functools.partial(jax.jit, static_argnums=(0,))
def _jit_reduce_replicas(op: str, array: jax.Array) -> jax.Array:
    return jnp.sum(array, axis=0) if op == "SUM" else jnp.mean(array, axis=0)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _jit_reduce_axis(op: str, array: jax.Array, axis: int) -> jax.Array:
    reduced = jnp.sum(array, axis=(0, axis))
    if op == "MEAN":
        reduced = reduced / (array.shape[0] * array.shape[axis])
    return reduced


def gather_per_replica(value: PerReplica, axis: int) -> jax.Array:
    array, lengths = _without_uniform_padding(value)
    ndim = array.ndim - 1
    if ndim == 0:
        raise ValueError("strategy.gather needs per-replica values of rank >= 1; got scalars. Use reduce, or expand dims first.")
    axis = _check_axis(axis, ndim)
    if lengths is not None:
        if axis != 0:
            raise ValueError(
                f"Per-replica values have different batch sizes {lengths.tolist()}; they "
                f"can be gathered along axis 0 only, not axis {axis}."
            )
        if axis == 0:
            rows = array.shape[1]
            index = np.concatenate([r * rows + np.arange(n) for r, n in enumerate(lengths.tolist())]).astype(np.int32)
            return _jit_take_rows(array, index)
    return _jit_concat(array, axis)


@jax.jit
def _jit_take_rows(array: jax.Array, index: jax.Array) -> jax.Array:
    flat = array.reshape((array.shape[0] * array.shape[1], *array.shape[2:]))
    return jnp.take(flat, index, axis=0)


@functools.partial(jax.jit, static_argnums=(1,))
def _jit_concat(array: jax.Array, axis: int) -> jax.Array:
    return jnp.concatenate([array[r] for r in range(array.shape[0])], axis=axis)
