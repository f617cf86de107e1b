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
from distribute.tracing import sum_gradients

AXIS = "replica"
_INSTALLED: list[bool] = []
_OBJECTS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # optimizers and metrics, to name owners in errors


def install() -> None:
    """Installs the hooks (idempotent)."""
    if _INSTALLED:
        return
    from keras.src.backend.jax.core import JaxVariable
    from keras.src.metrics.metric import Metric
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    from distribute.keras_support import trainer

    _patch(JaxVariable, "_initialize_layout", _variable_initialize_layout)
    _patch(BaseOptimizer, "__init__", _optimizer_init)
    _patch(BaseOptimizer, "apply", _optimizer_apply)
    _patch(Metric, "__init__", _metric_init)
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
            if not strategy.extended._owns(self):
                raise ValueError(
                    f"{describe_object(self)} was created outside strategy.scope() and is used "
                    f"inside {strategy!r}.run. Create it inside the scope: "
                    "`with strategy.scope(): optimizer = keras.optimizers.Adam(...)`."
                )
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
