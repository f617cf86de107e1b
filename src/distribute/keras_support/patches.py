"""Every replacement this package makes of a Keras attribute, in one table, and who installs which rows.

Keras is extended, not forked: a variable, optimizer, metric, layer or model
made inside a strategy's scope must behave as TF's distribution-aware ones,
and Keras 3 asks no policy object at these points, so each is a replacement
of one Keras attribute whose wrapper keeps Keras' own behaviour outside a
strategy. Each row says what it replaces and why; ``signature`` is Keras'
own signature (3.15) that the wrapper was written against:
``tests/test_keras_seam.py`` checks every row against the installed Keras, so
a Keras upgrade that renames or changes one fails there, by name.

Who installs (``_keras.install``, idempotent, process-wide; every wrapper
changes nothing for objects made outside a strategy):

* ``CORE``: every strategy, when it is built (the default strategy too);
* ``MULTI_WORKER``: MultiWorkerMirroredStrategy (saving from the chief only);
* ``PARAMETER_SERVER``: ParameterServerStrategy, on top of ``CORE`` (rows for
  an attribute ``CORE`` replaces wrap ``CORE``'s wrapper); also each ps
  worker process;
* ``data/keras_adapter.GET_DATA_ADAPTER``: the first ``distribute.data.Dataset``
  built (``fit(dataset)`` works with no strategy, as a tf.data dataset in TF).
"""

from __future__ import annotations

import keras

from distribute._keras import (
    BaseOptimizer,
    BatchNormalization,
    JaxVariable,
    JAXTrainer,
    KerasVariable,
    Layer,
    LossScaleOptimizer,
    Metric,
    Patch,
    SeedGenerator,
    Trainer,
    install,
    keras_backend,
    loss_module,
    per_thread,
)
from distribute.data.keras_adapter import GET_DATA_ADAPTER
import distribute.keras_support.layers as layers
import distribute.keras_support.replica_loss as replica_loss
import distribute.keras_support.optimizers as optimizers
import distribute.keras_support.variables as variables
import distribute.keras_support.ps_hooks as ps_hooks
import distribute.keras_support.saving as saving
import distribute.keras_support.model_methods as model_methods

_SELF = "(self)"
_VALUE = "(self, value)"
_FORCE = "(self, force=False)"
_BATCH_END = "(self, batch, logs=None)"
_FIT = ("(self, x=None, y=None, batch_size=None, epochs=1, verbose='auto', callbacks=None, validation_split=0.0, "
        "validation_data=None, shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0, "
        "steps_per_epoch=None, validation_steps=None, validation_batch_size=None, validation_freq=1)")
_EVALUATE = ("(self, x=None, y=None, batch_size=None, verbose='auto', sample_weight=None, steps=None, callbacks=None, "
             "return_dict=False, **kwargs)")
_PREDICT = "(self, x, batch_size=None, verbose='auto', steps=None, callbacks=None)"

CORE: tuple[Patch, ...] = (
    # -- variables: placement, cross-replica reads, SyncOnRead copies (variables.py) --
    Patch(KerasVariable, "__init__", variables.variable_init,
          "(self, initializer, shape=None, dtype=None, trainable=True, autocast=True, aggregation='none', "
          "synchronization='auto', name=None, layout=None, **kwargs)",
          "a variable made in scope asks its strategy where it lives (extended.place_variable), once"),
    Patch(JaxVariable, "_initialize_layout", variables.variable_initialize_layout, _SELF,
          "its value is created with its placement's sharding"),
    Patch(JaxVariable, "_initialize", variables.variable_initialized, _VALUE,
          "a SyncOnRead variable's first value becomes its copies' aggregate"),
    Patch(JaxVariable, "_initialize_with_initializer", variables.variable_initialized_with, "(self, initializer)",
          "the same, for a variable initialized by an initializer; a large ps variable is made on its ps"),
    Patch(KerasVariable, "value", variables.variable_value, _SELF,
          "a read in cross-replica context is one device's copy, as TF's _get_cross_replica"),
    Patch(KerasVariable, "assign_add", variables.additive, _VALUE,
          "an add inside run counts once per replica for sum aggregation; a cross-replica add moves its delta"),
    Patch(KerasVariable, "assign_sub", variables.additive, _VALUE, "the same, for assign_sub"),
    Patch(JaxVariable, "_direct_assign", variables.direct_assign, _VALUE,
          "an assignment outside any step is told to the placement (a ps pushes it)"),
    # -- optimizers, metrics, random numbers --
    Patch(BaseOptimizer, "__init__", optimizers.optimizer_init,
          "(self, learning_rate, weight_decay=None, clipnorm=None, clipvalue=None, global_clipnorm=None, "
          "use_ema=False, ema_momentum=0.99, ema_overwrite_frequency=None, loss_scale_factor=None, "
          "gradient_accumulation_steps=None, name=None, **kwargs)",
          "an optimizer remembers the scope it was made in"),
    Patch(KerasVariable, "shape", optimizers.variable_shape, _SELF,
          "inside a sliced optimizer update (sharded state) a sliced variable's shape is its slice's"),
    Patch(BaseOptimizer, "apply", optimizers.optimizer_apply, "(self, grads, trainable_variables=None)",
          "inside run the gradients are summed across replicas first, as TF's apply_gradients; with sharded "
          "state each replica updates its slices"),
    Patch(LossScaleOptimizer, "apply", optimizers.optimizer_apply, "(self, grads, trainable_variables=None)",
          "the same; in a step it runs Keras' stateless_apply (its apply assigns inside lax.cond branches)"),
    Patch(BaseOptimizer, "add_variable_from_reference", optimizers.add_variable_from_reference,
          "(self, reference_variable, name=None, initializer='zeros')",
          "an optimizer slot is placed with its variable: split as its update (sharded state), on its ps (TF)"),
    Patch(BaseOptimizer, "_clip_gradients", optimizers.clip_gradients, "(self, grads)",
          "in a sliced update, clipnorm / global_clipnorm take the norm over every replica's slice"),
    Patch(LossScaleOptimizer, "check_finite", optimizers.check_finite, "(self, grads)",
          "in a sliced update, gradients are finite only if every replica's slices are"),
    Patch(Metric, "__init__", optimizers.metric_init, "(self, dtype=None, name=None)",
          "a metric remembers the scope it was made in"),
    Patch(SeedGenerator, "next", optimizers.seed_next, "(self, ordered=True)",
          "each replica draws its own random numbers (Dropout masks differ, as TF)"),
    # -- layers --
    Patch(BatchNormalization, "__init__", layers.batch_norm_init,
          "(self, axis=-1, momentum=0.99, epsilon=0.001, center=True, scale=True, beta_initializer='zeros', "
          "gamma_initializer='ones', moving_mean_initializer='zeros', moving_variance_initializer='ones', "
          "beta_regularizer=None, gamma_regularizer=None, beta_constraint=None, gamma_constraint=None, renorm=False, "
          "renorm_clipping=None, renorm_momentum=0.99, synchronized=False, **kwargs)",
          "synchronized=True is accepted on JAX (TF's SyncBatchNormalization)"),
    Patch(BatchNormalization, "_moments", layers.batch_norm_moments, "(self, inputs, mask)",
          "synchronized moments over every replica's rows; an empty replica's moments are not NaN"),
    Patch(Layer, "activity_regularizer", layers.activity_regularizer_property, None,
          "an activity loss of an uneven step is divided by the global batch's rows"),
    # -- losses: what a replica's loss is in a fit step (replica_loss.py) --
    Patch(loss_module, "reduce_values", replica_loss.reduce_values,
          "(values, sample_weight=None, reduction='sum_over_batch_size')",
          "in a fit step a loss reduced by sum or mean_with_sample_weight is the replica's estimate of the batch's; "
          "in strategy.run a mean is scaled for the sum over replicas (TF's scale_loss_for_distribution)"),
    Patch(loss_module, "apply_mask", replica_loss.apply_mask, "(sample_weight, mask, dtype, reduction)",
          "in a fit step a masked mean counts the valid entries of every replica"),
    Patch(Layer, "_losses", per_thread("_losses", list), None, "a call's losses, per replica thread"),
    Patch(Layer, "_loss_ids", per_thread("_loss_ids", set), None, "the same, their ids"),
    Patch(Layer, "_losses_override", per_thread("_losses_override", list), None,
          "the forward pass's losses handed to compute_loss, per replica thread"),
    Patch(keras_backend, "rnn", layers.per_replica_states_of("rnn"),
          "(step_function, inputs, initial_states, go_backwards=False, mask=None, constants=None, unroll=False, "
          "input_length=None, time_major=False, zero_output_for_mask=False, return_all_outputs=True)",
          "recurrent layers start their scan from per-replica states"),
    Patch(keras_backend, "lstm", layers.per_replica_states_of("lstm"),
          "(inputs, initial_state_h, initial_state_c, mask, kernel, recurrent_kernel, bias, activation, "
          "recurrent_activation, return_sequences=False, go_backwards=False, unroll=False)",
          "the same, for the fused LSTM"),
    Patch(keras_backend, "gru", layers.per_replica_states_of("gru"),
          "(inputs, initial_state, mask, kernel, recurrent_kernel, bias, activation, recurrent_activation, "
          "return_sequences=False, go_backwards=False, unroll=False, reset_after=True)",
          "the same, for the fused GRU"),
    # -- models: compile, fit, evaluate, predict (model_methods.py, trainer.py) --
    Patch(Trainer, "compile", model_methods.compile_wrapper,
          "(self, optimizer='rmsprop', loss=None, loss_weights=None, metrics=None, weighted_metrics=None, "
          "run_eagerly=False, steps_per_execution=1, jit_compile='auto', auto_scale_loss=True)",
          "a model compiled in scope remembers its strategy; metrics made outside are adopted, as TF"),
    Patch(JAXTrainer, "fit", model_methods.in_scope, _FIT, "runs in the model's strategy scope; datasets are adapted"),
    Patch(JAXTrainer, "evaluate", model_methods.in_scope, _EVALUATE, "the same, for evaluate"),
    Patch(JAXTrainer, "predict", model_methods.in_scope, _PREDICT, "the same, for predict"),
    Patch(JAXTrainer, "train_on_batch", model_methods.in_scope,
          "(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False)", "the same, for train_on_batch"),
    Patch(JAXTrainer, "test_on_batch", model_methods.in_scope, "(self, x, y=None, sample_weight=None, return_dict=False)",
          "the same, for test_on_batch"),
    Patch(JAXTrainer, "predict_on_batch", model_methods.in_scope, "(self, x)", "the same, for predict_on_batch"),
    Patch(JAXTrainer, "make_train_function", model_methods.routed_to("train"), _FORCE,
          "a distributed model's train step runs on every replica (the engine's programs)"),
    Patch(JAXTrainer, "make_test_function", model_methods.routed_to("test"), _FORCE, "the same, for the test step"),
    Patch(JAXTrainer, "make_predict_function", model_methods.routed_to("predict"), _FORCE, "the same, for the predict step"),
    Patch(JAXTrainer, "_get_jax_state", variables.whole_state,
          "(self, trainable_variables=False, non_trainable_variables=False, optimizer_variables=False, "
          "metrics_variables=False, purge_model_variables=False)",
          "fit's loop state is the variables' replicated arrays (no cross-replica copy)"),
    Patch(Layer, "__setattr__", model_methods.untracked_loop_state, "(self, name, value)",
          "fit's per-step loop state is stored untracked on a distributed model"),
    Patch(keras.callbacks.CallbackList, "on_train_batch_end", model_methods.batch_end_of("train"), _BATCH_END,
          "a batch-end call no callback listens to is skipped (no device-to-host read)"),
    Patch(keras.callbacks.CallbackList, "on_test_batch_end", model_methods.batch_end_of("test"), _BATCH_END,
          "the same, for evaluate"),
    Patch(keras.callbacks.CallbackList, "on_predict_batch_end", model_methods.batch_end_of("predict"), _BATCH_END,
          "the same, for predict"),
    GET_DATA_ADAPTER,
)

MULTI_WORKER: tuple[Patch, ...] = (
    Patch(keras.Model, "save", saving.save_wrapper, "(self, filepath, overwrite=True, zipped=None, **kwargs)",
          "a non-chief worker writes to a temporary path (TF's distributed_file_utils)"),
    Patch(keras.Model, "save_weights", saving.save_wrapper, "(self, filepath, overwrite=True, max_shard_size=None)",
          "the same, for save_weights"),
    Patch(keras.callbacks.TensorBoard, "set_model", saving.tensorboard_set_model, "(self, model)",
          "a non-chief worker's summaries go to a temporary directory"),
    Patch(keras.callbacks.TensorBoard, "on_train_end", saving.tensorboard_on_train_end, "(self, logs=None)",
          "which it deletes at the end of fit"),
)

PARAMETER_SERVER: tuple[Patch, ...] = (
    Patch(KerasVariable, "assign_add", ps_hooks.additive_of(1), _VALUE,
          "an add in a scheduled function is a delta the ps applies (not last-writer-wins)"),
    Patch(KerasVariable, "assign_sub", ps_hooks.additive_of(-1), _VALUE, "the same, for assign_sub"),
    Patch(BaseOptimizer, "apply", ps_hooks.optimizer_apply, "(self, grads, trainable_variables=None)",
          "in a scheduled function the gradients are recorded; the ps applies them"),
    Patch(BaseOptimizer, "apply_gradients", ps_hooks.optimizer_apply_gradients, "(self, grads_and_vars)",
          "an optimizer the ps cannot run is refused before it runs"),
    Patch(JAXTrainer, "fit", ps_hooks.route_under_ps_of("fit"), _FIT,
          "fit of a model built in a ps strategy's scope goes to the coordinator's fit"),
    Patch(JAXTrainer, "evaluate", ps_hooks.route_under_ps_of("evaluate"), _EVALUATE, "the same, for evaluate"),
    Patch(JAXTrainer, "predict", ps_hooks.route_under_ps_of("predict"), _PREDICT, "the same, for predict"),
    Patch(ps_hooks.H5IOStore, "__setitem__", ps_hooks.h5_setitem, "(self, key, value)",
          "model.save / save_weights write a table held by its ps in row pieces, never whole on the coordinator"),
)

TABLE: tuple[Patch, ...] = CORE + MULTI_WORKER + PARAMETER_SERVER


def install_core() -> None:
    """Installs ``CORE`` (every strategy)."""
    install(CORE)


def install_multi_worker() -> None:
    """Installs ``CORE`` and ``MULTI_WORKER`` (MultiWorkerMirroredStrategy)."""
    install(CORE + MULTI_WORKER)


def install_parameter_server() -> None:
    """Installs ``CORE`` and ``PARAMETER_SERVER`` (ParameterServerStrategy, and its worker processes)."""
    install(CORE + PARAMETER_SERVER)
