"""Turns a stateful replica function into a pure, compiled SPMD program.

``strategy.run(fn, args)`` works in three steps, the first two once per input
signature:

1. discovery: ``fn`` is traced abstractly (``jax.eval_shape``) under a
   :class:`LiftingScope`, a Keras ``StatelessScope`` that records every Keras
   variable ``fn`` reads or assigns (variables ``fn`` creates, such as an
   optimizer's slots, are created then and initialized right after);
2. compilation: the pure function ``(variables, inputs) -> (new variables,
   outputs)`` goes through ``jax.shard_map`` over the strategy's mesh (axis
   ``"replica"``) and ``jax.jit``; the variables' old buffers are donated;
3. every call: inputs are placed, the compiled program runs, the assigned
   variables get their new values, outputs come back as PerReplica values.

How a variable enters and leaves the program is its placement's answer
(``placement.py``): a replicated variable goes in whole; a SyncOnRead one
(``sync_on_read.py``) as its per-replica copies, each replica reading and
assigning its own, their cross-replica value aggregated in the program; a
sharded one (``sharding.py``) as its slices, gathered for the replica's code and
sliced again when stored.  A ``sum``-aggregated variable (a metric's running
total: TF's sync-on-read SUM) adds every replica's change; any other variable
whose new value differs between replicas (BatchNorm statistics) is combined by
its ``aggregation``: ``mean`` averages,
``only_first_replica`` keeps replica 0's; ``none`` is an error for trainable
variables (as TF's MirroredVariable) and averages non-trainable ones (TF makes
BatchNorm's moving statistics sync-on-read MEAN variables).

The uneven step (a replica's real rows only) is ``uneven_step.py``; the
variable-lifting scope and the input/output classification it shares with
this module are ``lifting.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from distribute.mesh import AXIS
from distribute import _context, _invocation, creation, lifting, placement, spmd, uneven_step
from distribute._keras import KerasVariable, initialize_all_variables
from distribute.values import Mirrored, PerReplica
from distribute.lifting import LiftingScope, check_ownership


@dataclasses.dataclass
class _Program:
    read_vars: list
    write_vars: list
    compiled: Any = None
    out_tree: Any = None
    out_kinds: list = dataclasses.field(default_factory=list)
    out_statics: list = dataclasses.field(default_factory=list)
    per_replica: bool = False  # runs eagerly per replica (uneven.py): fn cannot be one SPMD program
    read_places: list = dataclasses.field(default_factory=list)  # each variable's placement, asked once
    write_places: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _TraceRecord:
    missing: dict = dataclasses.field(default_factory=dict)
    written: dict = dataclasses.field(default_factory=dict)
    out_tree: Any = None
    out_kinds: list = dataclasses.field(default_factory=list)
    out_statics: list = dataclasses.field(default_factory=list)
    created: list = dataclasses.field(default_factory=list)


def run(strategy: Any, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """Runs ``fn`` on every replica of ``strategy``; see ``Strategy.run``."""
    ext = strategy.extended
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=lifting.is_input_leaf)
    kinds, dynamic, statics, key_parts = [], [], [], []
    sharded, replicated = [], []  # the program's per-replica and replicated array inputs
    lengths = None
    for leaf in leaves:
        if isinstance(leaf, PerReplica):
            if leaf._strategy is not strategy:
                leaf = _bound(strategy, leaf)
            array = leaf._array
            kinds.append(lifting.SHARDED)
            dynamic.append(leaf)
            sharded.append(array)
            key_parts.append((lifting.SHARDED, array.shape, array.dtype))
            if leaf._lengths is not None:
                if lengths is not None and not np.array_equal(lengths, leaf._lengths):
                    raise ValueError(
                        f"strategy.run got per-replica inputs with different real sizes "
                        f"{lengths.tolist()} and {leaf._lengths.tolist()}; pass inputs from one batch."
                    )
                lengths = leaf._lengths
        elif isinstance(leaf, (Mirrored, jax.Array, np.ndarray, np.generic)):
            if isinstance(leaf, Mirrored) and leaf._strategy is None:
                leaf = leaf._bind(strategy)
            array = leaf._array if isinstance(leaf, Mirrored) else leaf
            kinds.append(lifting.REPLICATED)
            dynamic.append(leaf)
            replicated.append(array)
            key_parts.append((lifting.REPLICATED, array.shape, array.dtype))
        else:
            kinds.append(lifting.STATIC)
            statics.append(leaf)
            key_parts.append((lifting.STATIC, lifting.static_key(leaf)))
    key = (lifting.function_key(fn), treedef, tuple(key_parts))
    if lengths is not None:
        return _run_uneven(strategy, fn, treedef, kinds, dynamic, statics, key, lengths)
    if replicated:
        replicated = [lifting.place(a, ext.replica_mesh.replicated_sharding) for a in replicated]

    program = ext.programs.get(key)
    if program is None or (program.compiled is None and not program.per_replica):
        _warn_on_retracing(ext, fn)
        try:
            program = _compile(strategy, fn, treedef, kinds, statics, sharded, replicated)
        except (jax.errors.ConcretizationTypeError, TypeError) as err:
            if not isinstance(err, jax.errors.ConcretizationTypeError) and "concrete values" not in str(err):
                raise
            # fn needs concrete per-replica values (a shape from the replica id, a Python
            # branch on a value): it cannot be one SPMD program, so every replica runs it
            # eagerly, as TF's eager MirroredStrategy does.
            initialize_all_variables()
            import warnings

            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            warnings.warn(
                f"strategy.run: {getattr(fn, '__qualname__', fn)!r} cannot be compiled as one program for all "
                f"replicas ({first_line}); it runs eagerly on every replica, as in TF's eager mode, which is "
                "slower. Use jnp.where / lax.cond instead of Python branches on values, and shapes that do "
                "not depend on values or the replica id, to compile it.",
                stacklevel=3,
            )
            program = _Program(read_vars=[], write_vars=[], per_replica=True)
        ext.programs[key] = program
    if program.per_replica:
        return _run_uneven(strategy, fn, treedef, kinds, dynamic, statics, key, None)
    read_vals = [p.program_input(v) for v, p in zip(program.read_vars, program.read_places)]
    write_vals = [p.program_input(v) for v, p in zip(program.write_vars, program.write_places)]
    new_vals, outs, sums, _ = program.compiled(read_vals, write_vals, sharded, replicated)
    for var, p, value in zip(program.write_vars, program.write_places, new_vals):
        p.store(var, value)
    ext.record_dispatch(outs if outs else new_vals)
    sums, outs = iter(sums), iter(outs)
    results = [
        static if kind == lifting.STATIC_OUT else PerReplica._from_array(strategy, next(outs), None, next(sums) if kind == lifting.SUMMED_OUT else None)
        for kind, static in zip(program.out_kinds, program.out_statics)
    ]
    return jax.tree_util.tree_unflatten(program.out_tree, results)


def _bound(strategy: Any, leaf: PerReplica) -> PerReplica:
    """A PerReplica argument as ``strategy``'s: one built outside any scope is placed by it, as TF."""
    if leaf._strategy is None:
        leaf = leaf._bind(strategy)
    if leaf._strategy is not strategy:
        raise ValueError(
            f"strategy.run got a PerReplica value of {leaf._strategy!r}, not of "
            f"{strategy!r}; distribute the input with this strategy."
        )
    return leaf


def _compile(strategy, fn, treedef, kinds, statics, sharded, replicated, compile_program: bool = True) -> _Program:
    """Finds the variables ``fn`` reads and writes (tracing until the set is stable), then compiles.

    With ``compile_program=False`` only the discovery is done (the uneven step
    runs eagerly, but needs the variables ``fn`` creates to exist first).
    """
    known: dict[int, KerasVariable] = {}
    written: dict[int, KerasVariable] = {}
    for _ in range(4):
        read_vars = [v for i, v in known.items() if i not in written]
        write_vars = list(written.values())
        record = _TraceRecord()
        body = _make_body(strategy, fn, treedef, kinds, statics, read_vars, write_vars, record)
        program_fn = _shard_and_jit(strategy, body, read_vars, write_vars)
        read_vals, write_vals = _variable_inputs(strategy.extended, read_vars), _variable_inputs(strategy.extended, write_vars)
        traced = program_fn.trace(read_vals, write_vals, sharded, replicated)
        if record.created:  # variables fn created from traced values (creation.py): their initial values
            creation.compute_initial_values(traced, record.created, (read_vals, write_vals, sharded, replicated))
        # Variables created while tracing (optimizer slots, lazily built layers)
        # were deferred by Keras; give them their values now, outside the trace.
        initialize_all_variables()
        new_known = {**known, **record.missing, **record.written}
        if record.missing or any(i not in written for i in record.written):
            known, written = new_known, {**written, **record.written}
            continue
        check_ownership(strategy, list(known.values()))
        mesh = strategy.extended.replica_mesh
        return _Program(
            read_vars=read_vars,
            write_vars=write_vars,
            read_places=[placement.of(v, mesh) for v in read_vars],
            write_places=[placement.of(v, mesh) for v in write_vars],
            compiled=traced.lower().compile() if compile_program else None,
            out_tree=record.out_tree,
            out_kinds=record.out_kinds,
            out_statics=record.out_statics,
        )
    raise AssertionError("variable discovery did not converge")  # pragma: no cover


def _shard_and_jit(strategy, body: Callable, read_vars: list, write_vars: list):
    # Each variable's specs are its placement's (placement.py).
    mesh = strategy.extended.replica_mesh
    read_places, write_places = [placement.of(v, mesh) for v in read_vars], [placement.of(v, mesh) for v in write_vars]
    in_specs = (placement.in_specs(read_places), placement.in_specs(write_places), P(AXIS), P())
    out_specs = (placement.out_specs(write_places), P(AXIS), P(), P())
    return spmd.compile_program(strategy, body, in_specs, out_specs, donate_argnums=(1,))


def _variable_inputs(ext: Any, variables: list) -> list:
    return [placement.of(v, ext.replica_mesh).program_input(v) for v in variables]


def _make_body(strategy, fn, treedef, kinds, statics, read_vars, write_vars, record: _TraceRecord):
    def body(read_vals, write_vals, sharded, replicated):
        sharded_it, replicated_it, static_it = iter(sharded), iter(replicated), iter(statics)
        leaves = []
        for kind in kinds:
            if kind == lifting.SHARDED:
                leaves.append(next(sharded_it)[0])
            elif kind == lifting.REPLICATED:
                leaves.append(next(replicated_it))
            else:
                leaves.append(next(static_it))
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        context = spmd.replica_context(strategy, _batch_rows(leaves, kinds))
        mesh = strategy.extended.replica_mesh
        read_places, write_places = [placement.of(v, mesh) for v in read_vars], [placement.of(v, mesh) for v in write_vars]
        mapping = {id(v): p.replica_value(context, x) for v, p, x in zip(read_vars, read_places, read_vals)}
        mapping.update({id(v): p.replica_value(context, x) for v, p, x in zip(write_vars, write_places, write_vals)})
        scope = LiftingScope(mapping, placeholders=True)
        scope.creates = True
        with _context.enter_replica(strategy, context), scope:
            result = _invocation.call(fn, args, kwargs)
        record.missing = scope.missing
        record.written = scope.written
        record.created, initial_values = creation.traced_initial_values(scope)
        old_vals = [mapping[id(v)] for v in write_vars]
        new_vals = placement.combine_all(context, write_vars, write_places, [scope.state_mapping[id(v)] for v in write_vars], old_vals, frozenset(scope.plain), frozenset(scope.updates))
        new_vals = [p.program_output(context, n) for p, n in zip(write_places, new_vals)]
        out_leaves, record.out_tree = jax.tree_util.tree_flatten(result, is_leaf=lifting.is_keras_variable)
        record.out_kinds, record.out_statics, arrays = lifting.classify_outputs(out_leaves)
        # Small outputs (a step's loss) are also summed over replicas here, in the
        # step's own program: the strategy.reduce(SUM/MEAN, ..., axis=None) that
        # nearly every loop does after each step then dispatches nothing.
        sums = [lax.psum(x, AXIS) for x, kind in zip(arrays, [k for k in record.out_kinds if k != lifting.STATIC_OUT]) if kind == lifting.SUMMED_OUT]
        return new_vals, [x[None] for x in arrays], sums, initial_values

    return body


def _batch_rows(leaves: list, kinds: list) -> int | None:
    """This replica's rows: dim 0 of the first per-replica input (None without one)."""
    for leaf, kind in zip(leaves, kinds):
        if kind == lifting.SHARDED and jnp.ndim(leaf):
            return int(jnp.shape(leaf)[0])
    return None


def _run_uneven(strategy, fn, treedef, kinds, dynamic, statics, key, lengths) -> Any:
    """The exact uneven step (see ``uneven.py``): one thread per replica, each on its real rows.

    Also runs a step that cannot be one SPMD program (``lengths`` None): every
    replica's rows are then equal.
    """
    ext = strategy.extended
    # The padded input has the full step's shapes: its program knows the variables already.
    discovery_key = ("uneven", *key)
    program = ext.programs.get(key) or ext.programs.get(discovery_key)
    if program is None:
        padded = [d._array for d, k in zip(dynamic, lifting.dynamic_kinds(kinds)) if k == lifting.SHARDED]
        replicated = [lifting.place(lifting.array_of(d), ext.replica_mesh.replicated_sharding) for d, k in zip(dynamic, lifting.dynamic_kinds(kinds)) if k == lifting.REPLICATED]
        program = _compile(strategy, fn, treedef, kinds, statics, padded, replicated, compile_program=False)
        ext.programs[discovery_key] = program
    return uneven_step.run(strategy, fn, treedef, kinds, dynamic, statics, key, lengths, program)


_RETRACE_WARNING_AFTER = 8


def _warn_on_retracing(ext: Any, fn: Callable) -> None:
    """Warns once a replica function's code has been compiled many times (TF warns on retracing)."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    counts = ext.__dict__.setdefault("_compiles_per_code", {})
    counts[code] = counts.get(code, 0) + 1
    if code is not None and counts[code] == _RETRACE_WARNING_AFTER:
        import warnings

        warnings.warn(
            f"strategy.run has compiled {_RETRACE_WARNING_AFTER} programs for "
            f"{getattr(fn, '__qualname__', fn)!r}. Each new function object, input shape or "
            "Python constant compiles again (as tf.function retraces): pass the same function "
            "object each step and keep shapes fixed.",
            stacklevel=4,
        )
