"""Variables created inside a replica function on its first call (TF: creation in replica context).

TF 2.21, MirroredStrategy over 2 replicas: a variable created inside ``strategy.run``
(transformers' ``GradientAccumulator`` makes its accumulators on the first call,
``tf.Variable(tf.zeros_like(g), synchronization=ON_READ, aggregation=ONLY_FIRST_REPLICA)``)
is created once, through ``merge_call``: every replica gets the same variable (a
MirroredVariable, or a SyncOnRead one for ``synchronization=ON_READ``) whose copies all
start at the first replica's initial value.

Here ``keras.Variable(value, ...)`` inside ``run`` (and inside a ``distribute.function``
that calls it) is made the same way:

1. while the step is traced, the variable is made with a deferred value (its shape and
   dtype are the initial value's) and the rest of the trace reads the initial value;
2. after that trace, before anything is stored, the part of its program that computes the
   initial values runs once with the real inputs and variable values (``placeholder`` in
   ``lifting.py``) and the first replica's initial value becomes the variable's value (each
   copy's, for a SyncOnRead one);
3. the step is traced again with the new variable lifted like any other, and compiled.

A later call does not create it again: the Python code that made it sees it made (as
TF's ``tf.function``, which allows variable creation on the first call only).  A
callable initializer (``keras.Variable(initializer="zeros", shape=...)``, every Keras
``add_weight``) needs none of this: Keras defers it and it is initialized after the trace.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from distribute._keras import KerasVariable, global_state
from distribute.lifting import LiftingScope
from distribute.mesh import AXIS

_ARGUMENTS = ("initializer", "shape", "dtype", "trainable", "autocast", "aggregation", "synchronization", "name")


class InitialValue:
    """The initializer of a variable created inside a traced step: its initial value, once known.

    Args:
        value: the initial value as the trace computed it (a tracer), or a concrete array.
        unvalued: names of variables the trace read as zeros before (they had no value yet).
    """

    def __init__(self, value: Any, unvalued: list):
        self.value = value
        self.traced = isinstance(value, jax.core.Tracer)
        self.unvalued = unvalued
        self.concrete: Any = None
        self.name = "?"
        self.variable: Any = None

    def __call__(self, shape: Any = None, dtype: Any = None) -> Any:
        if not self.traced:
            return self.value
        if self.concrete is None:
            forget([self])  # Keras would try again at every later initialization
            raise RuntimeError(
                f"Variable '{self.name}' was created from a traced value inside a compiled program whose "
                "first run could not give its initial value (only strategy.run and the distribute.function "
                "steps that call it do). Create it before the step (inside strategy.scope()), or with a "
                "callable initializer: keras.Variable(initializer='zeros', shape=..., dtype=...)."
            )
        return self.concrete

    def get_config(self) -> dict:
        return {}


def defer(scope: LiftingScope, args: tuple, kwargs: dict) -> tuple[tuple, dict, InitialValue | None]:
    """``keras.Variable``'s arguments with an array initial value replaced by an ``InitialValue``.

    Keras refuses an array initial value inside a stateless scope ("You are attempting to
    create a variable while in a stateless scope"); a callable one it defers.  Arguments with
    a callable or named initializer come back unchanged (and None).
    """
    if len(args) > len(_ARGUMENTS):
        return args, kwargs, None
    bound = {**dict(zip(_ARGUMENTS, args)), **kwargs}
    initializer = bound.get("initializer")
    if initializer is None or callable(initializer) or isinstance(initializer, str):
        return args, kwargs, None
    if not scope.creates:
        raise ValueError(
            f"a variable (initial value of shape {tuple(getattr(initializer, 'shape', ()))}) was created inside a nested step scope (the loss "
            "function of distribute.compute_gradients or a tape's replay, an optimizer update, a replica "
            "thread of an uneven step); Keras cannot create it there. Create it in the replica function "
            "itself (strategy.run's function creates variables on its first call), before the step in "
            "strategy.scope(), or with a callable initializer: keras.Variable(initializer='zeros', shape=...)."
        )
    import keras

    value = initializer.value if isinstance(initializer, KerasVariable) else initializer
    value = keras.ops.convert_to_tensor(value, dtype=bound.get("dtype"))
    initial = InitialValue(value, [v.path for v in scope.unvalued.values()])
    bound.update(initializer=initial, shape=tuple(value.shape), dtype=bound.get("dtype") or value.dtype)
    return (), bound, initial


def created(scope: LiftingScope, variable: KerasVariable, initial: InitialValue) -> None:
    """Records a variable the trace created: the rest of the trace reads its initial value."""
    initial.name = variable.path
    initial.variable = variable
    scope.created.append((variable, initial))
    scope.missing[id(variable)] = variable
    scope.state_mapping[id(variable)] = initial.value


def traced_initial_values(scope: LiftingScope) -> tuple[list, list]:
    """The created variables whose initial values the trace computed, and those values (first replica's).

    Called in the step's body (inside ``shard_map``): every replica gets replica 0's value,
    as TF's ``merge_call`` gives every copy the first replica's initial value.
    """
    pairs = [(v, i) for v, i in scope.created if i.traced]
    return pairs, [_first_replica(i.value) for _, i in pairs]


def _first_replica(x: Any) -> Any:
    """Replica 0's ``x`` on every replica (one psum: the value is replicated, and known to be)."""
    first = lax.axis_index(AXIS) == 0
    wide = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
    total = lax.psum(jnp.where(first, wide, jnp.zeros_like(wide)), AXIS)
    return total.astype(x.dtype)


def compute_initial_values(traced: Any, pairs: list, inputs: tuple) -> None:
    """Runs a traced step once (its results thrown away) to give created variables their initial values.

    ``inputs``: the program's arguments (nothing is donated: the step's own program is not run).

    Raises:
        NotImplementedError: a variable was created after the step read variables that had
            no value yet (made by the same call: a model built lazily by its first step), so
            its initial value might depend on values this run does not have.
    """
    try:
        _run_for_initial_values(traced, pairs, inputs)
    except BaseException:
        forget([initial for _, initial in pairs])  # never initialized: Keras must not try again later
        raise


def forget(initials: list) -> None:
    """Takes the variables of ``initials`` off Keras' list of variables to initialize."""
    pending = global_state.get_global_attribute("uninitialized_variables")
    if pending:
        gone = {id(i.variable) for i in initials}
        pending[:] = [v for v in pending if id(v) not in gone]


def _run_for_initial_values(traced: Any, pairs: list, inputs: tuple) -> None:
    for variable, initial in pairs:
        if initial.unvalued:
            raise NotImplementedError(
                f"Variable '{variable.path}' was created inside strategy.run after the same call read "
                f"variables that had no value yet ({', '.join(initial.unvalued[:5])}: created by that call, "
                "such as a model built by its first step); its initial value could depend on them. Build "
                "the model (and optimizer) before the first step, create the variable before the step in "
                "strategy.scope(), or give it a callable initializer (keras.Variable(initializer='zeros', "
                "shape=..., dtype=...))."
            )
    # The trace's own program, cut to the initial values (XLA drops the rest of the step), with its
    # constants (the host copies of variables read for the first time: ``lifting.placeholder``)
    # passed as arguments: embedded in the program they would cost seconds per 100 MB to compile.
    closed = traced.jaxpr
    count = len(pairs)

    def initial_values(consts: list, args: list) -> list:
        return jax.core.eval_jaxpr(closed.jaxpr, consts, *args)[-count:]

    values = jax.jit(initial_values)(list(closed.consts), jax.tree_util.tree_leaves(inputs))
    for (_, initial), value in zip(pairs, values):
        initial.concrete, initial.value = value, None  # the tracer is not kept alive
