"""tf-keras' rules for Model.fit / evaluate / predict under ParameterServerStrategy: messages and shared checks.

The messages are TF 2.21's (tf-keras ``training.py``, ``data_adapter.py``,
``callbacks.py``), so code that matches on them keeps working.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

STEPS_REQUIRED_CREATOR = (
    "When using a `tf.keras.utils.experimental.DatasetCreator`, `steps_per_epoch`, `validation_steps`, "
    "`steps`, or `pss_evaluation_shards` argument must be provided in `Model.fit`, `Model.evaluate`, or "
    "`Model.predict`."
)
STEPS_REQUIRED = "`steps_per_epoch` must be specified with `ParameterServerStrategy`."
RUN_EAGERLY = "When using `Model` with `ParameterServerStrategy`, `run_eagerly` is not supported."
VERBOSE_1 = "`verbose=1` is not allowed with `ParameterServerStrategy` for performance reasons. Received: verbose=1"
UNSUPPORTED_INPUT = (
    "Only `tf.keras.utils.experimental.DatasetCreator`, `tf.Tensor`, numpy arrays and pandas dataframes "
    "are supported types at this time."
)
# TF rejects a callback implementing any of these (train, test or predict batch hooks) under PS.
_BATCH_HOOKS = (
    "on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end",
    "on_test_batch_begin", "on_test_batch_end", "on_predict_batch_begin", "on_predict_batch_end",
)


def supports_ps_logs(callback: Any, keras: Any) -> bool:
    """Whether ``callback`` takes its batch hooks under ParameterServerStrategy (TF's ``_supports_tf_logs``).

    TF's own ``ModelCheckpoint``, ``TensorBoard``, ``BackupAndRestore``,
    ``ProgbarLogger`` and ``TerminateOnNaN`` set ``_supports_tf_logs = True``
    (their batch hooks take a ``RemoteValue`` as ``logs``); Keras 3's namesakes
    never set the attribute, so they are recognized by class here.
    """
    if getattr(callback, "_supports_tf_logs", False):
        return True
    cb = keras.callbacks
    return isinstance(callback, (cb.ProgbarLogger, cb.History, cb.ModelCheckpoint, cb.TensorBoard,
                                 cb.BackupAndRestore, cb.TerminateOnNaN))


def check_callbacks(callbacks: Any, keras: Any) -> None:
    """TF's ``_disallow_batch_hooks_in_ps_strategy``: batch-level callbacks unless they declare support.

    Raises:
        ValueError: a callback overrides a train, test or predict batch hook and
            does not declare support (:func:`supports_ps_logs`; TF's message).
        NotImplementedError: a ``BackupAndRestore`` with an integer
            ``save_freq``: TF's callback returns from its batch hooks under
            ParameterServerStrategy (no batch-level backup is ever written); this
            refuses instead of skipping silently.
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    base = keras.callbacks.Callback
    unsupported = [
        cb for cb in (callbacks or [])
        if not supports_ps_logs(cb, keras)
        and any(getattr(type(cb), hook, None) is not getattr(base, hook) for hook in _BATCH_HOOKS)
    ]
    if unsupported:
        raise ValueError(
            "Batch-level `Callback`s are not supported with `ParameterServerStrategy`. "
            f"Found unsupported callbacks: {unsupported}"
        )
    for cb in callbacks or []:
        if isinstance(cb, keras.callbacks.BackupAndRestore) and cb.save_freq != "epoch":
            raise NotImplementedError(
                f"BackupAndRestore(save_freq={cb.save_freq!r}) under ParameterServerStrategy: TF's callback skips "
                "its batch-level backups under ParameterServerStrategy (a batch-level backup would not match the "
                "asynchronous steps still in flight), so only epoch-level backups exist; pass save_freq='epoch'."
            )


class BatchLogs(Mapping):
    """The ``logs`` of a batch hook under ParameterServerStrategy: a scheduled step's ``RemoteValue``, fetched lazily.

    TF passes the step's ``RemoteValue`` itself, so a callback that does not read
    its logs (``TensorBoard``'s ``isinstance(logs, dict)`` check, a ``ProgbarLogger``
    at ``verbose=2``) never waits for the step.  This is that value with the read
    side of a dict: ``fetch()`` / ``get()`` as a RemoteValue, and ``logs[key]``,
    ``in``, iteration, ``**logs`` wait for the step and read its logs
    ``{name: float}`` (TF's ``sync_to_numpy_or_python_type``; fetching also
    refreshes the coordinator's variables from the ps, so a ``ModelCheckpoint``
    with an integer ``save_freq`` saves the ps values).  Not a ``dict`` subclass:
    ``TensorBoard`` writes no ``batch_*`` scalars, as TF's does not for a RemoteValue.
    """

    def __init__(self, remote_value: Any):
        self._remote_value = remote_value
        self._logs: dict | None = None

    def fetch(self) -> dict:
        if self._logs is None:
            import numpy as np

            value = self._remote_value.fetch()
            self._logs = {k: float(np.asarray(v)) if np.ndim(v) == 0 else np.asarray(v) for k, v in (value or {}).items()}
        return self._logs

    def get(self, key: Any = None, default: Any = None) -> Any:  # type: ignore[override]
        return self.fetch() if key is None else self.fetch().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        return self.fetch()[key]

    def __iter__(self) -> Iterator:
        return iter(self.fetch())

    def __len__(self) -> int:
        return len(self.fetch())

    def __bool__(self) -> bool:  # ``logs or {}`` keeps the value without waiting for the step
        return True

    def __repr__(self) -> str:
        return f"BatchLogs({self._remote_value!r})"


class PredictBatchLogs(BatchLogs):
    """The ``logs`` of ``on_predict_batch_end`` under ParameterServerStrategy: ``{"outputs": ...}``, fetched lazily.

    TF's predict passes ``{"outputs": batch_outputs}``: the model's outputs for the
    step's batches (``steps_per_execution`` of them concatenated on axis 0), as
    numpy.  Here the same values, read from the scheduled closure when a callback
    first reads them (``logs["outputs"]`` waits for that closure only), so the
    other closures keep running on the workers meanwhile.
    """

    def fetch(self) -> dict:
        if self._logs is None:
            import jax
            import numpy as np

            outputs = self._remote_value._fetch_value()  # predict writes no variable: nothing to refresh
            self._logs = {"outputs": jax.tree_util.tree_map(lambda *parts: np.concatenate(parts, axis=0), *outputs)}
        return self._logs


def call_batch_end(callbacks: Any, mode: str, end: int, remote_value: Any) -> None:
    """``on_{mode}_batch_end(end, logs)`` on each callback of the ``CallbackList``.

    ``logs``: ``BatchLogs(remote_value)`` (``PredictBatchLogs`` for ``predict``).
    Called directly, as TF's ``CallbackList`` passes a RemoteValue untouched to
    callbacks that support it (Keras 3's would convert the logs, waiting for
    every step).  ``end``: the closure's last step, ``begin + size - 1`` (TF's
    ``step + step_increment``).
    """
    logs = (PredictBatchLogs if mode == "predict" else BatchLogs)(remote_value)
    for callback in callbacks.callbacks:
        getattr(callback, f"on_{mode}_batch_end")(end, logs=logs)


def call_batch_begin(callbacks: Any, mode: str, begin: int) -> None:
    """``on_{mode}_batch_begin(begin)`` on each callback (TF passes no logs)."""
    for callback in callbacks.callbacks:
        getattr(callback, f"on_{mode}_batch_begin")(begin, logs=None)


def spec_batch(iterator: Any) -> Any:
    """A batch of ``keras.KerasTensor`` leaves with the element spec a worker reported for ``iterator``.

    What the model is built from (Keras' symbolic build reads only shapes and
    dtypes) when fit or evaluate gets a DatasetCreator: the dataset is built on
    the workers only, as TF's, and the first worker to answer gives the spec.
    """
    import jax
    import keras
    import numpy as np

    treedef, leaves = iterator._spec()
    return jax.tree_util.tree_unflatten(treedef, [keras.KerasTensor(tuple(shape), np.dtype(dtype).name)
                                                  for shape, dtype in leaves])


def steps_per_execution(model: Any) -> int:
    """``compile(steps_per_execution=K)``'s ``K`` (1 by default): steps packed into one scheduled closure."""
    return max(int(getattr(model, "steps_per_execution", 1) or 1), 1)


def execution_sizes(steps: int, per_execution: int) -> list[int]:
    """Steps per scheduled closure: ``per_execution`` each, the remainder last (TF's DataHandler.steps)."""
    sizes = [per_execution] * (steps // per_execution)
    if steps % per_execution:
        sizes.append(steps % per_execution)
    return sizes
