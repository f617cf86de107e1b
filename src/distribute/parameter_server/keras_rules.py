"""tf-keras' rules for Model.fit / evaluate / predict under ParameterServerStrategy: messages and shared checks.

The messages are TF 2.21's (tf-keras ``training.py``, ``data_adapter.py``,
``callbacks.py``), so code that matches on them keeps working.
"""

from __future__ import annotations

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


def check_callbacks(callbacks: Any, keras: Any) -> None:
    """TF's ``_disallow_batch_hooks_in_ps_strategy``: batch-level callbacks unless ``_supports_tf_logs``.

    Raises:
        ValueError: a callback overrides a train, test or predict batch hook (TF's message).
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
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


def steps_per_execution(model: Any) -> int:
    """``compile(steps_per_execution=K)``'s ``K`` (1 by default): steps packed into one scheduled closure."""
    return max(int(getattr(model, "steps_per_execution", 1) or 1), 1)


def execution_sizes(steps: int, per_execution: int) -> list[int]:
    """Steps per scheduled closure: ``per_execution`` each, the remainder last (TF's DataHandler.steps)."""
    sizes = [per_execution] * (steps // per_execution)
    if steps % per_execution:
        sizes.append(steps % per_execution)
    return sizes
