"""``tape.gradient`` by replay: the function run again as a JAX trace, then differentiated.

JAX records no tape while a program runs; it differentiates functions.  So
``tape.gradient(target, sources)`` makes one: it runs the invocation's function
again from its start (the arguments as the call received them, in fresh
containers, see ``_invocation.copy_structure``; the variables' values when the
call began; its variable writes discarded) under ``jax.make_jaxpr``, up to this very
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
from jax.extend import core as jax_core

from distribute._keras import KerasVariable, placeholder_value
from distribute.lifting import LiftingScope
import distribute.tape._level as _level

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
        if value is None and variable._value is None and getattr(variable, "_initializer", None) is not None:
            # Created while the step was first traced (a model built by its first call, inside the
            # tape's block): one placeholder per replay, read (and watched) as any value.
            self.state_mapping[id(variable)] = placeholder_value(variable)
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
        # The arguments as the call received them, in fresh containers (what the first run or an earlier
        # replay did to its own is not seen here); their arrays become per-replica values (each
        # replica's gradients stay its own).
        args, kwargs = invocation.arguments(child.prepare_input)
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

    try:
        closed = jax.make_jaxpr(run)()
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError) as err:
        if type(level.root.trace).__name__ != "EvalTrace":
            raise
        raise NotImplementedError(
            f"GradientTape in {getattr(invocation.fn, '__qualname__', invocation.fn)!r}, which runs eagerly (it "
            "cannot be compiled: a Python branch on an array's value, or a shape that depends on one): a tape "
            "runs the step again as a JAX trace, where that Python code cannot run. Write the branch with "
            "jnp.where / lax.cond (what tf.function's autograph makes of it), so that the step compiles; or "
            "use distribute.compute_gradients here."
        ) from err
    return closed, child
