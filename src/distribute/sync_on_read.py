"""SyncOnRead variables: each replica keeps its own copy; a cross-replica read aggregates.

A Keras variable created in a strategy's scope with ``synchronization="on_read"``
(every Keras metric variable; users' own ones) behaves as TF's
``SyncOnReadVariable``, 2 replicas, ``keras.Variable(1.0, synchronization="on_read",
aggregation="sum")``:

* each replica's copy starts at the initial value (1.0, 1.0): a cross-replica read
  (``var.numpy()``, ``var.value``, ``float(var)``, inside or outside the scope)
  gives their aggregate, 2.0 (``"mean"``: 1.0; ``"only_first_replica"``:
  replica 0's copy), as one device's array (``keras_support/hooks.py``,
  ``_cross_replica_read``): ``var + strategy.reduce(...)`` works, as in TF;
* inside ``strategy.run`` each replica reads and assigns its own copy; after the
  step the cross-replica value is the aggregate of the new copies (replica
  copies 2.0 and 3.0 after ``assign_add(replica_id + 1)``: SUM reads 5.0);
* ``var.assign(6.0)`` in cross-replica context sets every copy to 3.0 for SUM
  (6.0 / replicas, as TF), to 6.0 otherwise; Keras' ``assign_add`` is
  ``assign(var + delta)``, so it follows the same rule (as Keras 3 on TF);
* ``strategy.experimental_local_results(var)`` gives the copies, and
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

from distribute.mesh import AXIS


def tracked(var: Any) -> bool:
    """Whether ``var`` is a SyncOnRead variable with one copy per replica (made in a scope of > 1 replica)."""
    if getattr(var, "synchronization", None) != "on_read":
        return False
    strategy = getattr(var, "_distribute_strategy", None)
    return strategy is not None and strategy.num_replicas_in_sync > 1 and hasattr(strategy.extended, "replica_mesh")


def on_created(var: Any) -> None:
    """Makes a new SyncOnRead variable's cross-replica value the aggregate of its identical copies.

    Raises:
        NotImplementedError: ``aggregation="none"``.
        ValueError: ``synchronization="none"`` in a strategy's scope (TF's message).
    """
    if getattr(var, "synchronization", None) == "none" and getattr(var, "_distribute_strategy", None) is not None:
        raise ValueError(
            "`NONE` variable synchronization mode is not supported with tf.distribute strategy. Please change "
            f"the `synchronization` for variable: {var.name} (distribute: create it with synchronization="
            "'auto', 'on_write' or 'on_read', or outside the strategy's scope)."
        )
    if not tracked(var) or var._value is None:
        return
    if var.aggregation == "none":
        raise NotImplementedError(
            f"Variable '{var.path}' has synchronization='on_read' and aggregation='none': its "
            "replicas' copies have no cross-replica value (TF raises 'Could not convert from "
            "tf.VariableAggregation NONE to tf.distribute.ReduceOp' when it is read). Create it "
            "with aggregation='sum', 'mean' or 'only_first_replica'."
        )
    if var.aggregation == "sum":
        var._value = var._value * jnp.asarray(var._distribute_strategy.num_replicas_in_sync, var._value.dtype)


def copies(var: Any) -> jax.Array:
    """``var``'s per-replica copies, ``(num_replicas_in_sync, *var.shape)`` sharded on ``"replica"``."""
    known = getattr(var, "_distribute_copies", None)
    if known is not None and known[0] is var._value and not known[1].is_deleted():
        return known[1]
    if var._value is None:
        raise ValueError(f"Variable '{var.path}' has no value (it is held by a running Keras fit loop).")
    ext = var._distribute_strategy.extended
    return _split_program(ext.replica_mesh.per_replica_sharding, var.aggregation, len(ext.replica_mesh.devices))(var._value)


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
    from distribute.values import PerReplica

    per_replica = copies(value)
    return PerReplica._from_array(value._distribute_strategy, _snapshot_program(per_replica.sharding)(per_replica))


@functools.lru_cache(maxsize=None)
def _snapshot_program(sharding: Any):
    return jax.jit(jnp.copy, out_shardings=sharding)


# -- the SPMD program (tracing.py) ------------------------------------------------------------
def in_specs(variables: Sequence[Any]) -> list:
    """shard_map specs of the variables' program inputs: copies sharded, others replicated."""
    return [P(AXIS) if tracked(v) else P() for v in variables]


def out_specs(variables: Sequence[Any]) -> list:
    """shard_map specs of the new values: ``(copies, aggregate)`` for tracked variables."""
    return [(P(AXIS), P()) if tracked(v) else P() for v in variables]


def program_input(var: Any, place: Any) -> Any:
    """The program input of ``var``: its copies, or ``place(var._value)`` (replicated)."""
    return copies(var) if tracked(var) else place(var._value)


def replica_value(var: Any, block: Any) -> Any:
    """What the replica reads from its input block: its own copy (``block[0]``), or the value."""
    return block[0] if tracked(var) else block


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


def combine_all(context: Any, variables: Sequence[Any], new: Sequence[Any], old: Sequence[Any], plain: frozenset = frozenset(),
                updates: frozenset = frozenset()) -> list:
    """Every assigned variable's result: ``(copy, aggregate)`` for tracked ones, else ``context._combine_all``.

    ``new`` / ``old``: this replica's values (its copy for tracked variables).
    """
    new = [jnp.asarray(n, dtype=o.dtype) for n, o in zip(new, old)]
    is_tracked = [tracked(v) for v in variables]
    mine = [i for i, t in enumerate(is_tracked) if t]
    rest = [i for i, t in enumerate(is_tracked) if not t]
    out: list = [None] * len(variables)
    combined = context._combine_all([variables[i] for i in rest], [new[i] for i in rest], [old[i] for i in rest], plain, updates) if rest else []
    for i, value in zip(rest, combined):
        out[i] = value
    aggregates = aggregate(context, [variables[i] for i in mine], [new[i] for i in mine])
    for i, value in zip(mine, aggregates):
        out[i] = (new[i], value)
    return out
