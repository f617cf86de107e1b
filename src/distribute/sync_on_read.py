"""SyncOnRead variables: each replica keeps its own copy; a cross-replica read aggregates.

A Keras variable created in a strategy's scope with ``synchronization="on_read"``
(every Keras metric variable; users' own ones) behaves as TF's
``SyncOnReadVariable``, 2 replicas, ``keras.Variable(1.0, synchronization="on_read",
aggregation="sum")``:

* each replica's copy starts at the initial value (1.0, 1.0): a cross-replica read
  (``var.numpy()``, ``var.value``, ``float(var)``, inside or outside the scope)
  gives their aggregate, 2.0 (``"mean"``: 1.0; ``"only_first_replica"``:
  replica 0's copy), as one device's array (``keras_support/variables.py``,
  ``_cross_replica_read``): ``var + strategy.reduce(...)`` works, as in TF;
* inside ``strategy.run`` each replica reads and assigns its own copy; after the
  step the cross-replica value is the aggregate of the new copies (replica
  copies 2.0 and 3.0 after ``assign_add(replica_id + 1)``: SUM reads 5.0);
* ``var.assign(6.0)`` in cross-replica context sets every copy to 3.0 for SUM
  (6.0 / replicas, as TF), to 6.0 otherwise; Keras' ``assign_add`` is
  ``assign(var + delta)``, so it follows the same rule (as Keras 3 on TF);
* ``strategy.experimental_local_results(var)`` gives one object per copy
  (``per_copy.VariableCopy``: reads that copy, ``assign`` sets it alone, as TF's
  component variables), and
  ``strategy.reduce(op, var, axis=None)`` reduces them (TF's SyncOnReadVariable
  is a DistributedValues).

Representation: ``var._value`` holds the cross-replica value (what Keras and
checkpoints read); the copies are a ``(num_replicas_in_sync, *shape)`` array
sharded on the ``"replica"`` axis, recorded beside it after a step
(``var._distribute_copies = (value, copies)``, valid while ``var._value`` is
still that value).  When ``_value`` was written since (a cross-replica assign,
a checkpoint restore, Keras ``fit``'s state sync) the copies are the even split
of the value, which is exactly TF's rule for a cross-replica assign.  One
consequence differs from TF: after ``model.fit`` a metric's copies are the even
split of its total, not each replica's partial count (the total is exact).

``aggregation="none"`` with ``"on_read"`` is refused (TF cannot read such a
variable in cross-replica context either). With one replica nothing changes.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from distribute import collectives
from distribute.mesh import AXIS
from distribute.placement import Replicated
from distribute.values import PerReplica


class SyncOnRead(Replicated):
    """One copy per replica, aggregated on a cross-replica read (TF's SyncOnReadVariable).

    The answer of a mesh strategy of more than one replica to a variable made
    with ``synchronization="on_read"``. ``var._value`` holds the cross-replica
    value, replicated (so ``layout`` and ``read`` are ``Replicated``'s); the
    copies live beside it (see the module docstring).

    Args:
        replica_mesh: the strategy's ``ReplicaMesh``.
    """

    def on_initialized(self, variable: Any) -> None:
        """Makes the new variable's cross-replica value the aggregate of its identical copies.

        Raises:
            NotImplementedError: ``aggregation="none"``.
        """
        if variable._value is None:
            return
        if variable.aggregation == "none":
            raise NotImplementedError(
                f"Variable '{variable.path}' has synchronization='on_read' and aggregation='none': its "
                "replicas' copies have no cross-replica value (TF raises 'Could not convert from "
                "tf.VariableAggregation NONE to tf.distribute.ReduceOp' when it is read). Create it "
                "with aggregation='sum', 'mean' or 'only_first_replica'."
            )
        if variable.aggregation == "sum":
            variable._value = variable._value * jnp.asarray(self.replica_mesh.num_replicas, variable._value.dtype)


    # -- the engine's questions (placement.py) ---------------------------------------------
    def in_spec(self) -> Any:
        """The copies go in sharded: each replica gets its own."""
        return P(AXIS)

    def out_spec(self) -> Any:
        """``(copies, aggregate)``."""
        return (P(AXIS), P())

    def program_input(self, variable: Any) -> Any:
        return copies(variable)

    def replica_value(self, context: Any, block: Any) -> Any:
        """The replica's own copy."""
        return block[0]

    @classmethod
    def combine(cls, context: Any, variables: Sequence[Any], new: Sequence[Any], old: Sequence[Any],
                plain: frozenset = frozenset(), updates: frozenset = frozenset()) -> list:
        """``(this replica's new copy, the cross-replica aggregate)`` of each variable (one all_reduce)."""
        return list(zip(new, aggregate(context, variables, new)))

    def program_output(self, context: Any, combined: Any) -> Any:
        return (combined[0][None], combined[1])

    def store(self, variable: Any, output: Any) -> None:
        store(variable, output[1], output[0])

    def local_value(self, variable: Any, device: Any) -> Any:
        """The copy of the replica on ``device``."""
        return collectives.local_buffers(copies(variable))[device][0]

    def store_from_replicas(self, variable: Any, strategy: Any, combined: list) -> None:
        per_replica, _ = collectives.per_replica_from_local(strategy, [c[0] for c in combined])
        store(variable, collectives.replicated_from_local(strategy, [c[1] for c in combined]), per_replica)


def tracked(var: Any) -> bool:
    """Whether ``var`` is a SyncOnRead variable with one copy per replica (made in a scope of > 1 replica)."""
    return isinstance(getattr(var, "_distribute_placement", None), SyncOnRead)


def copies(var: Any) -> jax.Array:
    """``var``'s per-replica copies, ``(num_replicas_in_sync, *var.shape)`` sharded on ``"replica"``."""
    known = getattr(var, "_distribute_copies", None)
    if known is not None and known[0] is var._value and not known[1].is_deleted():
        return known[1]
    if var._value is None:
        raise ValueError(f"Variable '{var.path}' has no value (it is held by a running Keras fit loop).")
    mesh = var._distribute_placement.replica_mesh
    return _split_program(mesh.per_replica_sharding, var.aggregation, mesh.num_replicas)(var._value)


@functools.lru_cache(maxsize=None)
def _split_program(sharding: Any, aggregation: str, num_replicas: int):
    def split(value):
        if aggregation == "sum":
            value = (value / num_replicas).astype(value.dtype)  # TF: cast(value / replicas)
        return jnp.broadcast_to(value, (num_replicas, *value.shape))

    return jax.jit(split, out_shardings=sharding)


def store(var: Any, value: jax.Array, per_replica: jax.Array) -> None:
    """Sets ``var``'s cross-replica value and the copies it aggregates."""
    var._value = value
    var._distribute_copies = (value, per_replica)


def as_per_replica(value: Any) -> Any:
    """A tracked variable as a PerReplica of a snapshot of its copies; anything else unchanged.

    A snapshot: the next step donates the copies' buffers, and values the user
    holds (``experimental_local_results``) must outlive it.
    """
    if not tracked(value):
        return value
    per_replica = copies(value)
    return PerReplica._from_array(value._distribute_strategy, _snapshot_program(per_replica.sharding)(per_replica))


@functools.lru_cache(maxsize=None)
def _snapshot_program(sharding: Any):
    return jax.jit(jnp.copy, out_shardings=sharding)


def aggregate(context: Any, variables: Sequence[Any], new: Sequence[Any]) -> list:
    """The cross-replica values of tracked variables from every replica's new copy.

    Runs one ``all_reduce`` (so it works in the SPMD program and in an uneven
    step's replica threads): SUM adds the copies, MEAN divides by
    ``num_replicas_in_sync``, ``only_first_replica`` keeps replica 0's.
    """
    if not variables:
        return []
    first = context.replica_id_in_sync_group == 0
    probe = [
        jnp.where(first, n, jnp.zeros_like(n)) if v.aggregation == "only_first_replica" else n
        for v, n in zip(variables, new)
    ]
    totals = context.all_reduce("SUM", probe)
    num = context.num_replicas_in_sync
    return [
        (t / num).astype(t.dtype) if v.aggregation == "mean" else t
        for v, t in zip(variables, totals)
    ]
