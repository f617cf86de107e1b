"""Model Garden's BERT custom training loop, ported by substitution.

Source (Apache-2.0, The TensorFlow Authors): tensorflow/models
official/legacy/bert/model_training_utils.py ``run_customized_training_loop`` and ``steps_to_run``, as
shipped in tf-models-no-deps 2.19.0. Substitutions: tf.distribute -> distribute, tf.function ->
distribute.function, tf.GradientTape -> distribute.GradientTape, tf_keras -> keras (Keras 3:
reset_states -> reset_state), ``for _ in tf.range(steps)`` -> ``range(steps)`` (no autograph: the
loop runs as Python inside the distribute.function, each strategy.run one compiled program),
tf.convert_to_tensor(steps, tf.int32) -> np.int32(steps), ``.numpy()`` -> np.asarray,
``tf.shape(x)[0]`` -> ``x.shape[0]``, tf.nest -> jax.tree_util, ``tf.config.list_physical_devices('GPU')``
-> JAX's GPU devices. Left out (the ported test passes none of them or only checks files): checkpoints
and init_checkpoint, summaries and the txt summary file (``training_summary`` is returned instead),
sub_model export, explicit_allreduce, the mixed-precision LossScaleOptimizer branch, the TPU checks.
"""

from __future__ import annotations

import jax
import keras
import numpy as np

import distribute


def _get_input_iterator(input_fn, strategy):
    if not callable(input_fn):
        raise ValueError("`input_fn` should be a closure that returns a dataset.")
    return iter(strategy.distribute_datasets_from_function(input_fn))


def _float_metric_value(metric):
    return np.asarray(metric.result()).astype(float)


def steps_to_run(current_step, steps_per_epoch, steps_per_loop):
    if steps_per_loop <= 0:
        raise ValueError("steps_per_loop should be positive integer.")
    if steps_per_loop == 1:
        return steps_per_loop
    remainder_in_epoch = current_step % steps_per_epoch
    if remainder_in_epoch != 0:
        return min(steps_per_epoch - remainder_in_epoch, steps_per_loop)
    return steps_per_loop


def run_customized_training_loop(
        _sentinel=None, strategy=None, model_fn=None, loss_fn=None, scale_loss=True, model_dir=None,
        train_input_fn=None, steps_per_epoch=None, num_eval_per_epoch=1, steps_per_loop=None, epochs=1,
        eval_input_fn=None, eval_steps=None, metric_fn=None, custom_callbacks=None, run_eagerly=False):
    """Returns ``(model, training_summary)`` (the original returns the model and writes the summary)."""
    if _sentinel is not None:
        raise ValueError("only call `run_customized_training_loop()` with named arguments.")
    required_arguments = [strategy, model_fn, loss_fn, model_dir, steps_per_epoch, train_input_fn]
    steps_between_evals = int(steps_per_epoch / num_eval_per_epoch)
    if [arg for arg in required_arguments if arg is None]:
        raise ValueError("`strategy`, `model_fn`, `loss_fn`, `model_dir`, `steps_per_epoch` and "
                         "`train_input_fn` are required parameters.")
    if not steps_per_loop:
        steps_per_loop = 1
    if steps_per_loop > steps_between_evals:
        steps_per_loop = steps_between_evals
    if eval_input_fn and eval_steps is None:
        raise ValueError("`eval_step` is required when `eval_input_fn ` is not none.")
    if metric_fn and not callable(metric_fn):
        raise ValueError("if `metric_fn` is specified, metric_fn must be a callable.")

    total_training_steps = steps_per_epoch * epochs
    train_iterator = _get_input_iterator(train_input_fn, strategy)
    eval_loss_metric = keras.metrics.Mean("training_loss", dtype="float32")

    with strategy.scope():  # was distribute_utils.get_strategy_scope(strategy)
        model, sub_model = model_fn()
        if not hasattr(model, "optimizer"):
            raise ValueError("User should set optimizer attribute to model inside `model_fn`.")
        callback_list = keras.callbacks.CallbackList(callbacks=custom_callbacks, model=model)
        optimizer = model.optimizer
        train_loss_metric = keras.metrics.Mean("training_loss", dtype="float32")
        eval_metrics = metric_fn() if metric_fn else []
        if not isinstance(eval_metrics, list):
            eval_metrics = [eval_metrics]
        train_metrics = [metric.__class__.from_config(metric.get_config()) for metric in eval_metrics]
        training_vars = model.trainable_variables

        def _replicated_step(inputs):
            inputs, labels = inputs
            with distribute.GradientTape() as tape:
                model_outputs = model(inputs, training=True)
                loss = loss_fn(labels, model_outputs)
                raw_loss = loss
                if scale_loss:
                    loss = loss / strategy.num_replicas_in_sync
            grads = tape.gradient(loss, training_vars)
            optimizer.apply_gradients(zip(grads, training_vars))
            train_loss_metric.update_state(raw_loss)
            for metric in train_metrics:
                metric.update_state(labels, model_outputs)

        @distribute.function
        def train_steps(iterator, steps):
            for _ in range(steps):  # was tf.range(steps)
                strategy.run(_replicated_step, args=(next(iterator),))

        def train_single_step(iterator):
            strategy.run(_replicated_step, args=(next(iterator),))

        def test_step(iterator):
            def _test_step_fn(inputs):
                inputs, labels = inputs
                model_outputs = model(inputs, training=False)
                for metric in eval_metrics:
                    metric.update_state(labels, model_outputs)
                return model_outputs, labels

            outputs, labels = strategy.run(_test_step_fn, args=(next(iterator),))
            outputs = jax.tree_util.tree_map(strategy.experimental_local_results, outputs,
                                             is_leaf=lambda x: isinstance(x, distribute.DistributedValues))
            labels = jax.tree_util.tree_map(strategy.experimental_local_results, labels,
                                            is_leaf=lambda x: isinstance(x, distribute.DistributedValues))
            return outputs, labels

        if not run_eagerly:
            train_single_step = distribute.function(train_single_step)
            test_step = distribute.function(test_step)

        def _run_evaluation(current_training_step, test_iterator):
            loss_list, loss_weights = list(), list()
            for _ in range(eval_steps):
                outputs, labels = test_step(test_iterator)
                for cur_logits, cur_labels in zip(outputs, labels):
                    cur_weight = jax.tree_util.tree_leaves(cur_labels)[0].shape[0]  # was tf.shape(...)[0]
                    if cur_weight != 0:
                        loss_list.append(np.asarray(loss_fn(cur_labels, cur_logits)))
                        loss_weights.append(cur_weight)
            eval_loss_metric.update_state(loss_list, sample_weight=loss_weights)
            logs = {}
            for metric in [eval_loss_metric] + eval_metrics + model.metrics:
                logs[metric.name] = _float_metric_value(metric)
            return logs

        current_step = int(np.asarray(optimizer.iterations))
        logs = {}
        callback_list.on_train_begin()
        while current_step < total_training_steps and not model.stop_training:
            if current_step % steps_per_epoch == 0:
                callback_list.on_epoch_begin(int(current_step / steps_per_epoch) + 1)
            train_loss_metric.reset_state()
            for metric in train_metrics + model.metrics:
                metric.reset_state()
            callback_list.on_batch_begin(current_step)
            steps = steps_to_run(current_step, steps_between_evals, steps_per_loop)
            if any(d.platform == "gpu" for d in jax.devices()):  # was tf.config.list_physical_devices('GPU')
                for _ in range(steps):
                    train_single_step(train_iterator)
            else:
                train_steps(train_iterator, np.int32(steps))
            train_loss = _float_metric_value(train_loss_metric)
            current_step += steps
            if current_step % steps_between_evals:
                callback_list.on_batch_end(current_step - 1, {"loss": train_loss})
            else:
                if current_step < total_training_steps:
                    if eval_input_fn:
                        eval_loss_metric.reset_state()
                        for metric in eval_metrics + model.metrics:
                            metric.reset_state()
                        logs = _run_evaluation(current_step, _get_input_iterator(eval_input_fn, strategy))
                logs["loss"] = train_loss
                callback_list.on_batch_end(current_step - 1, logs)
            if current_step % steps_per_epoch == 0:
                callback_list.on_epoch_end(int(current_step / steps_per_epoch), logs)

        if eval_input_fn:
            eval_loss_metric.reset_state()
            for metric in eval_metrics + model.metrics:
                metric.reset_state()
            logs = _run_evaluation(current_step, _get_input_iterator(eval_input_fn, strategy))
        callback_list.on_epoch_end(int(current_step / steps_per_epoch), logs)
        training_summary = {"total_training_steps": total_training_steps,
                            "train_loss": _float_metric_value(train_loss_metric)}
        for metric in model.metrics:
            training_summary[metric.name] = _float_metric_value(metric)
        if eval_metrics:
            training_summary["last_train_metrics"] = _float_metric_value(train_metrics[0])
            training_summary["eval_metrics"] = _float_metric_value(eval_metrics[0])
        callback_list.on_train_end()
        return model, training_summary
