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
from distribute.tape import _level, _replay


@dataclasses.dataclass
class _Plan:
    """Where the tape recorded and where each source enters, by equation index of the replay's jaxpr."""

    recorded: list  # per equation: recorded by the tape
    tag_sources: dict  # tag equation index -> source index (a recorded read of a source variable)
    watch_sources: dict  # watch marker index -> source index (tape.watch of a source tensor)
    out_sources: dict  # (equation index, out position) -> source index (an intermediate source)
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
    by_variable = {id(s): i for i, s in enumerate(source_leaves) if isinstance(s, KerasVariable) and _is_inexact(s)}
    tensor_sources = {v: i for i, v in enumerate(source_vars) if isinstance(v, jax_core.Var) and _is_inexact(source_leaves[i])}
    tag_sources, watch_sources, out_sources = {}, {}, {}
    bits: dict = {}  # var -> bit mask of the sources whose tangents it carries
    roots: dict = {}  # var -> True when on the tape (depends on what the tape watches)
    stopped: dict = {}

    def mask(atom: Any) -> int:
        return 0 if isinstance(atom, jax_core.Literal) else bits.get(atom, 0)

    for index, eqn in enumerate(eqns):
        if eqn.primitive is _replay.tag_p:
            variable, watchers = child.tags[eqn.params["key"]]
            out = eqn.outvars[0]
            mine = recorded[index] and any(o == ordinal for o, _ in watchers)
            roots[out] = mine
            bits[out] = 0
            source = by_variable.get(id(variable))
            if mine and source is not None:
                tag_sources[index] = source
                bits[out] = 1 << source
            if mask(eqn.invars[0]):
                stopped[index] = (0,)  # a read is a fresh value: no gradient through an earlier assign
            continue
        if eqn.primitive is _replay.marker_p:
            if eqn.params["kind"] == "watch" and eqn.params["tape"] == ordinal and recorded[index]:
                var = eqn.invars[0]
                if isinstance(var, jax_core.Var):
                    roots[var] = True
                    source = tensor_sources.get(var)
                    if source is not None and source not in watch_sources.values():
                        watch_sources[index] = source
                        bits[var] = bits.get(var, 0) | (1 << source)
            continue
        inputs = [a for a in eqn.invars if isinstance(a, jax_core.Var)]
        if recorded[index]:
            carried = 0
            on_tape = False
            for a in inputs:
                if _inexact_var(a):
                    carried |= bits.get(a, 0)
                    on_tape = on_tape or roots.get(a, False)
            for position, out in enumerate(eqn.outvars):
                if isinstance(out, jax_core.DropVar) or not _inexact_var(out):
                    continue
                bits[out] = carried
                roots[out] = on_tape
                source = tensor_sources.get(out)
                if source is not None and on_tape and source not in watch_sources.values():
                    out_sources[(index, position)] = source
                    bits[out] |= 1 << source
        else:
            stops = tuple(p for p, a in enumerate(eqn.invars) if mask(a))
            if stops:
                stopped[index] = stops
    reach = 0
    for var in target_vars:
        reach |= mask(var)
    connected = [bool(reach >> i & 1) for i in range(len(source_leaves))]
    return _Plan(recorded, tag_sources, watch_sources, out_sources, connected, stopped, _live(eqns, target_vars))


def _inexact_var(var: Any) -> bool:
    dtype = getattr(getattr(var, "aval", None), "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _recorded(eqns: list, ordinal: int) -> list:
    """Per equation: whether the tape ``ordinal`` was recording (after its last reset)."""
    recorded = [False] * len(eqns)
    start = None
    intervals: list = []
    for index, eqn in enumerate(eqns):
        if eqn.primitive is not _replay.marker_p or eqn.params["tape"] != ordinal:
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
        if eqn.primitive is _replay.marker_p:
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

    def evaluate(deltas: list) -> list:
        env: dict = dict(zip(jaxpr.constvars, closed.consts))

        def read(atom: Any) -> Any:
            return atom.val if isinstance(atom, jax_core.Literal) else env[atom]

        for index, eqn in enumerate(jaxpr.eqns):
            if not plan.live[index]:
                continue
            if eqn.primitive is _replay.tag_p:
                key = eqn.params["key"]
                value = level.prepare(substitutes[key]) if key in substitutes else read(eqn.invars[0])
                if index in plan.stopped and key not in substitutes:
                    value = _replay._fresh(value)
                source = plan.tag_sources.get(index)
                if source is not None and source in position:
                    value = _replay._inject(value, deltas[position[source]])
                env[eqn.outvars[0]] = value
                continue
            if eqn.primitive is _replay.marker_p:
                if eqn.params["kind"] == "watch" and isinstance(eqn.invars[0], jax_core.Var) and eqn.invars[0] in env:
                    var = eqn.invars[0]
                    key = eqn.params["key"]
                    if key in substitutes:
                        env[var] = substitutes[key]
                    source = plan.watch_sources.get(index)
                    if source is not None and source in position:
                        env[var] = _replay._inject(level.prepare(env[var]), deltas[position[source]])
                continue
            values = [read(a) for a in eqn.invars]
            for p in plan.stopped.get(index, ()):
                values[p] = _replay._fresh(values[p])
            params = eqn.primitive.get_bind_params(eqn.params)
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*values, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
            for p, (var, value) in enumerate(zip(eqn.outvars, outs)):
                source = plan.out_sources.get((index, p))
                if source is not None and source in position:
                    value = _replay._inject(level.prepare(value), deltas[position[source]])
                if not isinstance(var, jax_core.DropVar):
                    env[var] = value
        return [level.prepare(jnp.asarray(read(target_vars[k]))) for k in inexact_targets]

    primals = []
    for source in wanted:
        shape, dtype = _shape_dtype(source_leaves[source])
        primals.append(level.prepare(jnp.zeros(shape, dtype)))
    outputs, pullback = jax.vjp(evaluate, primals)
    cotangents = _cotangents(level, outputs, output_gradients, inexact_targets, len(target_leaves))
    if jacobian is None:
        (grads,) = pullback(cotangents)
    else:
        grads = _jacobian(level, pullback, outputs, jacobian)
    return {source: g for source, g in zip(wanted, grads)}


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
        rows = jax.vmap(lambda c: pullback([c])[0])(basis)
        return [r.reshape((*output.shape, *r.shape[1:])) for r in rows]
    batch, inner = output.shape[0], output.shape[1:]
    size = 1
    for d in inner:
        size *= d
    basis = jnp.broadcast_to(jnp.eye(size, dtype=output.dtype).reshape((size, 1, *inner)), (size, batch, *inner))
    rows = jax.vmap(lambda c: pullback([c])[0])(basis)
    # rows: (size, batch, *source_rest) -> (batch, *inner, *source_rest)
    return [jnp.moveaxis(r, 0, 1).reshape((batch, *inner, *r.shape[2:])) for r in rows]
