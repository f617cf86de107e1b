"""ReplicaContext: what the replica function sees inside ``strategy.run``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from distribute.values import ReduceOp

if TYPE_CHECKING:  # pragma: no cover
    from distribute.strategy import Strategy

AXIS = "replica"


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

    def __init__(self, strategy: "Strategy", *, in_program: bool, valid_count: Any = None, padded_rows: int | None = None):
        self._strategy = strategy
        self._in_program = in_program
        self._valid_count = valid_count  # this replica's real rows in a padded step (traced int32)
        self._padded_rows = padded_rows  # rows per replica after padding, when this step is padded

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

    @property
    def example_mask(self) -> jax.Array | None:
        """Which rows of this replica's batch are real, in a step whose last batch was padded.

        A ``(per_replica_batch,)`` bool array, or None when the step has no
        padding.  ``compute_average_loss`` and metrics created in scope use it
        already; use it for hand-written reductions over the batch dim.
        """
        if self._valid_count is None:
            return None
        return jnp.arange(self._padded_rows) < self._valid_count

    def _mask_for(self, rows: int) -> jax.Array | None:
        """The example mask if a value with ``rows`` rows is batch-aligned in this step."""
        if self._valid_count is None or rows != self._padded_rows:
            return None
        return self.example_mask

    def _global_valid_count(self) -> jax.Array | None:
        if self._valid_count is None:
            return None
        return lax.psum(self._valid_count, AXIS)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any = None) -> Any:
        """Combines ``value`` across all replicas; every replica gets the result (TF: same name).

        Shapes are unchanged; nested structures are reduced leaf by leaf.  Two
        replicas, SUM of ``replica_id_in_sync_group`` -> 1 on each.

        Raises:
            ValueError: unknown reduce op.
        """
        op = ReduceOp.from_value(reduce_op)
        if not self._in_program or self.num_replicas_in_sync == 1:
            return jax.tree_util.tree_map(jnp.asarray, value)
        reduce = lax.psum if op is ReduceOp.SUM else lax.pmean
        return jax.tree_util.tree_map(lambda v: reduce(jnp.asarray(v), AXIS), value)

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenates every replica's ``value`` along ``axis`` (TF: same name).

        Per-replica ``(b, ...)`` -> ``(num_replicas_in_sync * b, ...)`` for axis 0,
        on every replica, in replica order.
        """
        if not self._in_program or self.num_replicas_in_sync == 1:
            return jax.tree_util.tree_map(jnp.asarray, value)

        def gather(v: Any) -> jax.Array:
            v = jnp.asarray(v)
            if v.ndim == 0:
                raise ValueError("all_gather needs values of rank >= 1; got a scalar. Expand its dims first.")
            return lax.all_gather(v, AXIS, axis=axis % v.ndim, tiled=True)

        return jax.tree_util.tree_map(gather, value)

    def merge_call(self, merge_fn: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Not supported: a compiled SPMD program cannot leave replica context mid-step.

        Raises:
            NotImplementedError: always; use ``all_reduce`` / ``all_gather`` instead.
        """
        raise NotImplementedError(
            "ReplicaContext.merge_call is not supported: the replica function is one "
            "compiled SPMD program. Use all_reduce or all_gather for cross-replica values."
        )

    def __repr__(self) -> str:
        return f"ReplicaContext(strategy={self._strategy!r})"
