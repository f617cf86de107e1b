"""ReplicaContext: what the replica function sees inside ``strategy.run``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from distribute.mesh import AXIS
from distribute.values import ReduceOp

if TYPE_CHECKING:  # pragma: no cover
    from distribute.strategy import Strategy



class ReplicaContext:
    """The context of one replica inside ``strategy.run`` (tf.distribute.ReplicaContext).

    Get it with ``distribute.get_replica_context()``.  Collectives run over every
    replica of the strategy, across workers.

    Two replicas, inside ``run``::

        ctx = distribute.get_replica_context()
        ctx.replica_id_in_sync_group           # 0 on replica 0, 1 on replica 1
        ctx.all_reduce("sum", 1.0)             # 2.0 on both
        ctx.all_gather(jnp.array([1, 2]), 0)   # [1, 2, 1, 2] on both
    """

    def __init__(self, strategy: "Strategy", *, in_program: bool, rows: int | None = None, global_rows: int | None = None):
        self._strategy = strategy
        self._in_program = in_program
        self._rows = rows  # this replica's rows in the step's batch (None: no batched input)
        self._global_rows = global_rows  # the step's rows across all replicas

    @classmethod
    def _default(cls, strategy: "Strategy") -> "ReplicaContext":
        return cls(strategy, in_program=False)

    @property
    def strategy(self) -> "Strategy":
        """The strategy this replica belongs to."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas taking part in each step, across all workers."""
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> Any:
        """This replica's index in ``[0, num_replicas_in_sync)`` (an int32 scalar array inside run)."""
        if not self._in_program:
            return 0
        return lax.axis_index(AXIS)

    @property
    def devices(self) -> tuple[str, ...]:
        """This worker's devices, as TF-style names."""
        return self._strategy.extended.worker_devices

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any = None) -> Any:
        """Combines ``value`` across all replicas; every replica gets the result (TF: same name).

        Shapes are unchanged; nested structures are reduced leaf by leaf.  Two
        replicas, SUM of ``replica_id_in_sync_group`` -> 1 on each.

        Raises:
            ValueError: unknown reduce op.
        """
        op = ReduceOp.from_value(reduce_op)
        if not self._in_program:
            return jax.tree_util.tree_map(jnp.asarray, value)
        # Also with one replica: the psum is free there and types the value as the same on every
        # replica, which the program's replicated outputs (P()) need.
        reduce = lax.psum if op is ReduceOp.SUM else lax.pmean
        return jax.tree_util.tree_map(lambda v: reduce(jnp.asarray(v), AXIS), value)

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenates every replica's ``value`` along ``axis`` (TF: same name).

        Per-replica ``(b, ...)`` -> ``(num_replicas_in_sync * b, ...)`` for axis 0,
        on every replica, in replica order.
        """
        if not self._in_program:
            return jax.tree_util.tree_map(jnp.asarray, value)

        def gather(v: Any) -> jax.Array:
            v = jnp.asarray(v)
            if v.ndim == 0:
                raise ValueError("all_gather needs values of rank >= 1; got a scalar. Expand its dims first.")
            return lax.all_gather(v, AXIS, axis=axis % v.ndim, tiled=True)

        return jax.tree_util.tree_map(gather, value)

    def merge_call(self, merge_fn: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once in cross-replica context (TF: same).

        Array arguments arrive as PerReplica values of every replica's value; the
        result returns to every replica, a PerReplica one as that replica's
        component, a Mirrored one as its value.  Two replicas::

            v = replica_id_in_sync_group + 1.0
            ctx.merge_call(lambda s, x: s.reduce("SUM", x, axis=None), args=(v,))  # 3.0 on both
            ctx.merge_call(lambda s, x: x, args=(v,))                               # 1.0 | 2.0

        See ``merge_call.py``.

        Raises:
            TypeError: ``merge_fn`` is not callable.
        """
        from distribute.merge_call import merge_call

        return merge_call(self, merge_fn, args, kwargs)

    # -- used by the execution engine and the Keras hooks (the threaded context overrides them) --
    _runs_eagerly = False  # True in an uneven step's replica threads
    _sharding: Any = None  # the SPMD program's: the strategy's sharding.Sharding level (spmd.replica_context)
    _slices: Any = None  # the SPMD program's: the step's sharding.Slices

    def _tracing_replica_id(self, replica_id: Any) -> Any:
        """While tracing a per-replica program: ``replica_id_in_sync_group`` is this traced value."""
        import contextlib

        return contextlib.nullcontext()

    def _sum_gradients(self, grads: list) -> list:
        """Sums per-replica gradients across replicas (TF's apply_gradients all-reduce)."""
        if not self._in_program:
            return list(grads)
        return sum_gradients(list(grads))

    def _prepare_for_gradients(self, values: list) -> list:
        """Marks variable values as per-replica so that their gradients stay this replica's (as a tape)."""
        if not self._in_program:
            return values
        return [to_varying(x) for x in values]

    def _combine_all(self, variables: list, new: list, old: list, plain: frozenset = frozenset(),
                     updates: frozenset = frozenset()) -> list:
        """Makes assigned variables identical on every replica, by their aggregation.

        ``plain``: ids of the variables whose last write was a plain ``assign``
        (a ``sum`` variable then holds the sum of the assigned values, as TF's
        MirroredVariable; otherwise, after ``assign_add``, every replica's change).
        ``updates``: ids of the variables an optimizer wrote (combined as identical values).
        """
        if not self._in_program:
            return list(new)
        return [combine_replicas(v, n, o, id(v) in plain, id(v) in updates) for v, n, o in zip(variables, new, old)]

    def __repr__(self) -> str:
        return f"ReplicaContext(strategy={self._strategy!r})"


# -- the SPMD program's collectives (JAX's varying-manual-axes typing tells what differs) --
def combine_replicas(var: Any, new: Any, old: Any, plain: bool = False, update: bool = False) -> Any:
    """Makes a variable's new value identical on every replica, by its aggregation.

    ``update``: an optimizer's write (of already summed gradients); TF applies it in
    cross-replica context, where the aggregation does not apply.
    """
    new = jnp.asarray(new, dtype=old.dtype)
    aggregation = "mean" if update and var.aggregation == "sum" else var.aggregation
    if aggregation == "sum" and plain:
        return lax.psum(to_varying(new), AXIS)  # TF: assign in replica context sums the values
    if aggregation == "sum":
        # Sync-on-read SUM (metrics): every replica's change counts, even identical ones.
        return old + lax.psum(new - old, AXIS)
    if AXIS not in _varying_axes(new):
        return new
    if lax.axis_size(AXIS) == 1:
        return lax.psum(new, AXIS)  # one replica: its value is the value
    if aggregation == "none" and not var.trainable:
        aggregation = "mean"
    if aggregation == "mean":
        return lax.pmean(new, AXIS)
    if aggregation == "only_first_replica":
        first = lax.axis_index(AXIS) == 0
        return lax.psum(jnp.where(first, new, jnp.zeros_like(new)), AXIS)
    raise different_values_error(var)


def different_values_error(var: Any) -> ValueError:
    return ValueError(
        f"Variable '{var.path}' was assigned a different value on each replica inside "
        f"strategy.run, and its aggregation is {var.aggregation!r}, so there is no one "
        "value to keep (TF: 'You must specify an aggregation method to update a "
        "MirroredVariable in Replica Context'). Reduce the value first with "
        "get_replica_context().all_reduce(...), or create the variable with "
        "aggregation='sum', 'mean' or 'only_first_replica'."
    )


def _varying_axes(x: Any) -> frozenset:
    """Mesh axes along which ``x`` may differ between replicas (JAX's vma typing)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = aval.mat.varying
    return frozenset(vma)


def is_varying(x: Any) -> bool:
    """Whether ``x`` may differ between replicas inside the SPMD program (not yet summed, or a slice)."""
    return AXIS in _varying_axes(x)


def to_varying(x: Any) -> Any:
    """Marks ``x`` as possibly different on each replica (so its gradient stays local)."""
    return x if AXIS in _varying_axes(x) else lax.pcast(x, AXIS, to="varying")


def sum_gradients(grads: list) -> list:
    """Sums per-replica gradients across replicas (TF's apply_gradients all-reduce).

    A gradient with respect to a replicated value that JAX's autodiff already
    summed (it is the same on every replica) is left as it is.
    """
    return [g if g is None or AXIS not in _varying_axes(g) else lax.psum(g, AXIS) for g in grads]
