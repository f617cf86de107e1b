"""Distributed values: PerReplica, Mirrored, and the reduction ops.

Internal layout (see DESIGN.md, "How run works"):

* a ``PerReplica`` value is one global ``jax.Array`` of shape
  ``(num_replicas_in_sync, *per_replica_shape)`` sharded on the mesh axis
  ``"replica"``: replica ``r`` owns row ``r``.  When the per-replica values are
  slices of a batch that did not divide evenly, every replica is padded to the
  same number of rows and ``lengths[r]`` says how many rows of replica ``r`` are
  real; the padding never leaves this module (``experimental_local_results``,
  ``gather`` and ``reduce`` use only the real rows);
* a ``Mirrored`` value is one replicated ``jax.Array`` of the per-replica shape.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distribute import _context

if TYPE_CHECKING:  # pragma: no cover
    from distribute.strategy import Strategy


class ReduceOp(enum.Enum):
    """How values from several replicas are combined (tf.distribute.ReduceOp).

    ``SUM`` adds the replicas' values; ``MEAN`` divides that sum by the number of
    values combined.  Strings are accepted anywhere a ReduceOp is, in any case:
    ``"sum"``, ``"MEAN"``.
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_value(op: "ReduceOp | str") -> "ReduceOp":
        """Returns ``op`` as a ReduceOp.

        Raises:
            ValueError: ``op`` names no reduction; the message lists the valid ones.
        """
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str) and op.upper() in ReduceOp.__members__:
            return ReduceOp[op.upper()]
        raise ValueError(
            f"Unknown reduce op {op!r}: a reduce op must be ReduceOp.SUM or "
            "ReduceOp.MEAN (or the strings 'SUM' / 'MEAN', any case)."
        )


class DistributedValues:
    """Base class of values that have one component per replica (tf.distribute.DistributedValues).

    ``values`` is the tuple of this worker's components, one per local replica,
    in replica order.
    """

    _strategy: "Strategy"

    @property
    def values(self) -> tuple:
        """This worker's components, one per local replica, padding removed (TF: same name)."""
        return self._local_values()

    def _local_values(self) -> tuple:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self.values))
        return f"{type(self).__name__}:{{\n{body}\n}}"

    @property
    def __jax_array__(self):
        """Refuses, naming the fix, when a JAX transformation (``jax.jit``) or ``jnp.asarray`` gets this value.

        A ValueError: JAX replaces a TypeError raised here by its own generic message.
        """
        raise ValueError(
            f"A {type(self).__name__} value (one value per replica) was passed to a JAX transformation "
            "(jax.jit, vmap, grad) or converted to an array. Decorate a step that takes distributed values "
            "with distribute.function (TF: tf.function) instead of jax.jit: strategy.run inside compiles the "
            "replica function itself. For the components, use strategy.experimental_local_results(value); "
            "for one array, strategy.reduce(...) or strategy.gather(...)."
        )


class PerReplica(DistributedValues):
    """One possibly different value per replica (tf.distribute's PerReplica).

    Built by the input pipeline and by ``strategy.run``; users can also build one
    from a tuple of per-replica values, as in TF::

        v = PerReplica((jnp.array([1., 2.]), jnp.array([3., 4.])))  # 2 replicas

    Inside a strategy's scope it is placed on that strategy's replicas at once.
    Outside any scope it belongs to no strategy yet, as TF's: the strategy it is
    given to (``run``, ``reduce``, ``gather``, ``experimental_local_results``)
    places it.

    Args:
        values: one array per local replica of the strategy, all with the
            same shape except possibly dim 0.

    Raises:
        ValueError: the number of values differs from the number of local
            replicas, or shapes differ beyond dim 0 (when it is placed).
    """

    __slots__ = ("_strategy", "_array", "_lengths", "_cached_local", "_sum")

    def __init__(self, values: Sequence[Any]):
        strategy = _context.scope_strategy()
        values = [np.asarray(v) if not isinstance(v, jax.Array) else v for v in values]
        if strategy is None:
            self._strategy = None
            self._array = None
            self._lengths = None
            self._cached_local = tuple(values)
            self._sum = None
            return
        bound = PerReplica._bind_values(strategy, values)
        for name in PerReplica.__slots__:
            setattr(self, name, getattr(bound, name))

    @classmethod
    def _bind_values(cls, strategy: "Strategy", values: Sequence[Any]) -> "PerReplica":
        """A PerReplica of ``values`` (one per local replica of mesh strategy ``strategy``), placed on its replicas.

        Raises:
            ValueError: the number of values differs from the number of local
                replicas, or shapes differ beyond dim 0.
        """
        values = [np.asarray(v) if not isinstance(v, jax.Array) else v for v in values]
        mesh = strategy.extended.replica_mesh
        if len(values) != len(mesh.local_devices):
            raise ValueError(
                f"PerReplica got {len(values)} values but {strategy!r} has "
                f"{len(mesh.local_devices)} local replicas; give one value per replica."
            )
        array, lengths = stack_padded(values)
        if jax.process_count() > 1:
            array, lengths = _agree_across_workers(strategy, values, array)
        return cls._from_array(strategy, mesh.put_per_replica(array), lengths)

    def _bind(self, strategy: "Strategy") -> "PerReplica":
        """This value (built outside any scope) placed on ``strategy``'s replicas."""
        return self if self._strategy is strategy else PerReplica._bind_values(strategy, self._cached_local)

    @classmethod
    def _from_array(
        cls, strategy: "Strategy", array: jax.Array, lengths: np.ndarray | None = None, sum_: jax.Array | None = None
    ) -> "PerReplica":
        """Wraps a global ``(replicas, ...)`` array; ``sum_`` is its sum over replicas, when known."""
        self = cls.__new__(cls)
        self._strategy = strategy
        self._array = array
        self._lengths = lengths
        self._cached_local = None
        self._sum = sum_
        return self

    def _local_values(self) -> tuple:
        if isinstance(self._array, jax.core.Tracer):
            # Inside a compiled step's merge_call: every replica's value, gathered (merge_call.py).
            ext = self._strategy.extended
            first = ext.replica_mesh.devices.index(ext.replica_mesh.local_devices[0])
            return tuple(self._array[first + i] for i in range(len(ext.replica_mesh.local_devices)))
        if self._cached_local is None:
            ext = self._strategy.extended
            shards = sorted(self._array.addressable_shards, key=lambda s: s.index[0].start or 0)
            out = []
            for shard in shards:
                r = shard.index[0].start or 0
                piece = shard.data[0]
                if self._lengths is not None:
                    piece = piece[: int(self._lengths[r])]
                out.append(piece)
            assert len(out) == len(ext.replica_mesh.local_devices)
            self._cached_local = tuple(out)
        return self._cached_local


class Mirrored(DistributedValues):
    """One value, identical on every replica (tf.distribute's Mirrored).

    Backed by one replicated ``jax.Array``; ``values`` gives its copy on each local
    replica's device (TF: one component per device). Built outside any
    strategy's scope without ``strategy``, it belongs to no strategy until one
    places it (as ``PerReplica``).
    """

    __slots__ = ("_strategy", "_array", "_value")

    def __init__(self, value: Any, strategy: "Strategy | None" = None):
        if isinstance(value, DistributedValues):
            raise TypeError(f"Mirrored expects a plain array, got {type(value).__name__}")
        self._strategy = strategy or _context.scope_strategy()
        self._value = value if self._strategy is None else None  # kept only until a strategy places it
        if self._strategy is None:
            self._array = None
        elif isinstance(value, jax.core.Tracer):
            self._array = value  # inside a step's program (a merge_call's merge_fn): this replica's value
        else:
            self._array = self._strategy.extended.replica_mesh.put_replicated(value)

    def _bind(self, strategy: "Strategy") -> "Mirrored":
        """This value (built outside any scope) placed on ``strategy``'s replicas."""
        return self if self._strategy is strategy else Mirrored(self._value, strategy)

    def _local_values(self) -> tuple:
        if self._strategy is None:
            return (self._value,)
        return self._strategy.extended.replica_mesh.local_copies(self._array)


def stack_padded(values: Sequence[Any]) -> tuple[np.ndarray | jax.Array, np.ndarray | None]:
    """Stacks per-replica values into ``(num_values, *shape)``, padding dim 0.

    Returns the stacked array and, when dim 0 differed, the real row counts.

    Raises:
        ValueError: the values differ in rank or in a dimension other than dim 0.
    """
    shapes = [tuple(v.shape) for v in values]
    if all(s == shapes[0] for s in shapes):
        if all(isinstance(v, np.ndarray) for v in values):
            return np.stack(values), None
        return jnp.stack(values), None
    ranks = {len(s) for s in shapes}
    if len(ranks) != 1 or 0 in ranks or len({s[1:] for s in shapes}) != 1:
        raise ValueError(
            f"Per-replica values have shapes {shapes}: they may differ only in dim 0 "
            "(the batch dim). Make the other dims equal on every replica."
        )
    lengths = np.array([s[0] for s in shapes], dtype=np.int64)
    rows = int(lengths.max())
    padded = [
        np.concatenate([np.asarray(v), np.zeros((rows - v.shape[0], *v.shape[1:]), np.asarray(v).dtype)])
        for v in values
    ]
    return np.stack(padded), lengths


def _agree_across_workers(strategy: "Strategy", values: list, array: Any) -> tuple[Any, np.ndarray | None]:
    """Every worker's per-replica shapes, agreed before any collective: pads dim 0 to the job's widest.

    Returns this worker's stacked values (padded) and every replica's real row
    count in the job (None when all are equal).

    Raises:
        ValueError: on every worker alike, when ranks, dtypes or dims other than
            dim 0 differ between any two replicas of the job.
    """
    local = [[list(np.shape(v)), str(np.result_type(v))] for v in values]
    per_worker = strategy.extended.agree_on_shapes(local, "a PerReplica value's shapes")
    shapes = [tuple(shape) for worker in per_worker for shape, _ in worker]
    dtypes = sorted({dtype for worker in per_worker for _, dtype in worker})
    if len(set(shapes)) == 1 and len(dtypes) == 1:
        return array, None
    if len({len(s) for s in shapes}) != 1 or 0 in {len(s) for s in shapes} or len({s[1:] for s in shapes}) != 1 or len(dtypes) != 1:
        raise ValueError(
            f"Per-replica values have shapes {shapes} and dtypes {dtypes} across the workers: they may differ "
            "only in dim 0 (the batch dim). Make the other dims and the dtype equal on every replica of every worker."
        )
    lengths = np.array([s[0] for s in shapes], dtype=np.int64)
    width = int(lengths.max())
    array = np.asarray(array)
    padded = np.zeros((array.shape[0], width, *array.shape[2:]), array.dtype)
    padded[:, : array.shape[1]] = array
    return padded, lengths


def is_distributed(value: Any) -> bool:
    return isinstance(value, DistributedValues)
