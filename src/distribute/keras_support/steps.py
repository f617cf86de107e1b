"""The per-replica Keras train, test and predict steps run by distributed fit.

Each builder returns ``step(state, leaves, valid) -> (result, state)`` for one
replica inside ``shard_map``: ``leaves`` are this replica's ``(1, rows, ...)``
slices of the batch, ``valid`` its real row count when the batch was padded.

Exactness (results equal one device's):

* the loss rows are weighted ``mask * rows / N`` (N real rows in the global
  batch), so with Keras' ``sum_over_batch_size`` the replicas' losses add up to
  the loss of the whole batch; gradients with respect to the replicated weights
  are summed over replicas by JAX's autodiff;
* losses added by layers (regularization) are divided by the replica count;
* the loss tracker is fed the whole batch's loss once (by replica 0), compiled
  metrics get ``mask`` as sample weight; metric variables are summed over
  replicas (sync-on-read SUM).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import jax
import jax.numpy as jnp
from jax import lax
from keras.src import backend as keras_backend
from keras.src import tree
from keras.src.trainers.data_adapters import data_adapter_utils

from distribute import _context
from distribute.replica import ReplicaContext
from distribute.tracing import _combine_replicas, sum_gradients

AXIS = "replica"
_EXACT_REDUCTIONS = ("sum_over_batch_size", "mean")


def _unpack(treedef: Any, local_leaves: list) -> tuple:
    data = jax.tree_util.tree_unflatten(treedef, local_leaves)
    return data_adapter_utils.unpack_x_y_sample_weight(data)


def _weights(model, x, sample_weight, valid, rows, num_replicas):
    """Per-row weights for the loss (sum over replicas = whole-batch loss) and for metrics."""
    if valid is None:
        mask = jnp.ones((rows,), jnp.float32)
        global_rows = jnp.asarray(rows * num_replicas, jnp.float32)
    else:
        mask = (jnp.arange(rows) < valid[0]).astype(jnp.float32)
        global_rows = lax.psum(valid[0], AXIS).astype(jnp.float32)
    scale = rows / jnp.maximum(global_rows, 1.0)

    def combine(weight, factor):
        if weight is None:
            return factor
        weight = jnp.asarray(weight, jnp.float32)
        return factor.reshape(factor.shape + (1,) * (weight.ndim - 1)) * weight

    loss_weight = tree.map_structure(lambda w: combine(w, mask * scale), sample_weight) if sample_weight is not None else mask * scale
    metric_weight = tree.map_structure(lambda w: combine(w, mask), sample_weight) if sample_weight is not None else mask
    return loss_weight, metric_weight, mask, global_rows


def _check_reductions(model: Any) -> None:
    compile_loss = getattr(model, "_compile_loss", None)
    for entry in getattr(compile_loss, "_flat_losses", None) or []:
        reduction = getattr(entry[1], "reduction", "sum_over_batch_size")
        if reduction not in _EXACT_REDUCTIONS:
            raise NotImplementedError(
                f"Loss {getattr(entry[1], 'name', entry[1])!r} has reduction={reduction!r}; "
                "distributed fit splits the loss between replicas exactly only for the "
                "default reduction='sum_over_batch_size'. Use that reduction, or a custom "
                "loop with strategy.run."
            )


@contextlib.contextmanager
def _capturing_output_losses(model: Any) -> Iterator[list]:
    """Holds back the per-output loss trackers of a multi-output model.

    Keras' CompileLoss updates one Mean per output with that output's loss on
    this replica (a share of the batch's loss, weighted by this replica's rows).
    The values are captured instead, and ``_update_metrics`` feeds each tracker
    the whole batch's loss once, as on one device.
    """
    trackers = list(getattr(getattr(model, "_compile_loss", None), "metrics", None) or [])
    captured: list = [None] * len(trackers)
    saved = [tracker.__dict__.get("update_state") for tracker in trackers]

    def capture(index: int):
        def update_state(values, sample_weight=None):
            captured[index] = values

        return update_state

    for index, tracker in enumerate(trackers):
        object.__setattr__(tracker, "update_state", capture(index))
    try:
        yield captured
    finally:
        for tracker, method in zip(trackers, saved):
            if method is None:
                object.__delattr__(tracker, "update_state")
            else:
                object.__setattr__(tracker, "update_state", method)


def _loss(model, trainable, non_trainable, metrics_vars, x, y, loss_weight, training, num_replicas):
    """This replica's share of the batch's loss; also returns the per-output losses (multi-output)."""
    kwargs = {"training": training} if model._call_has_training_arg else {}
    y_pred, non_trainable, layer_losses = model.stateless_call(trainable, non_trainable, x, return_losses=True, **kwargs)
    if layer_losses:
        # Every replica adds the layers' losses; each adds its share.
        model._losses_override = [loss / num_replicas for loss in layer_losses]
    with _capturing_output_losses(model) as output_losses:
        loss, (trainable, non_trainable, metrics_vars) = model.stateless_compute_loss(
            trainable, non_trainable, metrics_vars, x=x, y=y, y_pred=y_pred, sample_weight=loss_weight, training=training
        )
    if layer_losses:
        model._losses_override = []
    _check_reductions(model)
    return loss, y_pred, non_trainable, metrics_vars, output_losses


def _update_metrics(model, start_vars, metrics_vars, global_loss, output_losses, global_rows, x, y, y_pred, metric_weight):
    """Updates the loss trackers (once, by replica 0) and compiled metrics; sums them over replicas.

    ``start_vars`` are the metric variables at the start of the step: each
    replica's change since then is added up (sync-on-read SUM).
    """
    first = lax.axis_index(AXIS) == 0
    weight = jnp.where(first, global_rows, 0.0)
    mapping = list(zip(model.metrics_variables, metrics_vars))
    with keras_backend.StatelessScope(state_mapping=mapping) as scope:
        model._loss_tracker.update_state(global_loss, sample_weight=weight)
        trackers = getattr(getattr(model, "_compile_loss", None), "metrics", None) or []
        for tracker, value in zip(trackers, output_losses):
            if value is not None:
                tracker.update_state(lax.psum(value, AXIS), sample_weight=weight)
        model.compute_metrics(x, y, y_pred, metric_weight)
    new = []
    for ref, old in zip(model.metrics_variables, metrics_vars):
        value = scope.get_current_value(ref)
        new.append(old if value is None else value)
    new = [_combine_replicas(ref, value, start) for ref, value, start in zip(model.metrics_variables, new, start_vars)]
    with keras_backend.StatelessScope(state_mapping=list(zip(model.metrics_variables, new))):
        logs = model.get_metrics_result()
    return logs, new


def _replica_context(strategy, valid, rows):
    return ReplicaContext(strategy, in_program=True, valid_count=None if valid is None else valid[0], padded_rows=rows)




def _fold(variables, new, old):
    return [_combine_replicas(v, n, o) for v, n, o in zip(variables, new, old)]


def train_step(model: Any, strategy: Any, variables: list, treedef: Any, rows: int):
    """One replica's training step; ``variables`` = [trainable, non_trainable, optimizer, metrics]."""
    num_replicas = strategy.num_replicas_in_sync

    def step(state, leaves, valid):
        trainable, non_trainable, opt_vars, metrics_vars = state
        x, y, sample_weight = _unpack(treedef, [leaf[0] for leaf in leaves])
        loss_weight, metric_weight, _, global_rows = _weights(model, x, sample_weight, valid, rows, num_replicas)
        with _context.enter_replica(strategy, _replica_context(strategy, valid, rows)):

            def loss_fn(trainable_):
                loss, y_pred, non_trainable_, metrics_, output_losses = _loss(model, trainable_, non_trainable, metrics_vars, x, y, loss_weight, True, num_replicas)
                scaled = loss
                if model.optimizer is not None:
                    mapping = list(zip(model.optimizer.variables, opt_vars))
                    with keras_backend.StatelessScope(state_mapping=mapping):
                        scaled = model.optimizer.scale_loss(loss)
                return scaled, (loss, y_pred, non_trainable_, metrics_, output_losses)

            (_, (loss, y_pred, new_non_trainable, new_metrics, output_losses)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
            logs, new_metrics = _update_metrics(model, metrics_vars, new_metrics, lax.psum(loss, AXIS), output_losses, global_rows, x, y, y_pred, metric_weight)
        # Outside the replica context: the hooked optimizer would check again.
        new_trainable, new_opt = model.optimizer.stateless_apply(opt_vars, sum_gradients(grads), trainable)
        state = (list(new_trainable), _fold(variables[1], new_non_trainable, non_trainable), _fold(variables[2], new_opt, opt_vars), new_metrics)
        return logs, state

    return step


def test_step(model: Any, strategy: Any, variables: list, treedef: Any, rows: int):
    """One replica's evaluation step; ``variables`` = [trainable, non_trainable, metrics]."""
    num_replicas = strategy.num_replicas_in_sync

    def step(state, leaves, valid):
        trainable, non_trainable, metrics_vars = state
        x, y, sample_weight = _unpack(treedef, [leaf[0] for leaf in leaves])
        loss_weight, metric_weight, _, global_rows = _weights(model, x, sample_weight, valid, rows, num_replicas)
        with _context.enter_replica(strategy, _replica_context(strategy, valid, rows)):
            loss, y_pred, new_non_trainable, new_metrics, output_losses = _loss(model, trainable, non_trainable, metrics_vars, x, y, loss_weight, False, num_replicas)
            logs, new_metrics = _update_metrics(model, metrics_vars, new_metrics, lax.psum(loss, AXIS), output_losses, global_rows, x, y, y_pred, metric_weight)
        return logs, (list(trainable), _fold(variables[1], new_non_trainable, non_trainable), new_metrics)

    return step


def predict_step(model: Any, strategy: Any, variables: list, treedef: Any, rows: int):
    """One replica's prediction step; outputs ``(1, rows, ...)`` per replica."""

    def step(state, leaves, valid):
        trainable, non_trainable = state
        x, _, _ = _unpack(treedef, [leaf[0] for leaf in leaves])
        kwargs = {"training": False} if model._call_has_training_arg else {}
        with _context.enter_replica(strategy, _replica_context(strategy, valid, rows)):
            outputs, new_non_trainable = model.stateless_call(trainable, non_trainable, x, **kwargs)
        outputs = tree.map_structure(lambda o: o[None], outputs)
        return outputs, (list(trainable), _fold(variables[1], new_non_trainable, non_trainable))

    return step
