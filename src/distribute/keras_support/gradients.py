"""Gradients of stateful Keras code: the JAX stand-in for tf.GradientTape."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from distribute import _context
from distribute._keras import get_stateless_scope
from distribute.tracing import LiftingScope


def compute_gradients(loss_fn: Callable[[], Any], variables: Sequence[Any], has_aux: bool = False) -> tuple:
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

    Args:
        loss_fn: computes a scalar loss (or ``(loss, aux)`` with ``has_aux``).
        variables: the Keras variables to differentiate with respect to.
        has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
        ``(loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux``; ``grads``
        is a list matching ``variables`` (shapes equal to each variable's).

    Raises:
        TypeError: the loss is not a scalar float (as ``jax.grad``).
    """
    variables = list(variables)
    parent = get_stateless_scope()
    parent = parent if isinstance(parent, LiftingScope) else None
    written: dict = {}

    def pure(values):
        scope = LiftingScope({id(v): x for v, x in zip(variables, values)}, parent=parent)
        with scope:
            out = loss_fn()
        written.update(scope.written)
        loss, aux = out if has_aux else (out, None)
        if context is not None:
            # Each replica's loss counts (TF: the gradient of an all-reduced loss is the
            # all-reduce of every replica's gradient), also when it is the same on all.
            loss = context._prepare_for_gradients([loss])[0]
        updates = [scope.state_mapping[i] for i in scope.written]
        return loss, (aux, updates)

    context = _context.current_replica_context()
    values = [v.value for v in variables]
    if context is not None:
        # Per-replica gradients, as TF's tape gives; apply_gradients sums them.
        values = context._prepare_for_gradients(values)
    (loss, (aux, updates)), grads = jax.value_and_grad(pure, has_aux=True)(values)
    for variable, value in zip(written.values(), updates):
        variable.assign(value)
    return ((loss, aux), grads) if has_aux else (loss, grads)
