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
import operator
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


class VariableCopy:
    """One local replica's copy of a variable made in a strategy's scope (TF: a component variable).

    What ``strategy.experimental_local_results(variable)`` gives, one per local replica,
    in replica order.  It reads like the array it holds (``value``, ``read_value()``,
    ``numpy()``, ``np.asarray``, ``float``, arithmetic, ``shape``, ``dtype``, ``devices()``)
    and is live, as TF's components: a read after a step gives the step's value.

    * a SyncOnRead variable's copy is that replica's own, and ``assign`` /
      ``assign_add`` / ``assign_sub`` write it alone, as TF's (2 replicas,
      ``only_first_replica``: ``copies[1].assign([1., -2.])`` changes replica 1's copy;
      the variable's cross-replica value is re-aggregated);
    * a MirroredVariable (and a variable split over the replicas) is one replicated
      value here: its copies read, and ``assign`` raises ``NotImplementedError`` naming
      the fix (TF lets the copies diverge, ``experimental_local_results(v)[1].assign(x)``).
    """

    __slots__ = ("_strategy", "_variable", "_replica")

    def __init__(self, strategy: Any, variable: Any, replica: int):
        self._strategy = strategy
        self._variable = variable
        self._replica = replica

    @property
    def value(self) -> jax.Array:
        """This copy's current array, on its replica's device."""
        mesh = self._strategy.extended.replica_mesh
        if sync_on_read.tracked(self._variable):
            return _local_copies(self._variable, mesh)[self._replica]
        stored = self._variable._value
        if isinstance(stored, jax.Array) and not stored.is_fully_replicated:
            stored = mesh.replicate(stored)
        return mesh.local_copies(stored)[self._replica]

    def read_value(self) -> jax.Array:
        return self.value

    def numpy(self) -> np.ndarray:
        return np.asarray(self.value)

    def assign(self, value: Any) -> "VariableCopy":
        """Sets this replica's copy of a SyncOnRead variable (TF: the component's ``assign``).

        Raises:
            NotImplementedError: the variable is a MirroredVariable (one replicated value here).
            ValueError: ``value``'s shape differs from the variable's.
            RuntimeError: called inside a replica function.
        """
        var = self._variable
        if not sync_on_read.tracked(var):
            raise NotImplementedError(
                f"strategy.experimental_local_results(v)[{self._replica}].assign(...) on MirroredVariable "
                f"'{var.path}': a MirroredVariable is one replicated value here, so its copies cannot be "
                "assigned one by one (TF lets them diverge). Assign the variable itself (v.assign(x) sets "
                "every copy), or, for one value per replica, create it with synchronization='on_read' (and "
                "aggregation='sum', 'mean' or 'only_first_replica'): its copies are each replica's own and "
                "assignable here; or pass a PerReplica value "
                "(strategy.experimental_distribute_values_from_function) to strategy.run."
            )
        if get_stateless_scope() is not None:
            raise RuntimeError(
                f"a copy of variable '{var.path}' was assigned inside a replica function; assign copies in "
                "cross-replica context, or assign the variable in the replica function (each replica "
                "writes its own copy)."
            )
        new = jnp.asarray(value, var.dtype)
        if tuple(new.shape) != tuple(var.shape):
            raise ValueError(
                f"copy {self._replica} of variable '{var.path}' has shape {tuple(var.shape)}; got a value "
                f"of shape {tuple(new.shape)}. Assign a value of the variable's shape."
            )
        mesh = self._strategy.extended.replica_mesh
        copies = list(_local_copies(var, mesh))
        copies[self._replica] = jax.device_put(new, mesh.local_devices[self._replica])
        per_replica, _ = collectives.per_replica_from_local(self._strategy, copies)
        sync_on_read.store(var, _aggregate(var.aggregation, mesh.replicated_sharding)(per_replica), per_replica)
        return self

    def assign_add(self, delta: Any) -> "VariableCopy":
        return self.assign(self._add(delta, 1))

    def assign_sub(self, delta: Any) -> "VariableCopy":
        return self.assign(self._add(delta, -1))

    def _add(self, delta: Any, sign: int) -> Any:
        value = self.value
        return value + sign * jax.device_put(jnp.asarray(delta, value.dtype), next(iter(value.devices())))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.value, name)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = np.asarray(self.value)
        return array if dtype is None else array.astype(dtype)

    def __jax_array__(self) -> jax.Array:
        return self.value

    def __float__(self) -> float:
        return float(self.value)

    def __int__(self) -> int:
        return int(self.value)

    def __bool__(self) -> bool:
        return bool(self.value)

    def __len__(self) -> int:
        return len(self.value)

    def __getitem__(self, index: Any) -> Any:
        return self.value[index]

    def __iter__(self):
        return iter(self.value)

    def __neg__(self) -> Any:
        return -self.value

    def __repr__(self) -> str:
        return f"<copy {self._replica} of variable '{self._variable.path}': {np.asarray(self.value)!r}>"


def _binary(op: Callable, reflected: bool = False) -> Callable:
    if reflected:
        return lambda self, other: op(other, self.value)
    return lambda self, other: op(self.value, other)


for _name, _op in {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
                   "floordiv": operator.floordiv, "pow": operator.pow, "matmul": operator.matmul, "mod": operator.mod}.items():
    setattr(VariableCopy, f"__{_name}__", _binary(_op))
    setattr(VariableCopy, f"__r{_name}__", _binary(_op, reflected=True))
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    setattr(VariableCopy, f"__{_name}__", _binary(getattr(operator, _name)))
VariableCopy.__hash__ = object.__hash__  # identity, as a variable's (``__eq__`` compares values)


def variable_copies(strategy: Any, variable: Any) -> tuple:
    """``experimental_local_results`` of a variable made in ``strategy``'s scope: one VariableCopy per local replica."""
    return tuple(VariableCopy(strategy, variable, r) for r in range(len(strategy.extended.replica_mesh.local_devices)))
