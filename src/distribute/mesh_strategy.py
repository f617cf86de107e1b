"""MeshStrategy: the execution interface over a one-axis device mesh (Mirrored, MultiWorkerMirrored, TPU, OneDevice, default).

A mesh strategy *has* an engine (``MeshExtended``: its ``ReplicaMesh`` of
devices, the compiled programs of ``run`` and the bound on steps in flight) and
an input policy (``input/policy.py``). Cross-replica operations (``reduce``,
``gather``, ``experimental_local_results``) work on the global arrays that back
:class:`~distribute.values.PerReplica` values; ``run`` compiles the replica
function into one SPMD program (``tracing.py``), or runs the exact uneven step.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distribute import _context, collectives, per_copy, sync_on_read
from distribute._keras import get_stateless_scope
from distribute.extended import StrategyExtended, require_cross_replica
from distribute.input.policy import InputPolicy
from distribute.mesh import ReplicaMesh
from distribute.placement import Placement, Replicated, Sharded
from distribute.sharding import Sharding, split_dim
from distribute.strategy import Strategy, ValueContext, check_run_args
from distribute.values import DistributedValues, Mirrored, PerReplica, ReduceOp, is_distributed

_MAX_STEPS_IN_FLIGHT = 2


class MeshExtended(StrategyExtended):
    """The extended half of a mesh strategy: TF's API, and the engine's parts.

    Attributes:
        replica_mesh: the ``ReplicaMesh`` (``mesh.py``: devices, the one-axis
            mesh, shardings of per-replica and mirrored values, placement).
        input_policy: how input is split between this worker's replicas (``input/policy.py``).
        programs: the compiled programs of ``run``, by function and input signature (``tracing.py``).
    """

    def __init__(self, strategy: "MeshStrategy", devices: Sequence[jax.Device], sharding: Any = None):
        super().__init__(strategy)
        self.replica_mesh = ReplicaMesh(devices)
        self._sharding = Sharding.from_value(sharding)
        self.input_policy = InputPolicy(self.replica_mesh)
        self.programs: dict = {}
        # XLA:CPU runs every virtual device's share of a program on one small thread
        # pool; with many collective programs queued, devices can wait on each
        # other's rendezvous for ever. On CPU at most _MAX_STEPS_IN_FLIGHT steps are
        # queued ahead of the host (GPUs and TPUs queue freely).
        self._in_flight: collections.deque | None = (
            collections.deque() if len(self.replica_mesh.devices) > 1 and self.replica_mesh.devices[0].platform == "cpu" else None
        )

    # -- where a variable lives -----------------------------------------------------
    @property
    def sharding(self) -> Sharding:
        """How much of the training state is split over the replicas (the strategy's ``sharding=``; ``sharding.py``)."""
        return self._sharding

    def place_variable(self, variable: Any) -> Placement:
        """Replicated on every replica (TF's MirroredVariable), one copy per replica for
        ``synchronization="on_read"`` (TF's SyncOnReadVariable, ``sync_on_read.py``), or
        split over the replicas (sharded state, by the strategy's ``sharding``).

        With ``sharding`` other than NONE, a trainable variable that
        ``sharding.split_dim`` splits is updated by slices along that dim: its
        optimizer slots (``add_variable_from_reference``) are split there, and
        with FULL the variable itself too. Everything else stays as without
        sharding.

        Raises:
            ValueError: ``synchronization="none"`` (TF's message).
        """
        if variable.synchronization == "none":
            raise ValueError(
                "`NONE` variable synchronization mode is not supported with tf.distribute strategy. Please change "
                f"the `synchronization` for variable: {variable.name} (distribute: create it with synchronization="
                "'auto', 'on_write' or 'on_read', or outside the strategy's scope)."
            )
        mesh = self.replica_mesh
        if variable.synchronization == "on_read" and mesh.num_replicas > 1:
            return sync_on_read.SyncOnRead(mesh)
        if self._sharding.splits_slots:
            reference = _context.colocated_with()
            if reference is not None:  # an optimizer slot: split as its variable's update
                dim = getattr(reference.__dict__.get("_distribute_placement"), "update_dim", None)
                if dim is not None and tuple(variable.shape) == tuple(reference.shape):
                    return Sharded(mesh, dim, len(variable.shape), self.agree_on_shapes)
                return Replicated(mesh)
            dim = split_dim(variable.shape, mesh.num_replicas) if variable.trainable else None
            if dim is not None:
                return Sharded(mesh, dim, len(variable.shape), self.agree_on_shapes) if self._sharding.splits_variables else Replicated(mesh, update_dim=dim)
        return Replicated(mesh)

    # -- public, as TF --------------------------------------------------------------
    @property
    def worker_devices(self) -> tuple[str, ...]:
        """This worker's devices, as strings (TF: worker_devices)."""
        return tuple(_device_name(d) for d in self.replica_mesh.local_devices)

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any = None, options: Any = None) -> Any:
        """Reduces ``value`` across replicas to ``destinations`` (TF: reduce_to).

        Shapes: per-replica ``s`` -> ``s``.  As TF: a distributed ``value`` with
        distributed (or no) ``destinations`` gives a Mirrored value; a device
        name as ``destinations`` gives a plain array; a non-distributed value
        gives a plain array (MEAN; SUM raises ValueError, as ``reduce``).

        Raises:
            ValueError: unknown op, or SUM of a non-distributed value with more than one replica.
        """
        strategy = self._container_strategy
        value = sync_on_read_as_per_replica(value)
        reduced = strategy.reduce(reduce_op, value, axis=None)
        if not isinstance(value, DistributedValues) or isinstance(destinations, (str, jax.Device)):
            return reduced
        return Mirrored(reduced, strategy)

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence, options: Any = None) -> list:
        """``reduce_to`` of each ``(value, destinations)`` pair.

        As TF's MirroredStrategy, every distributed value gives a Mirrored value
        here, whatever its destinations.
        """
        out = []
        for value, destinations in value_destination_pairs:
            value = sync_on_read_as_per_replica(value)
            out.append(self.reduce_to(reduce_op, value, None if isinstance(value, DistributedValues) else destinations, options))
        return out

    def update(self, var: Any, fn: Callable, args: Sequence = (), kwargs: dict | None = None, group: bool = True) -> Any:
        """Runs ``fn(var, *args, **kwargs)`` to update a mirrored variable in cross-replica context.

        Every replica holds the same (replicated) array, so one call updates all
        copies.  Raises RuntimeError inside ``run`` (TF requires cross-replica
        context here).
        """
        return super().update(var, fn, args, kwargs, group)

    # -- the engine -------------------------------------------------------------------
    def record_dispatch(self, outputs: Any) -> None:
        """Records a dispatched program (a step, a reduce, a gather); waits for an older
        one when too many are queued (CPU only).

        ``outputs``: arrays the program produces that no later program donates.
        """
        if self._in_flight is None:
            return
        leaves = jax.tree_util.tree_leaves(outputs)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return  # (traced: a merge_call's reduce inside a step's program dispatches nothing)
        self._in_flight.append(leaves)
        if len(self._in_flight) > _MAX_STEPS_IN_FLIGHT:
            _wait_for(self._in_flight.popleft())

    def agree_on_shapes(self, local: list, what: str) -> list:
        """Every worker's ``local`` (a JSON-able list), in worker order; one worker here: ``[local]``."""
        return [local]


def _wait_for(arrays: list) -> None:
    """Waits for an older step's arrays, except those a later program took (donated): it waits for them."""
    live = [a for a in arrays if isinstance(a, jax.Array) and not a.is_deleted()]
    try:
        jax.block_until_ready(live)
    except jax.errors.JaxRuntimeError as err:
        # An array object whose buffer a later program took under another object of the same buffer
        # (is_deleted() is False for it): nothing to wait for there; the others are waited for one by one.
        if "donated" not in str(err):
            raise
        for array in live:
            try:
                array.block_until_ready()
            except jax.errors.JaxRuntimeError as one:
                if "donated" not in str(one):
                    raise


class MeshStrategy(Strategy):
    """A strategy whose replicas are the devices of a one-axis mesh (see the module docstring).

    Args:
        devices: every replica's device, in replica order (all workers' for
            MultiWorkerMirroredStrategy).
        **extended_kwargs: passed to the strategy's extended class.
    """

    _extended_cls = MeshExtended

    def __init__(self, devices: Sequence[jax.Device], **extended_kwargs: Any):
        super().__init__(devices=devices, **extended_kwargs)

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas taking part in each step, across all workers."""
        return len(self._extended.replica_mesh.devices)

    def __repr__(self) -> str:
        devices = self._extended.replica_mesh.devices
        names = ", ".join(f"{d.platform}:{d.id}" for d in devices[:8])
        more = ", ..." if len(devices) > 8 else ""
        return f"<{type(self).__name__} num_replicas_in_sync={self.num_replicas_in_sync} devices=[{names}{more}] at {id(self):#x}>"

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

        check_run_args(args, kwargs)
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
        require_cross_replica("strategy.reduce", "use get_replica_context().all_reduce(...)")
        if op is ReduceOp.SUM and axis is None and type(value) is PerReplica and value._sum is not None and value._strategy is self:
            # A step's output its program summed already (the loss every loop reduces): no program.
            return collectives.reduce_per_replica(op, value, None)
        check_reduce_axis(axis)
        value = self._bound(sync_on_read_as_per_replica(value), "reduce")
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
        require_cross_replica("strategy.gather", "use get_replica_context().all_gather(...)")
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise ValueError(f"strategy.gather: axis must be an int, got {axis!r}.")
        value = self._bound(sync_on_read_as_per_replica(value), "gather")
        result = self._on_read_device(jax.tree_util.tree_map(lambda v: self._gather_one(v, axis), value, is_leaf=is_distributed))
        self._extended.record_dispatch(result)
        return result

    def experimental_local_results(self, value: Any) -> tuple:
        """This worker's components of ``value``, one per local replica (TF: same name).

        Padding of partial batches is removed: with 2 replicas, the last batch of
        ``range(5).batch(4)`` gives ``([4], [])``.  A non-distributed value gives
        ``(value,)``, a nested structure (list, tuple, dict) one copy per local replica
        with its distributed leaves split, as TF; a variable created in scope, one
        ``per_copy.VariableCopy`` per local replica (TF: its component variables): it
        reads as that replica's copy (a SyncOnRead variable's own copy, a
        MirroredVariable's copy on the replica's device) and, for a SyncOnRead
        variable, ``assign`` sets that copy alone; a MirroredVariable's copy refuses
        ``assign`` (``NotImplementedError`` naming the fix: it is one replicated value here).
        """
        if getattr(value, "_distribute_strategy", None) is self and hasattr(value, "value"):
            if _context.current_replica_context() is not None:
                _context.check_cross_replica_call()  # a distribute.function's trace: it runs as Python instead
            if get_stateless_scope() is None:
                # TF: the variable's components, each read and (SyncOnRead) assigned on its own (per_copy.py).
                return per_copy.variable_copies(self, value)
        value = self._bound(sync_on_read_as_per_replica(value), "experimental_local_results")
        if isinstance(value, DistributedValues):
            return value.values
        if getattr(value, "_distribute_strategy", None) is self and hasattr(value, "value"):
            # Inside a program (a merge_fn): a MirroredVariable's copy on each local replica's device;
            # a variable split over the replicas (sharded state): its whole value on each.
            mesh = self._extended.replica_mesh
            stored = value._value
            if isinstance(stored, jax.Array) and not stored.is_fully_replicated:
                stored = mesh.replicate(stored)
            return mesh.local_copies(stored)
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
        mesh = self._extended.replica_mesh
        ids = [mesh.devices.index(d) for d in mesh.local_devices]
        parts = [value_fn(ValueContext(i, self.num_replicas_in_sync)) for i in ids]
        leaves0, treedef = jax.tree_util.tree_flatten(parts[0])
        columns = [jax.tree_util.tree_leaves(p) for p in parts]
        out = [PerReplica._bind_values(self, [col[j] for col in columns]) for j in range(len(leaves0))]
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

    # -- internals ---------------------------------------------------------------------
    def _bound(self, value: Any, what: str) -> Any:
        """``value`` with every distributed leaf this strategy's: an unbound PerReplica / Mirrored
        (built outside any scope, as TF's) is placed on this strategy's devices.

        Raises:
            ValueError: a value of another strategy.
        """

        def one(leaf: Any) -> Any:
            if not isinstance(leaf, DistributedValues):
                return leaf
            if leaf._strategy is None:
                return leaf._bind(self)
            if leaf._strategy is not self:
                raise ValueError(
                    f"strategy.{what} got a {type(leaf).__name__} value of {leaf._strategy!r}, not of "
                    f"{self!r}; reduce or gather each value with the strategy that produced it."
                )
            return leaf

        return jax.tree_util.tree_map(one, value, is_leaf=is_distributed)

    def _on_read_device(self, tree: Any) -> Any:
        """reduce's and gather's results on one device, that of a cross-replica read (``ReplicaMesh.local_copy``).

        TF puts them on the current device (``reduce_to`` the current device), where a
        MirroredVariable's cross-replica read is too: ``v + strategy.reduce(...)`` works.
        """
        return jax.tree_util.tree_map(self._extended.replica_mesh.local_copy, tree)

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


def check_reduce_axis(axis: Any) -> None:
    """Raises ValueError unless ``axis`` is None or an int."""
    if axis is not None and (isinstance(axis, bool) or not isinstance(axis, (int, np.integer))):
        raise ValueError(f"strategy.reduce: axis must be None or an int, got {axis!r}.")


def sync_on_read_as_per_replica(value: Any) -> Any:
    """SyncOnRead variables in ``value`` as PerReplica values of their copies (TF: they are DistributedValues)."""
    return jax.tree_util.tree_map(sync_on_read.as_per_replica, value, is_leaf=is_distributed)


def _device_name(device: jax.Device) -> str:
    kind = {"cpu": "CPU", "gpu": "GPU", "tpu": "TPU"}.get(device.platform, device.platform.upper())
    return f"/job:localhost/replica:0/task:{device.process_index}/device:{kind}:{device.id}"
