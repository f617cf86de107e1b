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

Variables stay replicated, except SyncOnRead ones (``sync_on_read.py``): their
per-replica copies go in sharded, each replica reads and assigns its own, and
their cross-replica value is aggregated in the program.  A ``sum``-aggregated variable (a metric's running
total: TF's sync-on-read SUM) adds every replica's change; any other variable
whose new value differs between replicas (BatchNorm statistics) is combined by
its ``aggregation``: ``mean`` averages,
``only_first_replica`` keeps replica 0's; ``none`` is an error for trainable
variables (as TF's MirroredVariable) and averages non-trainable ones (TF makes
BatchNorm's moving statistics sync-on-read MEAN variables).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from distribute.mesh import AXIS
from distribute import _context, collectives, spmd, sync_on_read, uneven
from distribute._keras import KerasVariable, StatelessScope, initialize_all_variables
from distribute.values import DistributedValues, Mirrored, PerReplica

_SHARDED, _REPLICATED, _STATIC = 0, 1, 2
_ARRAY_OUT, _SUMMED_OUT, _STATIC_OUT = 0, 1, 2
_FUSED_REDUCE_MAX_SIZE = 64  # elements per replica; bigger outputs are reduced on demand


class LiftingScope(StatelessScope):
    """A StatelessScope whose variable values are traced program inputs.

    Reads of variables it does not map are recorded in ``missing`` (and answered
    by the parent scope, if any); assignments are recorded in ``written``.
    """

    def __init__(self, mapping: dict[int, Any], parent: "LiftingScope | None" = None, device: Any = None):
        # StatelessScope.__init__ converts values eagerly; ours are tracers already.
        self.collect_losses = False
        self.initialize_variables = False
        self.losses: list = []
        self.state_mapping = dict(mapping)
        self.parent = parent
        self.missing: dict[int, KerasVariable] = {}
        self.written: dict[int, KerasVariable] = {}
        self.device = device  # an uneven step's replica device: unmapped variables read their copy there
        self.plain: set[int] = set()  # variables whose last write was a plain assign (not assign_add/sub)
        self.additive_depth = 0  # > 0 inside assign_add / assign_sub

    def add_update(self, update: tuple) -> None:
        variable, value = update
        self.state_mapping[id(variable)] = value
        self.written[id(variable)] = variable
        if self.additive_depth:
            self.plain.discard(id(variable))
        else:
            self.plain.add(id(variable))

    def get_current_value(self, variable: KerasVariable) -> Any:
        value = self.state_mapping.get(id(variable))
        if value is None and self.parent is not None:
            value = self.parent.get_current_value(variable)
        if value is None and self.device is not None and variable._value is not None:
            value = self.state_mapping[id(variable)] = _local_value(variable, self.device)
        if value is None:
            self.missing[id(variable)] = variable
        return value


@dataclasses.dataclass
class _Program:
    read_vars: list
    write_vars: list
    compiled: Any = None
    out_tree: Any = None
    out_kinds: list = dataclasses.field(default_factory=list)
    out_statics: list = dataclasses.field(default_factory=list)
    per_replica: bool = False  # runs eagerly per replica (uneven.py): fn cannot be one SPMD program


@dataclasses.dataclass
class _TraceRecord:
    missing: dict = dataclasses.field(default_factory=dict)
    written: dict = dataclasses.field(default_factory=dict)
    out_tree: Any = None
    out_kinds: list = dataclasses.field(default_factory=list)
    out_statics: list = dataclasses.field(default_factory=list)


def run(strategy: Any, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """Runs ``fn`` on every replica of ``strategy``; see ``Strategy.run``."""
    from distribute.keras_support.hooks import install

    install()
    ext = strategy.extended
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_input_leaf)
    kinds, dynamic, statics, key_parts = [], [], [], []
    lengths = None
    for leaf in leaves:
        if isinstance(leaf, PerReplica):
            if leaf._strategy is not strategy:
                raise ValueError(
                    f"strategy.run got a PerReplica value of {leaf._strategy!r}, not of "
                    f"{strategy!r}; distribute the input with this strategy."
                )
            array = leaf._array
            kinds.append(_SHARDED)
            dynamic.append(leaf)
            key_parts.append((_SHARDED, array.shape, array.dtype))
            if leaf._lengths is not None:
                if lengths is not None and not np.array_equal(lengths, leaf._lengths):
                    raise ValueError(
                        f"strategy.run got per-replica inputs with different real sizes "
                        f"{lengths.tolist()} and {leaf._lengths.tolist()}; pass inputs from one batch."
                    )
                lengths = leaf._lengths
        elif isinstance(leaf, (Mirrored, jax.Array, np.ndarray, np.generic)):
            array = leaf._array if isinstance(leaf, Mirrored) else leaf
            kinds.append(_REPLICATED)
            dynamic.append(leaf)
            key_parts.append((_REPLICATED, array.shape, array.dtype))
        else:
            kinds.append(_STATIC)
            statics.append(leaf)
            key_parts.append((_STATIC, _static_key(leaf)))
    key = (_function_key(fn), treedef, tuple(key_parts))
    if lengths is not None:
        return _run_uneven(strategy, fn, treedef, kinds, dynamic, statics, key, lengths)
    sharded = [d._array for d, k in zip(dynamic, _dynamic_kinds(kinds)) if k == _SHARDED]
    replicated = [_place(_array_of(d), ext.replica_mesh.replicated_sharding) for d, k in zip(dynamic, _dynamic_kinds(kinds)) if k == _REPLICATED]

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
    read_vals, write_vals = _variable_inputs(ext, program.read_vars), _variable_inputs(ext, program.write_vars)
    new_vals, outs, sums = program.compiled(read_vals, write_vals, sharded, replicated)
    for var, value in zip(program.write_vars, new_vals):
        if sync_on_read.tracked(var):
            sync_on_read.store(var, value[1], value[0])  # SyncOnRead: (copies, aggregate)
        else:
            var._value = value
    ext.record_dispatch(outs if outs else new_vals)
    sums, outs = iter(sums), iter(outs)
    results = [
        static if kind == _STATIC_OUT else PerReplica._from_array(strategy, next(outs), None, next(sums) if kind == _SUMMED_OUT else None)
        for kind, static in zip(program.out_kinds, program.out_statics)
    ]
    return jax.tree_util.tree_unflatten(program.out_tree, results)


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
        # Variables created while tracing (optimizer slots, lazily built layers)
        # were deferred by Keras; give them their values now, outside the trace.
        initialize_all_variables()
        new_known = {**known, **record.missing, **record.written}
        if record.missing or any(i not in written for i in record.written):
            known, written = new_known, {**written, **record.written}
            continue
        check_ownership(strategy, list(known.values()))
        return _Program(
            read_vars=read_vars,
            write_vars=write_vars,
            compiled=traced.lower().compile() if compile_program else None,
            out_tree=record.out_tree,
            out_kinds=record.out_kinds,
            out_statics=record.out_statics,
        )
    raise AssertionError("variable discovery did not converge")  # pragma: no cover


def _shard_and_jit(strategy, body: Callable, read_vars: list, write_vars: list):
    # Variables are replicated, except SyncOnRead ones: their copies, one per replica (sync_on_read.py).
    in_specs = (sync_on_read.in_specs(read_vars), sync_on_read.in_specs(write_vars), P(AXIS), P())
    out_specs = (sync_on_read.out_specs(write_vars), P(AXIS), P())
    return spmd.compile_program(strategy, body, in_specs, out_specs, donate_argnums=(1,))


def _variable_inputs(ext: Any, variables: list) -> list:
    return [sync_on_read.program_input(v, lambda value: _place(value, ext.replica_mesh.replicated_sharding)) for v in variables]


def _make_body(strategy, fn, treedef, kinds, statics, read_vars, write_vars, record: _TraceRecord):
    def body(read_vals, write_vals, sharded, replicated):
        sharded_it, replicated_it, static_it = iter(sharded), iter(replicated), iter(statics)
        leaves = []
        for kind in kinds:
            if kind == _SHARDED:
                leaves.append(next(sharded_it)[0])
            elif kind == _REPLICATED:
                leaves.append(next(replicated_it))
            else:
                leaves.append(next(static_it))
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        mapping = {id(v): sync_on_read.replica_value(v, x) for v, x in zip(read_vars, read_vals)}
        mapping.update({id(v): sync_on_read.replica_value(v, x) for v, x in zip(write_vars, write_vals)})
        scope = LiftingScope(mapping)
        context = spmd.replica_context(strategy, _batch_rows(leaves, kinds))
        with _context.enter_replica(strategy, context), scope:
            result = fn(*args, **kwargs)
        record.missing = scope.missing
        record.written = scope.written
        old_vals = [mapping[id(v)] for v in write_vars]
        new_vals = sync_on_read.combine_all(context, write_vars, [scope.state_mapping[id(v)] for v in write_vars], old_vals, frozenset(scope.plain))
        new_vals = [(n[0][None], n[1]) if isinstance(n, tuple) else n for n in new_vals]
        out_leaves, record.out_tree = jax.tree_util.tree_flatten(result, is_leaf=_is_keras_variable)
        record.out_kinds, record.out_statics, arrays = _classify_outputs(out_leaves)
        # Small outputs (a step's loss) are also summed over replicas here, in the
        # step's own program: the strategy.reduce(SUM/MEAN, ..., axis=None) that
        # nearly every loop does after each step then dispatches nothing.
        sums = [lax.psum(x, AXIS) for x, kind in zip(arrays, [k for k in record.out_kinds if k != _STATIC_OUT]) if kind == _SUMMED_OUT]
        return new_vals, [x[None] for x in arrays], sums

    return body


def _batch_rows(leaves: list, kinds: list) -> int | None:
    """This replica's rows: dim 0 of the first per-replica input (None without one)."""
    for leaf, kind in zip(leaves, kinds):
        if kind == _SHARDED and jnp.ndim(leaf):
            return int(jnp.shape(leaf)[0])
    return None


def _classify_outputs(out_leaves: list) -> tuple[list, list, list]:
    """Python constants pass through (TF's regroup returns them as they are); arrays become PerReplica."""
    kinds, statics, arrays = [], [], []
    for x in out_leaves:
        if _is_python_constant(x):
            kinds.append(_STATIC_OUT)
            statics.append(x)
            continue
        x = _as_output(x)
        small = x.size <= _FUSED_REDUCE_MAX_SIZE and jnp.issubdtype(x.dtype, jnp.number)
        kinds.append(_SUMMED_OUT if small else _ARRAY_OUT)
        statics.append(None)
        arrays.append(x)
    return kinds, statics, arrays


def _is_python_constant(x: Any) -> bool:
    return isinstance(x, (bool, int, float, complex, str, bytes, type(None)))


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
        padded = [d._array for d, k in zip(dynamic, _dynamic_kinds(kinds)) if k == _SHARDED]
        replicated = [_place(_array_of(d), ext.replica_mesh.replicated_sharding) for d, k in zip(dynamic, _dynamic_kinds(kinds)) if k == _REPLICATED]
        program = _compile(strategy, fn, treedef, kinds, statics, padded, replicated, compile_program=False)
        ext.programs[discovery_key] = program
    slices = [collectives.local_slices(d, strategy) for d in dynamic]
    known = program.read_vars + program.write_vars
    multi_process = jax.process_count() > 1

    def body(context: uneven.ThreadedReplicaContext):
        local = context._local
        dynamic_local = [d[local] for d in slices]
        known_vals = [_strongly_typed(_local_value(v, context._device)) for v in known]
        local_program = None if multi_process else _local_program(strategy, fn, treedef, kinds, statics, key, known, program.write_vars, context, known_vals, dynamic_local)
        if context._agree(local_program is not None):
            replica_id = _replica_id_on(context._replica, context._device)
            new_vals, arrays = jax.block_until_ready(local_program.compiled(known_vals, dynamic_local, replica_id))
            written, out_tree, plain = local_program.written, local_program.out_tree, local_program.plain
            arrays = iter(arrays)
            out_leaves = [static if kind == _STATIC_OUT else next(arrays) for kind, static in zip(local_program.out_kinds, local_program.out_statics)]
            by_id = {id(v): x for v, x in zip(known, known_vals)}
            old = [by_id[id(v)] for v in written]
            new = list(new_vals)
        else:
            dyn, stat = iter(dynamic_local), iter(statics)
            leaves = [next(stat) if kind == _STATIC else next(dyn) for kind in kinds]
            args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            scope = LiftingScope({id(v): x for v, x in zip(known, known_vals)}, device=context._device)
            with scope:
                result = fn(*args, **kwargs)
            written = list(program.write_vars) + [v for i, v in scope.written.items() if all(w is not v for w in program.write_vars)]
            old = [_local_value(v, context._device) for v in written]
            new = [scope.state_mapping[id(v)] if id(v) in scope.written else o for v, o in zip(written, old)]
            plain = frozenset(scope.plain)
            out_leaves, out_tree = jax.tree_util.tree_flatten(result, is_leaf=_is_keras_variable)
            out_leaves = [x if _is_python_constant(x) else _as_output(x) for x in out_leaves]
        combined = sync_on_read.combine_all(context, written, new, old, plain)
        rows = None
        if multi_process and out_leaves:
            rows = context._everyones(jnp.asarray([np.shape(x)[0] if np.ndim(x) else -1 for x in out_leaves], jnp.int32))
        return written, combined, out_tree, out_leaves, rows

    if lengths is None:
        first = next((d for d, k in zip(dynamic, _dynamic_kinds(kinds)) if k == _SHARDED and d._array.ndim > 1), None)
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
        if sync_on_read.tracked(var):  # (this replica's copy, the aggregate) from each replica
            copies, _ = collectives.per_replica_from_local(strategy, [r[1][i][0] for r in results])
            sync_on_read.store(var, collectives.replicated_from_local(strategy, [r[1][i][1] for r in results]), copies)
        else:
            var._value = collectives.replicated_from_local(strategy, [r[1][i] for r in results])
    outputs = []
    for j in range(len(results[0][3])):
        values = [r[3][j] for r in results]
        if all(_is_python_constant(v) for v in values) and all(v == values[0] for v in values):
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
        leaves = [next(stat) if kind == _STATIC else next(dyn) for kind in kinds]
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        scope = LiftingScope({id(v): x for v, x in zip(known, known_in)})
        with context._tracing_replica_id(replica_id), context._compiling(), scope:
            result = fn(*args, **kwargs)
        written = list(write_vars) + [v for i, v in scope.written.items() if all(w is not v for w in write_vars)]
        by_id = {id(v): x for v, x in zip(known, known_in)}
        if scope.missing or any(id(v) not in by_id for v in written):
            raise uneven.NeedsEager("a variable the discovery did not see")
        out_leaves, record["out_tree"] = jax.tree_util.tree_flatten(result, is_leaf=_is_keras_variable)
        record["written"], record["plain"] = written, frozenset(scope.plain)
        record["out_kinds"] = [_STATIC_OUT if _is_python_constant(x) else _ARRAY_OUT for x in out_leaves]
        record["out_statics"] = [x if _is_python_constant(x) else None for x in out_leaves]
        new = [scope.state_mapping[id(v)] if id(v) in scope.written else by_id[id(v)] for v in written]
        return [jnp.asarray(n, dtype=v.dtype) for n, v in zip(new, written)], [_as_output(x) for x in out_leaves if not _is_python_constant(x)]

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


def _dynamic_kinds(kinds: list) -> list:
    """The kinds of the array leaves only (``dynamic`` holds no static leaves)."""
    return [k for k in kinds if k != _STATIC]


def _local_value(var: KerasVariable, device: Any) -> Any:
    """Variable ``var``'s copy on ``device`` (its replicated array's shard there; a SyncOnRead one's own copy)."""
    value = var._value
    if sync_on_read.tracked(var):
        return next(s.data[0] for s in sync_on_read.copies(var).addressable_shards if s.device == device)
    if isinstance(value, jax.Array):
        for shard in value.addressable_shards:
            if shard.device == device:
                return shard.data
    return jax.device_put(value, device)


def _array_of(value: Any) -> Any:
    return value._array if isinstance(value, Mirrored) else value


def _as_output(x: Any) -> jax.Array:
    if isinstance(x, KerasVariable):
        x = x.value
    if isinstance(x, DistributedValues):
        raise TypeError("the replica function returned a distributed value; return arrays instead.")
    try:
        return jnp.asarray(x)
    except TypeError as err:
        raise TypeError(
            f"the replica function returned {x!r} of type {type(x).__name__}; strategy.run "
            "returns arrays only (nested in tuples, lists or dicts). Return arrays, or "
            "keep other values outside the replica function."
        ) from err


def check_ownership(strategy, variables: list) -> None:
    """Raises the ValueError of ``keras_support.hooks.ownership_error`` for the first variable not made in ``strategy``'s scope."""
    from distribute.keras_support.hooks import ownership_error

    for var in variables:
        if not strategy.extended._owns(var):
            raise ownership_error(strategy, var)


def _function_key(fn: Callable) -> Any:
    """Cache key of a replica function: the function, or (function, instance) for a bound method.

    ``obj.step`` makes a new bound-method object on every access; keying on it
    would compile every step.
    """
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", None)
    if owner is not None and func is not None:
        return ("method", func, id(owner))
    return fn


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


def _place(value: Any, sharding: Any) -> Any:
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    return jax.device_put(value, sharding)


def _is_input_leaf(x: Any) -> bool:
    return isinstance(x, (DistributedValues, KerasVariable))


def _is_keras_variable(x: Any) -> bool:
    return isinstance(x, KerasVariable)


def _static_key(leaf: Any) -> Any:
    try:
        hash(leaf)
    except TypeError:
        return ("id", id(leaf))
    if isinstance(leaf, KerasVariable):
        return ("id", id(leaf))
    return (type(leaf), leaf)
