"""StrategyExtended (tf.distribute.StrategyExtended): the less common half of a strategy's API.

TF's public half only: ``reduce_to``, ``batch_reduce_to``, ``update``,
``colocate_vars_with``, ``variable_created_in_scope``, the device lists and the
``should_*`` flags; plus the one question every variable made in a strategy's
scope asks, :meth:`StrategyExtended.place_variable`. A strategy's engine (a
mesh strategy's ``MeshEngine``, the parameter-server cluster) belongs to that
strategy's own extended class.
"""

from __future__ import annotations

import abc
import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from distribute import _context
from distribute.values import ReduceOp

if TYPE_CHECKING:  # pragma: no cover
    from distribute.placement import Placement
    from distribute.runtime.workers import MultiWorkerRuntime
    from distribute.strategy import Strategy


class StrategyExtended(abc.ABC):
    """The less common half of a strategy's API (tf.distribute.StrategyExtended).

    Args:
        strategy: the strategy this is the extended half of.
    """

    # The cross-worker runtime of a synchronous multi-worker strategy (``runtime/workers.py``:
    # the cluster, bounded exchanges between workers); None for a strategy of one process.
    runtime: "MultiWorkerRuntime | None" = None

    def __init__(self, strategy: "Strategy"):
        self._container_strategy = strategy

    # -- where a variable lives -----------------------------------------------------
    @abc.abstractmethod
    def place_variable(self, variable: Any) -> "Placement":
        """Where ``variable``, a Keras variable being created in this strategy's scope, lives.

        Asked once per variable, when it is created (its name, shape, dtype,
        ``synchronization``, ``aggregation`` and ``trainable`` are set; its value
        not yet). The answer (``placement.py``) gives the variable's storage (its
        sharding), what a read in cross-replica context returns, and how it enters
        and leaves a compiled step: replicated on every replica (TF's
        MirroredVariable), one copy per replica (SyncOnRead), on a parameter
        server. It is the one place that decides this; Keras is patched to ask it
        (``keras_support/patches.py``).

        Raises:
            ValueError: a ``synchronization`` / ``aggregation`` this strategy refuses.
        """

    def variable_created_in_scope(self, v: Any) -> bool:
        """True when Keras variable ``v`` was created inside this strategy's scope (TF: same name)."""
        return getattr(v, "_distribute_strategy", None) is self._container_strategy

    # -- public, as TF --------------------------------------------------------------
    @property
    def worker_devices(self) -> tuple[str, ...]:
        """This worker's devices, as strings (TF: worker_devices)."""
        return ()

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Devices that hold variables."""
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
        """Whether this worker should initialize variables."""
        return True

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Places new variables with ``colocate_with_variable``.

        Here it changes nothing (every variable is placed by ``place_variable``);
        it exists so TF code runs unchanged. ParameterServerStrategy places them on
        that variable's ps.
        """
        yield

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any = None, options: Any = None) -> Any:
        """Reduces ``value`` across replicas to ``destinations`` (TF: reduce_to).

        Shapes: per-replica ``s`` -> ``s``. Here: ``strategy.reduce(op, value,
        axis=None)``, a plain array; a mesh strategy gives a Mirrored value for
        distributed destinations (``mesh_strategy.py``).

        Raises:
            ValueError: unknown op, or SUM of a non-distributed value with more than one replica.
        """
        return self._container_strategy.reduce(reduce_op, value, axis=None)

    def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence, options: Any = None) -> list:
        """``reduce_to`` of each ``(value, destinations)`` pair."""
        return [self.reduce_to(reduce_op, value, destinations, options) for value, destinations in value_destination_pairs]

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
        require_cross_replica("extended.update", "update the variable from the replica function with var.assign(...)")
        from distribute import per_copy

        return per_copy.update(self._container_strategy, var, fn, tuple(args), dict(kwargs or {}), group)


def require_cross_replica(what: str, fix: str) -> None:
    """Raises RuntimeError naming ``what`` and ``fix`` inside ``strategy.run`` (replica context)."""
    if _context.current_replica_context() is not None:
        _context.check_cross_replica_call()  # a distribute.function's trace: it runs as Python instead
        raise RuntimeError(
            f"{what} may only be called in cross-replica context (outside strategy.run); "
            f"it was called inside the replica function. Inside run, {fix} instead."
        )
