"""The Keras seam of ParameterServerStrategy: the patches that turn Keras state into ps updates.

The wrappers of ``keras_support/patches.py``'s ``PARAMETER_SERVER`` rows, on top
of the ``CORE`` ones (each changes nothing outside a ParameterServerStrategy):

* a Keras variable created in a ps strategy's scope asks the strategy where it
  lives, as every variable does (``extended.place_variable``: registered in
  creation order, so placement is round-robin as TF's); an optimizer slot
  (``add_variable_from_reference``, a ``CORE`` row) is colocated with its model
  variable, as TF colocates slots (``_context.colocated_with``);
* ``assign_add`` / ``assign_sub`` inside a scheduled function are recorded as
  additive deltas (Keras turns them into ``assign``, which would make a metric's
  total last-writer-wins); a plain ``assign`` stays an overwrite;
* ``optimizer.apply`` inside a scheduled function records the gradients (clipped
  on the worker, as TF clips before the apply ops) instead of updating: the ps
  that owns each variable applies them with its current optimizer state; inside
  :func:`local_updates` (the first ``K - 1`` steps of a ``steps_per_execution=K``
  closure) it also updates the worker's copies, so the next step of the closure
  sees them, as a TF worker reads the ps after each step's update; an optimizer
  whose update the ps cannot express raises :func:`check_optimizer`'s error;
* an assignment on the coordinator (``set_weights``, a checkpoint restore,
  ``metric.reset_state()``) is pushed to the ps (the placement's ``on_assign``);
* Keras' ``.keras`` / ``.weights.h5`` writer stores a table the coordinator
  does not hold (``Placement.remote``) piece by piece from its ps
  (:func:`h5_setitem`), never whole;
* ``Model.fit`` / ``evaluate`` / ``predict`` of a model built in a ps strategy's
  scope go to ``extended.keras_fit`` / ``keras_evaluate`` / ``keras_predict``
  (``parameter_server/keras_fit.py``, ``keras_eval.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp

from distribute import _context
from distribute._keras import BaseOptimizer, H5IOStore, JAXTrainer, KerasVariable, get_stateless_scope, initialize_all_variables, keras_backend
from distribute.lifting import LiftingScope
from distribute.strategy import CoordinatedStrategy

_LOCAL_UPDATES: contextvars.ContextVar[bool] = contextvars.ContextVar("distribute_ps_local_updates", default=False)

__all__ = [
    "H5IOStore", "KerasVariable", "PSApplyScope", "PSTraceScope", "check_optimizer", "initialize_all_variables",
    "local_updates", "without_clipping",
]


class PSTraceScope(LiftingScope):
    """The scope a scheduled function is traced in on the coordinator.

    Records, besides reads and writes: ``plain`` (variables assigned with
    ``assign``), ``deltas`` (the summed ``assign_add``/``assign_sub`` arguments of
    the others), ``applies`` (``(optimizer, variables, gradients, iterations)``
    per ``optimizer.apply``, ``iterations`` the step count that update sees) and
    ``local`` (variables written only by a worker-side copy of an update, inside
    :func:`local_updates`: never pushed, the ps applies the gradients itself).
    """

    def __init__(self, mapping: dict):
        super().__init__(mapping)
        self.plain: set[int] = set()
        self.deltas: dict[int, Any] = {}
        self.applies: list[tuple[Any, list, list, Any]] = []
        self.local: set[int] = set()
        self._adding = 0
        self._simulating = 0

    def add_update(self, update: tuple) -> None:
        super().add_update(update)
        if self._simulating:
            self.plain.discard(id(update[0]))
            self.local.add(id(update[0]))
        elif not self._adding:
            self.plain.add(id(update[0]))
            self.local.discard(id(update[0]))


class PSApplyScope(LiftingScope):
    """The scope an optimizer's update is traced in for one ps (reads and writes only)."""


def additive_of(sign: int):
    """The ``Patch.wrap`` of ``assign_add`` (``sign`` 1) or ``assign_sub`` (-1)."""
    return functools.partial(additive, sign=sign)


def route_under_ps_of(name: str):
    """The ``Patch.wrap`` of ``fit`` / ``evaluate`` / ``predict``."""
    return functools.partial(route_under_ps, name=name)


def additive(original, sign: int):
    def assign_additive(self, value):
        scope = get_stateless_scope()
        if not isinstance(scope, PSTraceScope) or scope._simulating:
            return original(self, value)
        scope._adding += 1
        try:
            result = original(self, value)
        finally:
            scope._adding -= 1
        scope.local.discard(id(self))
        delta = jnp.asarray(value, dtype=self.dtype) * sign
        previous = scope.deltas.get(id(self))
        scope.deltas[id(self)] = delta if previous is None else previous + delta
        return result

    return assign_additive


colocated_with = _context.colocated_with  # an optimizer slot's model variable (patches.py's CORE row)
colocate = _context.colocate


def optimizer_apply(original):
    def apply(self, grads, trainable_variables=None):
        scope = get_stateless_scope()
        if not isinstance(scope, PSTraceScope):
            return original(self, grads, trainable_variables)
        check_optimizer(self)
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
            clipped = list(self._clip_gradients([g for g, _ in pairs]))
            scope.applies.append((self, [v for _, v in pairs], clipped, self._iterations.value))
            if _LOCAL_UPDATES.get():
                _update_worker_copies(original, self, scope, clipped, [v for _, v in pairs])
        self._iterations.assign_add(1)
        return None

    return apply


def optimizer_apply_gradients(original):
    def apply_gradients(self, grads_and_vars):
        if isinstance(get_stateless_scope(), PSTraceScope):
            check_optimizer(self)  # before a wrapper's own apply() runs
        return original(self, grads_and_vars)

    return apply_gradients


def _update_worker_copies(apply: Any, optimizer: Any, scope: PSTraceScope, grads: list, variables: list) -> None:
    """Runs ``optimizer``'s update on the worker's copies (not pushed: the ps applies the gradients)."""
    iterations = scope.state_mapping.get(id(optimizer._iterations))
    scope._simulating += 1
    try:
        with without_clipping(optimizer):
            apply(optimizer, grads, variables)
    finally:
        scope._simulating -= 1
    if iterations is not None:  # the update's own count; apply() below adds the recorded 1
        scope.state_mapping[id(optimizer._iterations)] = iterations


@contextlib.contextmanager
def local_updates() -> Iterator[None]:
    """Inside: ``optimizer.apply`` in a scheduled function also updates the worker's copies (packed steps)."""
    token = _LOCAL_UPDATES.set(True)
    try:
        yield
    finally:
        _LOCAL_UPDATES.reset(token)


# An optimizer class that defines one of these (other than Keras' base classes) has its own apply logic.
_CUSTOM_APPLY = ("apply", "apply_gradients", "stateless_apply", "_backend_apply_gradients")


def check_optimizer(optimizer: Any) -> None:
    """Raises when ``optimizer``'s update would silently go wrong under asynchronous parameter servers.

    Under ParameterServerStrategy each ps applies, on its own, the gradients of the
    variables it holds, with the update of ``optimizer.update_step`` (TF runs the
    apply ops on the ps the same way).  An update that decides over all the
    gradients of a step at once, or across steps, cannot be split that way.

    Raises:
        NotImplementedError: ``keras.optimizers.LossScaleOptimizer`` (dynamic loss
            scaling: one finite-check over all gradients), an optimizer that wraps
            other optimizers or overrides ``apply``/``apply_gradients``
            (``keras.optimizers.MultiOptimizer`` and wrappers like it), or
            ``gradient_accumulation_steps`` (the ps would accumulate each
            worker's gradients against its own step count).
    """
    import keras

    name = type(optimizer).__name__
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise NotImplementedError(
            f"optimizer {name!r} (dynamic loss scaling) is not supported under ParameterServerStrategy: it checks all "
            "of a step's gradients at once and then either applies them or lowers the scale, but each parameter "
            "server applies the gradients of its own variables asynchronously, so the ps cannot make that decision. "
            "Use the inner optimizer with a fixed scale, e.g. keras.optimizers.Adam(loss_scale_factor=1024.0), and a "
            "'float32' or 'mixed_bfloat16' dtype policy ('mixed_float16' makes compile() wrap the optimizer in a "
            "LossScaleOptimizer)."
        )
    bases = {BaseOptimizer, keras.optimizers.Optimizer, *keras.optimizers.Optimizer.__mro__}
    inner = [v for v in vars(optimizer).values() if _holds_optimizer(v)]
    custom = [m for cls in type(optimizer).__mro__ if cls not in bases for m in _CUSTOM_APPLY if m in vars(cls)]
    if inner or custom:
        what = "wraps other optimizers" if inner else f"overrides `{custom[0]}`"
        raise NotImplementedError(
            f"optimizer {name!r} {what}; ParameterServerStrategy cannot run that update: each parameter server "
            "applies the gradients of its own variables with the optimizer's per-variable `update_step`, so an "
            "update that routes variables to other optimizers or changes `apply` would be silently skipped or split. "
            "Use one Keras optimizer (override `update_step` for a custom rule), or train with another strategy."
        )
    if optimizer.gradient_accumulation_steps:
        raise NotImplementedError(
            f"optimizer {name!r} with gradient_accumulation_steps={optimizer.gradient_accumulation_steps} is not "
            "supported under ParameterServerStrategy: under asynchronous training the ps would accumulate gradients "
            "from several workers against step counts each worker read at a different time. Drop "
            "gradient_accumulation_steps (use a bigger batch, or steps_per_execution to pack steps per closure)."
        )


def _holds_optimizer(value: Any) -> bool:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, BaseOptimizer):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, BaseOptimizer) for v in value)


_STEP_OF = {"fit": "train_step", "evaluate": "test_step", "predict": "predict_step"}


def route_under_ps(original, name: str):
    def method(self, *args, **kwargs):
        strategy = self.__dict__.get("_distribute_strategy")
        if isinstance(strategy, CoordinatedStrategy):
            step = _STEP_OF[name]
            if getattr(type(self), step) is not getattr(JAXTrainer, step):
                raise NotImplementedError(
                    f"{type(self).__name__} overrides {step}; under ParameterServerStrategy, {name} runs Keras' own "
                    f"step on the workers (each update applied by the ps). Override compute_loss instead (it runs "
                    f"there), or write the step as a custom loop: coordinator.schedule of a function that calls "
                    f"strategy.run (docs/guides/parameter_servers.md)."
                )
            return getattr(strategy.extended, f"keras_{name}")(self, args, kwargs)
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


def initial_epoch(model: Any, initial_epoch: int) -> int:
    """The epoch fit starts at after ``on_train_begin``: a BackupAndRestore's restored epoch, else ``initial_epoch``.

    Keras' trainers read ``model._initial_epoch`` (set by ``BackupAndRestore``) the same way.
    """
    return getattr(model, "_initial_epoch", None) or initial_epoch


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

    Forward pass, the compiled loss (``model.compute_loss``), gradients of the
    loss scaled by the optimizer's ``loss_scale_factor`` (as Keras' JAX trainer;
    the ps update unscales them) applied by the owning ps, the loss tracker (the
    unscaled loss, weighted by the batch size, as Keras) and the compiled metrics
    (``model.compute_metrics``), all recorded as ps updates.
    """
    from distribute.keras_support.gradients import compute_gradients

    optimizer = model.optimizer

    def replica_fn(x, y, sample_weight):
        def loss_fn():
            y_pred = model(x, training=True)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            return optimizer.scale_loss(loss), (loss, y_pred)

        (_, (loss, y_pred)), grads = compute_gradients(loss_fn, model.trainable_variables, has_aux=True)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        _update_metrics(model, loss, x, y, y_pred, sample_weight)
        return loss

    return replica_fn


def test_replica_fn(model: Any) -> Any:
    """``replica_fn(x, y, sample_weight) -> loss``: one Keras test step (Keras' ``test_step``), traced.

    Forward pass with ``training=False``, the compiled loss, the loss tracker and
    the compiled metrics, recorded as additive ps updates (exact totals).
    """

    def replica_fn(x, y, sample_weight):
        y_pred = model(x, training=False)
        loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
        _update_metrics(model, loss, x, y, y_pred, sample_weight)
        return loss

    return replica_fn


def _update_metrics(model: Any, loss: Any, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> None:
    import jax

    batch = next(a for a in jax.tree_util.tree_leaves(x) if a is not None).shape[0]
    model._loss_tracker.update_state(loss, sample_weight=batch)
    model.compute_metrics(x, y, y_pred, sample_weight)


def cached(model: Any, name: str, make: Any) -> Any:
    """``make()``, kept on ``model`` while its compiled state (optimizer, loss, metrics) is unchanged.

    So a second ``fit``/``evaluate`` reuses the scheduled functions, hence the
    programs traced for them (``schedule`` traces once per function and signature).
    """
    state = (model.optimizer, getattr(model, "_compile_loss", None), getattr(model, "_compile_metrics", None))
    entry = model.__dict__.get(name)
    if entry is not None and all(a is b for a, b in zip(entry[0], state)):
        return entry[1]
    value = make()
    object.__setattr__(model, name, (state, value))
    return value


def metrics_in_order(model: Any, logs: dict) -> Any:
    """``evaluate``'s list result: Keras' ``_flatten_metrics_in_order`` (a scalar when only the loss)."""
    return model._flatten_metrics_in_order(logs)


def h5_setitem(original):
    """``H5IOStore.__setitem__``: a remote variable (a large ps table) is written in row pieces read from its ps."""

    def __setitem__(self, key, value):
        placement = value.__dict__.get("_distribute_placement") if isinstance(value, KerasVariable) else None
        if placement is None or not placement.remote(value) or value.dtype == "bfloat16" or self.mode not in ("w", "a"):
            return original(self, key, value)
        if not self._h5_entry_initialized:
            self._create_h5_group(self._h5_entry_path)
        dataset = self._h5_entry_group.create_dataset(key, shape=tuple(value.shape), dtype=value.dtype)
        for start, rows in placement.row_pieces(value):
            dataset[start : start + len(rows)] = rows
        return None

    return __setitem__
