"""Traces a scheduled function on the coordinator into programs the workers and ps run.

``schedule(fn, args)`` traces ``fn`` once per input signature (as ``tf.function``
traces once per signature), inside the strategy's scope, under a
:class:`~distribute.keras_support.ps_hooks.PSTraceScope`:

* the **step program** ``(read values, dataset elements, array args) -> (results,
  gradients, deltas, assigned values)`` runs on a worker; every Keras variable
  ``fn`` reads is an input (the worker pulls it from its ps), each ``next()`` on a
  per-worker iterator is an input (the worker feeds its own dataset's element);
* one **apply program** per ``optimizer.apply`` and ps: the optimizer's update of
  the variables that ps holds (and their slots), run by that ps on its current
  values when the gradients arrive, as TF runs the apply ops on the ps; the
  step count it uses (Adam's bias correction, learning-rate schedules) is the one
  the worker's step read, plus the updates before it in the same closure
  (``steps_per_execution``), so packed steps update as unpacked ones.

Both are serialized with ``jax.export``: workers and ps never unpickle user code.
Variables created while tracing (optimizer slots, lazily built layers) are created
then, as TF creates slots at trace time, and retraced with.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distribute import _invocation
from distribute.keras_support.ps_hooks import KerasVariable, PSTraceScope, initialize_all_variables
from distribute.lifting import check_ownership
from distribute.parameter_server.step_plan import StepPlan

ITER, ARRAY, STATIC = 0, 1, 2
_IDS = itertools.count()


@dataclasses.dataclass
class Step:
    plan: StepPlan
    box: list
    out_tree: Any


def spec_at(element_specs: Any, k: int) -> list:
    """The ``[(shape, dtype), ...]`` of element ``k`` of an iterator input (the last known one past the end)."""
    return element_specs[min(k, len(element_specs) - 1)]


class _TracedIterator:
    """Stands for a per-worker iterator while tracing: each ``next()`` is a program input.

    ``element_specs``: the leaves' ``(shape, dtype)`` of each element the program
    reads (a program per signature: a partial batch gets its own program, as
    ``tf.function`` retraces for it); elements past the end take the last one's.
    """

    def __init__(self, treedef: Any, element_specs: list, elements: list):
        self._treedef, self._element_specs, self._elements = treedef, element_specs, elements
        self.count = 0

    def __iter__(self) -> _TracedIterator:
        raise TypeError(
            "A per-worker iterator cannot be looped over (`for batch in iterator`) inside a scheduled "
            "function: the function is compiled once for a fixed number of elements. Call next(iterator) a "
            "fixed number of times per scheduled call (TF's tutorials do), and schedule more calls."
        )

    def __next__(self) -> Any:
        if self.count < len(self._elements):
            leaves = self._elements[self.count]
        else:  # discovered now; an input from the next trace on
            leaves = [jnp.zeros(shape, dtype) for shape, dtype in spec_at(self._element_specs, self.count)]
        self.count += 1
        return jax.tree_util.tree_unflatten(self._treedef, leaves)

    def get_next(self) -> Any:
        return next(self)


class _TracedDataset:
    """Stands for a built per-worker dataset while tracing: ``iter()`` gives a fresh worker iterator each call."""

    def __init__(self, iterator: _TracedIterator):
        self._iterator, self._used = iterator, False

    def __iter__(self) -> _TracedIterator:
        if self._used:
            raise NotImplementedError(
                "iter() was called twice on a per-worker dataset inside one scheduled function; call it once per "
                "call (each call starts a fresh iterator on the worker), or pass iter(per_worker_dataset) instead."
            )
        self._used = True
        return self._iterator


@dataclasses.dataclass
class _Record:
    missing: dict = dataclasses.field(default_factory=dict)
    written: dict = dataclasses.field(default_factory=dict)
    counts: list = dataclasses.field(default_factory=list)
    out_tree: Any = None
    num_results: int = 0
    applies: list = dataclasses.field(default_factory=list)  # (optimizer, variables, grad positions)
    delta_vars: list = dataclasses.field(default_factory=list)
    set_vars: list = dataclasses.field(default_factory=list)


def trace_step(strategy: Any, fn: Callable, treedef: Any, kinds: list, statics: list, arg_avals: list, iter_specs: list,
               datasets: frozenset = frozenset()) -> Step:
    """Traces ``fn`` into a step program and its apply programs; see the module docstring.

    ``iter_specs``: per per-worker iterator argument, ``(resource_id, element treedef,
    element_specs)``; ``element_specs`` lists the ``[(shape, dtype), ...]`` of the
    elements the program reads, in order (one entry: every element alike).
    ``datasets``: the resource ids of the ITER arguments that are built per-worker
    datasets (``PerWorkerDataset.build()``): the function calls ``iter()`` on them once.
    """
    registry = strategy.extended._registry
    known: dict[int, KerasVariable] = {}
    counts = [len(specs) for _, _, specs in iter_specs]  # a guess; the trace below counts the next() calls
    for _ in range(8):
        read_vars = list(known.values())
        record = _Record()
        body = _step_body(strategy, fn, treedef, kinds, statics, iter_specs, counts, read_vars, record, datasets)
        read_avals = [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in read_vars]
        iter_avals = [
            jax.ShapeDtypeStruct(shape, dtype)
            for (_, _, specs), n in zip(iter_specs, counts)
            for k in range(n)
            for shape, dtype in spec_at(specs, k)
        ]
        closed = jax.make_jaxpr(body)(read_avals, iter_avals, arg_avals)
        initialize_all_variables()
        new = {i: v for i, v in {**record.missing, **record.written}.items() if i not in known}
        if new or record.counts != counts:
            known.update(new)
            counts = record.counts
            continue
        check_ownership(strategy, read_vars + list(record.written.values()))
        strategy.extended._flush()
        return _make_step(strategy, registry, fn, closed, record, read_vars, iter_specs, counts,
                          (read_avals, iter_avals, arg_avals))
    raise RuntimeError(
        f"tracing {getattr(fn, '__qualname__', fn)!r} for ClusterCoordinator.schedule did not settle: it keeps "
        "creating variables or calling next() a different number of times. Create variables before scheduling."
    )


def _export(fn, body, *avals):
    """``jax.export`` of ``body`` at ``avals``; a host callback (``jax.debug.print``) is a clear error."""
    try:
        return jax.export.export(jax.jit(body))(*avals)
    except NotImplementedError as err:
        if "host_callbacks" not in str(err):
            raise
        raise NotImplementedError(
            f"{getattr(fn, '__qualname__', fn)!r}, scheduled with ClusterCoordinator.schedule, calls back into "
            "Python (jax.debug.print, jax.debug.callback, jax.pure_callback or io_callback): a scheduled function "
            "goes to the workers as a jax.export program, which cannot carry host callbacks (TF's tf.print runs "
            "on the worker). Return the values instead and print them after RemoteValue.fetch()."
        ) from err


def _step_body(strategy, fn, treedef, kinds, statics, iter_specs, counts, read_vars, record: _Record, datasets=frozenset()):
    def body(read_vals, iter_vals, arg_vals):
        mapping = {id(v): x for v, x in zip(read_vars, read_vals)}
        scope = PSTraceScope(mapping)
        flat_iter = iter(iter_vals)
        iterators = []
        for (rid, el_treedef, specs), n in zip(iter_specs, counts):
            elements = [[next(flat_iter) for _ in spec_at(specs, k)] for k in range(n)]
            iterators.append(_TracedIterator(el_treedef, specs, elements))
        args_in = [_TracedDataset(it) if rid in datasets else it for (rid, _, _), it in zip(iter_specs, iterators)]
        it_iter, arg_iter, static_iter = iter(args_in), iter(arg_vals), iter(statics)
        leaves = [next(it_iter) if k == ITER else next(arg_iter) if k == ARRAY else next(static_iter) for k in kinds]
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        with strategy.scope(), strategy.extended._scheduling(), scope:
            result = _invocation.call(fn, args, kwargs)
        record.missing, record.written = scope.missing, scope.written
        record.counts = [it.count for it in iterators]
        result_leaves, record.out_tree = jax.tree_util.tree_flatten(result, is_leaf=lambda x: isinstance(x, KerasVariable))
        outs = [_as_output(x) for x in result_leaves]
        record.num_results = len(outs)
        for optimizer, variables, grads, iterations in scope.applies:
            # The step count this update sees (the k-th update of a packed closure sees k more).
            step_pos = len(outs) + len(grads)
            record.applies.append((optimizer, variables, list(range(len(outs), step_pos)), step_pos))
            outs.extend(jnp.asarray(g, v.dtype) for g, v in zip(grads, variables))
            outs.append(jnp.asarray(iterations, optimizer._iterations.dtype))
        for i, var in scope.written.items():
            if i in scope.local and i not in scope.deltas:
                continue  # a worker-side copy of an update the ps applies itself
            (record.set_vars if i in scope.plain else record.delta_vars).append(var)
        outs.extend(jnp.asarray(scope.deltas[id(v)], v.dtype) for v in record.delta_vars)
        outs.extend(jnp.asarray(scope.state_mapping[id(v)], v.dtype) for v in record.set_vars)
        return outs

    return body


def _as_output(x: Any) -> Any:
    if isinstance(x, KerasVariable):
        x = x.value
    try:
        return jnp.asarray(x)
    except TypeError as err:
        raise TypeError(
            f"a function scheduled with ClusterCoordinator.schedule returned {x!r} of type "
            f"{type(x).__name__}; it may return arrays only (nested in tuples, lists or dicts)."
        ) from err


def _make_step(strategy, registry, fn, closed, record: _Record, read_vars, iter_specs, counts, avals) -> Step:
    import ray

    from distribute.parameter_server import apply_program, row_step

    index_of = {id(v): k for k, v in enumerate(read_vars)}
    grad_vars = {pos: index_of[id(v)] for _, variables, positions, _ in record.applies
                 for v, pos in zip(variables, positions) if id(v) in index_of}
    analysis = row_step.analyze_step(closed, read_vars, grad_vars, registry)
    rows, row_tables = None, {}
    if analysis is None:
        whole = jax.extend.core.jaxpr_as_fun(closed)
        exported = _export(fn, lambda r, it, a: whole(*r, *it, *a), *avals)
    else:
        exported, rows, row_tables = row_step.build(fn, analysis, registry, read_vars, avals, _export, _IDS)
    program_id = next(_IDS)
    box = [ray.put(exported.serialize())]
    pull: dict[int, set] = {}

    def need(var):
        keys = tuple((s.ps, s.key) for s in registry.entry(var).shards)
        for j, k in keys:
            pull.setdefault(j, set()).add(k)
        return keys

    read = tuple(None if id(v) in row_tables else need(v) for v in read_vars)
    applies = []
    for optimizer, variables, positions, step_pos in record.applies:
        for j in range(registry.num_ps):
            applies.extend(apply_program.programs(registry, optimizer, variables, positions, step_pos, j, need,
                                                  row_tables, _IDS))
    deltas = tuple((record.num_results + _offset(record) + i, _targets(registry, v)) for i, v in enumerate(record.delta_vars))
    base = record.num_results + _offset(record) + len(record.delta_vars)
    sets = tuple((base + i, _targets(registry, v)) for i, v in enumerate(record.set_vars))
    plan = StepPlan(
        program_id=program_id,
        pull={j: tuple(sorted(keys)) for j, keys in pull.items()},
        read=read,
        iterators=tuple(
            (rid, n, tuple([(tuple(s), np.dtype(d).str) for s, d in spec_at(specs, k)] for k in range(n)))
            for (rid, _, specs), n in zip(iter_specs, counts)
        ),
        num_results=record.num_results,
        applies=tuple(applies),
        deltas=deltas,
        sets=sets,
        element_treedefs=tuple(el_treedef for _, el_treedef, _ in iter_specs),
        rows=rows,
    )
    return Step(plan=plan, box=box, out_tree=record.out_tree)


def with_iterators(step: Step, resource_ids: tuple) -> Step:
    """``step``'s programs reading the per-worker iterators ``resource_ids`` instead (one per iterator input, in order).

    A traced program does not depend on which iterator feeds it, only on the
    element signature (as ``tf.function`` keys a per-worker iterator by its
    element spec): a new iterator of the same signature (a second ``fit``, an
    ``iter()`` per epoch) reuses the traced step and apply programs.  The plan
    gets a program id of its own (a worker keeps plans by id); the worker runs
    the program it already compiled for the same box.
    """
    iterators = tuple((rid, *entry[1:]) for rid, entry in zip(resource_ids, step.plan.iterators, strict=True))
    plan = dataclasses.replace(step.plan, program_id=next(_IDS), iterators=iterators)
    return Step(plan=plan, box=step.box, out_tree=step.out_tree)


def _offset(record: _Record) -> int:
    return sum(len(p) + 1 for _, _, p, _ in record.applies)


def _targets(registry, var) -> tuple:
    shards = registry.entry(var).shards
    if len(shards) == 1:
        return ((shards[0].ps, shards[0].key, None, None),)
    return tuple((s.ps, s.key, s.start, s.stop) for s in shards)
