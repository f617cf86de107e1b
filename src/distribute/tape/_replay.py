"""``tape.gradient`` by replay: the function run again as a JAX trace, then differentiated.

JAX records no tape while a program runs; it differentiates functions.  So
``tape.gradient(target, sources)`` makes one: it runs the invocation's function
again from its start (same arguments, the variables' values when the call
began, its variable writes discarded) under ``jax.make_jaxpr``, up to this very
gradient call, and gets a jaxpr of everything the function computed so far, in
order.  Its events left marks there (``tape_marker``: where each tape entered,
exited, stopped, was reset, watched a tensor; ``tape_tag``: each read of a
watched variable while a tape recorded).  From them:

* the tape's recorded equations are those between its marks (TF records the
  operations run while the tape is active);
* each source gets a perturbation ``delta`` (zero) injected where TF's tape
  would meet it: every recorded read of a variable, the point of
  ``tape.watch(x)`` for a tensor (later uses only), the equation that produced
  an intermediate tensor computed while recording;
* the jaxpr is evaluated equation by equation under ``jax.vjp`` with respect to
  those deltas, with gradients stopped at every unrecorded equation.

Gradients are then exactly TF's: with respect to the values as read inside the
block, ``None`` where the target is not connected.  The evaluation runs in the
program being traced, so the forward computation appears twice there and
XLA's common-subexpression elimination merges the copies.  Python side effects
of the function before the gradient call run again at trace time, as when
``tf.function`` retraces.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
from jax.interpreters import ad, batching, mlir

from distribute._keras import KerasVariable
from distribute.lifting import LiftingScope
from distribute.tape import _level

# -- the two marks -------------------------------------------------------------------------
marker_p = jax_core.Primitive("tape_marker")
marker_p.multiple_results = True
marker_p.def_impl(lambda *args, **params: [])
marker_p.def_abstract_eval(lambda *args, **params: [])
mlir.register_lowering(marker_p, lambda ctx, *args, **params: [])
ad.primitive_jvps[marker_p] = lambda primals, tangents, **params: (marker_p.bind(*primals, **params), [])
batching.primitive_batchers[marker_p] = lambda args, dims, **params: (marker_p.bind(*args, **params), [])

tag_p = jax_core.Primitive("tape_tag")
tag_p.def_impl(lambda x, **params: x)
tag_p.def_abstract_eval(lambda x, **params: x)
mlir.register_lowering(tag_p, lambda ctx, x, **params: [x])
ad.primitive_jvps[tag_p] = lambda primals, tangents, **params: (tag_p.bind(*primals, **params), tangents[0])
batching.primitive_batchers[tag_p] = lambda args, dims, **params: (tag_p.bind(*args, **params), dims[0])


def marker(level: "_level.Level", kind: str, ordinal: int, key: int, tensor: Any) -> None:
    """Leaves a mark of a tape event in the replay's trace."""
    operands = [] if tensor is None else [tensor]
    with jax_core.set_current_trace(level.trace):
        marker_p.bind(*operands, kind=kind, tape=ordinal, key=key)


def tag(level: "_level.Level", value: Any, key: int, from_snapshot: bool) -> Any:
    """A watched variable's read in a replay: the value, marked as read event ``key``.

    A value the call began with is marked in the replay's own trace, also when
    read inside a nested trace (a Keras RNN reads its kernel inside
    ``lax.scan``), which then closes over it.
    """
    if from_snapshot or not isinstance(value, jax.core.Tracer):
        with jax_core.set_current_trace(level.trace):
            return tag_p.bind(level.prepare(value), key=key)
    return tag_p.bind(level.prepare(value), key=key)


@jax.custom_jvp
def _inject(x: Any, delta: Any) -> Any:
    """``x``, whose tangent also gets ``delta``'s: where a source meets the recorded computation."""
    return x


@_inject.defjvp
def _inject_jvp(primals, tangents):
    (x, _), (tx, td) = primals, tangents
    return x, tx + td


@jax.custom_jvp
def _fresh(x: Any) -> Any:
    """``x`` without its tangent (an unrecorded equation; a variable read is a fresh value, as TF's)."""
    return x


@_fresh.defjvp
def _fresh_jvp(primals, tangents):
    return primals[0], jnp.zeros_like(tangents[0])


class _Stop(BaseException):
    """Ends a replay at the gradient call it was run for (not an Exception: user code must not catch it)."""

    def __init__(self, outputs: list):
        super().__init__()
        self.outputs = outputs


class ReplayScope(LiftingScope):
    """The replay's variables: their values when the call began; its writes are discarded."""

    def __init__(self, origin: Any, snapshot: dict):
        lifting = isinstance(origin, LiftingScope)
        super().__init__(dict(snapshot), parent=origin.parent if lifting else None,
                         device=origin.device if lifting else None,
                         placeholders=origin.placeholders if lifting else False)
        self.origin = origin

    def get_current_value(self, variable: KerasVariable) -> Any:
        if self.origin is None and id(variable) not in self.state_mapping and variable._value is not None:
            self.state_mapping[id(variable)] = variable._value  # no lifting scope: the stored value
        value = super().get_current_value(variable)
        if self.missing and isinstance(self.origin, LiftingScope):
            self.origin.missing.update(self.missing)  # the engine's discovery learns of it too
        return value


def replay(level: "_level.Level", stop_at: int, ordinal: int) -> tuple:
    """Runs the invocation's function again under ``jax.make_jaxpr``, up to gradient call ``stop_at``.

    Returns the closed jaxpr (its outputs: the call's target leaves, then its
    tensor sources) and the replay level.
    """
    from distribute import _invocation

    invocation = level.invocation
    child = _level.Level(invocation, parent=level, stop_at=stop_at, diff_tapes=(ordinal, *level.diff_tapes))

    def run():
        with jax_core.take_current_trace() as trace:
            child.trace = trace
        scope = ReplayScope(invocation.scope, invocation.snapshot)
        level_token = _level._LEVEL.set(child)
        hook_token = _invocation.set_read_hook(child.on_read)
        # Arrays the call received become per-replica values here (each replica's gradients stay its own).
        args, kwargs = jax.tree_util.tree_map(child.prepare_input, (invocation.args, invocation.kwargs))
        try:
            with scope:
                invocation.fn(*args, **kwargs)
        except _Stop as stop:
            return stop.outputs
        finally:
            _invocation.reset_read_hook(hook_token)
            _level._LEVEL.reset(level_token)
        raise RuntimeError(
            f"GradientTape: running {getattr(invocation.fn, '__qualname__', invocation.fn)!r} again to compute "
            f"gradient call #{stop_at + 1}, the function returned before reaching it: it takes another path "
            "when run again. The function must compute the same things each time it runs (a tape replays it; "
            "keep Python state that changes between runs out of the tape's path)."
        )

    compiling = getattr(level.context, "_compiling", None)
    if compiling is not None:
        # An uneven step's replica: collectives in the replay are the program's host callbacks.
        with compiling():
            closed = jax.make_jaxpr(run)()
    else:
        closed = jax.make_jaxpr(run)()
    return closed, child
