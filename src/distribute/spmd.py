"""The one compile path of run and fit: a replica function as one SPMD program.

``strategy.run`` (``tracing.py``, which first lifts the Keras variables a stateful
function uses) and Keras fit/evaluate/predict (``keras_support/trainer.py``, whose
steps take their state explicitly) both build their programs here: the replica
body runs inside the replica context of the SPMD program, goes through
``jax.shard_map`` over the strategy's mesh (axis ``"replica"``) and ``jax.jit``,
with the state's old buffers donated.  Uneven steps, which cannot be one SPMD
program, go through ``uneven.run_replicas`` in both.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from distribute.replica import ReplicaContext
from distribute.sharding import Sharding, Slices



class RunOptions:
    """Options for ``Strategy.run`` (tf.distribute.RunOptions), accepted for TF code.

    None of them changes anything here: full steps compile with static shapes,
    an uneven step runs each replica on its real rows (``uneven.py``), and XLA
    is always used.

    Args:
        experimental_enable_dynamic_batch_size: TF (TPU): allow a dynamic batch dim.
        experimental_bucketizing_dynamic_shape: TF (TPU): pad dynamic shapes to buckets.
        experimental_xla_options: TF (TPU): XLA compiler options.
    """

    def __init__(self, experimental_enable_dynamic_batch_size: bool = True, experimental_bucketizing_dynamic_shape: bool = False, experimental_xla_options: Any = None):
        self.experimental_enable_dynamic_batch_size = experimental_enable_dynamic_batch_size
        self.experimental_bucketizing_dynamic_shape = experimental_bucketizing_dynamic_shape
        self.experimental_xla_options = experimental_xla_options

    def __repr__(self) -> str:
        return (f"RunOptions(experimental_enable_dynamic_batch_size={self.experimental_enable_dynamic_batch_size}, "
                f"experimental_bucketizing_dynamic_shape={self.experimental_bucketizing_dynamic_shape})")


def replica_context(strategy: Any, rows: int | None) -> ReplicaContext:
    """The SPMD program's replica context; ``rows``: each replica's rows (equal in a full step).

    It carries the strategy's sharding level and the step's ``sharding.Slices``
    (sharded state: which gathered values are the gathers of which slices).
    """
    global_rows = None if rows is None else rows * strategy.num_replicas_in_sync
    context = ReplicaContext(strategy, in_program=True, rows=rows, global_rows=global_rows)
    context._sharding = getattr(strategy.extended, "sharding", Sharding.NONE)
    context._slices = Slices()
    return context


def compile_program(strategy: Any, body: Callable, in_specs: Any, out_specs: Any, donate_argnums: tuple = ()) -> Any:
    """``jit(shard_map(body))`` over the strategy's mesh: the one place programs are built."""
    mapped = jax.shard_map(body, mesh=strategy.extended.replica_mesh.mesh, in_specs=in_specs, out_specs=out_specs)
    return jax.jit(mapped, donate_argnums=donate_argnums)
