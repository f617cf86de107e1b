"""What makes Keras variables, optimizers and metrics created in scope distribution-aware.

``install()`` patches four Keras methods once, each keeping Keras' behaviour
outside a strategy:

* a JAX Keras variable initialized inside a strategy's scope is placed
  replicated on the strategy's mesh (a MirroredVariable) and remembers the
  strategy (``variable_created_in_scope``);
* an optimizer remembers the scope it was created in; its ``apply`` inside
  ``strategy.run`` sums the gradients across replicas first (as TF's
  ``apply_gradients``) and refuses to run for another strategy;
* a metric created in scope remembers the strategy, and inside a padded step its
  ``update_state`` weights the padding rows by zero;
* inside a padded step, BatchNormalization computes its batch statistics over
  the real rows only (Keras' ``mask`` argument), as TF's per-replica BatchNorm
  does over each replica's real batch;
* inside a padded step, activity regularizers see only the real rows, scaled so
  that the replicas' losses add up to one device's (Keras divides them by the
  batch size);
* inside ``strategy.run`` and fit, each replica draws its own random numbers
  (Dropout masks differ between replicas, as in TF) while the seed generator's
  state stays mirrored;
* a model compiled in scope trains, evaluates and predicts over all replicas
  (``trainer.py``).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

import jax.numpy as jnp

from distribute import _context
from distribute.tracing import check_ownership, sum_gradients

AXIS = "replica"
_INSTALLED: list[bool] = []
_OBJECTS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # optimizers and metrics, to name owners in errors


def install() -> None:
    """Installs the hooks (idempotent)."""
    if _INSTALLED:
        return
    from keras.src.backend.jax.core import JaxVariable
    from keras.src.layers.layer import Layer
    from keras.src.layers.normalization.batch_normalization import BatchNormalization
    from keras.src.metrics.metric import Metric
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.random.seed_generator import SeedGenerator

    from distribute.keras_support import trainer

    _patch(JaxVariable, "_initialize_layout", _variable_initialize_layout)
    _patch(BaseOptimizer, "__init__", _optimizer_init)
    _patch(BaseOptimizer, "apply", _optimizer_apply)
    _patch(Metric, "__init__", _metric_init)
    _patch(BatchNormalization, "call", _batch_norm_call)
    _patch(BatchNormalization, "_moments", _batch_norm_moments)
    _install_activity_regularizer_property(Layer)
    _patch(SeedGenerator, "next", _seed_next)
    trainer.install()
    _INSTALLED.append(True)


def _patch(cls: type, name: str, make: Any) -> None:
    original = getattr(cls, name)
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    setattr(cls, name, wrapper)


def _variable_initialize_layout(original):
    def _initialize_layout(self):
        strategy = _context.scope_strategy()
        self._distribute_strategy = strategy
        if strategy is not None and self._layout is None:
            self._layout = strategy.extended._replicated_sharding
        return original(self)

    return _initialize_layout


def _optimizer_init(original):
    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_distribute_strategy", _context.scope_strategy())
        _OBJECTS.add(self)
        return original(self, *args, **kwargs)

    return __init__


def _optimizer_apply(original):
    def apply(self, grads, trainable_variables=None):
        context = _context.current_replica_context()
        if context is not None and context._in_program:
            strategy = context.strategy
            # Its step counter was created with it: the same error as for any variable.
            check_ownership(strategy, [self.iterations])
            grads = sum_gradients(list(grads))
        return original(self, grads, trainable_variables)

    return apply


def _metric_init(original):
    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_distribute_strategy", _context.scope_strategy())
        _OBJECTS.add(self)
        original(self, *args, **kwargs)
        if self._distribute_strategy is not None and "update_state" not in self.__dict__:
            object.__setattr__(self, "update_state", _masked_update(self, self.update_state))

    return __init__


def _masked_update(metric: Any, update_state: Any):
    """Wraps a metric's update_state so padding rows get sample weight 0."""
    try:
        signature = inspect.signature(update_state)
    except (TypeError, ValueError):  # pragma: no cover - builtins
        signature = None

    def masked(*args, **kwargs):
        context = _context.current_replica_context()
        if context is None or context._valid_count is None or signature is None:
            return update_state(*args, **kwargs)
        first = next((a for a in list(args) + list(kwargs.values()) if hasattr(a, "shape") and len(a.shape)), None)
        mask = None if first is None else context._mask_for(first.shape[0])
        if mask is None:
            return update_state(*args, **kwargs)
        if "sample_weight" not in signature.parameters:
            raise ValueError(
                f"{describe_object(metric)} has no sample_weight argument in update_state, so "
                "the padding of this partial batch cannot be left out. Add a sample_weight "
                "argument, or drop the last partial batch (batch(..., drop_remainder=True))."
            )
        bound = signature.bind(*args, **kwargs)
        weight = bound.arguments.get("sample_weight")
        mask = mask.astype("float32")
        if weight is not None:
            weight = jnp.asarray(weight)
            mask = mask.reshape(mask.shape + (1,) * max(weight.ndim - 1, 0)) * weight
        bound.arguments["sample_weight"] = mask
        return update_state(*bound.args, **bound.kwargs)

    return masked


def _batch_norm_call(original):
    def call(self, inputs, training=None, mask=None):
        context = _context.current_replica_context()
        if mask is None and context is not None and context._valid_count is not None:
            rows = _context_mask(context, inputs)
            if rows is not None:
                if self.axis not in (-1, len(inputs.shape) - 1):
                    raise NotImplementedError(
                        f"BatchNormalization(axis={self.axis}) in a padded (partial) batch: only the "
                        "last axis can leave the padding rows out of its statistics. Use axis=-1, or "
                        "drop the last partial batch (batch(..., drop_remainder=True))."
                    )
                shape = (rows.shape[0],) + (1,) * (len(inputs.shape) - 2)
                mask = jnp.broadcast_to(rows.reshape(shape), tuple(inputs.shape[:-1]))
        return original(self, inputs, training=training, mask=mask)

    return call


def _batch_norm_moments(original):
    """Masked moments over the real rows.

    Keras 3.15's masked path squeezes every size-1 dim (a 1-channel layer breaks)
    and divides by ``count + epsilon``; this one reduces exactly the layer's
    reduction axes and divides by the count.
    """

    def _moments(self, inputs, mask):
        if mask is None:
            return original(self, inputs, mask)
        axes = tuple(self._reduction_axes)
        weights = jnp.broadcast_to(jnp.expand_dims(mask, -1), inputs.shape).astype(inputs.dtype)
        count = jnp.maximum(jnp.sum(weights, axis=axes, keepdims=True), 1)
        mean = jnp.sum(inputs * weights, axis=axes, keepdims=True) / count
        variance = jnp.sum(jnp.square(inputs - mean) * weights, axis=axes, keepdims=True) / count
        return jnp.squeeze(mean, axis=axes), jnp.squeeze(variance, axis=axes)

    return _moments


def _install_activity_regularizer_property(layer_cls: type) -> None:
    """``Layer.activity_regularizer`` becomes a property that masks padding rows in padded steps."""

    def get(self):
        regularizer = self.__dict__.get("_distribute_activity_regularizer")
        context = _context.current_replica_context()
        if regularizer is None or context is None or context._valid_count is None:
            return regularizer
        return _PaddingAwareRegularizer(regularizer, context)

    def set(self, value):
        self.__dict__["_distribute_activity_regularizer"] = value

    layer_cls.activity_regularizer = property(get, set)


class _PaddingAwareRegularizer:
    """Applies a regularizer to the real rows of a padded batch.

    Keras divides an activity loss by the batch's rows (padding included) and the
    distributed step divides layer losses by the replica count; the factor
    ``rows * replicas / real rows in the global batch`` makes the replicas' losses
    sum to ``regularizer(all real rows) / real rows``, one device's value.
    """

    def __init__(self, regularizer: Any, context: Any):
        self._regularizer, self._context = regularizer, context

    def __call__(self, output: Any) -> Any:
        mask = _context_mask(self._context, output)
        if mask is None:
            return self._regularizer(output)
        shape = (mask.shape[0],) + (1,) * (output.ndim - 1)
        loss = self._regularizer(jnp.where(mask.reshape(shape), output, 0))
        factor = output.shape[0] * self._context.num_replicas_in_sync / jnp.maximum(self._context._global_valid_count(), 1)
        return loss * factor.astype(loss.dtype)


def _context_mask(context: Any, inputs: Any) -> Any:
    shape = getattr(inputs, "shape", None)
    if not shape or len(shape) < 2:
        return None
    return context._mask_for(shape[0])


def _seed_next(original):
    def next(self, ordered=True):
        seed = original(self, ordered=ordered)
        context = _context.current_replica_context()
        if context is None or not context._in_program or context.num_replicas_in_sync == 1:
            return seed
        # A different stream per replica; the generator's state itself stays mirrored.
        replica = context.replica_id_in_sync_group.astype(seed.dtype)
        return seed + jnp.stack([replica * jnp.asarray(0x9E3779B1 % (2**31), seed.dtype), jnp.zeros((), seed.dtype)])

    return next


def describe_object(obj: Any) -> str:
    from keras.src.metrics.metric import Metric

    kind = "metric" if isinstance(obj, Metric) else "optimizer"
    return f"{kind} '{type(obj).__name__}' (name {getattr(obj, 'name', '?')!r})"


def describe_owner(variable: Any) -> str:
    """Names the optimizer or metric that owns ``variable``, else the variable itself."""
    for obj in list(_OBJECTS):
        try:
            owned = obj.variables
        except Exception:  # noqa: BLE001 - an object mid-construction
            continue
        if any(v is variable for v in owned):
            return describe_object(obj)
    return f"Keras variable '{variable.path}' (of a layer or model)"
