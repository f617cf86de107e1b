"""Cross-replica reduce and gather of PerReplica values (``Strategy.reduce`` / ``gather``).

A PerReplica value is one ``(replicas, ...)`` array; when its replicas' rows differ
(an uneven batch) it carries the real row counts, and only real rows count here.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distribute.values import PerReplica, ReduceOp


def reduce_plain(op: ReduceOp, value: jax.Array, axis: int | None) -> jax.Array:
    if axis is None:
        return value
    return jnp.sum(value, axis=axis) if op is ReduceOp.SUM else _mean(value, axis)


def _mean(value: jax.Array, axis: Any) -> jax.Array:
    """``jnp.mean``, but the sum divided by the count as a true division (TF's truediv).

    ``jnp.mean`` divides by a constant, which XLA:CPU turns into a multiply by its
    reciprocal: the mean of [0, 2, .., 12] is then 6.0000005, where TF gives 6.0.
    The count goes in as an argument of the program, so the division stays a division.
    """
    axes = tuple(range(value.ndim)) if axis is None else (axis if isinstance(axis, tuple) else (axis,))
    return _sum_divided(value, axes, np.asarray(np.prod([value.shape[a] for a in axes]), np.int32))


@functools.partial(jax.jit, static_argnums=(1,))
def _sum_divided(value: jax.Array, axes: tuple, count: jax.Array) -> jax.Array:
    total = jnp.sum(value, axis=axes)
    dtype = total.dtype if jnp.issubdtype(total.dtype, jnp.inexact) else jnp.result_type(float)
    return total.astype(dtype) / count.astype(dtype)


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


def reduce_dispatches_nothing(op: ReduceOp, value: Any, axis: int | None) -> bool:
    """Whether ``strategy.reduce(op, value, axis)`` only reads sums its step's program made (no program of its own)."""
    if op is not ReduceOp.SUM or axis is not None:
        return False
    leaves = jax.tree_util.tree_leaves(value, is_leaf=lambda v: isinstance(v, PerReplica))
    return bool(leaves) and all(isinstance(v, PerReplica) and v._sum is not None for v in leaves)


def reduce_per_replica(op: ReduceOp, value: PerReplica, axis: int | None) -> jax.Array:
    if axis is None and value._sum is not None:
        # Summed in the step's program already; one device's copy, as TF returns a
        # reduced value on one device (so `total += loss` is a one-device op), the
        # device of a MirroredVariable's cross-replica read (ReplicaMesh.local_copy).
        total = value._strategy.extended.replica_mesh.local_copy(value._sum)
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
        return jnp.sum(rows, axis=0) if op is ReduceOp.SUM else _mean(rows, 0)
    if lengths is not None:
        raise ValueError(
            f"Per-replica values have different batch sizes {lengths.tolist()}; reducing "
            f"axis {axis} would leave differently shaped values. Reduce axis 0 as well."
        )
    return _jit_reduce_axis(op.value, array, axis + 1)


def _jit_reduce_replicas(op: str, array: jax.Array) -> jax.Array:
    return _jit_sum(array, (0,)) if op == "SUM" else _mean(array, 0)


def _jit_reduce_axis(op: str, array: jax.Array, axis: int) -> jax.Array:
    return _jit_sum(array, (0, axis)) if op == "SUM" else _mean(array, (0, axis))


@functools.partial(jax.jit, static_argnums=(1,))
def _jit_sum(array: jax.Array, axes: tuple) -> jax.Array:
    return jnp.sum(array, axis=axes)


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


# -- collectives of the uneven step, over the mesh (every worker makes the same calls) ----------
def global_from_local(strategy: Any, values: list) -> jax.Array:
    """A ``(replicas, ...)`` array sharded on the mesh from this worker's per-device values."""
    ext = strategy.extended
    shards = [jax.device_put(jnp.asarray(v)[None], d) for v, d in zip(values, ext.replica_mesh.local_devices)]
    shape = (len(ext.replica_mesh.devices), *shards[0].shape[1:])
    return jax.make_array_from_single_device_arrays(shape, ext.replica_mesh.per_replica_sharding, shards)


def local_buffers(array: jax.Array) -> dict:
    """This worker's buffers of ``array``, by device.

    Under several processes (jax 0.10, CPU), an array placed with ``jax.device_put``
    on a replicated sharding of the global mesh refuses ``addressable_shards`` ("the
    input arrays must have one shard each"); its first local copy is then copied to
    this worker's other devices.
    """
    try:
        return {s.device: s.data for s in array.addressable_shards}
    except ValueError:
        if not array.is_fully_replicated:
            raise
        first = array.addressable_data(0)
        return {d: first if d in first.devices() else jax.device_put(first, d) for d in array.sharding.addressable_devices}


def per_local_device(strategy: Any, array: jax.Array) -> list:
    by_device = local_buffers(array)
    return [by_device[d] for d in strategy.extended.replica_mesh.local_devices]


@functools.lru_cache(maxsize=None)
def sum_program(sharding: Any) -> Callable:
    return jax.jit(lambda arrays: [jnp.sum(a, axis=0) for a in arrays], out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def all_program(sharding: Any) -> Callable:
    return jax.jit(lambda arrays: list(arrays), out_shardings=sharding)


def sum_over_replicas(strategy: Any, columns: list[list], check: bool = True) -> list[list]:
    """``columns[i]``: this worker's per-device values of leaf ``i`` -> per local device, the sums.

    ``check``: first exchange every replica's shapes (not needed where the workers agreed on them).
    """
    if not columns:
        return [[] for _ in strategy.extended.replica_mesh.local_devices]
    ext = strategy.extended
    for every in shapes_everywhere(strategy, columns, "an all_reduce of an uneven step") if check else []:
        shapes, dtypes = sorted({shape for shape, _ in every}), sorted({dtype for _, dtype in every})
        if len(shapes) > 1 or len(dtypes) > 1:
            raise ValueError(
                f"all_reduce got values of shapes {shapes} (dtypes {dtypes}) on different replicas; every "
                "replica must pass a value of the same shape and dtype (reduce the batch dim first, e.g. "
                "with a sum over axis 0)."
            )
    totals = sum_program(ext.replica_mesh.replicated_sharding)([global_from_local(strategy, col) for col in columns])
    per_leaf = [per_local_device(strategy, t) for t in totals]
    return [list(per_device) for per_device in zip(*per_leaf)]


def everyone(strategy: Any, columns: list[list]) -> list[np.ndarray]:
    """Every replica's (equal-shaped) values of each leaf, on the host: ``(replicas, ...)`` each."""
    ext = strategy.extended
    gathered = all_program(ext.replica_mesh.replicated_sharding)([global_from_local(strategy, col) for col in columns])
    return [np.asarray(g) for g in gathered]


def shapes_everywhere(strategy: Any, columns: list[list], what: str) -> list[list[tuple]]:
    """Per leaf, every replica's ``(shape, dtype)`` in the job, in replica order.

    With several workers they are exchanged through the coordination service
    first (``MultiWorkerExtended.agree_on_shapes``), so a mismatch between
    workers raises the same ValueError on every worker instead of reaching a
    device collective (gloo aborts a process on mismatched sizes).
    """
    local = [[[list(jnp.shape(v)), str(jnp.result_type(v))] for v in col] for col in columns]
    per_worker = [local] if jax.process_count() == 1 else strategy.extended.agree_on_shapes(local, what)
    return [[(tuple(shape), dtype) for worker in per_worker for shape, dtype in worker[i]] for i in range(len(columns))]


def gather_over_replicas(strategy: Any, columns: list[list], axis: int) -> list[list]:
    """Concatenates every replica's value of each leaf along ``axis``; sizes along it may differ."""
    ext = strategy.extended
    out_columns = []
    for col, every in zip(columns, shapes_everywhere(strategy, columns, "an all_gather of an uneven step")):
        shapes = [shape for shape, _ in every]
        if len({len(shape) for shape in shapes}) > 1 or len({dtype for _, dtype in every}) > 1:
            raise ValueError(
                f"all_gather got values of shapes {sorted(set(shapes))} (dtypes {sorted({d for _, d in every})}) on "
                "different replicas: their ranks and dtypes must be equal; only the gathered axis may differ."
            )
        ndim = len(shapes[0])
        ax = axis % ndim
        others = {shape[:ax] + shape[ax + 1 :] for shape in shapes}
        sizes = np.array([shape[ax] for shape in shapes], np.int32)
        if len(others) > 1:
            raise ValueError(
                f"all_gather along axis {axis} got values whose other dims differ between replicas "
                f"({sorted(others)}); only the gathered axis may differ."
            )
        width = max(int(sizes.max()), 0)
        padded = [jnp.concatenate([v, jnp.zeros(v.shape[:ax] + (width - v.shape[ax],) + v.shape[ax + 1 :], v.dtype)], axis=ax) for v in col]
        gathered = everyone(strategy, [padded])[0]
        pieces = [np.take(gathered[r], np.arange(int(n)), axis=ax) for r, n in enumerate(sizes.tolist())]
        whole = np.concatenate(pieces, axis=ax)
        out_columns.append([jax.device_put(whole, d) for d in ext.replica_mesh.local_devices])
    return [list(per_device) for per_device in zip(*out_columns)]



def replicated_from_local(strategy: Any, per_device: list) -> jax.Array:
    """One replicated array from this worker's identical per-device copies."""
    ext = strategy.extended
    per_device = [v if isinstance(v, jax.Array) and v.committed and v.devices() == {d} else jax.device_put(jnp.asarray(v), d)
                  for v, d in zip(per_device, ext.replica_mesh.local_devices)]
    return jax.make_array_from_single_device_arrays(per_device[0].shape, ext.replica_mesh.replicated_sharding, per_device)


def per_replica_from_local(strategy: Any, per_device: list, all_rows: Sequence[int] | None = None) -> tuple[jax.Array, np.ndarray | None]:
    """A ``(replicas, rows, ...)`` array and the real row counts (None when equal) from per-device values.

    ``all_rows``: every replica's dim 0 in the job (needed with several workers).
    """
    per_device = [jnp.asarray(v) for v in per_device]
    shapes = {v.shape for v in per_device}
    if len({(v.ndim, v.shape[1:]) for v in per_device}) > 1 or (len(shapes) > 1 and 0 in {v.ndim for v in per_device}):
        raise ValueError(
            f"The replicas' values have shapes {[tuple(v.shape) for v in per_device]}: they may differ only in "
            "dim 0 (the batch dim), as one global array backs a PerReplica. Make the other dims equal on every "
            "replica (pad them, or return per-row values)."
        )
    if all_rows is None:
        all_rows = [v.shape[0] if v.ndim else None for v in per_device]
    if len(shapes) == 1 and len(set(all_rows)) == 1:
        return global_from_local(strategy, per_device), None
    width = max(all_rows)
    padded = [jnp.concatenate([v, jnp.zeros((width - v.shape[0], *v.shape[1:]), v.dtype)]) for v in per_device]
    return global_from_local(strategy, padded), np.asarray(all_rows, np.int64)


def local_slices(value: Any, strategy: Any) -> list:
    """This worker's per-replica components of an input leaf, each on its replica's device."""
    from distribute.values import Mirrored, PerReplica

    ext = strategy.extended
    if isinstance(value, PerReplica):
        return list(value.values)
    if isinstance(value, Mirrored):
        value = value._array
    if isinstance(value, jax.Array) and len(value.sharding.device_set) > 1:
        by_device = local_buffers(value)
        if all(d in by_device for d in ext.replica_mesh.local_devices):
            return [by_device[d] for d in ext.replica_mesh.local_devices]
    return [jax.device_put(value, d) for d in ext.replica_mesh.local_devices]
