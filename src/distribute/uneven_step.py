"""``strategy.run`` on uneven input: every replica runs on its real rows only (no padding).

One thread per replica (``uneven.run_replicas``).  On one worker each replica's
function is traced once per replica shape (replicas of one shape share the trace,
under a lock) and compiled per device; its collectives are ordered host callbacks
that meet the other replicas' programs (``uneven.py``).  All replicas first agree
whether everyone has a program; otherwise (an ``all_gather``, a Python branch on
a value, a variable the discovery did not see, or several workers) all run
eagerly under a ``LiftingScope``.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax

from distribute import collectives, lifting, placement, uneven
from distribute._keras import initialize_all_variables
from distribute.values import PerReplica


def run(strategy, fn, treedef, kinds, dynamic, statics, key, lengths, program) -> Any:
    """The exact uneven step (see ``uneven.py``): one thread per replica, each on its real rows.

    Also runs a step that cannot be one SPMD program (``lengths`` None): every
    replica's rows are then equal.  ``program`` is the step's discovery (``tracing._compile``):
    the variables it reads and writes.
    """
    slices = [collectives.local_slices(d, strategy) for d in dynamic]
    known = program.read_vars + program.write_vars
    mesh = strategy.extended.replica_mesh
    for v in known:
        placement.of(v, mesh).prepare_local(v)
    multi_process = jax.process_count() > 1

    def body(context: uneven.ThreadedReplicaContext):
        local = context._local
        dynamic_local = [d[local] for d in slices]
        known_vals = [_strongly_typed(lifting.local_value(v, context._device)) for v in known]
        local_program = None if multi_process else _local_program(strategy, fn, treedef, kinds, statics, key, known, program.write_vars, context, known_vals, dynamic_local)
        if context._agree(local_program is not None):
            replica_id = _replica_id_on(context._replica, context._device)
            new_vals, arrays = jax.block_until_ready(local_program.compiled(known_vals, dynamic_local, replica_id))
            written, out_tree, plain = local_program.written, local_program.out_tree, local_program.plain
            updates = local_program.updates
            arrays = iter(arrays)
            out_leaves = [static if kind == lifting.STATIC_OUT else next(arrays) for kind, static in zip(local_program.out_kinds, local_program.out_statics)]
            by_id = {id(v): x for v, x in zip(known, known_vals)}
            old = [by_id[id(v)] for v in written]
            new = list(new_vals)
        else:
            dyn, stat = iter(dynamic_local), iter(statics)
            leaves = [next(stat) if kind == lifting.STATIC else next(dyn) for kind in kinds]
            args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            scope = lifting.LiftingScope({id(v): x for v, x in zip(known, known_vals)}, device=context._device)
            with scope:
                result = fn(*args, **kwargs)
            written = list(program.write_vars) + [v for i, v in scope.written.items() if all(w is not v for w in program.write_vars)]
            old = [lifting.local_value(v, context._device) for v in written]
            new = [scope.state_mapping[id(v)] if id(v) in scope.written else o for v, o in zip(written, old)]
            plain = frozenset(scope.plain)
            updates = frozenset(scope.updates)
            out_leaves, out_tree = jax.tree_util.tree_flatten(result, is_leaf=lifting.is_keras_variable)
            out_leaves = [x if lifting.is_python_constant(x) else lifting.as_output(x) for x in out_leaves]
        combined = placement.combine_all(context, written, [placement.of(v, mesh) for v in written], new, old, plain, updates)
        rows = None
        if multi_process and out_leaves:
            rows = context._everyones(jnp.asarray([np.shape(x)[0] if np.ndim(x) else -1 for x in out_leaves], jnp.int32))
        return written, combined, out_tree, out_leaves, rows

    if lengths is None:
        first = next((d for d, k in zip(dynamic, lifting.dynamic_kinds(kinds)) if k == lifting.SHARDED and d._array.ndim > 1), None)
        rows = None if first is None else [first._array.shape[1]] * strategy.num_replicas_in_sync
    else:
        rows = lengths.tolist()
    results = uneven.run_replicas(strategy, body, rows)
    written, _, out_tree, _, all_rows = results[0]
    trees = {r[2] for r in results}
    if len(trees) > 1:
        raise ValueError(
            f"The replicas returned differently structured values from strategy.run ({sorted(map(str, trees))}); "
            "every replica must return the same structure (TF: an AssertionError in regroup)."
        )
    for i, var in enumerate(written):
        placement.of(var, mesh).store_from_replicas(var, strategy, [r[1][i] for r in results])
    outputs = []
    for j in range(len(results[0][3])):
        values = [r[3][j] for r in results]
        if all(lifting.is_python_constant(v) for v in values) and all(v == values[0] for v in values):
            outputs.append(values[0])  # TF's regroup: the same value on every replica is returned as it is
            continue
        rows = None if all_rows is None else [int(n) for n in np.asarray(all_rows)[:, j]]
        if rows is not None and rows[0] < 0:
            rows = None
        array, lengths_out = collectives.per_replica_from_local(strategy, values, rows)
        outputs.append(PerReplica._from_array(strategy, array, lengths_out))
    return jax.tree_util.tree_unflatten(out_tree, outputs)


@dataclasses.dataclass
class _LocalProgram:
    """One replica's part of an uneven step, compiled for its shapes (replicas of one shape share it)."""

    compiled: Any
    written: list
    plain: frozenset
    updates: frozenset
    out_tree: Any
    out_kinds: list
    out_statics: list


_EAGER = "eager"  # cached in place of a _LocalProgram: this code runs eagerly per replica
_LOCAL_TRACE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _replica_id_on(replica: int, device: Any) -> jax.Array:
    """The int32 replica id on its device, the argument of a replica's compiled program (made once)."""
    return jax.device_put(jnp.asarray(replica, jnp.int32), device)


def _strongly_typed(x: Any) -> Any:
    """``x`` without JAX's weak type (a variable's first value may be weakly typed, its later ones not):
    one compiled replica program serves every step."""
    return lax.convert_element_type(x, x.dtype) if getattr(x, "weak_type", False) else x


def _local_program(strategy, fn, treedef, kinds, statics, key, known, write_vars, context, known_vals, dynamic_local) -> "_LocalProgram | None":
    """Compiles ``fn`` for this replica's real shapes, its collectives as host callbacks (uneven.py).

    Returns None where ``fn`` cannot be one program for a replica: a Python value
    of a traced array, an ``all_gather``, a variable it reads that the step's
    discovery did not see; the replicas then run it eagerly.
    """
    signature = tuple((tuple(np.shape(x)), np.asarray(x).dtype if not isinstance(x, jax.Array) else x.dtype) for x in dynamic_local)
    # Replicas of one shape trace it once (the others wait here) and share the program.
    with _LOCAL_TRACE_LOCK:
        return _trace_local_program(strategy, fn, treedef, kinds, statics, ("uneven-local", key, signature), known, write_vars, context, known_vals, dynamic_local)


def _trace_local_program(strategy, fn, treedef, kinds, statics, cache_key, known, write_vars, context, known_vals, dynamic_local) -> "_LocalProgram | None":
    ext = strategy.extended
    cached = ext.programs.get(cache_key)
    if cached is not None:
        return None if cached is _EAGER else cached
    record: dict = {}

    def local_fn(known_in, dynamic_in, replica_id):
        dyn, stat = iter(dynamic_in), iter(statics)
        leaves = [next(stat) if kind == lifting.STATIC else next(dyn) for kind in kinds]
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        scope = lifting.LiftingScope({id(v): x for v, x in zip(known, known_in)})
        with context._tracing_replica_id(replica_id), context._compiling(), scope:
            result = fn(*args, **kwargs)
        written = list(write_vars) + [v for i, v in scope.written.items() if all(w is not v for w in write_vars)]
        by_id = {id(v): x for v, x in zip(known, known_in)}
        if scope.missing or any(id(v) not in by_id for v in written):
            raise uneven.NeedsEager("a variable the discovery did not see")
        out_leaves, record["out_tree"] = jax.tree_util.tree_flatten(result, is_leaf=lifting.is_keras_variable)
        record["written"], record["plain"] = written, frozenset(scope.plain)
        record["updates"] = frozenset(scope.updates)
        record["out_kinds"] = [lifting.STATIC_OUT if lifting.is_python_constant(x) else lifting.ARRAY_OUT for x in out_leaves]
        record["out_statics"] = [x if lifting.is_python_constant(x) else None for x in out_leaves]
        new = [scope.state_mapping[id(v)] if id(v) in scope.written else by_id[id(v)] for v in written]
        return [jnp.asarray(n, dtype=v.dtype) for n, v in zip(new, written)], [lifting.as_output(x) for x in out_leaves if not lifting.is_python_constant(x)]

    replica_id = _replica_id_on(context._replica, context._device)
    try:
        traced = jax.jit(local_fn).trace(known_vals, dynamic_local, replica_id)
    except Exception:  # noqa: BLE001 - any code the tracer cannot take runs eagerly, as before
        ext.programs[cache_key] = _EAGER
        return None
    finally:
        initialize_all_variables()
    # Traced once per shape; compiled once per device from the traced program (jit's cache).
    flat = jax.jit(jax.extend.core.jaxpr_as_fun(traced.jaxpr))
    num_written = len(record["written"])

    def compiled(known_in, dynamic_in, replica_id):
        outs = flat(*known_in, *dynamic_in, replica_id)
        return outs[:num_written], outs[num_written:]

    program = _LocalProgram(compiled=compiled, **record)
    ext.programs[cache_key] = program
    return program
