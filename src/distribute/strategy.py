"""Strategy and StrategyExtended (tf.distribute.Strategy), and the default strategy.

A mesh strategy owns a ``jax.sharding.Mesh`` with one axis, ``"replica"``, over its
devices.  Cross-replica operations (``reduce``, ``gather``,
``experimental_local_results``) work on the global arrays that back
:class:`~distribute.values.PerReplica` values; ``run`` compiles the replica
function into one SPMD program (see ``tracing.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distribute import _context, collectives
from distribute.extended import StrategyExtended, _require_cross_replica, _sync_on_read_as_per_replica
from distribute.values import DistributedValues, Mirrored, PerReplica, ReduceOp, is_distributed



class ValueContext:
    """What ``experimental_distribute_values_from_function`` tells ``value_fn``.

    Matches tf.distribute.experimental.ValueContext.
    """

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


class Strategy:
    """A way to run one computation on several replicas (tf.distribute.Strategy).

    Use :class:`~distribute.MirroredStrategy` and friends; this base holds the API
    they share.
    """

    _extended_cls = StrategyExtended

    def __init__(self, devices: Sequence[jax.Device], **extended_kwargs: Any):
        self._extended = self._extended_cls(self, devices, **extended_kwargs)
        self._cluster_resolver = None

    # -- properties ----------------------------------------------------------------------
    @property
    def extended(self) -> StrategyExtended:
        """The less common half of the API (TF: ``Strategy.extended``)."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas taking part in each step, across all workers."""
        return len(self._extended.replica_mesh.devices)

    @property
    def cluster_resolver(self):
        """The cluster resolver, for multi-worker strategies; None here (as TF)."""
        return self._cluster_resolver

    def __repr__(self) -> str:
        devices = ", ".join(f"{d.platform}:{d.id}" for d in self._extended.replica_mesh.devices[:8])
        more = ", ..." if len(self._extended.replica_mesh.devices) > 8 else ""
        return f"<{type(self).__name__} num_replicas_in_sync={self.num_replicas_in_sync} devices=[{devices}{more}] at {id(self):#x}>"

    # -- scope -----------------------------------------------------------------------------
    def scope(self) -> contextlib.AbstractContextManager:
        """Makes this strategy current: Keras variables, models, optimizers and
        metrics created inside become distribution-aware (mirrored on every replica).

        Nesting the same strategy's scope is fine.

        Raises:
            RuntimeError: another strategy's scope is already active (TF: "Mixing
                different tf.distribute.Strategy objects").
        """
        return _context.enter_scope(self)

    # -- run -----------------------------------------------------------------------------
    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None, options: Any = None) -> Any:
        """Runs ``fn`` once per replica, compiled as one SPMD program (TF: Strategy.run).

        ``fn`` receives each replica's component of PerReplica arguments (a
        ``(global_batch, ...)`` input arrives as ``(per_replica_batch, ...)``) and
        the value itself for anything else.  Keras variables that ``fn`` reads or
        assigns are lifted into the program and written back after it; collectives
        are available through ``get_replica_context()``.  The program is compiled
        once per input signature (shapes, dtypes, Python constants) and cached for
        the function object ``fn``.

        Returns:
            The structure ``fn`` returns, each array leaf as a PerReplica.

        Raises:
            ValueError: ``args`` is not a tuple or list, or ``kwargs`` not a dict
                (TF raises ValueError too).
            RuntimeError: called inside another ``run``.
            ValueError: ``fn`` uses a Keras variable created outside this
                strategy's scope.
        """
        from distribute import tracing

        _check_run_args(args, kwargs)
        if _context.current_replica_context() is not None:
            _context.check_cross_replica_call()  # a distribute.function's trace: it runs as Python instead
            raise RuntimeError(
                "strategy.run was called inside another strategy.run (in replica context). "
                "Call the inner function directly instead."
            )
        with self.scope():
            return tracing.run(self, fn, tuple(args), dict(kwargs or {}))

    # -- cross-replica ops ---------------------------------------------------------------
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combines the replicas' values into one (TF: Strategy.reduce).

        With ``axis=None`` the per-replica values are combined element-wise
        (per-replica ``s`` -> ``s``).  With an axis, that axis is also reduced, and
        MEAN divides by the total number of elements along it across replicas, so
        a padded partial batch gives the true mean: replicas ``[1,2,3,4]`` and
        ``[5,6]``, MEAN, axis 0 -> 3.5.  Works on nested structures.

        Raises:
            ValueError: unknown op; SUM with ``axis=None`` of a non-distributed
                value with more than one replica (as TF); per-replica shapes differ along dims that
                ``axis=None`` combines.
            RuntimeError: called inside ``run`` (use ``ReplicaContext.all_reduce``).
        """
        op = ReduceOp.from_value(reduce_op)
        _require_cross_replica("strategy.reduce", "use get_replica_context().all_reduce(...)")
        _check_reduce_axis(axis)
        value = _sync_on_read_as_per_replica(value)
        self._check_values_are_ours(value, "reduce")
        result = self._on_read_device(jax.tree_util.tree_map(lambda v: self._reduce_one(op, v, axis), value, is_leaf=is_distributed))
        if not collectives.reduce_dispatches_nothing(op, value, axis):
            # A SUM the step's program computed already is not a program of its own: counting
            # it would halve the steps the in-flight bound lets the loop queue.
            self._extended.record_dispatch(result)
        return result

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the replicas' values along ``axis`` (TF: Strategy.gather).

        Per-replica ``(b_r, ...)`` -> ``(sum_r b_r, ...)`` for ``axis=0``; padding of
        a partial batch is dropped, so exactly the real rows come back in order.

        Raises:
            RuntimeError: called inside ``run`` (use ``ReplicaContext.all_gather``).
            ValueError: replicas' shapes differ along a dim other than ``axis``.
        """
        _require_cross_replica("strategy.gather", "use get_replica_context().all_gather(...)")
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise ValueError(f"strategy.gather: axis must be an int, got {axis!r}.")
        value = _sync_on_read_as_per_replica(value)
        self._check_values_are_ours(value, "gather")
        result = self._on_read_device(jax.tree_util.tree_map(lambda v: self._gather_one(v, axis), value, is_leaf=is_distributed))
        self._extended.record_dispatch(result)
        return result

    def experimental_local_results(self, value: Any) -> tuple:
        """This worker's components of ``value``, one per local replica (TF: same name).

        Padding of partial batches is removed: with 2 replicas, the last batch of
        ``range(5).batch(4)`` gives ``([4], [])``.  A non-distributed value gives
        ``(value,)``, a nested structure (list, tuple, dict) one copy per local replica
        with its distributed leaves split, as TF; a variable created in scope, its
        copy on each local replica's device;
        a SyncOnRead variable, its replicas' copies (as TF's
        SyncOnReadVariable; see ``sync_on_read.py``).
        """
        value = _sync_on_read_as_per_replica(value)
        if isinstance(value, DistributedValues):
            return value.values
        if getattr(value, "_distribute_strategy", None) is self and hasattr(value, "value"):
            # A MirroredVariable: its copy on each local replica's device (TF: its components).
            return self._extended.replica_mesh.local_copies(value._value)
        leaves, treedef = jax.tree_util.tree_flatten(value, is_leaf=is_distributed)
        if any(isinstance(leaf, DistributedValues) for leaf in leaves) or isinstance(value, (list, tuple, dict)):
            # TF: a nested structure gives one copy per local replica, its distributed leaves split.
            n = len(self._extended.replica_mesh.local_devices)
            per_leaf = [leaf.values if isinstance(leaf, DistributedValues) else (leaf,) * n for leaf in leaves]
            return tuple(jax.tree_util.tree_unflatten(treedef, [parts[i] for parts in per_leaf]) for i in range(n))
        return (value,)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Builds a PerReplica from ``value_fn(ValueContext)``, called once per local replica.

        Matches TF: ``value_fn`` gets ``replica_id_in_sync_group`` and
        ``num_replicas_in_sync``; nested structures give nested PerReplica values.
        """
        ext = self._extended
        ids = [ext.replica_mesh.devices.index(d) for d in ext.replica_mesh.local_devices]
        parts = [value_fn(ValueContext(i, self.num_replicas_in_sync)) for i in ids]
        leaves0, treedef = jax.tree_util.tree_flatten(parts[0])
        columns = [jax.tree_util.tree_leaves(p) for p in parts]
        out = []
        for j in range(len(leaves0)):
            with self.scope():
                out.append(PerReplica([col[j] for col in columns]))
        return jax.tree_util.tree_unflatten(treedef, out)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Splits each global batch of ``dataset`` across the replicas (TF: same name).

        ``dataset`` must be batched with the global batch size: each element
        ``(global_batch, ...)`` becomes a PerReplica of ``(per_replica_batch, ...)``
        pieces, contiguous and in order.  A final partial batch is split as
        evenly as possible (``ceil(n / replicas)`` per replica, in order, as TF:
        3 rows over 2 replicas give 2 | 1), and every replica sees exactly its
        rows (``strategy.run`` runs such a step per replica, ``uneven.py``).

        Raises:
            ValueError: ``dataset`` is not batched.
            TypeError: ``dataset`` is not a ``distribute.data.Dataset``.
        """
        from distribute.input.distributed_dataset import DistributedDataset

        return DistributedDataset.from_dataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Builds each worker's input pipeline with ``dataset_fn(InputContext)`` (TF: same name).

        ``dataset_fn`` must batch with the per-replica batch size
        (``input_context.get_per_replica_batch_size(global_batch_size)``); each of
        its elements is split between this worker's replicas.
        """
        from distribute.input.distributed_dataset import DistributedDataset

        return DistributedDataset.from_function(self, dataset_fn, options)

    def experimental_distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """TF's older name of :meth:`distribute_datasets_from_function` (same behaviour)."""
        return self.distribute_datasets_from_function(dataset_fn, options)

    # -- internals ---------------------------------------------------------------------
    def _check_values_are_ours(self, value: Any, what: str) -> None:
        for leaf in jax.tree_util.tree_leaves(value, is_leaf=is_distributed):
            if isinstance(leaf, DistributedValues) and leaf._strategy is not self:
                raise ValueError(
                    f"strategy.{what} got a {type(leaf).__name__} value of {leaf._strategy!r}, not of "
                    f"{self!r}; reduce or gather each value with the strategy that produced it."
                )

    def _on_read_device(self, tree: Any) -> Any:
        """reduce's and gather's results on one device, that of a cross-replica read (``ReplicaMesh.local_copy``).

        TF puts them on the current device (``reduce_to`` the current device), where a
        MirroredVariable's cross-replica read is too: ``v + strategy.reduce(...)`` works.
        """
        mesh = getattr(self._extended, "replica_mesh", None)
        return tree if mesh is None else jax.tree_util.tree_map(mesh.local_copy, tree)

    def _reduce_one(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        mirrored_variable = getattr(value, "_distribute_strategy", None) is self and hasattr(value, "value")
        if isinstance(value, Mirrored) or mirrored_variable:
            reduced = collectives.reduce_plain(op, value.value if mirrored_variable else value._array, axis)
            return reduced * self.num_replicas_in_sync if op is ReduceOp.SUM else reduced
        if not isinstance(value, PerReplica):
            if op is ReduceOp.SUM and axis is None and self.num_replicas_in_sync > 1:
                raise ValueError(
                    f"A non-DistributedValues value {value!r} cannot be reduced with "
                    f"ReduceOp.SUM across {self.num_replicas_in_sync} replicas: the sum "
                    "would count it once per replica. Reduce a PerReplica value (the "
                    "output of strategy.run), or use ReduceOp.MEAN."
                )
            reduced = collectives.reduce_plain(op, jnp.asarray(value), axis)
            # TF counts a plain value once per replica when an axis is reduced too.
            return reduced * self.num_replicas_in_sync if op is ReduceOp.SUM else reduced
        return collectives.reduce_per_replica(op, value, axis)

    def _gather_one(self, value: Any, axis: int) -> Any:
        if isinstance(value, PerReplica):
            return collectives.gather_per_replica(value, axis)
        if isinstance(value, Mirrored):
            return jnp.concatenate([value._array] * self.num_replicas_in_sync, axis=axis)
        # A plain value comes back unchanged, as in TF 2.21.
        return jnp.asarray(value)


def _check_reduce_axis(axis: Any) -> None:
    if axis is not None and (isinstance(axis, bool) or not isinstance(axis, (int, np.integer))):
        raise ValueError(f"strategy.reduce: axis must be None or an int, got {axis!r}.")


def _check_run_args(args: Any, kwargs: Any) -> None:
    if not isinstance(args, (tuple, list)):
        raise ValueError(
            f"strategy.run: args must be a tuple or list, got {type(args).__name__}; "
            "wrap a single argument as args=(x,)."
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"strategy.run: kwargs must be a dict, got {type(kwargs).__name__}.")


# -- the default strategy -----------------------------------------------------------------
class _DefaultStrategy(Strategy):
    """The strategy in force when no scope is entered: one replica, no distribution.

    As in TF, ``reduce`` returns its input and ``experimental_distribute_dataset``
    returns the dataset unchanged.  ``run`` compiles ``fn`` like the other
    strategies (TF users get that from ``tf.function``), over the default device,
    with any Keras variables created outside a scope.
    """

    _is_default = True

    def __init__(self) -> None:
        super().__init__([jax.local_devices()[0]])

    def scope(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None, options: Any = None) -> Any:
        _check_run_args(args, kwargs)
        from distribute import tracing

        if _context.current_replica_context() is not None:
            return fn(*args, **(kwargs or {}))
        outputs = tracing.run(self, fn, tuple(args), dict(kwargs or {}))
        # One replica: plain values, as TF's default strategy returns.
        return jax.tree_util.tree_map(lambda v: v.values[0] if is_distributed(v) else v, outputs, is_leaf=is_distributed)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        op = ReduceOp.from_value(reduce_op)
        _check_reduce_axis(axis)
        return jax.tree_util.tree_map(
            lambda v: collectives.reduce_plain(op, jnp.asarray(v.values[0] if is_distributed(v) else v), axis),
            value,
            is_leaf=is_distributed,
        )

    def gather(self, value: Any, axis: int) -> Any:
        return value

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        return dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        from distribute.input.input_context import InputContext

        return dataset_fn(InputContext())

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> Any:
        return value_fn(ValueContext(0, 1))

    def __repr__(self) -> str:
        return "DefaultStrategy()"


_DEFAULT: list[_DefaultStrategy] = []


def _default_strategy() -> _DefaultStrategy:
    if not _DEFAULT:
        _DEFAULT.append(_DefaultStrategy())
    return _DEFAULT[0]


_context.register_default_strategy(_default_strategy)


def get_strategy() -> Strategy:
    """The current strategy: the one whose scope is active, else the default one (TF: same name)."""
    return _context.current_strategy()


def has_strategy() -> bool:
    """Whether a non-default strategy's scope is active (TF: same name)."""
    return _context.scope_strategy() is not None


def in_cross_replica_context() -> bool:
    """True inside a strategy's scope and outside ``run`` (TF: same name).

    False outside any scope (the default strategy's replica context) and inside
    ``run``.
    """
    state = _context.state()
    return state.strategy is not None and state.replica_context is None


def get_replica_context():
    """The current ReplicaContext (TF: same name).

    Inside ``run``: the replica's context.  In a strategy's scope outside ``run``:
    None (cross-replica context).  Outside any scope: the default strategy's
    context (one replica).
    """
    from distribute.replica import ReplicaContext

    state = _context.state()
    if state.replica_context is not None:
        return state.replica_context
    if state.strategy is not None:
        return None
    return ReplicaContext._default(_default_strategy())
