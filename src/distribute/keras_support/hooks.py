"""What makes Keras variables, optimizers and metrics created in scope distribution-aware.

``install()`` patches four Keras methods once, each keeping Keras' behaviour
outside a strategy:

* a JAX Keras variable initialized inside a strategy's scope is placed
  replicated on the strategy's mesh (a MirroredVariable) and remembers the
  strategy (``variable_created_in_scope``);
* an optimizer remembers the scope it was created in; its ``apply`` inside
  ``strategy.run`` sums the gradients across replicas first (as TF's
  ``apply_gradients``) and refuses to run for another strategy;
* a metric created in scope remembers the strategy (to refuse another
  strategy's steps);
* in an uneven step, an activity regularizer's loss is rescaled from Keras'
  "divided by this replica's rows" to "divided by the global batch's rows", so
  the replicas' losses add up to one device's;
* inside ``strategy.run`` and fit, each replica draws its own random numbers
  (Dropout masks differ between replicas, as in TF) while the seed generator's
  state stays mirrored;
* a model compiled in scope trains, evaluates and predicts over all replicas
  (``trainer.py``).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import jax.numpy as jnp

from distribute import _context, sync_on_read
from distribute._keras import install_per_thread_attributes
from distribute.tracing import check_ownership

AXIS = "replica"
_INSTALLED: list[bool] = []
_OBJECTS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # optimizers and metrics, to name owners in errors


def install() -> None:
    """Installs the hooks (idempotent)."""
    if _INSTALLED:
        return
    from keras.src.backend.jax.core import JaxVariable
    from keras.src.layers.layer import Layer
    from keras.src.metrics.metric import Metric
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.random.seed_generator import SeedGenerator

    from distribute.keras_support import trainer

    _patch(JaxVariable, "_initialize_layout", _variable_initialize_layout)
    _patch(JaxVariable, "_initialize", _variable_initialized)
    _patch(JaxVariable, "_initialize_with_initializer", _variable_initialized)
    _patch(BaseOptimizer, "__init__", _optimizer_init)
    _patch(BaseOptimizer, "apply", _optimizer_apply)
    _patch(Metric, "__init__", _metric_init)
    _patch(SeedGenerator, "next", _seed_next)
    trainer.install()
    install_per_thread_attributes()
    _install_activity_regularizer_property(Layer)
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


def _variable_initialized(original):
    """After a variable's first value is set: a SyncOnRead one's value becomes its copies' aggregate."""

    def initialize(self, *args):
        outer = not self.__dict__.get("_distribute_initializing")
        self.__dict__["_distribute_initializing"] = True
        try:
            original(self, *args)
        finally:
            if outer:
                del self.__dict__["_distribute_initializing"]
        if outer:
            sync_on_read.on_created(self)

    return initialize


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
            grads = context._sum_gradients(list(grads))
        return original(self, grads, trainable_variables)

    return apply


def _metric_init(original):
    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_distribute_strategy", _context.scope_strategy())
        _OBJECTS.add(self)
        original(self, *args, **kwargs)

    return __init__


def _install_activity_regularizer_property(layer_cls: type) -> None:
    """``Layer.activity_regularizer`` becomes a property that rescales its loss in uneven steps."""

    def get(self):
        regularizer = self.__dict__.get("_distribute_activity_regularizer")
        context = _context.current_replica_context()
        if regularizer is None or context is None or context._global_rows is None:
            return regularizer
        if context._rows * context.num_replicas_in_sync == context._global_rows:
            return regularizer
        return _RescaledRegularizer(regularizer, context._rows, context._rows * context.num_replicas_in_sync / max(context._global_rows, 1))

    def set(self, value):
        self.__dict__["_distribute_activity_regularizer"] = value

    layer_cls.activity_regularizer = property(get, set)


class _RescaledRegularizer:
    """An activity regularizer whose loss is multiplied by ``factor`` on outputs of this replica's rows.

    Keras divides an activity loss by the output's rows ``n_r`` and distributed
    steps divide layer losses by the replica count ``R``; ``factor = n_r R / N``
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


def _owner(variable: Any) -> Any:
    """The most specific optimizer or metric holding ``variable`` (a user's metric, not Keras' MetricsList)."""
    owners = []
    for obj in list(_OBJECTS):
        try:
            owned = obj.variables
        except Exception:  # noqa: BLE001 - an object mid-construction
            continue
        if any(v is variable for v in owned):
            # Fewest variables first; on a tie, not one of Keras' compile containers (CompileMetrics, MetricsList).
            owners.append((len(owned), type(obj).__module__.startswith("keras.src.trainers"), id(obj), obj))
    return min(owners, key=lambda entry: entry[:3])[3] if owners else None


def describe_owner(variable: Any) -> str:
    """Names the optimizer or metric that owns ``variable``, else the variable itself."""
    owner = _owner(variable)
    return describe_object(owner) if owner is not None else f"Keras variable '{variable.path}' (of a layer or model)"


def ownership_error(strategy: Any, variable: Any) -> ValueError:
    """The error for ``variable`` used with ``strategy`` but not made in its scope; names the user's object."""
    owner = _owner(variable)
    what = describe_object(owner) if owner is not None else f"Keras variable '{variable.path}' (of a layer or model)"
    where = getattr(variable, "_distribute_strategy", None)
    made_in = getattr(owner, "_distribute_strategy", None) if owner is not None else None
    if where is None and made_in is strategy:
        if what.startswith("optimizer"):
            verb, fix = "built", "`with strategy.scope(): optimizer.build(model.trainable_variables)` (or let its first apply_gradients inside strategy.run / model.fit build it)"
        else:
            verb, fix = "first used (its variables were created)", "call update_state for the first time inside the scope or inside strategy.run"
        return ValueError(
            f"{what} was created inside {strategy!r}'s scope, but {verb} outside it: its variable "
            f"'{variable.path}' was created outside any strategy.scope(). Build it inside the scope too: {fix}."
        )
    if where is None:
        return ValueError(
            f"{what} was created outside any strategy.scope() and is used with {strategy!r} "
            "(strategy.run or model.fit). Create models, optimizers and metrics inside the scope: "
            "`with strategy.scope(): model = ...; optimizer = ...`."
        )
    return ValueError(
        f"{what} belongs to {where!r} (it was created in that scope) and is used with {strategy!r}. "
        "Use each model, optimizer and metric with the strategy whose scope created it."
    )
