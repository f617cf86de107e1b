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
    """A variable stored as row shards (TF: ``tf.distribute.experimental``'s ``ShardedVariable``).

    Two kinds, both ``isinstance(v, distribute.ShardedVariable)``:

    * **made by the strategy**: a Keras variable created in the scope of
      ``ParameterServerStrategy(variable_partitioner=...)`` whose partitioner
      returns more than one shard on axis 0.  It stays a Keras variable (layers,
      optimizers and ``model.fit`` use it as before; reads and ``assign`` /
      ``assign_add`` / ``assign_sub`` work on the full value, as Keras' do) and
      gains ``.variables``: one :class:`ShardView` per shard, TF's ``"div"`` rows,
      each with the ``device`` of the ps task holding it
      (``/job:ps/replica:0/task:<j>/device:CPU:0``) and ``name`` ``"<name>/part_<i>"``.
    * **built from shards**: ``ShardedVariable([v0, v1, ...], name=...)`` over
      Keras variables of equal dtype and equal shapes except axis 0 (TF's
      constructor and validation).  Reads concatenate the shards on axis 0;
      ``assign*`` split the full value into them and return ``self`` (TF).

    A ``distribute.Checkpoint`` stores the full logical value, so it restores into
    another number of shards, or into an unpartitioned variable (TF's
    ``SaveSliceInfo`` behaviour).  Iterating yields the shards (TF).

    In a scheduled function that only looks rows up (``Embedding``,
    ``keras.ops.take(v, ids, axis=0)``, ``v[ids]``) a worker reads just those rows
    from the shards that hold them and each shard's ps updates just those rows
    (TF's per-shard gather; see ``row_plan.py``); otherwise it reads the whole value.

    Differences from TF: a Keras layer lists the variable once in ``.weights``
    (TF lists each shard); there is no ``scatter_*``/``sparse_read`` method.

    Raises:
        TypeError: ``variables`` is not a non-empty list of Keras variables.
        ValueError: dtypes differ, or shapes differ beyond axis 0 (TF's messages).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return object.__new__(_ShardList if cls is ShardedVariable else cls)


class ShardView:
    """One shard of a strategy-made :class:`ShardedVariable`: rows ``[start, stop)`` of axis 0.

    ``numpy()`` / ``value`` read those rows of the full value; ``assign*`` of a
    ``(stop - start, ...)`` value update them (the full variable's assignment,
    pushed to the ps).
    """

    def __init__(self, full: Any, index: int, start: int, stop: int, device: str):
        self._full, self.start, self.stop, self.device = full, start, stop, device
        self.name, self._index = f"{full.name}/part_{index}", index

    def _remote(self) -> Any:
        """The full variable's placement when the coordinator holds none of it (a large ps table), else None."""
        placement = self._full.__dict__.get("_distribute_placement")
        return placement if placement is not None and placement.remote(self._full) else None

    @property
    def shape(self) -> tuple:
        return (self.stop - self.start, *tuple(self._full.shape)[1:])

    @property
    def dtype(self) -> str:
        return self._full.dtype

    @property
    def value(self) -> Any:
        placement = self._remote()
        if placement is not None:  # this shard only, read from its ps
            return placement.read_shard(self._full, self._index)
        return self._full.value[self.start : self.stop]

    def numpy(self) -> np.ndarray:
        return np.asarray(self.value)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.numpy(), dtype=dtype)

    def assign(self, value: Any) -> ShardView:
        rows = np.asarray(value, dtype=np.dtype(self.dtype))
        if rows.shape != self.shape:
            raise ValueError(f"{self.name}: assign of shape {rows.shape}; this shard has shape {self.shape}.")
        placement = self._remote()
        if placement is not None:  # sent to this shard's ps only, in pieces
            placement.assign_shard(self._full, self._index, rows)
            return self
        full = np.array(self._full.numpy(), copy=True)
        full[self.start : self.stop] = rows
        self._full.assign(full)
        return self

    def assign_add(self, delta: Any) -> ShardView:
        return self.assign(self.numpy() + np.asarray(delta, dtype=np.dtype(self.dtype)))

    def assign_sub(self, delta: Any) -> ShardView:
        return self.assign(self.numpy() - np.asarray(delta, dtype=np.dtype(self.dtype)))

    def __repr__(self) -> str:
        return f"<ShardView {self.name!r} shape={self.shape} device={self.device!r}>"


class _PartitionedKerasVariable(ShardedVariable):
    """Mixed into a strategy-made partitioned Keras variable's class (before the Keras class)."""

    @property
    def variables(self) -> list:
        """The shards, in row order (TF: the shard variables)."""
        return list(self.__dict__["_distribute_shards"])

    def __iter__(self) -> Any:
        return iter(self.variables)


_CLASSES: dict[type, type] = {}


def make_sharded(var: Any, bounds: list[tuple[int, int]], devices: list[str]) -> None:
    """Turns a Keras variable into a strategy-made :class:`ShardedVariable` (its class gains the mixin)."""
    base = type(var)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type("ShardedVariable", (_PartitionedKerasVariable, base), {"__module__": __name__})
    var.__dict__["_distribute_shards"] = tuple(
        ShardView(var, i, a, b, d) for i, ((a, b), d) in enumerate(zip(bounds, devices))
    )
    var.__class__ = cls


class _ShardList(ShardedVariable):
    """A ShardedVariable built from shard variables (``ShardedVariable([v0, v1])``)."""

    _distribute_logical_variable = True  # a Checkpoint stores it as one variable

    def __init__(self, variables: Any, name: str = "ShardedVariable"):
        import keras

        if not isinstance(variables, (list, tuple)) or not variables or not all(
            isinstance(v, keras.Variable) for v in variables
        ):
            raise TypeError(
                "Argument `variables` should be a non-empty list of `variables.Variable`s. Received "
                f"{variables!r}; pass Keras variables, e.g. ShardedVariable([keras.Variable([0]), keras.Variable([1])])."
            )
        dtypes = {v.dtype for v in variables}
        if len(dtypes) > 1:
            raise ValueError(
                f"All elements in argument `variables` must have the same dtype. Received dtypes: {[v.dtype for v in variables]}"
            )
        rest = {tuple(v.shape)[1:] for v in variables}
        if len(rest) > 1 or any(len(v.shape) == 0 for v in variables):
            raise ValueError(
                "All elements in argument `variables` must have the same shapes except for the first axis. "
                f"Received shapes: {[tuple(v.shape) for v in variables]}"
            )
        self._variables, self.name = list(variables), name

    @property
    def variables(self) -> list:
        return list(self._variables)

    @property
    def path(self) -> str:
        return self.name

    @property
    def dtype(self) -> str:
        return self._variables[0].dtype

    @property
    def shape(self) -> tuple:
        return (sum(int(v.shape[0]) for v in self._variables), *tuple(self._variables[0].shape)[1:])

    @property
    def value(self) -> Any:
        import jax.numpy as jnp

        return jnp.concatenate([jnp.asarray(v.value) for v in self._variables], axis=0)

    def numpy(self) -> np.ndarray:
        return np.asarray(self.value)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.numpy(), dtype=dtype)

    def __jax_array__(self) -> Any:
        return self.value

    def __iter__(self) -> Any:
        return iter(self.variables)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> Any:
        return self.value[index]

    def _split(self, value: Any) -> list:
        import jax.numpy as jnp

        value = jnp.asarray(value, dtype=self.dtype)
        if tuple(value.shape) != self.shape:
            raise ValueError(f"ShardedVariable {self.name!r}: a value of shape {tuple(value.shape)}; it has shape {self.shape}.")
        out, start = [], 0
        for v in self._variables:
            out.append(value[start : start + int(v.shape[0])])
            start += int(v.shape[0])
        return out

    def assign(self, value: Any) -> _ShardList:
        for v, part in zip(self._variables, self._split(value)):
            v.assign(part)
        return self

    def assign_add(self, delta: Any) -> _ShardList:
        for v, part in zip(self._variables, self._split(delta)):
            v.assign_add(part)
        return self

    def assign_sub(self, delta: Any) -> _ShardList:
        for v, part in zip(self._variables, self._split(delta)):
            v.assign_sub(part)
        return self

    def __repr__(self) -> str:
        return f"<ShardedVariable {self.name!r} shape={self.shape} dtype={self.dtype} shards={len(self._variables)}>"
