"""Gradients of stateful Keras code: the JAX stand-in for tf.GradientTape."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from distribute import _context
from distribute._keras import get_stateless_scope, initialize_all_variables
from distribute.lifting import LiftingScope


def compute_gradients(loss_fn: Callable[[], Any], variables: "Sequence[Any] | Callable[[], Sequence[Any]]", has_aux: bool = False) -> tuple:
    """Computes ``loss_fn()`` and its gradients with respect to Keras ``variables``.

    The one-line port of a ``tf.GradientTape`` block: the recorded code moves into
    a function without arguments::

        # TF:  with tf.GradientTape() as tape:
        #          loss = loss_object(y, model(x, training=True))
        #      grads = tape.gradient(loss, model.trainable_variables)
        loss, grads = distribute.compute_gradients(
            lambda: loss_object(y, model(x, training=True)), model.trainable_variables)

    Works inside ``strategy.run`` (the gradients are this replica's; an optimizer
    created in scope sums them across replicas in ``apply_gradients``) and
    outside it.  Variable assignments made by ``loss_fn`` (BatchNorm statistics,
    metric updates) take effect as they would under a tape.

    A loss that is not a scalar (a per-example loss of shape ``(batch,)``) is
    differentiated through its sum, as ``tape.gradient`` does, and returned as it is.

    A model built lazily by ``loss_fn`` (its first call, as in TF's tutorials, where
    ``tape.gradient(loss, model.trainable_variables)`` reads the variables after the
    block ran) has no variables before: pass them as a function,
    ``lambda: model.trainable_variables``; while it returns none, ``loss_fn`` is
    first run once, its results and assignments thrown away, to build the model.

    Args:
        loss_fn: computes the loss (or ``(loss, aux)`` with ``has_aux``).
        variables: the Keras variables to differentiate with respect to, or a
            function without arguments returning them.
        has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
        ``(loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux``; ``grads``
        is a list matching ``variables`` (shapes equal to each variable's), with
        ``None`` for a variable that is not floating point (as ``tape.gradient``:
        the ``uint32`` seed state in an LSTM's ``model.variables``).

    Raises:
        TypeError: the loss is not floating point (as ``jax.grad``).
    """
    parent = get_stateless_scope()
    parent = parent if isinstance(parent, LiftingScope) else None
    variables = _variables(variables, loss_fn, parent)
    written: dict = {}

    def pure(float_values):
        mapped = list(values)
        for i, x in zip(differentiable, float_values):
            mapped[i] = x
        scope = LiftingScope({id(v): x for v, x in zip(variables, mapped)}, parent=parent)
        scope.observe_reads = False  # its values are this differentiation's; a tape saw the reads outside
        with scope:
            out = loss_fn()
        written.update(scope.written)
        loss, aux = out if has_aux else (out, None)
        # TF's tape.gradient of a non-scalar target is the gradient of its sum.
        target = loss if jnp.ndim(loss) == 0 else jnp.sum(loss)
        if context is not None:
            # Each replica's loss counts (TF: the gradient of an all-reduced loss is the
            # all-reduce of every replica's gradient), also when it is the same on all.
            target = context._prepare_for_gradients([target])[0]
        updates = [scope.state_mapping[i] for i in scope.written]
        return target, (loss, aux, updates)

    context = _context.current_replica_context()
    values = [v.value for v in variables]
    if context is not None:
        # Per-replica gradients, as TF's tape gives; apply_gradients sums them.
        values = context._prepare_for_gradients(values)
    # TF's tape gives None for a variable it cannot differentiate (an integer seed state)
    differentiable = [i for i, v in enumerate(variables) if jnp.issubdtype(jnp.dtype(v.dtype), jnp.inexact)]
    (_, (loss, aux, updates)), float_grads = jax.value_and_grad(pure, has_aux=True)(
        [values[i] for i in differentiable])
    grads: list = [None] * len(variables)
    for i, grad in zip(differentiable, float_grads):
        grads[i] = grad
    for variable, value in zip(written.values(), updates):
        variable.assign(value)
    return ((loss, aux), grads) if has_aux else (loss, grads)


def _variables(variables: Any, loss_fn: Callable[[], Any], parent: "LiftingScope | None") -> list:
    """The variables to differentiate; a function of them is called after building what ``loss_fn`` builds."""
    if not callable(variables):
        return list(variables)
    found = list(variables())
    if found:
        return found
    # Nothing to differentiate yet: the model is built by loss_fn's first call (TF's lazy build).
    # Run it once in a throwaway scope (nothing it assigns is kept); the variables it creates are
    # deferred by Keras and initialized at once, or by the trace in progress when there is one.
    with LiftingScope({}, parent=parent):
        loss_fn()
    if parent is None:
        initialize_all_variables()
    return list(variables())
