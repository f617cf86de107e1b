"""The per-replica Keras train, test and predict steps run by distributed fit.

Each builder returns ``step(state, leaves) -> (result, state)`` for one replica:
``leaves`` are this replica's ``(rows, ...)`` slices of the batch (its real rows:
in an uneven step the engine runs every replica on its own rows, see
``uneven.py``).  The step runs inside the replica's context and reaches the
other replicas only through it (``all_reduce``, ``_sum_gradients``,
``_combine_all``), so the same code runs in the SPMD program and in an uneven
step's replica threads.

Exactness (results equal one device's):

* a replica's loss is what the model's ``compute_loss`` (Keras' own or an
  override) returns for its rows, weighted ``n_r / N`` (``replica_loss.py``:
  the one rule, and which losses it makes exact); gradients are summed over
  replicas;
* metric variables are summed over replicas (sync-on-read SUM); then every
  replica feeds the loss tracker the whole batch's loss (identical everywhere).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import jax
import jax.numpy as jnp

from distribute import _context
from distribute._keras import data_adapter_utils, keras_backend, tree
from distribute.keras_support import optimizers, replica_loss


def _unpack(treedef: Any, local_leaves: list) -> tuple:
    data = jax.tree_util.tree_unflatten(treedef, local_leaves)
    return data_adapter_utils.unpack_x_y_sample_weight(data)


_CAPTURE = threading.local()


@contextlib.contextmanager
def _capturing_output_losses(model: Any) -> Iterator[list]:
    """Holds back the per-output loss trackers of a multi-output model.

    Keras' CompileLoss updates one Mean per output with that output's loss on
    this replica (a share of the batch's loss, weighted by this replica's rows).
    The values are captured instead (per thread: an uneven step's replica
    threads share the model), and ``_update_metrics`` feeds each tracker the
    whole batch's loss once, as on one device.
    """
    trackers = list(getattr(getattr(model, "_compile_loss", None), "metrics", None) or [])
    captured: list = [None] * len(trackers)
    for index, tracker in enumerate(trackers):
        if "_distribute_capturing" not in tracker.__dict__:
            object.__setattr__(tracker, "update_state", _capturing(tracker, tracker.update_state))
            object.__setattr__(tracker, "_distribute_capturing", True)
    previous = getattr(_CAPTURE, "slots", None)
    _CAPTURE.slots = {id(tracker): (captured, index) for index, tracker in enumerate(trackers)}
    try:
        yield captured
    finally:
        _CAPTURE.slots = previous


def _capturing(tracker: Any, update_state: Any) -> Any:
    def capture(values, sample_weight=None):
        slot = (getattr(_CAPTURE, "slots", None) or {}).get(id(tracker))
        if slot is None:
            return update_state(values, sample_weight=sample_weight)
        captured, index = slot
        captured[index] = values

    return capture


def _loss(model, trainable, non_trainable, metrics_vars, x, y, sample_weight, training, context):
    """This replica's share of the batch's loss (``replica_loss``'s rule); also its per-output shares (multi-output).

    The model's ``compute_loss`` (Keras' own or an override) runs on the replica's rows with the
    user's sample weights, as on one device; its result, weighted ``n_r / N``, is the replica's share.
    An empty replica of an uneven step computes it too (a loss may meet the other replicas), then
    drops it: its share is zero.
    """
    kwargs = {"training": training} if model._call_has_training_arg else {}
    rows, metrics_before = _rows(x), metrics_vars
    with replica_loss.replica_share(context, rows) as share:
        y_pred, non_trainable, layer_losses = model.stateless_call(trainable, non_trainable, x, return_losses=True, **kwargs)
        if layer_losses:
            model._losses_override = layer_losses
        try:
            with _capturing_output_losses(model) as output_losses:
                loss, (trainable, non_trainable, metrics_vars) = model.stateless_compute_loss(
                    trainable, non_trainable, metrics_vars, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
                )
        finally:
            if layer_losses:
                model._losses_override = []
    # Metrics updated inside compute_loss (a tracker of the loss, keras.distillation.Distiller's): each
    # replica's change is weighted by its share of the rows, R n_r / N (1 on even batches), so that the
    # replicas' changes, summed, are one device's update (a Mean of the batch's loss: once, its value).
    metrics_vars = _weighted_changes(metrics_vars, metrics_before, share * context.num_replicas_in_sync)
    if rows == 0:
        # Depend on the (empty) outputs, so the backward pass meets the other replicas at
        # every collective of the forward pass (synchronized BatchNorm).
        loss = sum((jnp.sum(p).astype(jnp.float32) for p in tree.flatten(y_pred)), jnp.zeros((), jnp.float32))
        return loss, y_pred, non_trainable, metrics_vars, [jnp.zeros((), jnp.float32) for _ in output_losses]
    weight = jnp.asarray(share, jnp.result_type(loss))
    return loss * weight, y_pred, non_trainable, metrics_vars, [None if v is None else v * share for v in output_losses]


def _weighted_changes(new: list, old: list, factor: float) -> list:
    """``old + (new - old) * factor`` for each floating variable that changed (``factor`` 0: ``old``).

    ``factor`` 0 (an empty replica of an uneven step) keeps ``old`` itself, not ``old + change * 0``:
    a mean over zero rows is NaN, and NaN * 0 is NaN, which the replicas' sum would carry into the metric.
    """
    if factor == 1:
        return list(new)
    if factor == 0:
        return list(old)
    out = []
    for n, o in zip(new, old):
        if n is o or not jnp.issubdtype(jnp.result_type(o), jnp.floating):
            out.append(n)
        else:
            out.append((o + (n - o) * jnp.asarray(factor, jnp.result_type(o))).astype(jnp.result_type(o)))
    return out


def _rows(x: Any) -> int:
    first = tree.flatten(x)[0]
    return int(first.shape[0]) if getattr(first, "ndim", 0) else 1


def _compiled_metrics(model, metrics_vars, x, y, y_pred, sample_weight) -> list:
    """The compiled metrics' variables after this replica's rows (no collectives)."""
    if _rows(x) == 0:  # Keras' metrics do not take empty batches; nothing to count anyway
        return list(metrics_vars)
    mapping = list(zip(model.metrics_variables, metrics_vars))
    with keras_backend.StatelessScope(state_mapping=mapping) as scope:
        model.compute_metrics(x, y, y_pred, sample_weight)
    return [old if scope.get_current_value(ref) is None else scope.get_current_value(ref) for ref, old in zip(model.metrics_variables, metrics_vars)]


def _update_metrics(model, context, start_vars, metrics_vars, loss, output_losses):
    """Sums the metric variables over replicas, then updates the loss trackers with the whole batch's loss.

    ``start_vars`` are the metric variables at the start of the step: each
    replica's change since then is added up (sync-on-read SUM).  ``loss`` and
    ``output_losses`` are this replica's shares.  The replicas' losses are summed
    beside the metrics' changes (neither waits for the other, so XLA makes one
    all-reduce of them and the gradients); every replica then feeds each tracker
    the same whole-batch loss, weighted by the batch's rows, as one device does:
    the trackers come out identical on every replica with no further exchange.
    """
    global_loss = context.all_reduce("SUM", loss)
    output_totals = [None if value is None else context.all_reduce("SUM", value) for value in output_losses]
    combined = context._combine_all(list(model.metrics_variables), list(metrics_vars), list(start_vars))
    weight = jnp.float32(context._global_rows)
    mapping = list(zip(model.metrics_variables, combined))
    with keras_backend.StatelessScope(state_mapping=mapping) as scope:
        model._loss_tracker.update_state(global_loss, sample_weight=weight)
        trackers = getattr(getattr(model, "_compile_loss", None), "metrics", None) or []
        for tracker, value in zip(trackers, output_totals):
            if value is not None:
                tracker.update_state(value, sample_weight=weight)
    new = []
    for ref, old in zip(model.metrics_variables, combined):
        value = scope.get_current_value(ref)
        new.append(old if value is None else value)
    with keras_backend.StatelessScope(state_mapping=list(zip(model.metrics_variables, new))):
        logs = model.get_metrics_result()
    return logs, new


def train_step(model: Any, strategy: Any, variables: list, treedef: Any):
    """One replica's training step; ``variables`` = [trainable, non_trainable, optimizer, metrics]."""

    def local(trainable, non_trainable, opt_vars, metrics_vars, leaves):
        context = _context.current_replica_context()
        x, y, sample_weight = _unpack(treedef, leaves)

        def loss_fn(trainable_):
            loss, y_pred, non_trainable_, metrics_, output_losses = _loss(model, trainable_, non_trainable, metrics_vars, x, y, sample_weight, True, context)
            scaled = loss
            if model.optimizer is not None:
                mapping = list(zip(model.optimizer.variables, opt_vars))
                with keras_backend.StatelessScope(state_mapping=mapping):
                    scaled = model.optimizer.scale_loss(loss)
            return scaled, (loss, y_pred, non_trainable_, metrics_, output_losses)

        # Each replica's own gradients of its float32 variables (summed or reduce-scattered by the update), as TF
        # all-reduces them: not autodiff's implicit sum, which under mixed precision adds float16 partials.
        differentiated = context._prepare_for_gradients(list(trainable))
        (_, (loss, y_pred, new_non_trainable, new_metrics, output_losses)), grads = jax.value_and_grad(loss_fn, has_aux=True)(differentiated)
        new_metrics = _compiled_metrics(model, new_metrics, x, y, y_pred, sample_weight)
        return loss, new_non_trainable, new_metrics, output_losses, grads

    def step(state, leaves):
        context = _context.current_replica_context()
        trainable, non_trainable, opt_vars, metrics_vars = state
        with replica_loss.fit_step():
            loss, new_non_trainable, new_metrics, output_losses, grads = local(trainable, non_trainable, opt_vars, metrics_vars, leaves)
            logs, new_metrics = _update_metrics(model, context, metrics_vars, new_metrics, loss, output_losses)
        new_trainable, new_opt = optimizers.stateless_apply(context, model.optimizer, opt_vars, grads, trainable)
        state = (
            list(new_trainable),
            context._combine_all(variables[1], new_non_trainable, non_trainable),
            context._combine_all(variables[2], new_opt, opt_vars),
            new_metrics,
        )
        return logs, state

    return step


def test_step(model: Any, strategy: Any, variables: list, treedef: Any):
    """One replica's evaluation step; ``variables`` = [trainable, non_trainable, metrics]."""

    def local(trainable, non_trainable, metrics_vars, leaves):
        context = _context.current_replica_context()
        x, y, sample_weight = _unpack(treedef, leaves)
        loss, y_pred, new_non_trainable, new_metrics, output_losses = _loss(model, trainable, non_trainable, metrics_vars, x, y, sample_weight, False, context)
        return loss, new_non_trainable, _compiled_metrics(model, new_metrics, x, y, y_pred, sample_weight), output_losses

    def step(state, leaves):
        context = _context.current_replica_context()
        trainable, non_trainable, metrics_vars = state
        with replica_loss.fit_step():
            loss, new_non_trainable, new_metrics, output_losses = local(trainable, non_trainable, metrics_vars, leaves)
            logs, new_metrics = _update_metrics(model, context, metrics_vars, new_metrics, loss, output_losses)
        return logs, (list(trainable), context._combine_all(variables[1], new_non_trainable, non_trainable), new_metrics)

    return step


def predict_step(model: Any, strategy: Any, variables: list, treedef: Any):
    """One replica's prediction step; outputs ``(rows, ...)`` per replica."""

    def local(trainable, non_trainable, leaves):
        x, _, _ = _unpack(treedef, leaves)
        kwargs = {"training": False} if model._call_has_training_arg else {}
        return model.stateless_call(trainable, non_trainable, x, **kwargs)

    def step(state, leaves):
        context = _context.current_replica_context()
        trainable, non_trainable = state
        outputs, new_non_trainable = local(trainable, non_trainable, leaves)
        return outputs, (list(trainable), context._combine_all(variables[1], new_non_trainable, non_trainable))

    return step
