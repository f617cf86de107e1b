"""tf.distribute's cross-device reduction classes, for ``MirroredStrategy(cross_device_ops=...)``.

In TF these choose how MirroredStrategy adds up values across devices (NCCL
all-reduce, a hierarchical copy, or a reduction on one device).  Here XLA's
collectives do every reduction (``psum`` inside the compiled step, an XLA
all-reduce between steps), whatever object is passed: the classes exist so that
TF programs construct and call them unchanged, and their ``reduce`` /
``batch_reduce`` / ``broadcast`` give TF's values (2 replicas, per-replica
``[1, 2]`` and ``[11, 12]``)::

    ops = distribute.NcclAllReduce()
    ops.reduce(distribute.ReduceOp.SUM, per_replica, destinations=per_replica)
    # Mirrored: [12, 14] on each replica
    ops.reduce("MEAN", per_replica, destinations="/cpu:0")   # plain array [6, 7]
    ops.broadcast(jnp.float32(2.0), per_replica)             # Mirrored 2.0
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from distribute import _context
from distribute.values import DistributedValues, Mirrored, ReduceOp


class CrossDeviceOps:
    """Base class of cross-device reductions (tf.distribute.CrossDeviceOps).

    As in TF, the base class implements no reduction: ``reduce`` of a
    distributed value and ``batch_reduce`` raise NotImplementedError; a
    non-distributed value is returned unchanged by ``reduce``.
    """

    def __init__(self) -> None:
        pass

    def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any, options: Any = None) -> Any:
        """Reduces ``per_replica_value`` across replicas to ``destinations`` (TF: CrossDeviceOps.reduce).

        Args:
            reduce_op: ``ReduceOp.SUM`` / ``MEAN`` (or their names).
            per_replica_value: a PerReplica (or Mirrored) value; shapes
                ``s`` per replica -> ``s``.
            destinations: a distributed value (the result is Mirrored on its
                replicas) or a device name (the result is a plain array).
            options: accepted for compatibility (TF's CommunicationOptions).

        Returns:
            Mirrored, or a plain array for a device-name destination; a
            non-distributed ``per_replica_value`` comes back unchanged (as TF).

        Raises:
            ValueError: unknown reduce op.
            NotImplementedError: on the base class, for a distributed value (as TF).
        """
        op = ReduceOp.from_value(reduce_op)
        if not isinstance(per_replica_value, DistributedValues):
            return per_replica_value
        return self.reduce_implementation(op, per_replica_value, destinations, options)

    def batch_reduce(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]], options: Any = None) -> list:
        """``reduce`` of each ``(value, destinations)`` pair (TF: CrossDeviceOps.batch_reduce).

        Raises:
            ValueError: unknown reduce op, or a pair that is not ``(value, destinations)``.
            NotImplementedError: on the base class (as TF).
        """
        op = ReduceOp.from_value(reduce_op)
        pairs = list(value_destination_pairs)
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"batch_reduce: value_destination_pairs must be (value, destinations) pairs; got {pair!r}.")
        return self.batch_reduce_implementation(op, pairs, options)

    def broadcast(self, tensor: Any, destinations: Any) -> Mirrored:
        """``tensor`` copied to every replica of ``destinations``' strategy: a Mirrored value (TF: same name)."""
        return Mirrored(tensor, _strategy_of(destinations))

    # -- TF's names for the parts a subclass implements --------------------------------------
    def reduce_implementation(self, reduce_op: ReduceOp, per_replica_value: Any, destinations: Any, options: Any) -> Any:
        raise NotImplementedError("_reduce method must be implemented in descendants.")

    def batch_reduce_implementation(self, reduce_op: ReduceOp, value_destination_pairs: list, options: Any) -> list:
        raise NotImplementedError("batch_reduce_implementation method must be implemented in descendants.")

    def broadcast_implementation(self, tensor: Any, destinations: Any) -> Mirrored:
        return self.broadcast(tensor, destinations)


class _XlaReduction(CrossDeviceOps):
    """Every concrete TF reduction here: XLA's all-reduce over the strategy's mesh."""

    def reduce_implementation(self, reduce_op: ReduceOp, per_replica_value: Any, destinations: Any, options: Any) -> Any:
        strategy = per_replica_value._strategy or _strategy_of(destinations)
        if strategy is None:
            raise ValueError(
                f"{type(self).__name__}.reduce got a {type(per_replica_value).__name__} built outside any strategy's "
                "scope and destinations of no strategy; build the value inside strategy.scope() (or pass "
                "destinations from the strategy, e.g. a PerReplica of it)."
            )
        reduced = strategy.reduce(reduce_op, per_replica_value, axis=None)
        if isinstance(destinations, (str, jax.Device)):
            return reduced
        return Mirrored(reduced, strategy)

    def batch_reduce_implementation(self, reduce_op: ReduceOp, value_destination_pairs: list, options: Any) -> list:
        return [self.reduce(reduce_op, value, destinations, options) for value, destinations in value_destination_pairs]


class _PackedReduction(_XlaReduction):
    """TF's all-reduce classes that split gradients into ``num_packs`` packs; XLA's all-reduce here.

    Args:
        num_packs: how many packs TF splits gradients into; must be >= 0 (as TF).

    Raises:
        ValueError: ``num_packs < 0`` (TF's message).
    """

    _tf_name = ""

    def __init__(self, num_packs: int = 1) -> None:
        if num_packs < 0:
            raise ValueError(f"{self._tf_name} requires num_packs >= 0, but {num_packs} is specified")
        super().__init__()
        self.num_packs = num_packs


class NcclAllReduce(_PackedReduction):
    """TF's NCCL all-reduce (tf.distribute.NcclAllReduce); here XLA's all-reduce does the work."""

    _tf_name = "NCCL all-reduce"


class HierarchicalCopyAllReduce(_PackedReduction):
    """TF's hierarchical-copy all-reduce (tf.distribute.HierarchicalCopyAllReduce); XLA's all-reduce here."""

    _tf_name = "HierarchicalCopy"


class ReductionToOneDevice(_XlaReduction):
    """TF's reduce-on-one-device-then-broadcast (tf.distribute.ReductionToOneDevice); XLA's all-reduce here.

    Args:
        reduce_to_device: the device TF reduces on; accepted, unused.
        accumulation_fn: TF's summing function (``tf.math.add_n``); accepted, unused.
    """

    def __init__(self, reduce_to_device: Any = None, accumulation_fn: Callable | None = None) -> None:
        super().__init__()
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn


def _strategy_of(destinations: Any) -> Any:
    """The strategy of ``destinations`` (a distributed value), else the one whose scope is active (None: no scope)."""
    if isinstance(destinations, DistributedValues) and destinations._strategy is not None:
        return destinations._strategy
    return _context.scope_strategy()
