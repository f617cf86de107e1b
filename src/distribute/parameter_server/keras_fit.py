"""Keras ``Model.fit`` under ParameterServerStrategy (tf-keras' ``_ClusterCoordinatorDataHandler`` rules).

``fit(x, epochs=E, steps_per_epoch=S)`` for a model compiled in the scope:
``S`` scheduled train steps per epoch (one batch each), ``coordinator.join()``
at each epoch end, logs read from the model's ps-side metrics (TF: "the last
scheduled train step may not give the latest metrics"), so after fit
``optimizer.iterations == E * S``.  Reached through ``ps_hooks`` (which
patches ``Model.fit``) and ``ParameterServerStrategyExtended._keras_fit``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

STEPS_REQUIRED_CREATOR = (
    "When using a `tf.keras.utils.experimental.DatasetCreator`, `steps_per_epoch`, `validation_steps`, "
    "`steps`, or `pss_evaluation_shards` argument must be provided in `Model.fit`, `Model.evaluate`, or "
    "`Model.predict`."
)
STEPS_REQUIRED = "`steps_per_epoch` must be specified with `ParameterServerStrategy`."
RUN_EAGERLY = "When using `Model` with `ParameterServerStrategy`, `run_eagerly` is not supported."
VERBOSE_1 = "`verbose=1` is not allowed with `ParameterServerStrategy` for performance reasons. Received: verbose=1"
VALIDATION = "Evaluation in `model.fit` with `ParameterServerStrategy` is not yet supported."
UNSUPPORTED_INPUT = (
    "Only `tf.keras.utils.experimental.DatasetCreator`, `tf.Tensor`, numpy arrays and pandas dataframes "
    "are supported types at this time."
)
_BATCH_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")


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

    Raises:
        ValueError: ``steps_per_epoch`` missing, ``run_eagerly``, ``verbose=1``,
            batch-level callbacks (TF's messages), or a model not compiled.
        NotImplementedError: ``validation_data``/``validation_split`` (TF's
            message), ``steps_per_epoch`` not a positive int (TF's ``-1``),
            ``class_weight``, ``sample_weight`` with numpy, or an unsupported
            input type.
    """
    import keras

    from distribute.data import Dataset
    from distribute.parameter_server.coordinator import ClusterCoordinator
    from distribute.keras_support import ps_hooks
    from distribute.parameter_server.dataset import DatasetCreator, DistributedDatasetSpec

    if model.optimizer is None:
        raise ValueError("You must call `compile()` before calling `fit()` (in strategy.scope()).")
    if model.run_eagerly:
        raise ValueError(RUN_EAGERLY)
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
    if validation_data is not None or validation_split:
        raise NotImplementedError(VALIDATION)
    if class_weight is not None:
        raise NotImplementedError("`class_weight` in `model.fit` with `ParameterServerStrategy` is not supported yet.")
    if verbose == 1:
        raise ValueError(VERBOSE_1)
    verbose = 2 if verbose == "auto" else verbose
    _check_callbacks(callbacks, keras)

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
    with strategy.scope():  # model, compiled metrics and optimizer slots are created on the ps
        if first is not None:
            ps_hooks.build_fit_state(model, first)
        elif not ps_hooks.fit_state_built(model):
            raise ValueError("model.fit under ParameterServerStrategy with a DatasetCreator needs a built model and "
                             "built metrics: in strategy.scope(), call model.compute_metrics on one batch, or fit once "
                             "from a Dataset, before fitting from a DatasetCreator.")
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
    iterator = iter(coordinator.create_per_worker_dataset(source))
    step = _train_step(strategy, model)

    callback_list = keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0, model=model, verbose=verbose, epochs=epochs,
        steps=steps_per_epoch,
    )
    model.stop_training = False
    callback_list.on_train_begin()
    logs: dict = {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()  # pushed to the ps
        callback_list.on_epoch_begin(epoch)
        for _ in range(steps_per_epoch):
            coordinator.schedule(step, args=(iterator,))
        coordinator.join()
        logs = {k: float(np.asarray(v)) for k, v in model.get_metrics_result().items()}
        callback_list.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callback_list.on_train_end(logs)
    return model.history


def _check_callbacks(callbacks: Any, keras: Any) -> None:
    base = keras.callbacks.Callback
    unsupported = [
        cb for cb in (callbacks or [])
        if not getattr(cb, "_supports_tf_logs", False)
        and not isinstance(cb, (keras.callbacks.ProgbarLogger, keras.callbacks.History))
        and any(getattr(type(cb), hook, None) is not getattr(base, hook) for hook in _BATCH_HOOKS)
    ]
    if unsupported:
        raise ValueError(
            "Batch-level `Callback`s are not supported with `ParameterServerStrategy`. "
            f"Found unsupported callbacks: {unsupported}"
        )


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
    """The scheduled train step: one batch from the worker's iterator through ``ps_hooks.fit_replica_fn``."""
    from distribute.keras_support import ps_hooks

    replica_fn = ps_hooks.fit_replica_fn(model)

    def train_step(iterator):
        x, y, sample_weight = ps_hooks.unpack_x_y_sample_weight(next(iterator))
        return strategy.reduce("SUM", strategy.run(replica_fn, args=(x, y, sample_weight)), axis=None)

    return train_step
