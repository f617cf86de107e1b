"""Keras ``fit`` / ``evaluate`` / ``predict`` over every replica of a strategy.

A model compiled inside ``strategy.scope()`` remembers the strategy.  Its
``fit``, ``evaluate`` and ``predict`` then run inside that scope (so lazily built
layers are mirrored too) with Keras' own loop, callbacks and progress bar; only
the per-step functions are replaced by SPMD programs over the strategy's mesh:

* each batch is split between the replicas (``input/splitting.py``); a partial
  batch is padded and masked, so results equal one device's exactly;
* each replica's loss is weighted so that the sum over replicas is the loss of
  the whole batch (``sum_over_batch_size``: rows weighted ``b / N``); gradients
  are summed across replicas; regularization losses are divided by the number of
  replicas; the loss tracker and compiled metrics count real rows only;
* variables stay replicated (``tracing._combine_replicas``).

Beyond TF: TF's Keras averages each replica's mean loss, so an uneven last
batch gives a slightly different answer there; here it is exact.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from keras.src import backend as keras_backend
from keras.src import tree
from keras.src.trainers.data_adapters import data_adapter_utils

from distribute import _context
from distribute.input.splitting import split_batch
from distribute.replica import ReplicaContext
from distribute.tracing import _check_ownership, _combine_replicas, sum_gradients

AXIS = "replica"
_EXACT_REDUCTIONS = {"sum_over_batch_size": "mean", "mean": "mean", "sum": "sum"}


def install() -> None:
    from keras.src.backend.jax.trainer import JAXTrainer

    for name in ("compile",):
        original = getattr(JAXTrainer, name)
        setattr(JAXTrainer, name, functools.wraps(original)(_compile_wrapper(original)))
    for name in ("fit", "evaluate", "predict"):
        original = getattr(JAXTrainer, name)
        setattr(JAXTrainer, name, functools.wraps(original)(_in_scope(original)))
    for name, builder in (
        ("make_train_function", _make_train_function),
        ("make_test_function", _make_test_function),
        ("make_predict_function", _make_predict_function),
    ):
        original = getattr(JAXTrainer, name)
        setattr(JAXTrainer, name, functools.wraps(original)(_routed(original, builder)))


def model_strategy(model: Any) -> Any:
    return model.__dict__.get("_distribute_strategy")


def _compile_wrapper(original):
    def compile(self, *args, **kwargs):
        strategy = _context.scope_strategy()
        if strategy is None:
            owners = {getattr(v, "_distribute_strategy", None) for v in self.weights}
            owners.discard(None)
            strategy = owners.pop() if len(owners) == 1 else None
        object.__setattr__(self, "_distribute_strategy", strategy)
        if strategy is None:
            return original(self, *args, **kwargs)
        with strategy.scope():
            return original(self, *args, **kwargs)

    return compile


def _in_scope(original):
    def method(self, *args, **kwargs):
        strategy = model_strategy(self)
        if strategy is None:
            return original(self, *args, **kwargs)
        with strategy.scope():
            return original(self, *args, **kwargs)

    return method


def _routed(original, builder):
    def make_function(self, force=False):
        strategy = model_strategy(self)
        if strategy is None:
            return original(self, force)
        return builder(self, strategy, force)

    return make_function


# -- placing batches ------------------------------------------------------------------
def _place_batch(strategy: Any, data: Any, rows_seen: list[int]) -> tuple[Any, list, Any, np.ndarray | None]:
    """Splits one Keras batch between the replicas and puts it on their devices.

    Every replica is padded to the most rows seen so far by this function (the
    first, full batch's share), so the last, partial batch reuses the compiled step.
    """
    ext = strategy.extended
    leaves, treedef = jax.tree_util.tree_flatten(data)
    leaves = [np.asarray(x) for x in leaves]
    rows_seen[0] = max(rows_seen[0], -(-leaves[0].shape[0] // strategy.num_replicas_in_sync))
    stacked, lengths = split_batch(leaves, len(ext._local_devices), rows_seen[0])
    placed = [ext._put_per_replica(x) for x in stacked]
    valid = None if lengths is None else ext._put_per_replica(lengths.astype(np.int32))
    return treedef, placed, valid, lengths


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
                f"Loss {getattr(entry[1], 'name', entry[1])!r} has reduction={reduction!r}, which "
                "distributed fit cannot split exactly between replicas. Use "
                "reduction='sum_over_batch_size' (the default) or 'sum'."
            )
        if _EXACT_REDUCTIONS[reduction] == "sum":
            raise NotImplementedError(
                "reduction='sum' is not supported by distributed fit yet; use the default "
                "reduction='sum_over_batch_size'."
            )


def _loss(model, trainable, non_trainable, metrics_vars, x, y, loss_weight, training, num_replicas):
    kwargs = {"training": training} if model._call_has_training_arg else {}
    y_pred, non_trainable, layer_losses = model.stateless_call(trainable, non_trainable, x, return_losses=True, **kwargs)
    if layer_losses:
        # Every replica adds the layers' losses; each adds its share.
        model._losses_override = [loss / num_replicas for loss in layer_losses]
    loss, (trainable, non_trainable, metrics_vars) = model.stateless_compute_loss(
        trainable, non_trainable, metrics_vars, x=x, y=y, y_pred=y_pred, sample_weight=loss_weight, training=training
    )
    if layer_losses:
        model._losses_override = []
    _check_reductions(model)
    return loss, y_pred, non_trainable, metrics_vars


def _update_metrics(model, metrics_vars, global_loss, global_rows, x, y, y_pred, metric_weight):
    first = lax.axis_index(AXIS) == 0
    mapping = list(zip(model.metrics_variables, metrics_vars))
    with keras_backend.StatelessScope(state_mapping=mapping) as scope:
        model._loss_tracker.update_state(global_loss, sample_weight=jnp.where(first, global_rows, 0.0))
        model.compute_metrics(x, y, y_pred, metric_weight)
    new = []
    for ref, old in zip(model.metrics_variables, metrics_vars):
        value = scope.get_current_value(ref)
        new.append(old if value is None else value)
    new = [_combine_replicas(ref, value, old) for ref, value, old in zip(model.metrics_variables, new, metrics_vars)]
    with keras_backend.StatelessScope(state_mapping=list(zip(model.metrics_variables, new))):
        logs = model.get_metrics_result()
    return logs, new


def _replica_context(strategy, valid, rows):
    return ReplicaContext(strategy, in_program=True, valid_count=None if valid is None else valid[0], padded_rows=rows)


def _check_supported(model: Any, method: str) -> None:
    from keras.src.backend.jax.trainer import JAXTrainer

    if getattr(type(model), method) is not getattr(JAXTrainer, method):
        raise NotImplementedError(
            f"{type(model).__name__} overrides {method}; distributed fit/evaluate/predict run "
            "Keras' own step on every replica. Use a custom loop with strategy.run for a custom "
            f"{method}, or drop the override."
        )


def _state_variables(model, parts):
    out = []
    for part in parts:
        if part == "trainable":
            out.append(list(model.trainable_variables))
        elif part == "non_trainable":
            out.append(list(model.non_trainable_variables))
        elif part == "optimizer":
            out.append(list(model.optimizer.variables))
        else:
            out.append(list(model.metrics_variables))
    return out


def _compiled_step(strategy, step, result_spec=P()):
    """shard_map + jit of ``step(state, data, valid) -> (result, state)``; state replicated and donated."""
    mesh = strategy.extended._mesh
    mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=(result_spec, P()))
    return jax.jit(mapped, donate_argnums=(0,))


def _loop(model, strategy, compiled_for, rows_seen, state, iterator):
    """Runs up to ``steps_per_execution`` steps; StopIteration when the data is exhausted."""
    outputs = []
    for _ in range(max(int(model.steps_per_execution), 1)):
        try:
            data = next(iterator)
        except StopIteration:
            if not outputs:
                raise
            break
        treedef, placed, valid, lengths = _place_batch(strategy, data, rows_seen)
        compiled = compiled_for(treedef, placed, valid)
        result, state = compiled(state, placed, valid)
        outputs.append((result, lengths))
    return outputs, state


def _make_train_function(model, strategy, force):
    if model.train_function is not None and not force:
        return model.train_function
    _check_supported(model, "train_step")
    num_replicas = strategy.num_replicas_in_sync
    cache: dict = {}
    rows_seen = [0]

    def compiled_for(treedef, placed, valid):
        key = (treedef, tuple((p.shape, p.dtype) for p in placed), valid is None)
        if key not in cache:
            _check_ownership(strategy, [v for part in _state_variables(model, ("trainable", "non_trainable", "optimizer", "metrics")) for v in part])
            rows = placed[0].shape[1]
            variables = _state_variables(model, ("trainable", "non_trainable", "optimizer", "metrics"))

            def step(state, leaves, valid_):
                trainable, non_trainable, opt_vars, metrics_vars = state
                x, y, sample_weight = _unpack(treedef, [leaf[0] for leaf in leaves])
                loss_weight, metric_weight, _, global_rows = _weights(model, x, sample_weight, valid_, rows, num_replicas)
                with _context.enter_replica(strategy, _replica_context(strategy, valid_, rows)):

                    def loss_fn(trainable_):
                        loss, y_pred, non_trainable_, metrics_ = _loss(model, trainable_, non_trainable, metrics_vars, x, y, loss_weight, True, num_replicas)
                        unscaled = loss
                        if model.optimizer is not None:
                            mapping = list(zip(model.optimizer.variables, opt_vars))
                            with keras_backend.StatelessScope(state_mapping=mapping):
                                loss = model.optimizer.scale_loss(loss)
                        return loss, (unscaled, y_pred, non_trainable_, metrics_)

                    (_, (loss, y_pred, new_non_trainable, metrics_vars2)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
                    global_loss = lax.psum(loss, AXIS)
                    logs, new_metrics = _update_metrics(model, metrics_vars2, global_loss, global_rows, x, y, y_pred, metric_weight)
                # The variables are replicated, so JAX's autodiff has already summed their
                # gradients over replicas; apply outside the replica context (the
                # hooked optimizer would check again).
                grads = sum_gradients(grads)
                new_trainable, new_opt = model.optimizer.stateless_apply(opt_vars, grads, trainable)
                new_non_trainable = [_combine_replicas(v, n, o) for v, n, o in zip(variables[1], new_non_trainable, non_trainable)]
                new_opt = [_combine_replicas(v, n, o) for v, n, o in zip(variables[2], new_opt, opt_vars)]
                return logs, (list(new_trainable), new_non_trainable, new_opt, new_metrics)

            cache[key] = _compiled_step(strategy, step)
        return cache[key]

    def train_function(state, iterator):
        outputs, state = _loop(model, strategy, compiled_for, rows_seen, state, iterator)
        return outputs[-1][0], state

    model.train_function = train_function
    return train_function


def _make_test_function(model, strategy, force):
    if model.test_function is not None and not force:
        return model.test_function
    _check_supported(model, "test_step")
    num_replicas = strategy.num_replicas_in_sync
    cache: dict = {}
    rows_seen = [0]

    def compiled_for(treedef, placed, valid):
        key = (treedef, tuple((p.shape, p.dtype) for p in placed), valid is None)
        if key not in cache:
            variables = _state_variables(model, ("trainable", "non_trainable", "metrics"))
            _check_ownership(strategy, [v for part in variables for v in part])
            rows = placed[0].shape[1]

            def step(state, leaves, valid_):
                trainable, non_trainable, metrics_vars = state
                x, y, sample_weight = _unpack(treedef, [leaf[0] for leaf in leaves])
                loss_weight, metric_weight, _, global_rows = _weights(model, x, sample_weight, valid_, rows, num_replicas)
                with _context.enter_replica(strategy, _replica_context(strategy, valid_, rows)):
                    loss, y_pred, new_non_trainable, metrics_vars = _loss(model, trainable, non_trainable, metrics_vars, x, y, loss_weight, False, num_replicas)
                    global_loss = lax.psum(loss, AXIS)
                    logs, new_metrics = _update_metrics(model, metrics_vars, global_loss, global_rows, x, y, y_pred, metric_weight)
                new_non_trainable = [_combine_replicas(v, n, o) for v, n, o in zip(variables[1], new_non_trainable, non_trainable)]
                return logs, (list(trainable), new_non_trainable, new_metrics)

            cache[key] = _compiled_step(strategy, step)
        return cache[key]

    def test_function(state, iterator):
        outputs, state = _loop(model, strategy, compiled_for, rows_seen, state, iterator)
        return outputs[-1][0], state

    model.test_function = test_function
    return test_function


def _make_predict_function(model, strategy, force):
    if model.predict_function is not None and not force:
        return model.predict_function
    _check_supported(model, "predict_step")
    cache: dict = {}
    rows_seen = [0]

    def compiled_for(treedef, placed, valid):
        key = (treedef, tuple((p.shape, p.dtype) for p in placed), valid is None)
        if key not in cache:
            variables = _state_variables(model, ("trainable", "non_trainable"))
            _check_ownership(strategy, [v for part in variables for v in part])
            rows = placed[0].shape[1]

            def step(state, leaves, valid_):
                trainable, non_trainable = state
                x, _, _ = _unpack(treedef, [leaf[0] for leaf in leaves])
                kwargs = {"training": False} if model._call_has_training_arg else {}
                with _context.enter_replica(strategy, _replica_context(strategy, valid_, rows)):
                    outputs, new_non_trainable = model.stateless_call(trainable, non_trainable, x, **kwargs)
                outputs = tree.map_structure(lambda o: o[None], outputs)
                new_non_trainable = [_combine_replicas(v, n, o) for v, n, o in zip(variables[1], new_non_trainable, non_trainable)]
                return outputs, (list(trainable), new_non_trainable)

            cache[key] = _compiled_step(strategy, step, P(AXIS))
        return cache[key]

    def predict_function(state, iterator):
        outputs, state = _loop(model, strategy, compiled_for, rows_seen, state, iterator)
        pieces = [tree.map_structure(lambda o: _real_rows(np.asarray(o), lengths), result) for result, lengths in outputs]
        if len(pieces) == 1:
            return pieces[0], state
        return tree.map_structure(lambda *parts: np.concatenate(parts), *pieces), state

    model.predict_function = predict_function
    return predict_function


def _real_rows(stacked: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """``(replicas, rows, ...)`` -> the real rows, in order."""
    if lengths is None:
        return stacked.reshape((-1, *stacked.shape[2:]))
    return np.concatenate([stacked[r, : int(n)] for r, n in enumerate(lengths.tolist())])
