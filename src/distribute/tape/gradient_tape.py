"""``distribute.GradientTape``: TensorFlow's ``tf.GradientTape`` for code that runs in a JAX program."""

from __future__ import annotations

import contextlib
import enum
import logging
from typing import Any, Iterator

import jax
import jax.numpy as jnp

from distribute import _invocation
from distribute._keras import KerasVariable
import distribute.tape._differentiate as _differentiate
import distribute.tape._level as _level
import distribute.tape._replay as _replay

_LOG = logging.getLogger("distribute")

_NO_FUNCTION = (
    "distribute.GradientTape records the code of a step function and computes gradients by running that "
    "function again as a JAX trace (JAX has no eager tape), so it must be used inside one: a function given "
    "to strategy.run, one scheduled with ClusterCoordinator.schedule, or one decorated with "
    "distribute.function (TF's tf.function). Here it is used outside any. Wrap the step: "
    "`@distribute.function\\ndef train_step(x, y):\\n    with distribute.GradientTape() as tape: ...`."
)
_IN_PYTHON_LOOP = (
    "distribute.GradientTape was used directly in a distribute.function that runs as Python (it iterates a "
    "dataset or runs in cross-replica context), not in a step function of its own: tape.gradient runs the "
    "enclosing step function again, and running that loop again would consume its iterator and repeat its "
    "earlier steps, which would give wrong gradients. Call the step through a strategy: "
    "strategy.run(step_fn, args=(x,)) (without a strategy, distribute.get_strategy().run(step_fn, args=(x,))), "
    "or decorate step_fn itself with @distribute.function."
)
_NESTED_TRACE = (
    "distribute.GradientTape was used inside a JAX transformation (jax.jit, jax.vmap, lax.scan, jax.grad, "
    "distribute.compute_gradients' loss function) within the step function; a tape's block and its "
    "gradient calls must be in the step function's own code. Remove the inner transformation "
    "(strategy.run and distribute.function compile the whole step already)."
)
_NON_PERSISTENT = "A non-persistent GradientTape can only be used to compute one set of gradients (or jacobians)"


class UnconnectedGradients(enum.Enum):
    """What ``tape.gradient`` returns for a source the target does not depend on (tf.UnconnectedGradients)."""

    NONE = "none"
    ZERO = "zero"


class GradientTape:
    """Records operations for automatic differentiation (tf.GradientTape), inside a step function.

    As in TF::

        with distribute.GradientTape() as tape:
            logits = model(x, training=True)
            loss = distribute.compute_average_loss(loss_object(y, logits))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    Trainable Keras variables read inside the block are watched; ``watch`` adds
    tensors (arrays) and variables.  Gradients are with respect to the values as
    read inside the block; operations run outside it (before it, after it, or
    inside ``stop_recording()``) are not differentiated, and a source the target
    does not depend on through recorded operations gets ``None`` (or zeros with
    ``unconnected_gradients="zero"``).  Inside ``strategy.run`` the gradients
    are this replica's; an optimizer created in the strategy's scope sums them
    across replicas in ``apply_gradients``, as TF's.  Persistent tapes, nested
    tapes (higher-order gradients), several tapes over one block (a GAN step),
    ``reset``, ``jacobian`` and ``batch_jacobian`` work as TF's.

    How, and the limits: JAX differentiates functions, not recordings, so
    ``tape.gradient`` runs the enclosing step function again, from its start, as
    a JAX trace up to that call, and differentiates that (its variable writes
    discarded; the compiled program computes the forward pass once, XLA merging
    the copies).  Hence the tape must be used inside a step function: one given
    to ``strategy.run``, scheduled with ``ClusterCoordinator.schedule``, or
    decorated with ``distribute.function`` (at a script's top level there is
    none: ``RuntimeError``), in that function's own code (not inside a
    ``jax.jit`` / ``vmap`` / ``lax.scan`` within it); the function must take the
    same path when run again.

    What the run again sees: the arguments as the function received them.  Their
    containers (dicts, lists, tuples, namedtuples, sets, ``jax.tree_util``
    nodes, numpy arrays), at every depth, are copied before the function runs,
    so ``label = inputs.pop("label")`` inside the block (orbit's trainers),
    appending to a list argument or rewriting a nested dict's entry happen once,
    as in TF; Keras variables are read at their values when the call began.  Any
    other Python state is shared by the runs: objects that are not containers
    (a model's Python attributes, an instance of your class), and what the
    function reaches through ``self``, closures or globals.  A change to it
    before a gradient call happens again in the run again (``seen.append(x)``
    appends twice, the second time a JAX tracer), and the run again sees what
    the first run left, as when ``tf.function`` retraces.  Keep such changes
    after the last gradient call, or keep that state in Keras variables.

    Args:
        persistent: allow several ``gradient`` / ``jacobian`` calls (TF: same).
        watch_accessed_variables: watch trainable variables read while recording.

    Raises:
        RuntimeError: used outside a step function; a second ``gradient`` call on a
            non-persistent tape (TF's message).
    """

    def __init__(self, persistent: bool = False, watch_accessed_variables: bool = True):
        self._persistent = bool(persistent)
        self._watch_accessed_variables = bool(watch_accessed_variables)
        self._last_level: _level.Level | None = None

    # -- recording ---------------------------------------------------------------------------
    def __enter__(self) -> "GradientTape":
        level = self._level(entering=True)
        state = level.state(self)
        if state is not None and state.recording:
            raise ValueError("Tape is still recording, This can happen if you try to re-enter an already-active tape.")
        if level.parent is None and level.invocation.tape_level is level and not getattr(level, "_hooked", False):
            _invocation.set_read_hook(level.on_read)  # reset when the invocation ends
            level._hooked = True
        level.enter(self)
        self._last_level = level
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc, _replay._Stop):
            return  # a replay ends here
        level = self._level()
        state = level.state(self)
        if state is not None and state.recording:
            level.stop(state, "exit")

    @contextlib.contextmanager
    def stop_recording(self) -> Iterator[None]:
        """Operations inside are not recorded (TF: same).

        Raises:
            RuntimeError: the tape is not recording (TF's message).
        """
        level = self._level()
        state = level.state(self)
        if state is None or not state.recording:
            raise RuntimeError("Trying to stop recording a tape which is not recording.")
        level.stop(state, "stop")
        try:
            yield
        finally:
            if not state.recording:
                level.start(state, "resume")

    def reset(self) -> None:
        """Clears what was recorded so far, as exiting and re-entering a new tape (TF: same)."""
        level = self._level()
        state = level.state(self)
        if state is not None:
            level.reset(state)

    def watch(self, tensor: Any) -> None:
        """Watches ``tensor`` (an array, a Keras variable, or a nested structure of them) (TF: same).

        Later uses of a watched array, while recording, are differentiated with
        respect to it. Integer arrays are not watched (TF logs a warning too).

        Raises:
            ValueError: a leaf is neither a JAX array nor a Keras variable (TF's
                message); a numpy array or Python number cannot be followed:
                convert it first (``x = jnp.asarray(x); tape.watch(x)``).
        """
        level = self._level()
        state = level.state(self)
        leaves = jax.tree_util.tree_leaves(tensor, is_leaf=lambda x: isinstance(x, KerasVariable))
        for leaf in leaves:
            if isinstance(leaf, KerasVariable):
                if state is not None:
                    state.watched[id(leaf)] = leaf
                continue
            if not _level.is_tensor(leaf):
                raise ValueError(
                    f"Passed in object {leaf!r} of type {type(leaf).__name__!r}, not a JAX array or Keras "
                    "variable (TF: not tf.Tensor or tf.Variable). Convert it first and use the converted "
                    "array afterwards: x = jnp.asarray(x); tape.watch(x)."
                )
            if not jnp.issubdtype(leaf.dtype, jnp.inexact):
                _LOG.warning("The dtype of the watched tensor must be floating (e.g. float32), got %s", leaf.dtype)
                continue
            if state is None or not state.recording:
                continue  # TF: watching outside the block records nothing
            self._check_trace(level)
            level.watch_tensor(state, leaf)

    def watched_variables(self) -> tuple:
        """The variables watched so far: read while recording, or watched explicitly (TF: same)."""
        level = self._last_level if self._last_level is not None else self._level()
        state = level.state(self)
        if state is None:
            return ()
        seen = dict(state.watched)
        seen.update(state.accessed)
        return tuple(seen.values())

    # -- gradients ---------------------------------------------------------------------------
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: UnconnectedGradients | str = UnconnectedGradients.NONE) -> Any:
        """The gradient of ``target`` (summed over its elements and leaves) w.r.t. ``sources`` (TF: same).

        Args:
            target: an array, a Keras variable, or a nested structure of them.
            sources: Keras variables and watched arrays, in any nested structure.
            output_gradients: the target's cotangents (one per target leaf), default ones.
            unconnected_gradients: ``"none"`` (TF's default) or ``"zero"``.

        Returns:
            The gradients in ``sources``' structure, each of its source's shape and
            dtype (inside ``strategy.run``: this replica's), ``None`` for an
            unconnected source (or zeros).

        Raises:
            RuntimeError: a second call on a non-persistent tape; outside a step function.
            ValueError: ``unconnected_gradients`` is unknown.
        """
        return self._compute(target, sources, output_gradients, unconnected_gradients, None)

    def jacobian(self, target: Any, sources: Any, unconnected_gradients: UnconnectedGradients | str = UnconnectedGradients.NONE,
                 parallel_iterations: Any = None, experimental_use_pfor: bool = True) -> Any:
        """The Jacobian of array ``target`` w.r.t. ``sources``: ``target.shape + source.shape`` each (TF: same)."""
        return self._compute(target, sources, None, unconnected_gradients, "full")

    def batch_jacobian(self, target: Any, source: Any, unconnected_gradients: UnconnectedGradients | str = UnconnectedGradients.NONE,
                       parallel_iterations: Any = None, experimental_use_pfor: bool = True) -> Any:
        """Per-example Jacobians: ``(batch, *target.shape[1:], *source.shape[1:])`` (TF: same).

        Assumes, as TF, that example ``i`` of ``target`` depends only on example ``i`` of ``source``.
        """
        return self._compute(target, source, None, unconnected_gradients, "batch")

    def _compute(self, target: Any, sources: Any, output_gradients: Any, unconnected: Any, jacobian: str | None) -> Any:
        zeros = _unconnected(unconnected) is UnconnectedGradients.ZERO
        level = self._level()
        state = level.state(self)
        if state is None or (not state.persistent and state.used):
            raise RuntimeError(_NON_PERSISTENT)
        if sources is None:
            raise TypeError("tape.gradient: sources is None; pass the variables or watched arrays to differentiate by.")
        self._check_trace(level)
        call = level.num_gradient_calls
        level.num_gradient_calls += 1
        if state.persistent and state.recording:
            _LOG.warning(
                "Calling GradientTape.gradient on a persistent tape inside its context is significantly less "
                "efficient than calling it outside the context (it causes the gradient ops to be recorded on "
                "the tape, leading to increased CPU and memory usage). Only call GradientTape.gradient inside "
                "the context if you actually want to trace the gradient in order to compute higher order derivatives."
            )
        if not state.persistent:
            state.used = True
            if state.recording:
                level.stop(state, "exit")
        if level.replay and call == level.stop_at:
            raise _replay._Stop(_stop_outputs(target, sources))
        if level.replay and not any(level.is_recording(o) for o in level.diff_tapes):
            return level.root.results[call]  # not recorded by what this replay differentiates: a constant
        result = _differentiate.differentiate(level, state, call, target, sources, output_gradients, zeros, jacobian)
        if not level.replay:
            level.results[call] = result
        return result

    # -- internals ---------------------------------------------------------------------------
    def _level(self, entering: bool = False) -> _level.Level:
        invocation = _invocation.current()
        if invocation is None:
            raise RuntimeError(_NO_FUNCTION)
        if invocation.python_loop:
            raise NotImplementedError(_IN_PYTHON_LOOP)
        level = _level.current_level(invocation)
        self._check_trace(level)
        return level

    @staticmethod
    def _check_trace(level: _level.Level) -> None:
        if not level.in_own_trace():
            raise NotImplementedError(_NESTED_TRACE)


def _unconnected(value: Any) -> UnconnectedGradients:
    if isinstance(value, UnconnectedGradients):
        return value
    name = getattr(value, "value", value)
    for member in UnconnectedGradients:
        if isinstance(name, str) and name.lower() == member.value:
            return member
    raise ValueError(f"Unknown value for unconnected_gradients: {value!r}; use 'none' or 'zero' (UnconnectedGradients).")


def _stop_outputs(target: Any, sources: Any) -> list:
    """A replay's outputs: the target's leaves, then the sources that are arrays (their replay values)."""
    targets = [jnp.asarray(x.value if isinstance(x, KerasVariable) else x)
               for x in jax.tree_util.tree_leaves(target, is_leaf=lambda x: isinstance(x, KerasVariable))]
    tensors = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(sources, is_leaf=lambda x: isinstance(x, KerasVariable))
               if not isinstance(x, KerasVariable)]
    return targets + tensors
