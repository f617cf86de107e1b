"""Differentiating a replay's jaxpr as TF's tape would (see ``_replay.py`` for the method).

``differentiate`` is ``tape.gradient``'s work once the replay is made: find the
tape's recorded equations and where each source meets them, then evaluate the
jaxpr under ``jax.vjp``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from distribute._keras import KerasVariable
import distribute.tape._level as _level
import distribute.tape._marks as _marks
import distribute.tape._replay as _replay


@dataclasses.dataclass
class _Plan:
    """Where the tape recorded and where each source enters, by equation index of the replay's jaxpr."""

    recorded: list  # per equation: recorded by the tape
    tag_sources: dict  # tag equation index -> source indices (a recorded read of a source variable)
    watch_sources: dict  # watch marker index -> source indices (tape.watch of a source tensor)
    out_sources: dict  # (equation index, out position) -> source indices (an intermediate source)
    avals: dict  # source index -> the abstract value where it enters (its delta's type)
    connected: list  # per source: the target depends on it through recorded equations
    stopped: dict  # equation index -> positions of inputs whose tangent stops there
    live: list  # per equation: needed for the targets


def differentiate(level: "_level.Level", state: "_level.TapeState", call: int, target: Any, sources: Any,
                  output_gradients: Any, zeros: bool, jacobian: str | None = None) -> Any:
    """The gradients (or Jacobians) of ``target`` with respect to ``sources``, in ``sources``' structure."""
    source_leaves, source_tree = jax.tree_util.tree_flatten(sources, is_leaf=_is_source_leaf)
    target_leaves = jax.tree_util.tree_leaves(target, is_leaf=lambda x: isinstance(x, KerasVariable))
    compiling = getattr(level.context, "_compiling", None)
    with compiling() if compiling is not None else contextlib.nullcontext():
        closed, child = _replay.replay(level, call, state.ordinal)
        jaxpr = closed.jaxpr
        num_targets = len(target_leaves)
        target_vars = jaxpr.outvars[:num_targets]
        tensor_vars = iter(jaxpr.outvars[num_targets:])
        source_vars = [None if isinstance(s, KerasVariable) else next(tensor_vars) for s in source_leaves]
        plan = _plan(jaxpr, child, state.ordinal, source_leaves, source_vars, target_vars)
        wanted = [i for i, ok in enumerate(plan.connected) if ok]
        grads = _evaluate(closed, plan, level, child, wanted, source_leaves, source_vars, target_vars,
                          target_leaves, output_gradients, jacobian)
    out = []
    for i, leaf in enumerate(source_leaves):
        if i in grads:
            out.append(grads[i])
        elif zeros and _is_inexact(leaf):
            shape, dtype = _shape_dtype(leaf)
            out.append(level.prepare(jnp.zeros(_jacobian_shape(target_leaves, shape, jacobian), dtype)))
        else:
            out.append(None)
    return jax.tree_util.tree_unflatten(source_tree, out)


def _is_source_leaf(x: Any) -> bool:
    return isinstance(x, KerasVariable) or x is None


def _shape_dtype(leaf: Any) -> tuple:
    if isinstance(leaf, KerasVariable):
        return tuple(leaf.shape), jnp.dtype(leaf.dtype)
    return tuple(jnp.shape(leaf)), jnp.result_type(leaf)


def _is_inexact(leaf: Any) -> bool:
    return jnp.issubdtype(_shape_dtype(leaf)[1], jnp.inexact)


def _jacobian_shape(target_leaves: list, shape: tuple, jacobian: str | None) -> tuple:
    if jacobian is None:
        return shape
    target_shape = tuple(jnp.shape(target_leaves[0]))
    return (*target_shape, *shape) if jacobian == "full" else (*target_shape, *shape[1:])


def _plan(jaxpr: Any, child: "_level.Level", ordinal: int, source_leaves: list, source_vars: list,
          target_vars: list) -> _Plan:
    eqns = jaxpr.eqns
    recorded = _recorded(eqns, ordinal)
    by_variable: dict = {}
    for i, s in enumerate(source_leaves):
        if isinstance(s, KerasVariable) and _is_inexact(s):
            by_variable.setdefault(id(s), []).append(i)
    tensor_sources: dict = {}
    for i, v in enumerate(source_vars):
        if isinstance(v, jax_core.Var) and _is_inexact(source_leaves[i]):
            tensor_sources.setdefault(v, []).append(i)
    tag_sources, watch_sources, out_sources, avals = {}, {}, {}, {}
    entered: set = set()  # tensor sources injected already
    bits: dict = {}  # var -> bit mask of the sources whose tangents it carries
    roots: dict = {}  # var -> on the tape (depends on what the tape watches)
    stopped: dict = {}

    def mask(atom: Any) -> int:
        return 0 if isinstance(atom, jax_core.Literal) else bits.get(atom, 0)

    def enter(sources: list, var: Any) -> int:
        for i in sources:
            avals.setdefault(i, var.aval)
        return sum(1 << i for i in sources)

    for index, eqn in enumerate(eqns):
        if eqn.primitive is _marks.tag_p:
            variable, watchers = child.tags[eqn.params["key"]]
            out = eqn.outvars[0]
            mine = recorded[index] and any(o == ordinal for o, _ in watchers)
            roots[out] = mine
            bits[out] = 0
            sources = by_variable.get(id(variable))
            if mine and sources:
                tag_sources[index] = sources
                bits[out] = enter(sources, out)
            if mask(eqn.invars[0]):
                stopped[index] = (0,)  # a read is a fresh value: no gradient through an earlier assign
            continue
        if eqn.primitive is _marks.marker_p:
            var = eqn.invars[0] if eqn.invars else None
            if eqn.params["kind"] == "watch" and eqn.params["tape"] == ordinal and recorded[index] and isinstance(var, jax_core.Var):
                roots[var] = True
                sources = [i for i in tensor_sources.get(var, []) if i not in entered]
                if sources:
                    entered.update(sources)
                    watch_sources[index] = sources
                    bits[var] = bits.get(var, 0) | enter(sources, var)
            continue
        if recorded[index] and eqn.primitive.name != "stop_gradient":  # TF: stop_gradient has no gradient
            carried = 0
            on_tape = False
            for a in eqn.invars:
                if isinstance(a, jax_core.Var) and _inexact_var(a):
                    carried |= bits.get(a, 0)
                    on_tape = on_tape or roots.get(a, False)
            for position, out in enumerate(eqn.outvars):
                if isinstance(out, jax_core.DropVar) or not _inexact_var(out):
                    continue
                bits[out] = carried
                roots[out] = on_tape
                sources = [i for i in tensor_sources.get(out, []) if i not in entered]
                if sources and on_tape:
                    entered.update(sources)
                    out_sources[(index, position)] = sources
                    bits[out] |= enter(sources, out)
        else:
            stops = tuple(p for p, a in enumerate(eqn.invars) if mask(a))
            if stops:
                stopped[index] = stops
    reach = 0
    for var in target_vars:
        reach |= mask(var)
    connected = [bool(reach >> i & 1) for i in range(len(source_leaves))]
    return _Plan(recorded, tag_sources, watch_sources, out_sources, avals, connected, stopped, _live(eqns, target_vars))


def _inexact_var(var: Any) -> bool:
    dtype = getattr(getattr(var, "aval", None), "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _recorded(eqns: list, ordinal: int) -> list:
    """Per equation: whether the tape ``ordinal`` was recording (after its last reset)."""
    recorded = [False] * len(eqns)
    start = None
    intervals: list = []
    for index, eqn in enumerate(eqns):
        if eqn.primitive is not _marks.marker_p or eqn.params["tape"] != ordinal:
            continue
        kind = eqn.params["kind"]
        if kind in ("enter", "resume"):
            start = index
        elif kind in ("exit", "stop") and start is not None:
            intervals.append((start, index))
            start = None
        elif kind == "reset":
            intervals = []
            start = index if start is not None else None
    if start is not None:
        intervals.append((start, len(eqns)))
    for begin, end in intervals:
        for index in range(begin, end):
            recorded[index] = True
    return recorded


def _live(eqns: list, target_vars: list) -> list:
    """Per equation: whether the targets need it (the rest of the replay is not evaluated)."""
    needed = {v for v in target_vars if isinstance(v, jax_core.Var)}
    live = [False] * len(eqns)
    for index in range(len(eqns) - 1, -1, -1):
        eqn = eqns[index]
        if eqn.primitive is _marks.marker_p:
            live[index] = True
            continue
        if any(not isinstance(o, jax_core.DropVar) and o in needed for o in eqn.outvars):
            live[index] = True
            needed.update(a for a in eqn.invars if isinstance(a, jax_core.Var))
    return live


def _evaluate(closed: Any, plan: _Plan, level: "_level.Level", child: "_level.Level", wanted: list,
              source_leaves: list, source_vars: list, target_vars: list, target_leaves: list,
              output_gradients: Any, jacobian: str | None) -> dict:
    """The gradients of the connected sources (by source index), by ``jax.vjp`` of the replay's jaxpr."""
    if not wanted:
        return {}
    jaxpr = closed.jaxpr
    position = {source: k for k, source in enumerate(wanted)}
    inexact_targets = [k for k, var in enumerate(target_vars) if _inexact_var(var) or (
        isinstance(var, jax_core.Literal) and jnp.issubdtype(jnp.result_type(var.val), jnp.inexact))]
    if not inexact_targets:
        return {}
    substitutes = level.values  # the asking level's values of the replay's events (same numbering)

    def entering(value: Any, sources: list, deltas: list) -> Any:
        """``value`` where ``sources`` enter: their deltas' tangents join its tangent."""
        chosen = [deltas[position[i]] for i in sources if i in position]
        if not chosen:
            return value
        delta = chosen[0]
        for d in chosen[1:]:
            delta = delta + d
        return _marks._inject(value, delta)

    def evaluate(deltas: list) -> list:
        env: dict = dict(zip(jaxpr.constvars, closed.consts))
        injected: set = set()

        def read(atom: Any) -> Any:
            return atom.val if isinstance(atom, jax_core.Literal) else env[atom]

        for index, eqn in enumerate(jaxpr.eqns):
            if not plan.live[index]:
                continue
            if eqn.primitive is _marks.tag_p:
                key = eqn.params["key"]
                out = eqn.outvars[0]
                if key in substitutes:
                    value = _like(level, substitutes[key], out.aval)
                else:
                    value = read(eqn.invars[0])
                    if index in plan.stopped:
                        value = _marks._fresh(value)
                env[out] = entering(value, plan.tag_sources.get(index, ()), deltas)
                continue
            if eqn.primitive is _marks.marker_p:
                var = eqn.invars[0] if eqn.invars else None
                if eqn.params["kind"] == "watch" and isinstance(var, jax_core.Var) and var in env:
                    key = eqn.params["key"]
                    if key in substitutes and var not in injected:  # (keep a delta injected earlier)
                        env[var] = _like(level, substitutes[key], var.aval)
                    if index in plan.watch_sources:
                        env[var] = entering(env[var], plan.watch_sources[index], deltas)
                        injected.add(var)
                continue
            values = [read(a) for a in eqn.invars]
            for p in plan.stopped.get(index, ()):
                values[p] = _marks._fresh(values[p])
            params = eqn.primitive.get_bind_params(eqn.params)
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*values, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
            for p, (var, value) in enumerate(zip(eqn.outvars, outs)):
                if not isinstance(var, jax_core.DropVar):
                    env[var] = entering(value, plan.out_sources.get((index, p), ()), deltas)
        return [level.prepare(jnp.asarray(read(target_vars[k]))) for k in inexact_targets]

    primals = []
    for source in wanted:
        shape, dtype = _shape_dtype(source_leaves[source])
        aval = plan.avals[source]
        primals.append(_like(level, jnp.zeros(aval.shape, aval.dtype), aval))
    outputs, pullback = jax.vjp(evaluate, primals)
    cotangents = _cotangents(level, outputs, output_gradients, inexact_targets, len(target_leaves))
    if jacobian is None:
        (grads,) = pullback(cotangents)
    else:
        grads = _jacobian(level, pullback, outputs, jacobian)
    return {source: g for source, g in zip(wanted, grads)}


def _varying(aval: Any) -> bool:
    mat = getattr(aval, "mat", None)
    return bool(getattr(mat, "varying", None) or getattr(aval, "vma", None))


def _like(level: "_level.Level", value: Any, aval: Any) -> Any:
    """``value`` typed as ``aval`` is (per-replica when it is)."""
    return level.prepare(value) if _varying(aval) else value


def _cotangents(level: "_level.Level", outputs: list, output_gradients: Any, inexact_targets: list, num_targets: int) -> list:
    if output_gradients is None:
        return [jnp.ones_like(o) for o in outputs]
    given = jax.tree_util.tree_leaves(output_gradients, is_leaf=lambda x: x is None)
    if len(given) != num_targets:
        raise ValueError(
            f"tape.gradient: output_gradients has {len(given)} values for {num_targets} targets; give one "
            "per target (the same structure as target), or None."
        )
    out = []
    for k, o in zip(inexact_targets, outputs):
        g = given[k]
        out.append(jnp.ones_like(o) if g is None else level.prepare(jnp.broadcast_to(jnp.asarray(g, o.dtype), o.shape)))
    return out


def _jacobian(level: "_level.Level", pullback: Any, outputs: list, kind: str) -> list:
    """Jacobians of the single target by one pullback per target element (``jax.vmap``)."""
    (output,) = outputs
    if kind == "full":
        basis = jnp.eye(output.size, dtype=output.dtype).reshape((output.size, *output.shape))
        rows = jax.vmap(lambda c: pullback([c])[0])(level.prepare(basis))
        return [r.reshape((*output.shape, *r.shape[1:])) for r in rows]
    batch, inner = output.shape[0], output.shape[1:]
    size = 1
    for d in inner:
        size *= d
    basis = jnp.broadcast_to(jnp.eye(size, dtype=output.dtype).reshape((size, 1, *inner)), (size, batch, *inner))
    basis = level.prepare(basis)
    rows = jax.vmap(lambda c: pullback([c])[0])(basis)
    # rows: (size, batch, *source_rest) -> (batch, *inner, *source_rest)
    return [jnp.moveaxis(r, 0, 1).reshape((batch, *inner, *r.shape[2:])) for r in rows]
