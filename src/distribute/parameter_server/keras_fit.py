"""Keras ``Model.fit`` under ParameterServerStrategy (tf-keras' ``_ClusterCoordinatorDataHandler`` rules).

``fit(x, epochs=E, steps_per_epoch=S)`` for a model compiled in the scope:
``S`` train steps per epoch (one batch each), scheduled ``K`` to a closure with
``compile(steps_per_execution=K)`` (one Ray round trip per ``K`` steps, the last
closure of an epoch taking the remainder, as TF's DataHandler), ``coordinator.join()``
at each epoch end, logs read from the model's ps-side metrics (TF: "the last
scheduled train step may not give the latest metrics"), so after fit
``optimizer.iterations == E * S``.  Validation (``validation_data``,
``validation_split``, ``validation_steps``, ``validation_freq``) runs
``keras_eval``'s evaluation on the workers after the epoch's ``join()`` and adds
``val_`` logs, as tf-keras' fit calls ``evaluate``.  Callbacks get TF's hooks:
``on_train_batch_begin(step)`` / ``on_train_batch_end(step + K - 1, logs)``
per scheduled closure, ``logs`` the closure's RemoteValue read lazily
(``keras_rules.BatchLogs``), epoch hooks with the ps-side logs; a model not yet
built is built from the element spec the workers report (TF builds it from the
first batch).  Reached through ``ps_hooks``
(which patches ``Model.fit``) and ``ParameterServerStrategyExtended.keras_fit``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from distribute.parameter_server.keras_rules import (
    RUN_EAGERLY,
    STEPS_REQUIRED,
    STEPS_REQUIRED_CREATOR,
    UNSUPPORTED_INPUT,
    VERBOSE_1,
    call_batch_begin,
    call_batch_end,
    check_callbacks,
    execution_sizes,
    spec_batch,
    steps_per_execution,
)


def fit(
    strategy: Any,
    model: Any,
    x: Any = None,
    y: Any = None,
    batch_size: int | None = None,
    epochs: int = 1,
    verbose: Any = "auto",
    callbacks: Any = None,
    validation_split: float = 0.0,
    validation_data: Any = None,
    shuffle: bool = True,
    class_weight: Any = None,
    sample_weight: Any = None,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    validation_steps: int | None = None,
    validation_batch_size: int | None = None,
    validation_freq: int = 1,
) -> Any:
    """``Model.fit`` on the workers of ``strategy``; returns the ``History``.

    Inputs: numpy arrays ``x (n, ...)``, ``y (n, ...)`` (each worker shuffles them
    when ``shuffle``, repeats them and batches by ``batch_size``, default 32,
    dropping the remainder), a ``distribute.data.Dataset`` of ``(x, y)`` or
    ``(x, y, sample_weight)`` batches (each worker iterates its own copy; make it
    infinite with ``repeat()``, as TF asks), or a ``DatasetCreator``.
    ``validation_data``: ``(x_val, y_val[, sample_weight])`` arrays, a Dataset or
    a ``DatasetCreator`` (then ``validation_steps`` is required, TF's message);
    ``validation_split`` takes the last fraction of numpy inputs, as Keras.

    Raises:
        ValueError: ``steps_per_epoch`` missing, ``run_eagerly``, ``verbose=1``,
            batch-level callbacks that do not declare support (TF's messages;
            Keras' ModelCheckpoint, TensorBoard, BackupAndRestore, ProgbarLogger
            and TerminateOnNaN do, as TF's), a model not compiled, or
            ``validation_split`` with a Dataset.
        NotImplementedError: ``steps_per_epoch`` not a positive int (TF's
            ``-1``), ``class_weight``, ``sample_weight`` with numpy, an
            unsupported input type, ``BackupAndRestore(save_freq=int)`` (TF
            skips its batch-level backups under PS), or an optimizer the ps cannot apply
            (``ps_hooks.check_optimizer``: LossScaleOptimizer, wrappers,
            gradient accumulation).
    """
    import keras

    from distribute.data import Dataset
    from distribute.parameter_server.coordinator import ClusterCoordinator
    from distribute.keras_support import ps_hooks
    from distribute.parameter_server.dataset import DatasetCreator, DistributedDatasetSpec
    from distribute.parameter_server.keras_eval import Evaluation, _Arrays

    if model.optimizer is None:
        raise ValueError("You must call `compile()` before calling `fit()` (in strategy.scope()).")
    if model.run_eagerly:
        raise ValueError(RUN_EAGERLY)
    ps_hooks.check_optimizer(model.optimizer)
    is_creator = isinstance(x, (DatasetCreator, DistributedDatasetSpec))
    is_arrays = not is_creator and not isinstance(x, Dataset)
    if is_arrays and not isinstance(x, (np.ndarray, list, tuple, dict)) and not hasattr(x, "__array__"):
        raise NotImplementedError(UNSUPPORTED_INPUT)
    if steps_per_epoch is None:
        raise ValueError(STEPS_REQUIRED if isinstance(x, Dataset) else STEPS_REQUIRED_CREATOR)
    if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
        raise NotImplementedError(
            f"steps_per_epoch={steps_per_epoch!r}: model.fit under ParameterServerStrategy needs a positive int here "
            "(TF's -1, train until stopped, is not supported yet)."
        )
    if validation_split and validation_data is None:
        if not is_arrays:
            raise ValueError("`validation_split` is only supported for Tensors or NumPy arrays; split a Dataset "
                             "yourself and pass `validation_data`.")
        (x, y), validation_data = _split(x, y, validation_split)
    if class_weight is not None:
        raise NotImplementedError("`class_weight` in `model.fit` with `ParameterServerStrategy` is not supported yet.")
    if verbose == 1:
        raise ValueError(VERBOSE_1)
    verbose = 2 if verbose == "auto" else verbose
    check_callbacks(callbacks, keras)
    validation = None
    if validation_data is not None:
        validation = _validation_source(validation_data, validation_batch_size or batch_size or 32, _Arrays)
        if isinstance(validation, (DatasetCreator, DistributedDatasetSpec)) and validation_steps is None:
            raise ValueError(STEPS_REQUIRED_CREATOR)
        if isinstance(validation, Dataset) and validation_steps is None and int(validation.cardinality()) == -1:
            raise ValueError("model.fit under ParameterServerStrategy got an infinite validation Dataset (repeat()) "
                             "and validation_steps=None; validation would never end. Pass validation_steps=.")
        _should_eval(0, validation_freq)  # validates it
        if validation_steps is not None and (isinstance(validation_steps, bool) or not isinstance(validation_steps, int)
                                             or validation_steps < 1):
            raise ValueError(f"validation_steps={validation_steps!r} must be a positive int or None.")

    coordinator = ClusterCoordinator(strategy)
    if is_arrays:
        if sample_weight is not None:
            raise NotImplementedError("`sample_weight` arrays in `model.fit` with `ParameterServerStrategy` are not "
                                      "supported yet; pass a Dataset of (x, y, sample_weight) batches.")
        if y is None:
            raise ValueError("model.fit under ParameterServerStrategy with numpy inputs needs `y`.")
        source: Any = _arrays_dataset_fn(x, y, batch_size or 32, shuffle)
        first = _first_batch_of_arrays(x, y, batch_size or 32)
    else:
        source = x
        dataset = x.dataset if isinstance(x, DistributedDatasetSpec) else x
        first = _first_element(dataset) if isinstance(dataset, Dataset) else None
    iterator = None
    with strategy.scope():  # model, compiled metrics and optimizer slots are created on the ps
        if first is not None:
            ps_hooks.build_fit_state(model, first)
        elif not ps_hooks.fit_state_built(model):
            # TF builds the model from the first batch; here from the element spec the workers report.
            iterator = iter(coordinator.create_per_worker_dataset(source))
            ps_hooks.build_fit_state(model, spec_batch(iterator))
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
    if iterator is None:
        iterator = iter(coordinator.create_per_worker_dataset(source))
    step = ps_hooks.cached(model, "_distribute_ps_train_step", lambda: _train_step(strategy, model))
    sizes = execution_sizes(steps_per_epoch, steps_per_execution(model))
    evaluation = Evaluation.of(strategy, model) if validation is not None else None
    val_iterators: dict = {}  # a validation DatasetCreator's per-worker iterators, kept across epochs (TF)

    callback_list = keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0, model=model, verbose=verbose, epochs=epochs,
        steps=steps_per_epoch,
    )
    model.stop_training = False
    callback_list.on_train_begin()
    initial_epoch = ps_hooks.initial_epoch(model, initial_epoch)  # BackupAndRestore's resume epoch (Keras' rule)
    logs: dict = {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()  # pushed to the ps
        callback_list.on_epoch_begin(epoch)
        begin = 0
        for size in sizes:  # TF: on_train_batch_begin(step), schedule, on_train_batch_end(step + increment, logs)
            call_batch_begin(callback_list, "train", begin)
            remote_value = coordinator.schedule(step, args=(iterator, size))
            call_batch_end(callback_list, "train", begin + size - 1, remote_value)
            begin += size
            if model.stop_training:
                break
        coordinator.join()
        logs = {k: float(np.asarray(v)) for k, v in model.get_metrics_result().items()}
        if evaluation is not None and _should_eval(epoch, validation_freq):
            val_logs = evaluation.run(validation, validation_steps, callback_list, val_iterators)
            logs.update({"val_" + name: value for name, value in val_logs.items()})
        callback_list.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callback_list.on_train_end(logs)
    return model.history


def _should_eval(epoch: int, validation_freq: Any) -> bool:
    """Keras' rule: validate after epoch ``epoch + 1`` when it is a multiple of an int freq, or in a list."""
    if isinstance(validation_freq, int) and not isinstance(validation_freq, bool) and validation_freq > 0:
        return (epoch + 1) % validation_freq == 0
    if isinstance(validation_freq, (list, tuple)):
        return epoch + 1 in validation_freq
    raise ValueError(
        f"Expected `validation_freq` to be a positive int or a list of epochs (1-indexed). Received: "
        f"validation_freq={validation_freq!r} of type {type(validation_freq)}."
    )


def _split(x: Any, y: Any, validation_split: float) -> tuple:
    """Keras' ``train_validation_split``: the last ``validation_split`` of the rows validate."""
    import jax
    import math

    if not 0.0 < float(validation_split) < 1.0:
        raise ValueError(f"validation_split={validation_split!r} must be a float between 0 and 1.")
    size = int(np.shape(jax.tree_util.tree_leaves(x)[0])[0])
    split_at = int(math.floor(size * (1.0 - validation_split)))
    if split_at == 0 or split_at == size:
        raise ValueError(f"validation_split={validation_split} leaves no rows for training or validation out of {size}.")
    head = jax.tree_util.tree_map(lambda a: np.asarray(a)[:split_at], (x, y))
    tail = jax.tree_util.tree_map(lambda a: np.asarray(a)[split_at:], (x, y))
    return head, tail


def _validation_source(validation_data: Any, batch_size: int, arrays: Any) -> Any:
    """What ``Evaluation.run`` takes: a Dataset, a DatasetCreator / distributed dataset, or batched arrays."""
    from distribute.data import Dataset
    from distribute.keras_support import ps_hooks
    from distribute.parameter_server.dataset import DatasetCreator, DistributedDatasetSpec

    if isinstance(validation_data, (Dataset, DatasetCreator, DistributedDatasetSpec)):
        return validation_data
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
        raise ValueError(
            "`validation_data` must be a tuple (x_val, y_val) or (x_val, y_val, val_sample_weight), a Dataset or a "
            f"DatasetCreator; got {type(validation_data).__name__}."
        )
    val_x, val_y, val_sample_weight = ps_hooks.unpack_x_y_sample_weight(tuple(validation_data))
    return arrays(val_x, val_y, val_sample_weight, batch_size)


def _arrays_dataset_fn(x: Any, y: Any, batch_size: int, shuffle: bool) -> Callable[[], Any]:
    """A per-worker ``dataset_fn``: each worker shuffles (its own order), repeats and batches the arrays."""
    from distribute.parameter_server.worker_context import experimental_get_current_worker_index
    from distribute.data import Dataset

    size = len(np.asarray(y))
    if batch_size > size:
        raise ValueError(f"batch_size={batch_size} is larger than the {size} training examples; the per-worker "
                         "pipeline drops the remainder, so a batch must fit: pass batch_size <= the example count.")

    def dataset_fn():
        dataset = Dataset.from_tensor_slices((x, y))
        if shuffle:
            dataset = dataset.shuffle(size, seed=experimental_get_current_worker_index())
        return dataset.repeat().batch(batch_size, drop_remainder=True)

    return dataset_fn


def _first_element(dataset: Any) -> Any:
    """The first element of ``dataset``, read on the coordinator (only to build the model's state)."""
    for element in dataset.take(1):
        return element
    raise ValueError("model.fit under ParameterServerStrategy: the Dataset is empty; it must yield (x, y) batches.")


def _first_batch_of_arrays(x: Any, y: Any, batch_size: int) -> tuple:
    import jax

    return jax.tree_util.tree_map(lambda a: np.asarray(a)[:batch_size], (x, y))


def _train_step(strategy: Any, model: Any) -> Callable:
    """The scheduled train step: ``num_steps`` batches from the worker's iterator (``steps_per_execution``).

    Returns the logs ``{name: value}`` of the model's metrics as this worker
    sees them after its steps (the ps values it read plus its own updates: TF's
    "the last scheduled train step may not give the latest metrics"); the
    batch hooks get them as a lazily fetched ``BatchLogs``.

    Every step but the last also updates the worker's copies of the variables
    (``ps_hooks.local_updates``), so the next step of the closure computes its
    gradients on the weights the ps will hold after the previous update, as a TF
    worker's next step reads them from the ps; the ps applies every step's
    gradients in order.
    """
    from distribute.keras_support import ps_hooks

    replica_fn = ps_hooks.fit_replica_fn(model)

    def one_step(iterator):
        x, y, sample_weight = ps_hooks.unpack_x_y_sample_weight(next(iterator))
        return strategy.reduce("SUM", strategy.run(replica_fn, args=(x, y, sample_weight)), axis=None)

    def train_step(iterator, num_steps):
        for _ in range(num_steps - 1):
            with ps_hooks.local_updates():
                one_step(iterator)
        one_step(iterator)
        return model.get_metrics_result()  # the batch hooks' logs (TF's train_function returns them)

    return train_step
