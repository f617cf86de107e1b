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

Variables stay replicated.  A ``sum``-aggregated variable (a metric's running
total: TF's sync-on-read SUM) adds every replica's change; any other variable
whose new value differs between replicas (BatchNorm statistics) is combined by
its ``aggregation``: ``mean`` averages,
``only_first_replica`` keeps replica 0's; ``none`` is an error for trainable
variables (as TF's MirroredVariable) and averages non-trainable ones (TF makes
BatchNorm's moving statistics sync-on-read MEAN variables).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.common.variables import Variable as KerasVariable
from keras.src.backend.common.variables import initialize_all_variables

from distribute import _context
from distribute.replica import ReplicaContext
from distribute.values import DistributedValues, Mirrored, PerReplica

AXIS = "replica"
_SHARDED, _REPLICATED, _STATIC = 0, 1, 2
_FUSED_REDUCE_MAX_SIZE = 64  # elements per replica; bigger outputs are reduced on demand


class LiftingScope(StatelessScope):
    """A StatelessScope whose variable values are traced program inputs.

    Reads of variables it does not map are recorded in ``missing`` (and answered
    by the parent scope, if any); assignments are recorded in ``written``.
    """

    def __init__(self, mapping: dict[int, Any], parent: "LiftingScope | None" = None):
        # StatelessScope.__init__ converts values eagerly; ours are tracers already.
        self.collect_losses = False
        self.initialize_variables = False
        self.losses: list = []
        self.state_mapping = dict(mapping)
        self.parent = parent
        self.missing: dict[int, KerasVariable] = {}
        self.written: dict[int, KerasVariable] = {}

    def add_update(self, update: tuple) -> None:
        variable, value = update
        self.state_mapping[id(variable)] = value
        self.written[id(variable)] = variable

    def get_current_value(self, variable: KerasVariable) -> Any:
        value = self.state_mapping.get(id(variable))
        if value is None and self.parent is not None:
            value = self.parent.get_current_value(variable)
        if value is None:
            self.missing[id(variable)] = variable
        return value


@dataclasses.dataclass
class _Program:
    read_vars: list
    write_vars: list
    compiled: Any = None
    out_tree: Any = None
    out_rows: list = dataclasses.field(default_factory=list)
    out_summed: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _TraceRecord:
    missing: dict = dataclasses.field(default_factory=dict)
    written: dict = dataclasses.field(default_factory=dict)
    out_tree: Any = None
    out_rows: list = dataclasses.field(default_factory=list)
    out_summed: list = dataclasses.field(default_factory=list)


def run(strategy: Any, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """Runs ``fn`` on every replica of ``strategy``; see ``Strategy.run``."""
    from distribute.keras_support.hooks import install

    install()
    ext = strategy.extended
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_input_leaf)
    kinds, dynamic, statics, key_parts = [], [], [], []
    lengths, padded_rows = None, None
    for leaf in leaves:
        if isinstance(leaf, PerReplica):
            if leaf._strategy is not strategy:
                raise ValueError(
                    f"strategy.run got a PerReplica value of {leaf._strategy!r}, not of "
                    f"{strategy!r}; distribute the input with this strategy."
                )
            array = leaf._array
            kinds.append(_SHARDED)
            dynamic.append(array)
            key_parts.append((_SHARDED, array.shape, array.dtype))
            if leaf._lengths is not None:
                if lengths is not None and not np.array_equal(lengths, leaf._lengths):
                    raise ValueError(
                        f"strategy.run got padded inputs with different real sizes "
                        f"{lengths.tolist()} and {leaf._lengths.tolist()}; pass inputs from one batch."
                    )
                lengths, padded_rows = leaf._lengths, array.shape[1]
        elif isinstance(leaf, (Mirrored, jax.Array, np.ndarray, np.generic)):
            array = leaf._array if isinstance(leaf, Mirrored) else leaf
            kinds.append(_REPLICATED)
            dynamic.append(array)
            key_parts.append((_REPLICATED, array.shape, array.dtype))
        else:
            kinds.append(_STATIC)
            statics.append(leaf)
            key_parts.append((_STATIC, _static_key(leaf)))
    key = (_function_key(fn), treedef, tuple(key_parts), padded_rows)
    sharded = [d for d, k in zip(dynamic, kinds) if k == _SHARDED]
    replicated = [_place(d, ext._replicated_sharding) for d, k in zip(dynamic, kinds) if k == _REPLICATED]
    valid = None
    if lengths is not None:
        valid = jax.device_put(lengths.astype(np.int32), ext._per_replica_sharding)

    program = ext._compiled.get(key)
    if program is None:
        _warn_on_retracing(ext, fn)
        program = _compile(strategy, fn, treedef, kinds, statics, padded_rows, sharded, replicated, valid)
        ext._compiled[key] = program
    read_vals = [_place(v._value, ext._replicated_sharding) for v in program.read_vars]
    write_vals = [_place(v._value, ext._replicated_sharding) for v in program.write_vars]
    new_vals, outs, sums = program.compiled(read_vals, write_vals, sharded, replicated, valid)
    for var, value in zip(program.write_vars, new_vals):
        var._value = value
    ext._step_dispatched(outs if outs else new_vals)
    sums = iter(sums)
    per_replica = [
        PerReplica._from_array(
            strategy, out, lengths if rows is not None and rows == padded_rows else None, next(sums) if summed else None
        )
        for out, rows, summed in zip(outs, program.out_rows, program.out_summed)
    ]
    return jax.tree_util.tree_unflatten(program.out_tree, per_replica)


def _compile(strategy, fn, treedef, kinds, statics, padded_rows, sharded, replicated, valid) -> _Program:
    known: dict[int, KerasVariable] = {}
    written: dict[int, KerasVariable] = {}
    for _ in range(4):
        read_vars = [v for i, v in known.items() if i not in written]
        write_vars = list(written.values())
        record = _TraceRecord()
        body = _make_body(strategy, fn, treedef, kinds, statics, padded_rows, read_vars, write_vars, record)
        program_fn = _shard_and_jit(strategy, body, len(write_vars))
        read_vals = [_place(v._value, strategy.extended._replicated_sharding) for v in read_vars]
        write_vals = [_place(v._value, strategy.extended._replicated_sharding) for v in write_vars]
        traced = program_fn.trace(read_vals, write_vals, sharded, replicated, valid)
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
            compiled=traced.lower().compile(),
            out_tree=record.out_tree,
            out_rows=record.out_rows,
            out_summed=record.out_summed,
        )
    raise AssertionError("variable discovery did not converge")  # pragma: no cover


def _shard_and_jit(strategy, body: Callable, num_written: int):
    ext = strategy.extended
    mapped = jax.shard_map(
        body,
        mesh=ext._mesh,
        in_specs=(P(), P(), P(AXIS), P(), P(AXIS)),
        out_specs=(P(), P(AXIS), P()),
    )
    return jax.jit(mapped, donate_argnums=(1,))


def _make_body(strategy, fn, treedef, kinds, statics, padded_rows, read_vars, write_vars, record: _TraceRecord):
    def body(read_vals, write_vals, sharded, replicated, valid):
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
        mapping = {id(v): x for v, x in zip(read_vars, read_vals)}
        mapping.update({id(v): x for v, x in zip(write_vars, write_vals)})
        scope = LiftingScope(mapping)
        context = ReplicaContext(
            strategy,
            in_program=True,
            valid_count=None if valid is None else valid[0],
            padded_rows=padded_rows,
        )
        with _context.enter_replica(strategy, context), scope:
            result = fn(*args, **kwargs)
        record.missing = scope.missing
        record.written = scope.written
        new_vals = [
            _combine_replicas(v, scope.state_mapping[id(v)], old) for v, old in zip(write_vars, write_vals)
        ]
        out_leaves, record.out_tree = jax.tree_util.tree_flatten(result, is_leaf=_is_keras_variable)
        out_leaves = [_as_output(x) for x in out_leaves]
        record.out_rows = [x.shape[0] if x.ndim else None for x in out_leaves]
        # Small outputs (a step's loss) are also summed over replicas here, in the
        # step's own program: the strategy.reduce(SUM/MEAN, ..., axis=None) that
        # nearly every loop does after each step then dispatches nothing.
        record.out_summed = [
            x.size <= _FUSED_REDUCE_MAX_SIZE and jnp.issubdtype(x.dtype, jnp.number) and (padded_rows is None or rows != padded_rows)
            for x, rows in zip(out_leaves, record.out_rows)
        ]
        sums = [lax.psum(x, AXIS) for x, summed in zip(out_leaves, record.out_summed) if summed]
        return new_vals, [x[None] for x in out_leaves], sums

    return body


def _combine_replicas(var: KerasVariable, new: Any, old: Any) -> Any:
    """Makes a variable's new value identical on every replica, by its aggregation."""
    new = jnp.asarray(new, dtype=old.dtype)
    aggregation = var.aggregation
    if aggregation == "sum":
        # Sync-on-read SUM (metrics): every replica's change counts, even identical ones.
        return old + lax.psum(new - old, AXIS)
    if AXIS not in _varying_axes(new):
        return new
    if lax.axis_size(AXIS) == 1:
        return lax.psum(new, AXIS)  # one replica: its value is the value
    if aggregation == "none" and not var.trainable:
        aggregation = "mean"
    if aggregation == "mean":
        return lax.pmean(new, AXIS)
    if aggregation == "only_first_replica":
        first = lax.axis_index(AXIS) == 0
        return lax.psum(jnp.where(first, new, jnp.zeros_like(new)), AXIS)
    raise ValueError(
        f"Variable '{var.path}' was assigned a different value on each replica inside "
        f"strategy.run, and its aggregation is {var.aggregation!r}, so there is no one "
        "value to keep (TF: 'You must specify an aggregation method to update a "
        "MirroredVariable in Replica Context'). Reduce the value first with "
        "get_replica_context().all_reduce(...), or create the variable with "
        "aggregation='sum', 'mean' or 'only_first_replica'."
    )


def _varying_axes(x: Any) -> frozenset:
    """Mesh axes along which ``x`` may differ between replicas (JAX's vma typing)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = aval.mat.varying
    return frozenset(vma)


def to_varying(x: Any) -> Any:
    """Marks ``x`` as possibly different on each replica (so its gradient stays local)."""
    return x if AXIS in _varying_axes(x) else lax.pcast(x, AXIS, to="varying")


def sum_gradients(grads: list) -> list:
    """Sums per-replica gradients across replicas (TF's apply_gradients all-reduce).

    A gradient with respect to a replicated value that JAX's autodiff already
    summed (it is the same on every replica) is left as it is.
    """
    return [g if g is None or AXIS not in _varying_axes(g) else lax.psum(g, AXIS) for g in grads]


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
    from distribute.keras_support.hooks import describe_owner

    for var in variables:
        if not strategy.extended._owns(var):
            where = getattr(var, "_distribute_strategy", None)
            if where is None:
                raise ValueError(
                    f"{describe_owner(var)} was created outside any strategy.scope() and is used "
                    f"with {strategy!r} (strategy.run or model.fit). Create models, optimizers and "
                    "metrics inside the scope: `with strategy.scope(): model = ...; optimizer = ...`."
                )
            raise ValueError(
                f"{describe_owner(var)} belongs to {where!r} (it was created in that scope) and is "
                f"used with {strategy!r}. Use each model, optimizer and metric with the strategy "
                "whose scope created it."
            )


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
