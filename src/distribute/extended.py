"""StrategyExtended (tf.distribute.StrategyExtended): the less common half of a strategy's API.

It also holds what the engine needs of a mesh strategy: its ``ReplicaMesh``
(``mesh.py``), the compiled programs of ``run`` and the bound on steps in flight.
"""

from __future__ import annotations

import collections
import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import jax

from distribute import _context, sync_on_read
from distribute.input.policy import InputPolicy
from distribute.mesh import ReplicaMesh
from distribute.values import DistributedValues, Mirrored, ReduceOp, is_distributed

if TYPE_CHECKING:  # pragma: no cover
    from distribute.strategy import Strategy

_MAX_STEPS_IN_FLIGHT = 2


class StrategyExtended:
    """The less common half of a strategy's API (tf.distribute.StrategyExtended).

    A mesh strategy's extended holds ``replica_mesh`` (``mesh.py``: its devices,
    the one-axis mesh, the shardings of per-replica and mirrored values, and
    placement), the compiled-program cache and the in-flight bound.
    """

    def __init__(self, strategy: "Strategy", devices: Sequence[jax.Device]):
        self._container_strategy = strategy
        self.replica_mesh = ReplicaMesh(devices)  # devices, mesh, shardings, placement (mesh.py)
        self.input_policy = InputPolicy(self.replica_mesh)  # how input is split (input/policy.py)
        self.programs: dict = {}  # the compiled programs of run, by function and input signature (tracing.py)
        # XLA:CPU runs every virtual device's share of a program on one small thread
        # pool; with many collective programs queued, devices can wait on each
        # other's rendezvous for ever. On CPU at most _MAX_STEPS_IN_FLIGHT steps are
        # queued ahead of the host (GPUs and TPUs queue freely).
        self._in_flight: collections.deque | None = (
            collections.deque() if len(self.replica_mesh.devices) > 1 and self.replica_mesh.devices[0].platform == "cpu" else None
        )

    # -- public, as TF --------------------------------------------------------------
    @property
    def worker_devices(self) -> tuple[str, ...]:
        """This worker's devices, as strings (TF: worker_devices)."""
        return tuple(_device_name(d) for d in self.replica_mesh.local_devices)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Devices that hold variables: every replica's (mirrored variables)."""
        return self.worker_devices

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker should save checkpoints (TF: the chief only)."""
        return True

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker should write summaries (TF: the chief only)."""
        return True

    @property
    def should_init(self) -> bool:
        """Whether this worker should initialize variables (always: variables are mirrored)."""
        return True

    def variable_created_in_scope(self, v: Any) -> bool:
        """True when Keras variable ``v`` was created inside this strategy's scope.

        Matches TF's ``StrategyExtended.variable_created_in_scope`` (for the default
        strategy: created outside every scope).
        """
        return self._owns(v)

    def _owns(self, obj: Any) -> bool:
        """Whether ``obj`` (a Keras variable, optimizer or metric) was made in this strategy's scope."""
        owner = getattr(obj, "_distribute_strategy", None)
        if owner is None:
            return getattr(self._container_strategy, "_is_default", False)
        return owner is self._container_strategy

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Places new variables with ``colocate_with_variable``.

        Every variable is mirrored on every replica here, so this changes nothing;
        it exists so TF code runs unchanged.
        """
        yield

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any = None, options: Any = None) -> Any:
        """Reduces ``value`` across replicas to ``destinations`` (TF: reduce_to).

        Shapes: per-replica ``s`` -> ``s``.  As TF: a distributed ``value`` with
        distributed (or no) ``destinations`` gives a Mirrored value; a device
        name as ``destinations`` gives a plain array; a non-distributed value
        gives a plain array (MEAN; SUM raises ValueError, as ``reduce``); the
        default strategy always gives a plain array (``float()`` works).

        Raises:
            ValueError: unknown op, or SUM of a non-distributed value with more than one replica.
        """
        strategy = self._container_strategy
        value = _sync_on_read_as_per_replica(value)
        reduced = strategy.reduce(reduce_op, value, axis=None)
        if getattr(strategy, "_is_default", False) or not isinstance(value, DistributedValues) or isinstance(destinations, (str, jax.Device)):
            return reduced
        return Mirrored(reduced, strategy)

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence, options: Any = None) -> list:
        """``reduce_to`` of each ``(value, destinations)`` pair.

        As TF's MirroredStrategy, every distributed value gives a Mirrored value
        here, whatever its destinations; the default strategy gives plain arrays.
        """
        out = []
        for value, destinations in value_destination_pairs:
            value = _sync_on_read_as_per_replica(value)
            reduced = self.reduce_to(reduce_op, value, None if isinstance(value, DistributedValues) else destinations, options)
            out.append(reduced)
        return out

    def update(self, var: Any, fn: Callable, args: Sequence = (), kwargs: dict | None = None, group: bool = True) -> Any:
        """Runs ``fn(copy, *args, **kwargs)`` on each copy of ``var`` with that replica's arguments (TF: update).

        PerReplica arguments give each copy its component, Mirrored ones their
        copy (``per_copy.py``): a SUM SyncOnRead variable updated with
        ``assign(5.0)`` on 2 replicas holds 5.0 per copy and reads 10.0, as TF.
        Returns a Mirrored value of ``fn``'s results (PerReplica when they
        differ; a tuple with ``group=False``).

        Raises:
            RuntimeError: inside ``run`` outside a ``merge_call`` (TF requires
                cross-replica context here).
            ValueError: a MirroredVariable's copies would get different values.
        """
        _require_cross_replica("extended.update", "update the variable from the replica function with var.assign(...)")
        from distribute import per_copy

        return per_copy.update(self._container_strategy, var, fn, tuple(args), dict(kwargs or {}), group)

    # -- internal ---------------------------------------------------------------------
    def record_dispatch(self, outputs: Any) -> None:
        """Records a dispatched program (a step, a reduce, a gather); waits for an older
        one when too many are queued (CPU only).

        ``outputs``: arrays the program produces that no later program donates.
        """
        if self._in_flight is None or any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(outputs)):
            return  # (traced: a merge_call's reduce inside a step's program dispatches nothing)
        self._in_flight.append(outputs)
        if len(self._in_flight) > _MAX_STEPS_IN_FLIGHT:
            oldest = [a for a in jax.tree_util.tree_leaves(self._in_flight.popleft()) if isinstance(a, jax.Array) and not a.is_deleted()]
            jax.block_until_ready(oldest)


def _require_cross_replica(what: str, fix: str) -> None:
    if _context.current_replica_context() is not None:
        _context.check_cross_replica_call()  # a distribute.function's trace: it runs as Python instead
        raise RuntimeError(
            f"{what} may only be called in cross-replica context (outside strategy.run); "
            f"it was called inside the replica function. Inside run, {fix} instead."
        )


def _device_name(device: jax.Device) -> str:
    kind = {"cpu": "CPU", "gpu": "GPU", "tpu": "TPU"}.get(device.platform, device.platform.upper())
    return f"/job:localhost/replica:0/task:{device.process_index}/device:{kind}:{device.id}"


def _sync_on_read_as_per_replica(value: Any) -> Any:
    """SyncOnRead variables in ``value`` as PerReplica values of their copies (TF: they are DistributedValues)."""
    return jax.tree_util.tree_map(sync_on_read.as_per_replica, value, is_leaf=is_distributed)
