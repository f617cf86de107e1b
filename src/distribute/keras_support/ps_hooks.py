"""The Keras seam of ParameterServerStrategy: the patches that turn Keras state into ps updates.

``install()`` adds, on top of ``hooks.install()`` (each patch changes nothing
outside a ParameterServerStrategy):

* a Keras variable created in a ps strategy's scope is registered with the
  strategy at creation (``extended._on_variable_created``), in creation order,
  so placement is round-robin as TF's; an optimizer slot (``add_variable_from_reference``)
  is colocated with its model variable, as TF colocates slots;
* ``assign_add`` / ``assign_sub`` inside a scheduled function are recorded as
  additive deltas (Keras turns them into ``assign``, which would make a metric's
  total last-writer-wins); a plain ``assign`` stays an overwrite;
* ``optimizer.apply`` inside a scheduled function records the gradients (clipped
  on the worker, as TF clips before the apply ops) instead of updating: the ps
  that owns each variable applies them with its current optimizer state;
* an assignment on the coordinator (``set_weights``, a checkpoint restore,
  ``metric.reset_state()``) is pushed to the ps.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp

from distribute import _context
from distribute._keras import BaseOptimizer, JAXTrainer, JaxVariable, KerasVariable, get_stateless_scope, initialize_all_variables, keras_backend
from distribute._keras import patch as _patch
from distribute.tracing import LiftingScope

_INSTALLED: list[bool] = []
_COLOCATE: contextvars.ContextVar[Any] = contextvars.ContextVar("distribute_ps_colocate", default=None)

__all__ = ["KerasVariable", "PSApplyScope", "PSTraceScope", "initialize_all_variables", "install", "without_clipping"]


class PSTraceScope(LiftingScope):
    """The scope a scheduled function is traced in on the coordinator.

    Records, besides reads and writes: ``plain`` (variables assigned with
    ``assign``), ``deltas`` (the summed ``assign_add``/``assign_sub`` arguments of
    the others) and ``applies`` (``(optimizer, variables, gradients)`` per
    ``optimizer.apply``).
    """

    def __init__(self, mapping: dict):
        super().__init__(mapping)
        self.plain: set[int] = set()
        self.deltas: dict[int, Any] = {}
        self.applies: list[tuple[Any, list, list]] = []
        self._adding = 0

    def add_update(self, update: tuple) -> None:
        super().add_update(update)
        if not self._adding:
            self.plain.add(id(update[0]))


class PSApplyScope(LiftingScope):
    """The scope an optimizer's update is traced in for one ps (reads and writes only)."""


def install() -> None:
    """Installs the patches (idempotent); also installs ``hooks.install()`` first."""
    if _INSTALLED:
        return
    from distribute.keras_support import hooks

    hooks.install()
    _patch(KerasVariable, "__init__", _variable_init)
    _patch(KerasVariable, "assign_add", functools.partial(_additive, sign=1))
    _patch(KerasVariable, "assign_sub", functools.partial(_additive, sign=-1))
    _patch(JaxVariable, "_direct_assign", _direct_assign)
    _patch(BaseOptimizer, "add_variable_from_reference", _add_variable_from_reference)
    _patch(BaseOptimizer, "apply", _optimizer_apply)
    for name in ("fit", "evaluate", "predict"):
        _patch(JAXTrainer, name, functools.partial(_refuse_under_ps, name=name))
    _INSTALLED.append(True)


def _variable_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        strategy = _context.scope_strategy()
        callback = getattr(getattr(strategy, "extended", None), "_on_variable_created", None)
        if callback is not None:
            callback(self, _COLOCATE.get())

    return __init__


def _additive(original, sign: int):
    def assign_additive(self, value):
        scope = get_stateless_scope()
        if not isinstance(scope, PSTraceScope):
            return original(self, value)
        scope._adding += 1
        try:
            result = original(self, value)
        finally:
            scope._adding -= 1
        delta = jnp.asarray(value, dtype=self.dtype) * sign
        previous = scope.deltas.get(id(self))
        scope.deltas[id(self)] = delta if previous is None else previous + delta
        return result

    return assign_additive


def _direct_assign(original):
    def _direct_assign(self, value):
        original(self, value)
        callback = self.__dict__.get("_distribute_on_assign")
        if callback is not None:
            callback(self)

    return _direct_assign


def _add_variable_from_reference(original):
    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        token = _COLOCATE.set(reference_variable)
        try:
            return original(self, reference_variable, *args, **kwargs)
        finally:
            _COLOCATE.reset(token)

    return add_variable_from_reference


def _optimizer_apply(original):
    def apply(self, grads, trainable_variables=None):
        scope = get_stateless_scope()
        if not isinstance(scope, PSTraceScope):
            return original(self, grads, trainable_variables)
        grads = list(grads)
        if not grads:
            return None
        variables = list(self._trainable_variables if trainable_variables is None else trainable_variables)
        if not self.built:
            with keras_backend.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if pairs:
            clipped = self._clip_gradients([g for g, _ in pairs])
            scope.applies.append((self, [v for _, v in pairs], list(clipped)))
        self._iterations.assign_add(1)
        return None

    return apply


def _refuse_under_ps(original, name: str):
    def method(self, *args, **kwargs):
        strategy = self.__dict__.get("_distribute_strategy")
        if getattr(strategy, "_should_use_with_coordinator", False) and name == "fit":
            return strategy.extended._keras_fit(self, args, kwargs)
        if getattr(strategy, "_should_use_with_coordinator", False):
            raise NotImplementedError(
                f"Model.{name} under ParameterServerStrategy is not supported yet (Model.fit is). Use a custom loop: "
                "schedule a step function with distribute.coordinator.ClusterCoordinator(strategy).schedule(step, "
                "args=(iter(coordinator.create_per_worker_dataset(dataset_fn)),)), then coordinator.join() "
                "(see the README's parameter-server section)."
            )
        return original(self, *args, **kwargs)

    return method


@contextlib.contextmanager
def without_clipping(optimizer: Any) -> Iterator[None]:
    """The optimizer's update without gradient clipping (the worker clipped already)."""
    saved = optimizer.clipnorm, optimizer.clipvalue, optimizer.global_clipnorm
    optimizer.clipnorm = optimizer.clipvalue = optimizer.global_clipnorm = None
    try:
        yield
    finally:
        optimizer.clipnorm, optimizer.clipvalue, optimizer.global_clipnorm = saved


# -- Model.fit under ParameterServerStrategy (parameter_server/keras_fit.py): the Keras internals it needs --------
def build_fit_state(model: Any, data_batch: Any) -> None:
    """Builds the model, its compiled loss and metrics from ``data_batch`` (Keras' symbolic build); call in scope."""
    model._symbolic_build(data_batch=data_batch)


def fit_state_built(model: Any) -> bool:
    """Whether the model and its compiled metrics are built (fit can then start without a batch)."""
    metrics = model._compile_metrics
    return bool(model.built) and (metrics is None or metrics.built)


def unpack_x_y_sample_weight(data: Any) -> tuple:
    """Keras' ``(x, y, sample_weight)`` of a batch."""
    from distribute._keras import data_adapter_utils

    return data_adapter_utils.unpack_x_y_sample_weight(data)


def fit_replica_fn(model: Any) -> Any:
    """``replica_fn(x, y, sample_weight) -> loss``: one Keras train step, traced into a scheduled function.

    Forward pass, the compiled loss (``model.compute_loss``), gradients applied by
    the owning ps, the loss tracker (weighted by the batch size, as Keras) and the
    compiled metrics (``model.compute_metrics``), all recorded as ps updates.
    """
    import jax

    from distribute.keras_support.gradients import compute_gradients

    optimizer = model.optimizer

    def replica_fn(x, y, sample_weight):
        def loss_fn():
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            return loss, y_pred

        (loss, y_pred), grads = compute_gradients(loss_fn, model.trainable_variables, has_aux=True)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        batch = next(a for a in jax.tree_util.tree_leaves(x) if a is not None).shape[0]
        model._loss_tracker.update_state(loss, sample_weight=batch)
        model.compute_metrics(x, y, y_pred, sample_weight)
        return loss

    return replica_fn
