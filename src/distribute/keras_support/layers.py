"""Keras layers inside a replica (the wrappers of ``patches.py``'s layer rows).

* ``BatchNormalization(synchronized=True)`` (Keras 3 allows it on TensorFlow
  only) computes its batch moments over every replica's rows, as TF's
  SyncBatchNormalization; an empty replica's moments are not NaN;
* in an uneven step of ``strategy.run``, an activity regularizer's loss is rescaled from Keras'
  "divided by this replica's rows" to "divided by the global batch's rows", so
  the replicas' losses add up to one device's;
* Keras' recurrent layers start their scan from per-replica states: inside the
  SPMD program a replica's rows differ from the others', so the scan's carry
  comes out per replica ("varying" in ``shard_map``'s typing) while the zeros
  it starts from are the same everywhere, and JAX refuses the scan. TF's
  replicas each run their own loop, so the initial states are marked per
  replica too (``pcast`` to varying), which changes no value.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp

from distribute import _context
from distribute.keras_support import replica_loss


def batch_norm_init(original):
    def __init__(self, *args, **kwargs):
        synchronized = kwargs.pop("synchronized", False)
        original(self, *args, synchronized=False, **kwargs)
        # Keras 3 refuses synchronized=True outside TensorFlow; the moments below do it.
        self.synchronized = bool(synchronized)

    # Keras' Operation.__new__ reads the constructor's argspec: keep Keras' own.
    __init__.__signature__ = inspect.signature(original)
    return __init__


def batch_norm_moments(original):
    """Moments over every replica's rows for ``synchronized=True`` (TF's SyncBatchNormalization).

    As TF: the sum, the sum of squares and the count of the reduced elements are
    all-reduced, ``mean = sum / count``, ``variance = sum_sq / count - mean**2``.
    Differentiable (the all-reduce's gradient is an all-reduce); a replica with no
    rows adds zeros; outside a replica context it is the layer's own moments.
    Unsynchronized, an empty replica's moments are 0 and 1 instead of NaN.
    """

    def _moments(self, inputs, mask):
        if not self.synchronized:
            if any(inputs.shape[a] == 0 for a in self._reduction_axes):
                # An empty replica of an uneven step: Keras' moments would be NaN (0 / 0)
                # and poison the gradients; its output is empty, and its moving
                # statistics are left out of the replicas' mean (uneven.py).
                shape = [d for i, d in enumerate(inputs.shape) if i not in self._reduction_axes]
                return jnp.zeros(shape, inputs.dtype), jnp.ones(shape, inputs.dtype)
            return original(self, inputs, mask)
        if mask is not None:
            raise NotImplementedError(
                "BatchNormalization(synchronized=True) with a mask is not supported; pass no mask, "
                "or use synchronized=False."
            )
        context = _context.current_replica_context()
        axes = tuple(self._reduction_axes)
        x = jnp.asarray(inputs)
        dtype = x.dtype
        if dtype in (jnp.float16, jnp.bfloat16):
            x = x.astype(jnp.float32)
        count = 1
        for axis in axes:
            count *= x.shape[axis]
        local = (jnp.sum(x, axis=axes), jnp.sum(jnp.square(x), axis=axes), jnp.asarray(count, jnp.float32))
        if context is not None and context._in_program and context.num_replicas_in_sync > 1:
            total, total_sq, total_count = context.all_reduce("SUM", local)
        else:
            total, total_sq, total_count = local
        total_count = jnp.maximum(total_count, 1.0)
        mean = total / total_count
        variance = jnp.maximum(total_sq / total_count - jnp.square(mean), 0.0)
        return mean.astype(dtype), variance.astype(dtype)

    return _moments


def activity_regularizer_property(_original: Any) -> property:
    """``Layer.activity_regularizer`` (an instance attribute in Keras) as a property that rescales its loss in uneven steps."""

    def get(self):
        regularizer = self.__dict__.get("_distribute_activity_regularizer")
        context = _context.current_replica_context()
        if regularizer is None or context is None or context._global_rows is None or replica_loss.active():
            return regularizer  # a fit step weights the whole loss, this term included, by the replica's rows
        if context._rows * context.num_replicas_in_sync == context._global_rows:
            return regularizer
        return _RescaledRegularizer(regularizer, context._rows, context._rows * context.num_replicas_in_sync / max(context._global_rows, 1))

    def set(self, value):
        self.__dict__["_distribute_activity_regularizer"] = value

    return property(get, set)


class _RescaledRegularizer:
    """An activity regularizer whose loss is multiplied by ``factor`` on outputs of this replica's rows.

    Keras divides an activity loss by the output's rows ``n_r`` and a custom loop divides
    layer losses by the replica count ``R`` (``scale_regularization_loss``); ``factor = n_r R / N``
    makes each replica's share ``regularizer(its rows) / N``, so the shares add up
    to one device's ``regularizer(all rows) / N``.
    """

    def __init__(self, regularizer: Any, rows: int, factor: float):
        self._regularizer, self._rows, self._factor = regularizer, rows, factor

    def __call__(self, output: Any) -> Any:
        loss = self._regularizer(output)
        if getattr(output, "ndim", 0) and output.shape[0] == self._rows:
            loss = loss * jnp.asarray(self._factor, loss.dtype)
        return loss


# backend function -> positions of its initial-state arguments
_STATE_ARGUMENTS = {"rnn": (2,), "lstm": (1, 2), "gru": (1,)}
_STATE_KEYWORDS = {"rnn": ("initial_states",), "lstm": ("initial_state_h", "initial_state_c"), "gru": ("initial_state",)}


def per_replica_states_of(name: str) -> Callable[[Callable], Callable]:
    """The ``Patch.wrap`` of backend function ``name`` (``rnn``, ``lstm`` or ``gru``)."""
    return lambda original: per_replica_states(original, _STATE_ARGUMENTS[name], _STATE_KEYWORDS[name])


def per_replica_states(original: Callable, positions: tuple, keywords: tuple) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        context = _context.current_replica_context()
        if context is None:
            return original(*args, **kwargs)

        def per_replica(states: Any) -> Any:
            # the replica context's own marking (the SPMD program's pcast; the uneven step's
            # per-replica programs need none)
            leaves, treedef = jax.tree_util.tree_flatten(states)
            return jax.tree_util.tree_unflatten(treedef, context._prepare_for_gradients(leaves))

        args = list(args)
        for i in positions:
            if i < len(args) and args[i] is not None:
                args[i] = per_replica(args[i])
        for key in keywords:
            if kwargs.get(key) is not None:
                kwargs[key] = per_replica(kwargs[key])
        return original(*args, **kwargs)

    return call
