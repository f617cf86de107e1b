"""``StrategyExtended.update``: ``fn`` on each copy of a variable with that replica's arguments (TF's).

TF calls ``fn(copy, *args)`` once per device, with each device's component of
distributed arguments (a PerReplica's value there, a Mirrored value's copy).
A SyncOnRead variable keeps one copy per replica here too, so each copy gets
its own update (TF 2.21, 2 replicas: a SUM SyncOnRead variable updated with
``assign(5.0)`` holds 5.0 per copy and reads 10.0).  A MirroredVariable is one
replicated array here: updates that leave its copies equal (a reduced gradient,
the same value) are kept; copies that would differ (TF lets them diverge)
raise ``ValueError``.  Inside a compiled step (a ``merge_call``'s ``merge_fn``)
each replica updates its own copy with its component.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from distribute import collectives, merge_call, sync_on_read
from distribute._keras import KerasVariable, get_stateless_scope
from distribute.lifting import LiftingScope
from distribute.values import DistributedValues, Mirrored, PerReplica


def update(strategy: Any, var: Any, fn: Callable, args: tuple, kwargs: dict, group: bool) -> Any:
    """``fn(copy, *args_r, **kwargs_r)`` on each of ``var``'s copies; see the module docstring.

    Returns:
        With ``group``: a Mirrored value of ``fn``'s results when they are equal,
        else a PerReplica; without: the tuple of this worker's results.

    Raises:
        ValueError: a MirroredVariable whose copies would get different values.
    """
    scope = get_stateless_scope()
    if isinstance(scope, LiftingScope):
        # Inside a step's program (a merge_fn): this replica's copy, this replica's component; a
        # cross-replica write, as an optimizer's (the variable's aggregation does not count it per replica).
        args, kwargs = jax.tree_util.tree_map(merge_call.this_replica_component, (args, kwargs), is_leaf=_is_leaf)
        scope.update_depth += 1
        try:
            return fn(var, *args, **kwargs)
        finally:
            scope.update_depth -= 1
    mesh = getattr(strategy.extended, "replica_mesh", None)
    if mesh is None or not isinstance(var, KerasVariable) or getattr(var, "_distribute_strategy", None) is not strategy:
        args, kwargs = jax.tree_util.tree_map(lambda a: _component(a, 0), (args, kwargs), is_leaf=_is_leaf)
        return fn(var, *args, **kwargs)
    on_read = sync_on_read.tracked(var)
    copies = _local_copies(var, mesh) if on_read else mesh.local_copies(var._value)
    results, new = [], []
    for r, copy in enumerate(copies):
        args_r, kwargs_r = jax.tree_util.tree_map(lambda a: _component(a, r), (args, kwargs), is_leaf=_is_leaf)
        scope = LiftingScope({id(var): copy}, device=mesh.local_devices[r])
        with jax.default_device(mesh.local_devices[r]), scope:
            results.append(fn(var, *args_r, **kwargs_r))
        new.append(jnp.asarray(scope.state_mapping[id(var)], var.dtype))
    if on_read:
        per_replica, _ = collectives.per_replica_from_local(strategy, new)
        sync_on_read.store(var, _aggregate(var.aggregation, mesh.replicated_sharding)(per_replica), per_replica)
    else:
        if any(not np.array_equal(np.asarray(new[0]), np.asarray(n)) for n in new[1:]):
            raise ValueError(
                f"StrategyExtended.update gave the copies of variable '{var.path}' different values "
                f"({[np.asarray(n).tolist() for n in new]}): a MirroredVariable is one replicated value here "
                "(TF lets its copies diverge). Pass the same value for every replica (reduce it first: "
                "strategy.extended.reduce_to(...)), or use a synchronization='on_read' variable."
            )
        var._value = collectives.replicated_from_local(strategy, new)
    return _regroup(strategy, results, group)


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (DistributedValues, KerasVariable))


def _component(value: Any, r: int) -> Any:
    return value.values[r] if isinstance(value, DistributedValues) else value


def _local_copies(var: Any, mesh: Any) -> list:
    by_device = {s.device: s.data[0] for s in sync_on_read.copies(var).addressable_shards}
    return [by_device[d] for d in mesh.local_devices]


@functools.lru_cache(maxsize=None)
def _aggregate(aggregation: str, sharding: Any) -> Callable:
    def combine(copies):
        if aggregation == "sum":
            return jnp.sum(copies, axis=0).astype(copies.dtype)
        if aggregation == "mean":
            return jnp.mean(copies, axis=0).astype(copies.dtype)
        return copies[0]

    return jax.jit(combine, out_shardings=sharding)


def _regroup(strategy: Any, results: list, group: bool) -> Any:
    if not group:
        return tuple(results)
    leaves = [jax.tree_util.tree_leaves(r) for r in results]
    if not leaves[0] or not all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves[0]):
        return results[0]
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for other in leaves[1:] for a, b in zip(leaves[0], other))
    treedef = jax.tree_util.tree_structure(results[0])
    if same:
        return jax.tree_util.tree_unflatten(treedef, [Mirrored(jnp.asarray(x), strategy) for x in leaves[0]])
    out = []
    for j in range(len(leaves[0])):
        array, lengths = collectives.per_replica_from_local(strategy, [jnp.asarray(col[j]) for col in leaves])
        out.append(PerReplica._from_array(strategy, array, lengths))
    return jax.tree_util.tree_unflatten(treedef, out)
