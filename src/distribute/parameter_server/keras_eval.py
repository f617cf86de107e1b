"""Keras ``Model.evaluate`` and ``Model.predict`` under ParameterServerStrategy: scheduled closures on the workers.

Where the data comes from decides how batches reach the workers:

* numpy arrays, a ``distribute.data.Dataset`` (finite, or with ``steps``), and for
  ``predict`` a ``DatasetCreator``: the coordinator reads the batches in order and
  sends each closure its own (``steps_per_execution = K`` batches per closure), so
  every row is evaluated exactly once whatever the number of workers, and
  ``predict`` returns the rows in order; a partial last batch is traced once more;
* a ``DatasetCreator`` or a distributed dataset in ``evaluate``: every worker
  iterates its own copy (TF's ``_ClusterCoordinatorDataHandler``), ``steps``
  required, with TF's message.

Metrics accumulate on the ps (additive updates, each closure's once, so totals are
exact) and are read after ``join()``, as tf-keras reads the model's ps-side
metrics.  TF 2.21 runs ``predict`` on the coordinator; here it runs on the
workers, with the same values.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

from distribute.parameter_server.keras_rules import (
    RUN_EAGERLY,
    STEPS_REQUIRED_CREATOR,
    VERBOSE_1,
    call_batch_begin,
    call_batch_end,
    check_callbacks,
    execution_sizes,
    spec_batch,
    steps_per_execution,
)

INFINITE_STEPS = (
    "model.{method} under ParameterServerStrategy got an infinite Dataset (repeat()) and steps=None; it would never "
    "end. Pass steps=<number of batches>."
)


class Evaluation:
    """One model's evaluation on the workers of ``strategy``: the scheduled step functions, traced once."""

    def __init__(self, strategy: Any, model: Any):
        from distribute.keras_support import ps_hooks
        from distribute.parameter_server.coordinator import ClusterCoordinator

        self.strategy, self.model = strategy, model
        self.coordinator = ClusterCoordinator(strategy)
        replica_fn = ps_hooks.test_replica_fn(model)

        def test_batches(batches):  # returns the batch hooks' logs, as TF's test_function
            for x, y, sample_weight in batches:
                strategy.run(replica_fn, args=(x, y, sample_weight))
            return model.get_metrics_result()

        def test_iterator(iterator, num_steps):
            for _ in range(num_steps):
                x, y, sample_weight = ps_hooks.unpack_x_y_sample_weight(next(iterator))
                strategy.run(replica_fn, args=(x, y, sample_weight))
            return model.get_metrics_result()

        self._test_batches, self._test_iterator = test_batches, test_iterator

    @classmethod
    def of(cls, strategy: Any, model: Any) -> Evaluation:
        """The model's evaluation, made once per compiled state (so its programs are traced once)."""
        from distribute.keras_support import ps_hooks

        return ps_hooks.cached(model, "_distribute_ps_evaluation", lambda: cls(strategy, model))

    def run(self, source: Any, steps: int | None, callbacks: Any, iterators: dict | None = None) -> dict:
        """Evaluates on ``source`` (see :func:`evaluate`); returns the logs ``{name: float}``.

        ``iterators``: the caller's per-worker iterators by source, kept across runs
        (fit's validation continues a DatasetCreator's iterators, as tf-keras caches
        its eval data handler); a fresh one per run without it.
        """
        from distribute.keras_support import ps_hooks

        model = self.model
        per_worker = _is_per_worker(source)
        if per_worker:
            if steps is None:
                raise ValueError(STEPS_REQUIRED_CREATOR)
            _check_steps(steps, "steps")
            iterators = {} if iterators is None else iterators
            if iterators.get(id(source)) is None:
                iterators[id(source)] = iter(self.coordinator.create_per_worker_dataset(source))
            if not ps_hooks.fit_state_built(model):  # TF builds from the first batch; here from the workers' spec
                with self.strategy.scope():
                    ps_hooks.build_fit_state(model, spec_batch(iterators[id(source)]))
            feed: Iterator = iter(())
        else:
            feed = batches_of(source, steps, "evaluate")  # from the first batch each run, as Keras 3
            first = next(feed, None)
            if first is None:
                raise ValueError("model.evaluate under ParameterServerStrategy: the data is empty.")
            feed = itertools.chain([first], feed)
            with self.strategy.scope():
                if not ps_hooks.fit_state_built(model):
                    ps_hooks.build_fit_state(model, first)
        callbacks.on_test_begin()
        model.reset_metrics()  # pushed to the ps
        per_execution = steps_per_execution(model)
        if per_worker:
            iterator = iterators[id(source)]
            scheduled = ((size, (self._test_iterator, (iterator, size))) for size in execution_sizes(steps, per_execution))
        else:
            scheduled = ((len(group), (self._test_batches, (group,))) for group in _groups(feed, per_execution))
        begin = 0
        for size, (fn, args) in scheduled:  # TF's test batch hooks, one pair per scheduled closure
            call_batch_begin(callbacks, "test", begin)
            call_batch_end(callbacks, "test", begin + size - 1, self.coordinator.schedule(fn, args=args))
            begin += size
        self.coordinator.join()
        logs = {k: float(np.asarray(v)) for k, v in model.get_metrics_result().items()}
        callbacks.on_test_end(logs)
        return logs


def evaluate(
    strategy: Any,
    model: Any,
    x: Any = None,
    y: Any = None,
    batch_size: int | None = None,
    verbose: Any = "auto",
    sample_weight: Any = None,
    steps: int | None = None,
    callbacks: Any = None,
    return_dict: bool = False,
    **kwargs: Any,
) -> Any:
    """``Model.evaluate`` on the workers of ``strategy``: the loss and metrics, as one device's Keras evaluate.

    Inputs: numpy arrays ``x (n, ...)``, ``y (n, ...)``, ``sample_weight (n,)``
    (batches of ``batch_size``, default 32, the last one partial), a
    ``distribute.data.Dataset`` of ``(x, y)`` / ``(x, y, sample_weight)`` batches
    (read in order by the coordinator; ``steps`` limits it and is required when
    it is infinite), or a ``DatasetCreator`` / distributed dataset (each worker
    iterates its own copy; ``steps`` required, as TF).  ``steps_per_execution``
    of ``compile`` packs that many batches into one scheduled closure.

    Returns:
        The loss and metrics as ``model.evaluate`` returns them: a dict with
        ``return_dict``, else a list in ``model.metrics_names`` order (a scalar
        when there is only the loss).

    Raises:
        ValueError: not compiled, ``run_eagerly``, ``verbose=1``, batch-level
            callbacks (TF's messages), ``steps`` missing for a DatasetCreator
            (TF's message) or an infinite Dataset, or unknown keyword arguments.
    """
    import keras

    kwargs.pop("_use_cached_eval_dataset", None)
    if kwargs:
        raise ValueError(f"Arguments not recognized: {kwargs}")
    _check_model(model, "evaluate")
    verbose = _verbosity(verbose)
    check_callbacks(callbacks, keras)
    if steps is not None:
        _check_steps(steps, "steps")
    source = x if _is_per_worker(x) or _is_dataset(x) else _Arrays(x, y, sample_weight, batch_size or 32)
    callback_list = keras.callbacks.CallbackList(
        callbacks, add_progbar=verbose != 0, model=model, verbose=verbose, epochs=1, steps=steps,
    )
    logs = Evaluation.of(strategy, model).run(source, steps, callback_list)
    if return_dict:
        return logs
    from distribute.keras_support import ps_hooks

    return ps_hooks.metrics_in_order(model, logs)


def predict(
    strategy: Any,
    model: Any,
    x: Any,
    batch_size: int | None = None,
    verbose: Any = "auto",
    steps: int | None = None,
    callbacks: Any = None,
) -> Any:
    """``Model.predict`` on the workers of ``strategy``: the outputs of every row, in order (numpy).

    Inputs: numpy arrays ``x (n, ...)`` (batches of ``batch_size``, default 32),
    a ``distribute.data.Dataset`` of ``x`` or ``(x, ...)`` batches, or a
    ``DatasetCreator`` (its ``dataset_fn`` runs on the coordinator, as TF's
    predict does; ``steps`` required, TF's message).  The coordinator sends each
    closure its batches (``steps_per_execution`` of them), so rows keep their
    order whichever worker ran them.  Callbacks get tf-keras' predict hooks per
    closure: ``on_predict_batch_begin(step)`` and ``on_predict_batch_end(step +
    K - 1, logs)``, ``logs["outputs"]`` the closure's outputs (read lazily:
    ``keras_rules.PredictBatchLogs``); any callback is accepted, as TF's predict
    (which runs outside the PS scope) accepts it.

    Returns:
        The model's outputs concatenated over batches, ``(n, ...)`` per output,
        nested as the model returns them.

    Raises:
        ValueError: ``run_eagerly`` (TF's message), ``steps`` missing for a
            DatasetCreator (TF's message) or an infinite Dataset, empty data.
    """
    import jax
    import keras

    from distribute.keras_support import ps_hooks
    from distribute.parameter_server.coordinator import ClusterCoordinator
    from distribute.parameter_server.dataset import DatasetCreator, DistributedDatasetSpec

    if model.run_eagerly:
        raise ValueError(RUN_EAGERLY)
    if steps is not None:
        _check_steps(steps, "steps")
    if isinstance(x, (DatasetCreator, DistributedDatasetSpec)):
        if steps is None:
            raise ValueError(STEPS_REQUIRED_CREATOR)
        x = _local_dataset(x)
    source = x if _is_dataset(x) else _Arrays(x, None, None, batch_size or 32)
    verbose = 2 if verbose == "auto" else verbose
    callback_list = keras.callbacks.CallbackList(
        callbacks, add_progbar=verbose != 0, model=model, verbose=verbose, epochs=1, steps=steps,
    )
    coordinator = ClusterCoordinator(strategy)
    predict_batches = ps_hooks.cached(model, "_distribute_ps_predict", lambda: _predict_fn(model))
    callback_list.on_predict_begin()
    remote_values, begin = [], 0
    for group in _groups(batches_of(source, steps, "predict"), steps_per_execution(model)):
        # TF's predict loop: on_predict_batch_begin(step), the step, on_predict_batch_end(step + increment, outputs).
        call_batch_begin(callback_list, "predict", begin)
        remote_values.append(coordinator.schedule(predict_batches, args=(tuple(x for x, _, _ in group),)))
        call_batch_end(callback_list, "predict", begin + len(group) - 1, remote_values[-1])
        begin += len(group)
    if not remote_values:
        raise ValueError("model.predict under ParameterServerStrategy: the data is empty.")
    coordinator.join()
    outputs = [out for remote_value in remote_values for out in remote_value.fetch()]
    result = jax.tree_util.tree_map(lambda *parts: np.concatenate(parts, axis=0), *outputs)
    callback_list.on_predict_end()
    return result


def _predict_fn(model: Any) -> Any:
    def predict_batches(xs):
        return tuple(model(x, training=False) for x in xs)

    return predict_batches


# -- inputs ---------------------------------------------------------------------------------------
class _Arrays:
    """numpy inputs, batched on the coordinator in row order (Keras' array adapter without shuffling)."""

    def __init__(self, x: Any, y: Any, sample_weight: Any, batch_size: int):
        import jax

        _check_steps(batch_size, "batch_size")
        leaves = jax.tree_util.tree_leaves(x)
        if not leaves:
            raise ValueError("model.evaluate/predict under ParameterServerStrategy needs `x` (numpy arrays).")
        self.data = jax.tree_util.tree_map(np.asarray, (x, y, sample_weight))
        self.size = int(np.shape(leaves[0])[0])
        self.batch_size = batch_size

    def __iter__(self) -> Iterator:
        import jax

        for start in range(0, self.size, self.batch_size):
            yield jax.tree_util.tree_map(lambda a: a[start : start + self.batch_size], self.data)


def batches_of(source: Any, steps: int | None, method: str) -> Iterator:
    """``(x, y, sample_weight)`` batches of ``source`` in order, at most ``steps`` of them.

    Raises:
        ValueError: an infinite Dataset without ``steps``.
    """
    if steps is None and not isinstance(source, _Arrays) and int(source.cardinality()) == -1:
        raise ValueError(INFINITE_STEPS.format(method=method))
    return itertools.islice(_batches(source), steps)


def _batches(source: Any) -> Iterator:
    from distribute.keras_support import ps_hooks

    if isinstance(source, _Arrays):
        return iter(source)
    return (ps_hooks.unpack_x_y_sample_weight(element) for element in source)


def _groups(batches: Iterator, size: int) -> Iterator[tuple]:
    """Consecutive batches, ``size`` to a group, the remainder last: TF's DataHandler steps.

    A group holding a partial batch is one more signature, traced once.
    """
    group: list = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield tuple(group)
            group = []
    if group:
        yield tuple(group)


def _local_dataset(x: Any) -> Any:
    """The dataset a DatasetCreator / distributed dataset builds, built on the coordinator (TF's predict)."""
    from distribute.input.input_context import InputContext
    from distribute.parameter_server.dataset import DatasetCreator

    context = InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)
    if isinstance(x, DatasetCreator):
        return x(context)
    return x.dataset if x.dataset is not None else x.dataset_fn(context)


def _is_dataset(x: Any) -> bool:
    from distribute.data import Dataset

    return isinstance(x, Dataset)


def _is_per_worker(x: Any) -> bool:
    from distribute.parameter_server.dataset import DatasetCreator, DistributedDatasetSpec

    return isinstance(x, (DatasetCreator, DistributedDatasetSpec))


# -- rules -----------------------------------------------------------------------------------------
def _check_model(model: Any, method: str) -> None:
    if model.optimizer is None and not getattr(model, "compiled", False):
        raise ValueError(f"You must call `compile()` before calling `{method}()` (in strategy.scope()).")
    if model.run_eagerly:
        raise ValueError(RUN_EAGERLY)


def _verbosity(verbose: Any) -> Any:
    if verbose == 1:
        raise ValueError(VERBOSE_1)
    return 2 if verbose == "auto" else verbose


def _check_steps(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r}: under ParameterServerStrategy it must be a positive int (or None).")

