"""RemoteValue and PerWorkerValues (tf.distribute.experimental.coordinator's names).

A :class:`RemoteValue` is the future of one scheduled function: ``fetch()``
blocks until it ran and returns numpy values in the function's structure.  A
:class:`PerWorkerValues` holds one RemoteValue per worker (a per-worker
iterator); a scheduled function given one receives the executing worker's part.
"""

from __future__ import annotations

import enum
import threading
from typing import Any

import jax
import numpy as np

from distribute.parameter_server.errors import ABORTED_MESSAGE, CancelledError


class RemoteValueStatus(enum.Enum):
    NOT_READY = "NOT_READY"
    ABORTED = "ABORTED"
    READY = "READY"


class RemoteValue:
    """The value a scheduled function returns, once it has run (TF: ``RemoteValue``).

    Status goes ``NOT_READY -> READY`` (a result or an error) or ``NOT_READY ->
    ABORTED`` (the function was cancelled).  Results are copied to the coordinator
    as soon as the function finishes, so ``fetch()`` still works after the worker
    that ran it is lost (TF: ``testNumpyFetchedAfterWorkerFailure``).
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._status = RemoteValueStatus.NOT_READY
        self._value: Any = None
        self._error: BaseException | None = None
        self._after_fetch: Any = None  # set by the coordinator: refresh its variable copies from the ps

    # -- set by the coordinator --------------------------------------------------------
    def _set_value(self, value: Any) -> None:
        self._value, self._error, self._status = value, None, RemoteValueStatus.READY
        self._event.set()

    def _set_error(self, error: BaseException) -> None:
        self._value, self._error, self._status = None, error, RemoteValueStatus.READY
        self._event.set()

    def _set_aborted(self, error: BaseException | None = None) -> None:
        self._error = error or CancelledError(ABORTED_MESSAGE)
        self._status = RemoteValueStatus.ABORTED
        self._event.set()

    def _reset(self) -> None:
        self._event.clear()
        self._status, self._value, self._error = RemoteValueStatus.NOT_READY, None, None

    # -- public ----------------------------------------------------------------------------
    def fetch(self) -> Any:
        """Waits for the function and returns its result as numpy (nested structure kept).

        ``None`` for a function without outputs.

        Raises:
            CancelledError: the function was cancelled because another one failed
                ("The corresponding function is cancelled. Please reschedule the
                function.") or aborted.
            Exception: the function's own error, with its own type.
        """
        value = self._fetch_value()
        if self._after_fetch is not None:
            self._after_fetch()
        return value

    def _fetch_value(self) -> Any:
        self._event.wait()
        if self._error is not None:
            raise self._error
        return jax.tree_util.tree_map(np.asarray, self._value)

    def get(self) -> Any:
        """Like ``fetch``; TF returns tensors copied to the coordinator, here numpy arrays."""
        return self.fetch()

    def _wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def __repr__(self) -> str:
        return f"<RemoteValue status={self._status.value}>"


class PerWorkerValues:
    """One value per worker (TF: ``PerWorkerValues``); ``._values`` holds them, worker order.

    Scheduled functions given a PerWorkerValues receive the part of the worker that
    runs them.  The public way to get one is ``iter(coordinator.create_per_worker_dataset(...))``.
    """

    def __init__(self, values: tuple) -> None:
        self._values = tuple(values)

    def __repr__(self) -> str:
        return f"PerWorkerValues({len(self._values)} workers)"


class ShardedVariable:
    """TF's ``ShardedVariable`` (a list of shard variables acting as one): not built here.

    Under ``ParameterServerStrategy(variable_partitioner=...)`` a Keras variable
    stays one Keras variable on the coordinator and in scheduled functions; only
    its storage is split into TF's "div" row shards over the ps (round-robin per
    shard, slots split alike).  Checkpoints hold the whole value, so they restore
    into any shard count.

    Raises:
        NotImplementedError: always, naming that alternative.
    """

    def __init__(self, variables: Any = None, name: str = "ShardedVariable"):
        raise NotImplementedError(
            "ShardedVariable objects are not supported yet. Create the variable inside the scope of "
            "ParameterServerStrategy(variable_partitioner=...): it stays one Keras variable whose rows are "
            "stored as shards on the parameter servers (assign/assign_add work on it as a whole)."
        )
