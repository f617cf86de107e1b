"""What the replica contexts of an uneven step share: the public collectives and the engine's hooks.

An uneven step runs each replica on its own rows, either as per-replica programs
split at their collectives (``per_replica.py``, the collectives made on the
host between the programs) or eagerly, one thread per replica (``threads.py``).
Both contexts give the same answers as the SPMD program's context; they differ
only in how a collective reaches the other replicas (``_sum_tree``,
``_everyones``, ``_gather_tree``, ``_combine``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distribute.engine.host import VariableSpec, variable_specs
from distribute.replica import ReplicaContext
from distribute.values import ReduceOp


def under_transformation_error() -> TypeError:
    return TypeError(
        "A collective (all_reduce, all_gather, or an optimizer's gradient sum) was called "
        "under a JAX transformation (vmap, lax.scan, lax.cond, lax.while_loop) inside an uneven step. "
        "In an uneven step (a batch that does not divide between the replicas) every replica "
        "runs on its own rows, and its collectives are made between its programs: call the "
        "collective outside the transformation (jax.jit around it is fine), or drop the uneven "
        "batch (batch(..., drop_remainder=True))."
    )


class UnevenReplicaContext(ReplicaContext):
    """The replica context of one replica of an uneven step (same API and answers as the SPMD one).

    ``replica_id_in_sync_group`` is an int32 scalar array, as in the SPMD program.
    Subclasses reach the other replicas through ``_sum_tree``, ``_everyones``,
    ``_gather_tree`` and ``_combine``.
    """

    def __init__(self, strategy: Any, replica: int | None, rows: int | None, global_rows: int | None):
        super().__init__(strategy, in_program=True, rows=rows, global_rows=global_rows)
        self._replica = replica  # None while a program shared by the replicas of one shape is traced

    # -- what a subclass provides ------------------------------------------------------------
    def _sum_tree(self, tree: Any) -> Any:  # pragma: no cover - abstract
        """Sum over every replica (all workers) of each leaf of ``tree``; every replica gets it."""
        raise NotImplementedError

    def _everyones(self, tree: Any) -> Any:  # pragma: no cover - abstract
        """Every replica's value of each (equal-shaped) leaf: ``(num_replicas_in_sync, ...)`` each."""
        raise NotImplementedError

    def _gather_tree(self, tree: Any, axis: int) -> Any:  # pragma: no cover - abstract
        """Concatenation of every replica's leaves along ``axis`` (sizes may differ along it)."""
        raise NotImplementedError

    def _combine(self, specs: tuple[VariableSpec, ...], new: list, old: list) -> list:  # pragma: no cover - abstract
        """The variables' values made identical on every replica (``host.HostCollectives.combine``)."""
        raise NotImplementedError

    # -- public collectives ---------------------------------------------------------------
    def _sum(self, tree: Any) -> Any:
        """Differentiable sum over replicas (the gradient of a sum is a sum)."""
        return _differentiable_sum(self)(tree)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any = None) -> Any:
        op = ReduceOp.from_value(reduce_op)
        total = self._sum(jax.tree_util.tree_map(jnp.asarray, value))
        if op is ReduceOp.SUM:
            return total
        return jax.tree_util.tree_map(lambda t: t / self.num_replicas_in_sync, total)

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        for leaf in jax.tree_util.tree_leaves(value):
            if jnp.ndim(leaf) == 0:
                raise ValueError("all_gather needs values of rank >= 1; got a scalar. Expand its dims first.")
        return _differentiable_gather(self, axis)(jax.tree_util.tree_map(jnp.asarray, value))

    # -- what the engine and the Keras hooks use ---------------------------------------------
    def _sum_gradients(self, grads: list) -> list:
        present = [g for g in grads if g is not None]
        summed = iter(self._sum_tree(present))
        return [None if g is None else next(summed) for g in grads]

    def _prepare_for_gradients(self, values: list) -> list:
        return values

    def _combine_all(self, variables: Sequence[Any], new: Sequence[Any], old: Sequence[Any], plain: frozenset = frozenset(),
                     updates: frozenset = frozenset()) -> list:
        """Makes assigned variables identical on every replica, by their aggregation (as the SPMD path).

        ``sum``: every replica's change counts; values equal on every replica stay;
        others: ``mean`` over the replicas that had rows (an empty replica
        contributes nothing), ``only_first_replica`` replica 0's, ``none`` an
        error for trainable variables and the mean for the others (BatchNorm).
        """
        if not variables:
            return []
        new = [jnp.asarray(n, dtype=o.dtype) for n, o in zip(new, old)]
        return self._combine(variable_specs(variables, plain, updates), new, [jnp.asarray(o) for o in old])


def _differentiable_sum(context: UnevenReplicaContext) -> Callable:
    @jax.custom_vjp
    def total(tree):
        return context._sum_tree(tree)

    def fwd(tree):
        return context._sum_tree(tree), None

    def bwd(_, cotangent):
        return (context._sum_tree(cotangent),)

    total.defvjp(fwd, bwd)
    return total


def _differentiable_gather(context: UnevenReplicaContext, axis: int) -> Callable:
    @jax.custom_vjp
    def gather(tree):
        return context._gather_tree(tree, axis)

    def fwd(tree):
        sizes = jax.tree_util.tree_map(lambda x: x.shape[axis % x.ndim], tree)
        return context._gather_tree(tree, axis), sizes

    def bwd(sizes, cotangent):
        # The gradient of a gather: this replica's slice of the sum of every replica's cotangent.
        total = context._sum_tree(cotangent)
        starts = context._gather_tree(jax.tree_util.tree_map(lambda n: jnp.asarray([n]), sizes), 0)

        def mine(t, offsets, n):
            start = int(np.sum(np.asarray(offsets)[: context._replica]))
            return jax.lax.slice_in_dim(t, start, start + n, axis=axis % t.ndim)

        return (jax.tree_util.tree_map(mine, total, starts, sizes),)

    gather.defvjp(fwd, bwd)
    return gather
