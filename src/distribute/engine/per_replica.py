"""The compiled uneven step: each replica's function as programs split at its collectives.

A replica function of an uneven step (every replica on its own rows, so each
replica's shapes differ) is traced once per replica shape to a jaxpr in which
every collective is a marker (``collective_p``, whose abstract evaluation gives
the result's shape).  Calls that contain markers (a user's ``jax.jit``, a
``custom_vjp`` / ``custom_jvp`` forward, ``jax.checkpoint``) are inlined; the flat
jaxpr is cut at the markers into segments, each scheduled as early as its
inputs allow (a collective runs in round ``1 + `` the latest round its inputs
depend on, so independent collectives share a round), and each segment is
compiled per device with ``jax.jit``.  A step then runs segment 0 on every
replica, the round's collectives on the host (``host.py``: numpy on one worker,
a compiled program over the mesh across workers), segment 1, and so on.

No program ever waits on another program or on the host: a collective is made
between programs, never inside one, so there is nothing to deadlock.  The host's
wait for a segment is bounded and names the replica and the segment.

A collective under ``lax.cond`` / ``lax.scan`` / ``lax.while_loop`` or ``vmap``
is a TypeError; code that cannot be traced (an ``all_gather``, whose result
shape depends on the other replicas; a Python branch on a value) raises
:class:`NeedsEager` while tracing and runs eagerly (``threads.py``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.interpreters import batching

from distribute import _context
from distribute.engine.context import UnevenReplicaContext, under_transformation_error
from distribute.engine.host import HostCollectives

# -- the marker ------------------------------------------------------------------------------------
collective_p = core.Primitive("distribute_collective")
collective_p.multiple_results = True


def _marker_impl(*args, **params):
    raise RuntimeError("a collective marker of an uneven step ran outside its per-replica programs (internal error)")


def _marker_abstract_eval(*avals, kind: str, num: int = 0, specs: tuple = ()):
    if kind == "sum":
        return [jax.core.ShapedArray(a.shape, a.dtype) for a in avals]
    if kind == "stack":
        return [jax.core.ShapedArray((num, *a.shape), a.dtype) for a in avals]
    if kind == "combine":  # (new..., old...) -> combined, with the old values' types
        return [jax.core.ShapedArray(a.shape, a.dtype) for a in avals[len(avals) // 2:]]
    raise AssertionError(kind)


def _marker_batching(*args, **params):
    raise under_transformation_error()


collective_p.def_impl(_marker_impl)
collective_p.def_abstract_eval(_marker_abstract_eval)
batching.primitive_batchers[collective_p] = _marker_batching


class NeedsEager(Exception):
    """Raised while tracing a replica's program: this code runs eagerly instead."""


class SegmentingReplicaContext(UnevenReplicaContext):
    """The replica context while a replica's program is traced: every collective becomes a marker."""

    def __init__(self, strategy: Any, rows: int | None, global_rows: int | None):
        super().__init__(strategy, None, rows, global_rows)
        self._replica_id: Any = None

    @property
    def replica_id_in_sync_group(self) -> Any:
        return self._replica_id

    def _mark(self, tree: Any, **params: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return jax.tree_util.tree_unflatten(treedef, collective_p.bind(*[jnp.asarray(x) for x in leaves], **params))

    def _sum_tree(self, tree: Any) -> Any:
        if not jax.tree_util.tree_leaves(tree):
            return tree
        return self._mark(tree, kind="sum")

    def _everyones(self, tree: Any) -> Any:
        return self._mark(tree, kind="stack", num=self.num_replicas_in_sync)

    def _gather_tree(self, tree: Any, axis: int) -> Any:
        raise NeedsEager("all_gather's result shape depends on the other replicas' shapes")

    def merge_call(self, merge_fn: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NeedsEager("merge_call runs merge_fn once, in cross-replica context, with every replica's values")

    def _combine(self, specs: tuple, new: list, old: list) -> list:
        return list(collective_p.bind(*new, *old, kind="combine", specs=specs))


# -- tracing and cutting ------------------------------------------------------------------------------
@dataclasses.dataclass
class Marker:
    """One collective of a replica's program: its kind, parameters, inputs and outputs (flat jaxpr atoms)."""

    kind: str
    params: dict
    inputs: list
    outputs: list
    index: int  # position among the program's collectives

    def signature(self) -> tuple:
        shapes = tuple((tuple(a.aval.shape), str(a.aval.dtype)) for a in self.inputs)
        return (self.kind, tuple(sorted(self.params.items())), shapes)

    def describe(self) -> str:
        return {"sum": "all_reduce", "stack": "exchange", "combine": "variable combination"}[self.kind]


@dataclasses.dataclass
class _Segment:
    run: Callable
    inputs: list
    outputs: list


class Program:
    """One replica shape's traced program: a flat jaxpr, its collectives, and its segments once cut."""

    def __init__(self, closed: Any, out_tree: Any, record: dict):
        self.out_tree = out_tree
        self.record = record
        flat = _Flattener()
        self.invars = [core.Var(v.aval) for v in closed.jaxpr.invars]
        self.outvars = flat.emit(closed.jaxpr, closed.consts, self.invars)
        self.eqns, self.consts = flat.eqns, flat.consts
        self.markers = [
            Marker(e.params["kind"], {k: v for k, v in e.params.items() if k != "kind"}, list(e.invars), list(e.outvars), i)
            for i, e in enumerate(e for e in self.eqns if e.primitive is collective_p)
        ]
        self.rounds = self._earliest_rounds()
        self._signature = [m.signature() for m in self.markers]
        self._cut: dict[tuple, list] = {}

    def signature(self) -> list:
        return self._signature

    def _earliest_rounds(self) -> list[int]:
        """Per collective: 1 + the latest round its inputs depend on (0 for the program's inputs)."""
        level: dict = {}
        rounds, effects = [], 0
        for eqn in self.eqns:
            depth = max([level.get(a, 0) for a in eqn.invars if isinstance(a, core.Var)], default=0)
            if eqn.primitive is collective_p:
                depth += 1
                rounds.append(depth)
            elif eqn.effects:
                depth = effects = max(depth, effects)
            for v in eqn.outvars:
                level[v] = depth
        return rounds

    def segments(self, rounds: Sequence[int]) -> list:
        """The segments (one per round, some empty) for the collectives' ``rounds`` (each >= the earliest)."""
        rounds = tuple(rounds)
        if rounds not in self._cut:
            self._cut[rounds] = self._segments(rounds)
        return self._cut[rounds]

    def _segments(self, rounds: tuple) -> list:
        level: dict = {}
        marker_round = iter(rounds)
        by_round: dict[int, list] = {}
        effects = 0
        for eqn in self.eqns:
            depth = max([level.get(a, 0) for a in eqn.invars if isinstance(a, core.Var)], default=0)
            if eqn.primitive is collective_p:
                depth = next(marker_round)
            else:
                if eqn.effects:
                    depth = effects = max(depth, effects)
                by_round.setdefault(depth, []).append(eqn)
            for v in eqn.outvars:
                level[v] = depth
        num_rounds = max(rounds, default=0)
        # Liveness: a segment's outputs are the values it defines that a later round or the program's
        # outputs use; its inputs are the values it uses that it does not define.
        used_later: set = {a for a in self.outvars if isinstance(a, core.Var)}
        for marker in self.markers:
            used_later.update(a for a in marker.inputs if isinstance(a, core.Var))
        segments: list = [None] * (num_rounds + 1)
        for r in range(num_rounds, -1, -1):
            eqns = by_round.get(r, [])
            defined = {v for e in eqns for v in e.outvars}
            used = {a for e in eqns for a in e.invars if isinstance(a, core.Var)}
            if eqns:
                consts = [v for v in _ordered(used - defined) if v in self.consts]
                inputs = [v for v in _ordered(used - defined) if v not in self.consts]
                outputs = [v for v in _ordered(defined) if v in used_later and not isinstance(v, core.DropVar)]
                effects = frozenset().union(*(e.effects for e in eqns))
                info = core.DebugInfo("an uneven step's program", f"part {r} of a replica function", tuple(f"x{i}" for i in range(len(inputs))),
                                      tuple(f"y{i}" for i in range(len(outputs))))
                jaxpr = core.Jaxpr(consts, inputs, outputs, eqns, effects, info)
                closed = core.ClosedJaxpr(jaxpr, [self.consts[v] for v in consts])
                segments[r] = _Segment(jax.jit(core.jaxpr_as_fun(closed)), inputs, outputs)
            used_later |= used
        return segments


def _ordered(variables: set) -> list:
    return sorted(variables, key=id)


# Calls whose sub-jaxpr is inlined when it contains a collective (the forward of a custom_vjp /
# custom_jvp: the trace already took every derivative it needs).
_INLINED = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
            "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr"}


class _Flattener:
    """Inlines every call that contains a collective marker, renaming its variables (a jaxpr may be inlined twice)."""

    def __init__(self) -> None:
        self.eqns: list = []
        self.consts: dict = {}
        self._marked: dict[int, bool] = {}

    def has_marker(self, jaxpr: Any) -> bool:
        key = id(jaxpr)
        if key not in self._marked:
            self._marked[key] = any(
                eqn.primitive is collective_p or any(self.has_marker(sub) for sub in core.jaxprs_in_params(eqn.params))
                for eqn in jaxpr.eqns
            )
        return self._marked[key]

    def emit(self, jaxpr: Any, consts: Sequence[Any], inputs: Sequence[Any]) -> list:
        env: dict = {}
        for v, value in zip(jaxpr.constvars, consts):
            env[v] = fresh = core.Var(v.aval)
            self.consts[fresh] = value
        env.update(zip(jaxpr.invars, inputs))

        def read(atom: Any) -> Any:
            return atom if isinstance(atom, core.Literal) else env[atom]

        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            if eqn.primitive is not collective_p and any(self.has_marker(s) for s in core.jaxprs_in_params(eqn.params)):
                param = _INLINED.get(eqn.primitive.name)
                if param is None:
                    raise under_transformation_error()
                sub = eqn.params[param]
                sub_jaxpr, sub_consts = (sub.jaxpr, sub.consts) if isinstance(sub, core.ClosedJaxpr) else (sub, ())
                for v, out in zip(eqn.outvars, self.emit(sub_jaxpr, sub_consts, ins)):
                    env[v] = out
                continue
            outs = [core.DropVar(v.aval) if isinstance(v, core.DropVar) else core.Var(v.aval) for v in eqn.outvars]
            env.update(zip(eqn.outvars, outs))
            self.eqns.append(eqn.replace(invars=ins, outvars=outs))
        return [read(a) for a in jaxpr.outvars]


def trace(strategy: Any, function: Callable, args: Sequence[Any], rows: int | None, global_rows: int | None) -> Program:
    """Traces ``function(record, replica_id, *args)`` for one replica shape, its collectives as markers.

    ``args``: arrays (or ``jax.ShapeDtypeStruct``) of the replica's inputs.

    Raises:
        NeedsEager: the function cannot be one program per replica.
        TypeError: a collective under ``vmap`` / ``lax.scan`` / ``lax.cond``.
    """
    from distribute._keras import initialize_all_variables

    context = SegmentingReplicaContext(strategy, rows, global_rows)
    record: dict = {}
    out_tree: list = []

    def traced(replica_id, *flat):
        context._replica_id = replica_id
        with _context.enter_replica(strategy, context):
            out = function(record, *flat)
        leaves, tree = jax.tree_util.tree_flatten(out)
        out_tree.append(tree)
        return leaves

    spec = jax.ShapeDtypeStruct((), jnp.int32)
    try:
        closed = jax.jit(traced).trace(spec, *args).jaxpr
    finally:
        # Variables created while tracing (deferred by Keras) get their values now, outside the trace.
        initialize_all_variables()
    return Program(closed, out_tree[-1], record)


# -- running -----------------------------------------------------------------------------------------
def check_same_collectives(programs: Sequence[Program], first_replica: int) -> None:
    """Raises the uneven step's errors when the local replicas' programs make different collectives.

    Raises:
        RuntimeError: different numbers or kinds of collectives.
        ValueError: an all_reduce of values with different shapes or dtypes.
    """
    signatures = [p.signature() for p in programs]
    if all(s == signatures[0] for s in signatures):
        return
    for index in range(max(len(s) for s in signatures)):
        at = [s[index] if index < len(s) else None for s in signatures]
        if any(a is None or a[:2] != at[0][:2] for a in at):
            kinds = ", ".join(
                f"replica {first_replica + r}: {'none (it returned)' if a is None else programs[r].markers[index].describe()}"
                for r, a in enumerate(at))
            raise RuntimeError(
                f"The replicas of an uneven step make different collective calls at collective #{index + 1} ({kinds}). "
                "Every replica must make the same collective calls (all_reduce, all_gather, apply_gradients) in the "
                "same order, whatever its number of rows: do not skip them for an empty replica."
            )
        if any(a != at[0] for a in at):
            one_leaf = all(len(a[2]) == 1 for a in at)  # named as the eager step names them: [(0,), (2,)]
            shapes = sorted({a[2][0][0] if one_leaf else tuple(shape for shape, _ in a[2]) for a in at})
            dtypes = sorted({str(a[2][0][1]) if one_leaf else tuple(dtype for _, dtype in a[2]) for a in at})
            raise ValueError(
                f"all_reduce got values of shapes {shapes} (dtypes {dtypes}) on different replicas (collective "
                f"#{index + 1} of an uneven step); every replica must pass a value of the same shape and dtype "
                "(reduce the batch dim first, e.g. with a sum over axis 0)."
            )


def aligned_rounds(programs: Sequence[Program]) -> list[int]:
    """Per collective, the round every replica can make it in (the latest of their earliest)."""
    return [max(r) for r in zip(*(p.rounds for p in programs))] if programs else []


def run(strategy: Any, programs: Sequence[Program], rounds: Sequence[int], inputs: Sequence[Sequence[Any]],
        replica_ids: Sequence[Any], host: HostCollectives, timeout_seconds: float) -> list:
    """Runs every local replica's program; returns each replica's outputs (its function's result).

    ``inputs[r]``: local replica ``r``'s flat inputs, on its device.

    Raises:
        RuntimeError: a replica's segment did not finish within ``timeout_seconds``.
    """
    devices = strategy.extended.replica_mesh.local_devices
    first = host.first
    envs = []
    for program, values, replica_id in zip(programs, inputs, replica_ids):
        env = dict(program.consts)
        env.update(zip(program.invars, [replica_id, *values]))
        envs.append(env)
    cut = [p.segments(rounds) for p in programs]
    by_round: dict[int, list[int]] = {}
    for index, r in enumerate(rounds):
        by_round.setdefault(r, []).append(index)
    num_rounds = max(rounds, default=0)
    for r in range(num_rounds + 1):
        for env, segments in zip(envs, cut):
            segment = segments[r]
            if segment is not None:
                env.update(zip(segment.outputs, segment.run(*[env[v] for v in segment.inputs])))
        collectives_now = by_round.get(r + 1, [])
        if not collectives_now:
            continue
        wanted = [[_read(env, a) for index in collectives_now for a in p.markers[index].inputs] for env, p in zip(envs, programs)]
        _wait(wanted, r, num_rounds, [programs[0].markers[i] for i in collectives_now], first, timeout_seconds)
        host_values = jax.device_get(wanted)
        offset = 0
        results: list[list] = [[] for _ in programs]
        for index in collectives_now:
            marker = programs[0].markers[index]
            width = len(marker.inputs)
            values = [v[offset: offset + width] for v in host_values]
            offset += width
            for local, out in enumerate(_collective(host, marker, values)):
                results[local].extend(out)
        for local, (env, program) in enumerate(zip(envs, programs)):
            placed = jax.device_put(results[local], devices[local])
            outs = [v for index in collectives_now for v in program.markers[index].outputs]
            env.update((v, x) for v, x in zip(outs, placed) if not isinstance(v, core.DropVar))
    return [jax.tree_util.tree_unflatten(p.out_tree, [_on(device, _read(env, a)) for a in p.outvars])
            for env, p, device in zip(envs, programs, devices)]


def _read(env: dict, atom: Any) -> Any:
    return atom.val if isinstance(atom, core.Literal) else env[atom]


def _on(device: Any, value: Any) -> Any:
    """An output on its replica's device (an output that is a constant of the trace is not yet)."""
    if isinstance(value, jax.Array) and value.committed and value.devices() == {device}:
        return value
    return jax.device_put(value, device)


def _collective(host: HostCollectives, marker: Marker, values: list[list]) -> list[list]:
    if marker.kind == "sum":
        return host.sum(values)
    if marker.kind == "stack":
        return host.stack(values)
    n = len(values[0]) // 2
    return host.combine(marker.params["specs"], [v[:n] for v in values], [v[n:] for v in values])


def _wait(values: list[list], round_: int, num_rounds: int, markers: list[Marker], first: int, timeout_seconds: float) -> None:
    """Waits (bounded, interruptible) until every replica's inputs of this round's collectives are computed."""
    deadline = time.monotonic() + timeout_seconds
    delay = 0.0001
    while True:
        pending = [r for r, vs in enumerate(values) if not all(_ready(v) for v in vs)]
        if not pending:
            return
        if time.monotonic() > deadline:
            what = ", ".join(f"#{m.index + 1} ({m.describe()})" for m in markers)
            raise RuntimeError(
                f"replicas {[first + r for r in pending]} of an uneven step did not finish part {round_ + 1} of "
                f"{num_rounds + 1} of their programs (before collectives {what}) within {timeout_seconds:.0f} s; "
                f"replicas {[first + r for r in range(len(values)) if r not in pending]} did."
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.005)


def _ready(value: Any) -> bool:
    return not isinstance(value, jax.Array) or value.is_ready()
