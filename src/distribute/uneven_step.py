"""``strategy.run`` on uneven input: every replica runs on its real rows only (no padding).

The replica function, with the Keras variables it uses lifted into inputs and
outputs (the step's discovery, ``tracing._compile``, found them), goes through
``uneven.run_step``: on every worker compiled once per replica shape and cut at
its collectives, or, where it cannot be traced (an ``all_gather``, a Python
branch on a value, a variable the discovery did not see), eagerly in one
thread per replica under a ``LiftingScope``.  The assigned variables are
combined in the step (as the SPMD program does) and written back here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from distribute import _context, _invocation, collectives, lifting, placement, uneven
from distribute.values import PerReplica


def run(strategy, fn, treedef, kinds, dynamic, statics, key, lengths, program) -> Any:
    """The exact uneven step (see ``uneven.py``): every replica on its real rows.

    Also runs a step that cannot be one SPMD program (``lengths`` None): every
    replica's rows are then equal.  ``program`` is the step's discovery
    (``tracing._compile``): the variables it reads and writes.
    """
    mesh = strategy.extended.replica_mesh
    # Each replica's block of the inputs, as stored (a per-replica input padded to the full share: the
    # replica's program cuts its real rows, so that placing the inputs dispatches nothing).
    blocks = [_local_blocks(d, strategy) for d in dynamic]
    known = program.read_vars + program.write_vars
    for v in known:
        placement.of(v, mesh).prepare_local(v)  # (a split variable spanning workers: gathered once, here)
    inputs = [
        [*(_strongly_typed(lifting.local_value(v, device)) for v in known), *(b[local] for b in blocks)]
        for local, device in enumerate(mesh.local_devices)
    ]
    cuts = [None if not isinstance(d, PerReplica) else ("rows" if d._lengths is not None else "block") for d in dynamic]
    function = _replica_function(fn, treedef, kinds, statics, known, program.write_vars, cuts)
    if lengths is None:
        first = next((d for d, k in zip(dynamic, lifting.dynamic_kinds(kinds)) if k == lifting.SHARDED and d._array.ndim > 1), None)
        rows = None if first is None else [first._array.shape[1]] * strategy.num_replicas_in_sync
    else:
        rows = lengths.tolist()
    results = uneven.run_step(strategy, function, inputs, rows, ("run", key))
    records = [record for _, record in results]
    trees = {str(r["out_tree"]) for r in records}
    if len(trees) > 1:
        raise ValueError(
            f"The replicas returned differently structured values from strategy.run ({sorted(trees)}); "
            "every replica must return the same structure (TF: an AssertionError in regroup)."
        )
    _write_back(strategy, records[0]["written"], [out[0] for out, _ in results])
    return jax.tree_util.tree_unflatten(records[0]["out_tree"], _outputs(strategy, results))


def _local_blocks(value: Any, strategy: Any) -> list:
    """Per local replica, its block of an input leaf on its device: ``(1, rows, ...)`` of a PerReplica, else the value."""
    if isinstance(value, PerReplica):
        by_device = collectives.local_buffers(value._array)
        return [by_device[d] for d in strategy.extended.replica_mesh.local_devices]
    return collectives.local_slices(value, strategy)


def _write_back(strategy: Any, written: list, combined: list) -> None:
    """Sets the written variables' new values from each replica's ``combine`` result (their placements')."""
    mesh = strategy.extended.replica_mesh
    for i, var in enumerate(written):
        placement.of(var, mesh).store_from_replicas(var, strategy, [c[i] for c in combined])


def _outputs(strategy: Any, results: list) -> list:
    """The step's outputs as PerReplica values (or the Python constant every replica returned)."""
    records = [record for _, record in results]
    all_rows = results[0][0][2]
    outputs, arrays = [], [iter(out[1]) for out, _ in results]
    mesh = strategy.extended.replica_mesh
    for j, (kind, static) in enumerate(zip(records[0]["out_kinds"], records[0]["out_statics"])):
        statics_now = [r["out_statics"][j] for r in records]
        if all(r["out_kinds"][j] == lifting.STATIC_OUT for r in records) and all(s == statics_now[0] for s in statics_now):
            outputs.append(static)  # TF's regroup: the same value on every replica is returned as it is
            continue
        # Each replica's output comes as (1, ...) from its program.
        values = [next(a) if r["out_kinds"][j] != lifting.STATIC_OUT else jax.device_put(np.asarray(r["out_statics"][j])[None], device)
                  for a, r, device in zip(arrays, records, mesh.local_devices)]
        rows_out = None if all_rows is None else [int(n) for n in np.asarray(all_rows)[:, j]]
        if rows_out is not None and rows_out[0] < 0:
            rows_out = None
        shapes = {v.shape for v in values}
        if len(shapes) == 1 and (rows_out is None or len(set(rows_out)) == 1):
            array = jax.make_array_from_single_device_arrays((len(mesh.devices), *values[0].shape[1:]), mesh.per_replica_sharding, values)
            outputs.append(PerReplica._from_array(strategy, array, None, _host_sum(strategy, values)))
            continue
        array, lengths_out = collectives.per_replica_from_local(strategy, [v[0] for v in values], rows_out)
        outputs.append(PerReplica._from_array(strategy, array, lengths_out))
    return outputs


def _host_sum(strategy: Any, values: list) -> Any:
    """A small output's sum over the replicas, on this worker's first device (what ``reduce(SUM, axis=None)`` reads)."""
    if jax.process_count() > 1 or values[0].size > lifting.FUSED_REDUCE_MAX_SIZE or not jnp.issubdtype(values[0].dtype, jnp.number):
        return None
    total = np.sum(np.concatenate(jax.device_get(values)), axis=0, dtype=values[0].dtype)
    return jax.device_put(total, strategy.extended.replica_mesh.local_devices[0])


def _replica_function(fn, treedef, kinds, statics, known, write_vars, cuts):
    """``fn`` as ``function(record, *known_values, *input_blocks) -> (combined variables, outputs, output rows)``.

    ``cuts``: per input, how the replica's value is cut from its block: ``"rows"`` (a padded PerReplica:
    the replica's real rows), ``"block"`` (a PerReplica: the block's one row), None (the value itself).
    """
    num_known = len(known)
    multi_process = jax.process_count() > 1

    def function(record: dict, *flat):
        context = _context.current_replica_context()
        eager = context._runs_eagerly
        known_in = flat[:num_known]
        blocks = flat[num_known:]
        dynamic_in = iter(b if cut is None else (b[0, :context._rows] if cut == "rows" else b[0]) for b, cut in zip(blocks, cuts))
        stat = iter(statics)
        leaves = [next(stat) if kind == lifting.STATIC else next(dynamic_in) for kind in kinds]
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        by_id = {id(v): x for v, x in zip(known, known_in)}
        scope = lifting.LiftingScope(dict(by_id), device=context._device if eager else None)
        with scope:
            result = _invocation.call(fn, args, kwargs)
        written = list(write_vars) + [v for v in scope.written.values() if all(w is not v for w in write_vars)]
        if not eager and (scope.missing or any(id(v) not in by_id for v in written)):
            raise uneven.NeedsEager("a variable the discovery did not see")
        old = [by_id[id(v)] if id(v) in by_id else lifting.local_value(v, context._device) for v in written]
        new = [scope.state_mapping[id(v)] if id(v) in scope.written else o for v, o in zip(written, old)]
        places = [placement.of(v, context.strategy.extended.replica_mesh) for v in written]
        combined = placement.combine_all(context, written, places, new, old, frozenset(scope.plain), frozenset(scope.updates))
        out_leaves, record["out_tree"] = jax.tree_util.tree_flatten(result, is_leaf=lifting.is_keras_variable)
        record["written"] = written
        record["out_kinds"] = [lifting.STATIC_OUT if lifting.is_python_constant(x) else lifting.ARRAY_OUT for x in out_leaves]
        record["out_statics"] = [x if lifting.is_python_constant(x) else None for x in out_leaves]
        arrays = [lifting.as_output(x) for x in out_leaves if not lifting.is_python_constant(x)]
        rows = None
        if multi_process and out_leaves:
            # Every replica's dim 0 of each output: the other workers' PerReplica pieces need them.
            dims = [jnp.shape(x)[0] if jnp.ndim(x) else -1 for x in (lifting.as_output(x) for x in out_leaves)]
            rows = context._everyones(jnp.asarray(dims, jnp.int32))
        return combined, [x[None] for x in arrays], rows

    return function


def _strongly_typed(x: Any) -> Any:
    """``x`` without JAX's weak type (a variable's first value may be weakly typed, its later ones not):
    one compiled replica program serves every step."""
    return lax.convert_element_type(x, x.dtype) if getattr(x, "weak_type", False) else x
