"""``ReplicaContext.merge_call``: leave replica context for a moment, with every replica's values (TF's).

``merge_fn(strategy, *args, **kwargs)`` runs once, in cross-replica context,
with each array argument as a PerReplica of every replica's value; what it
returns goes back to every replica: a PerReplica as that replica's component,
a Mirrored value as its value, anything else as it is (TF 2.21, 2 replicas: a
``merge_fn`` that returns ``strategy.reduce("SUM", value)`` of
``replica_id + 1`` gives 3.0 on both replicas; one that returns
``strategy.experimental_local_results(value)`` gives both replicas the tuple
``(1.0, 2.0)``; one that returns ``value`` gives each replica its own value).

In the compiled step (``tracing.py``) every replica gathers the arguments
(``all_gather``) and runs ``merge_fn`` itself on the same values, so the
results agree without another collective; PerReplica values there are traced
``(replicas, ...)`` arrays, and ``strategy.reduce`` / ``gather`` /
``experimental_local_results`` / ``extended.update`` work on them.  In an
uneven step (one thread per replica, ``uneven.py``) the replicas meet, and the
last to arrive runs ``merge_fn``; a replica program being compiled gives way
to the eager step.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from distribute import _context
from distribute._keras import KerasVariable
from distribute.mesh import AXIS
from distribute.values import DistributedValues, Mirrored, PerReplica


def merge_call(context: Any, merge_fn: Callable, args: Any = (), kwargs: Any = None) -> Any:
    """``context.merge_call(merge_fn, args, kwargs)``; see the module docstring."""
    if not callable(merge_fn):
        raise TypeError(f"merge_call: merge_fn must be callable, got {merge_fn!r}.")
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = dict(kwargs or {})
    strategy = context.strategy
    if not context._in_program:
        # One replica outside a program (the default strategy's context, a ps worker's replica).
        with _context.leave_replica():
            return merge_fn(strategy, *args, **kwargs)
    return _in_program(strategy, merge_fn, args, kwargs)


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (DistributedValues, KerasVariable))


def _in_program(strategy: Any, merge_fn: Callable, args: tuple, kwargs: dict) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_leaf)
    gathered = [_traced_per_replica(strategy, leaf) for leaf in leaves]
    args, kwargs = jax.tree_util.tree_unflatten(treedef, gathered)
    with _context.leave_replica():
        result = merge_fn(strategy, *args, **kwargs)
    return jax.tree_util.tree_map(_this_replicas, result, is_leaf=_is_leaf)


def _traced_per_replica(strategy: Any, leaf: Any) -> Any:
    if isinstance(leaf, (DistributedValues, KerasVariable)) or not _is_array(leaf):
        return leaf
    x = jnp.asarray(leaf)
    # (replicas, ...): every replica's value, typed as the same on every replica (a psum of one-hot
    # placements; lax.all_gather's result would be typed per-replica)
    slots = jnp.zeros((lax.axis_size(AXIS), *x.shape), x.dtype).at[lax.axis_index(AXIS)].set(x)
    return PerReplica._from_array(strategy, lax.psum(slots, AXIS))


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.core.Tracer)) or hasattr(x, "__array__") and not isinstance(x, (str, bytes))


def _this_replicas(value: Any) -> Any:
    if isinstance(value, PerReplica):
        array = value._array
        if isinstance(array, jax.core.Tracer):
            return array[lax.axis_index(AXIS)]
        raise ValueError(
            "merge_fn returned a PerReplica value made outside this step (from values of another step); "
            "return values computed from merge_call's arguments."
        )
    if isinstance(value, Mirrored):
        return value._array
    return value


def this_replica_component(value: Any) -> Any:
    """Inside a merge_fn of a compiled step: this replica's component of ``value`` (others unchanged)."""
    return _this_replicas(value)


# -- an uneven step: the replicas' threads meet ------------------------------------------------
def threaded(context: Any, merge_fn: Callable, args: Any, kwargs: Any, per_replica_from_local: Callable) -> Any:
    """merge_call in an uneven step's replica thread: the replicas meet; the last to arrive runs merge_fn.

    ``per_replica_from_local`` builds a PerReplica's backing array from this
    worker's replicas' values (``collectives``). ``context._meet`` refuses traced
    values (a collective under a JAX transformation).
    """
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = dict(kwargs or {})
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_leaf)
    strategy = context.strategy

    def combine(per_replica: list) -> list:
        columns = list(zip(*per_replica))
        built = []
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, (DistributedValues, KerasVariable)) or not _is_array(leaf):
                built.append(leaf)
                continue
            array, lengths = per_replica_from_local(strategy, [jnp.asarray(v) for v in columns[j]])
            built.append(PerReplica._from_array(strategy, array, lengths))
        merged_args, merged_kwargs = jax.tree_util.tree_unflatten(treedef, built)
        with _context.leave_replica():
            result = merge_fn(strategy, *merged_args, **merged_kwargs)
        devices = strategy.extended.replica_mesh.local_devices
        return [_component(result, r, devices[r]) for r in range(len(per_replica))]

    return context._meet(leaves, combine, "merge_call")


def _component(result: Any, local_index: int, device: Any) -> Any:
    """Replica ``local_index``'s share of merge_fn's result, its arrays on that replica's device."""
    def one(value: Any) -> Any:
        if isinstance(value, DistributedValues):
            value = value.values[local_index]
        if isinstance(value, jax.Array):
            return jax.device_put(value, device)
        return value

    return jax.tree_util.tree_map(one, result, is_leaf=_is_leaf)
