"""distribute.Checkpoint (tf.train.Checkpoint) on orbax-checkpoint."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import distribute.checkpoint._state as _state
import distribute.checkpoint._storage as _storage


def _agreed_path(strategy: Any, path: str) -> str:
    """The chief's path, on every worker (a non-chief may pass its own temporary directory, as in TF's tutorials).

    Every worker must write the same orbax checkpoint; the chief's path is the
    real one.  A non-chief whose own path differs gets that directory created,
    as TF's non-chief writes there (so the tutorials' ``rmtree`` of it works).
    """
    exchange = _runtime_of(strategy).exchange if _runtime_of(strategy) is not None else None
    if exchange is None:
        return path
    paths = exchange.all_gather(exchange.new_channel(), path.encode("utf-8"), f"the checkpoint save of {path!r}")
    chief = paths[0].decode("utf-8")
    if chief != path:
        _storage.checkpoint_path(os.path.dirname(path) or ".").mkdir(parents=True, exist_ok=True)
    return chief


def _after_commit(location: Any, on_commit: Any) -> Any:
    """After a save committed: the sibling tables of a format-2 checkpoint it replaced are deleted, then ``on_commit``."""

    def committed() -> None:
        _storage.delete_sibling_tables(location)
        if on_commit is not None:
            on_commit()

    return committed


def _table_writer(tables: list) -> Any:
    """``write(directory)``: each ps writes its shards of the ``(placement, variable, name)`` tables there."""
    if not tables:
        return None

    def write(directory: str) -> None:
        for placement, variable, name in tables:
            placement.save_parts(variable, directory, name)

    return write


def _runtime_of(strategy: Any) -> Any:
    """``strategy``'s cross-worker runtime (``runtime/workers.py``), None for one process or the default strategy."""
    return None if strategy is None else strategy.extended.runtime


def _num_workers(strategy: Any) -> int:
    runtime = _runtime_of(strategy)
    return runtime.num_workers if runtime is not None else 1


def _timeout_seconds(strategy: Any) -> float:
    runtime = _runtime_of(strategy)
    return runtime.timeout_seconds if runtime is not None else 1200.0


class RestoreStatus:
    """What ``Checkpoint.restore`` returns (TF's load status).

    ``assert_consumed()`` raises ``AssertionError`` while some saved values wait
    for their object to be built (deferred restoration), as TF.
    """

    def __init__(self, path: str, num_variables: int, extra: dict | None, waiting: dict[str, Any]):
        self.path, self.num_variables = path, num_variables
        self._extra = dict(extra or {})
        self._waiting = waiting  # object name -> object, until it is built and restored

    @property
    def extra(self) -> dict:
        return dict(self._extra)

    def assert_consumed(self) -> RestoreStatus:
        """Raises AssertionError unless every saved value has been assigned."""
        if self._waiting:
            raise AssertionError(
                f"checkpoint {self.path!r}: the values of {sorted(self._waiting)} are not restored yet; they "
                "are assigned when those objects are built (call the model on a batch or build it first)."
            )
        return self

    def assert_existing_objects_matched(self) -> RestoreStatus:
        """Every variable that exists now was matched (mismatches raise in restore)."""
        return self

    def expect_partial(self) -> RestoreStatus:
        return self

    def __repr__(self) -> str:
        return f"RestoreStatus(path={self.path!r}, num_variables={self.num_variables}, waiting={sorted(self._waiting)})"



class InitializationOnlyStatus:
    """What ``Checkpoint.restore(None)`` returns: nothing was restored (TF's InitializationOnlyStatus).

    ``assert_consumed``, ``assert_existing_objects_matched`` and
    ``assert_nontrivial_match`` raise TF's ``AssertionError``; ``expect_partial``
    and ``initialize_or_restore`` do nothing.
    """

    _MESSAGE = "No checkpoint specified (save_path=None); nothing is being restored."

    def assert_consumed(self) -> None:
        raise AssertionError(self._MESSAGE)

    def assert_existing_objects_matched(self) -> None:
        raise AssertionError(self._MESSAGE)

    def assert_nontrivial_match(self) -> None:
        raise AssertionError(self._MESSAGE)

    def expect_partial(self) -> "InitializationOnlyStatus":
        return self

    def initialize_or_restore(self, session: Any = None) -> None:
        return None

    def __repr__(self) -> str:
        return "InitializationOnlyStatus()"


class SaveCounter(int):
    """The number of ``save`` calls, as an int that also answers TF code's ``save_counter.numpy()``."""

    def numpy(self) -> np.int64:
        return np.int64(self)

    def read_value(self) -> np.int64:
        return np.int64(self)

class Checkpoint:
    """Saves and restores Keras objects' variables (tf.train.Checkpoint), on orbax-checkpoint.

    Every worker calls ``save``/``write``/``restore``.  A save is one orbax
    checkpoint directory, committed atomically (a killed worker leaves the
    previous checkpoint whole) and written asynchronously: ``save`` returns once
    the values are copied to host memory; the next save, ``wait_until_finished()``,
    any restore or ``latest_checkpoint`` in this process, and the end of the
    process wait for the bytes to be on disk.  Under MultiWorkerMirroredStrategy
    every worker takes part in the orbax save (orbax's barriers go through JAX's
    coordination service, bounded by ``CommunicationOptions.timeout_seconds``);
    the chief writes the files.

    Every dtype round-trips exactly: an ``int64`` variable is stored as int64
    even though JAX without x64 holds it as int32.  Restoring puts each value
    back with the variable's current placement, so a checkpoint written with 4
    replicas restores under 1 or 2, or on another worker count.

    Example::

        with strategy.scope():
            model, optimizer = make_model(), keras.optimizers.Adam()
        checkpoint = distribute.Checkpoint(model=model, optimizer=optimizer)
        path = checkpoint.save("ckpt/run")      # 'ckpt/run-1' (a directory)
        checkpoint.restore(path)

    Args:
        **objects: Keras models, layers, optimizers, metrics or variables, by name.

    Raises:
        ValueError: no objects, or an object that holds no Keras variables.
    """

    def __init__(self, **objects: Any):
        if not objects:
            raise ValueError("Checkpoint() needs at least one object, e.g. Checkpoint(model=model, optimizer=optimizer).")
        for name, obj in objects.items():
            if not (_state.is_optimizer(obj) or _state.is_unbuilt(obj)):
                _state.variables_of(name, obj)
        self._objects = dict(objects)
        self.save_counter = SaveCounter(0)
        self._writer: _storage._Writer | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        """``checkpoint.name = obj`` adds ``obj`` to the checkpoint under ``name``, as tf.train.Checkpoint tracks attributes.

        Names starting with ``_`` and ``save_counter`` are ordinary attributes.

        Raises:
            ValueError: ``value`` holds no Keras variables.
        """
        if name.startswith("_") or name == "save_counter":
            object.__setattr__(self, name, value)
            return
        if not (_state.is_optimizer(value) or _state.is_unbuilt(value)):
            _state.variables_of(name, value)
        self._objects[name] = value

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"Checkpoint has no object {name!r}; it holds {sorted(objects)}")

    def _variables(self) -> list:
        return [v for name, obj in self._objects.items() for v in _state.variables_of(name, obj)]

    def _strategy(self) -> Any:
        return _state.strategy_of(self._variables())

    # -- writing ----------------------------------------------------------------------------------
    def save(self, file_prefix: str | os.PathLike) -> str:
        """Writes ``{file_prefix}-{save_counter + 1}`` and increments ``save_counter`` (TF: save).

        Returns:
            The checkpoint's path (the chief's, on every worker).

        Raises:
            ValueError: a path orbax cannot open (see ``write``).
        """
        self.save_counter = SaveCounter(self.save_counter + 1)
        return self.write(f"{os.fspath(file_prefix)}-{self.save_counter}")

    def write(self, file_prefix: str | os.PathLike) -> str:
        """Writes the checkpoint to the directory ``file_prefix``, replacing one already there (TF: write).

        Every worker must call it.  Returns before the bytes are on disk (see the
        class docstring); the write is atomic.

        Returns:
            The checkpoint's path, on every worker.

        Raises:
            ValueError: a path with a scheme orbax cannot open (``hdfs://...``).
            OSError: the previous save of this Checkpoint failed.
        """
        return self._write(file_prefix, {})

    def _write(self, file_prefix: str | os.PathLike, extra: dict, on_commit: Any = None) -> str:
        path = os.fspath(file_prefix)
        _storage.checkpoint_path(path)  # a bad scheme fails before any worker waits for another
        strategy = self._strategy()
        path = _agreed_path(strategy, path)
        location = _storage.checkpoint_path(path)
        tree: dict[str, list] = {}
        entries: list = []
        tables: list = []  # (placement, variable, name): written by their ps into the checkpoint, during the save
        for name, obj in self._objects.items():
            tree[name] = []
            for index, variable in enumerate(_state.variables_of(name, obj)):
                placement = variable.__dict__.get("_distribute_placement")
                if placement is not None and placement.remote(variable):
                    # Held by its ps only (a large ParameterServerStrategy table): each ps writes its shards.
                    tables.append((placement, variable, f"{name}_{index}"))
                    entries.append({"object": name, "index": index, "path": variable.path,
                                    "shape": list(variable.shape), "dtype": np.dtype(variable.dtype).name,
                                    "empty": False, "table": placement.table_parts(variable, f"{name}_{index}")})
                    continue
                value = _state.saved_value(variable)
                empty = value.size == 0  # orbax cannot store zero-size arrays; the record has the shape
                if not empty:
                    tree[name].append(value)
                entries.append({"object": name, "index": index, "path": variable.path, "shape": list(value.shape),
                                "dtype": value.dtype.name, "empty": empty})
        record = {"format": _storage._FORMAT, "save_counter": self.save_counter, "variables": entries, "extra": extra,
                  "tables": _storage.TABLES if tables else None}
        if self._writer is None:
            self._writer = _storage._Writer(_num_workers(strategy), _timeout_seconds(strategy))
        self._writer.save(location, tree, record, _after_commit(location, on_commit), _table_writer(tables))
        return path

    def wait_until_finished(self) -> None:
        """Blocks until this Checkpoint's last save is on disk (committed).

        Raises:
            OSError: that save failed.
        """
        if self._writer is not None:
            self._writer.wait()

    sync = wait_until_finished  # TF's name for the same wait (tf.train.Checkpoint.sync)

    # -- reading ----------------------------------------------------------------------------------
    def restore(self, save_path: str | os.PathLike | None) -> "RestoreStatus | InitializationOnlyStatus":
        """Puts the saved values back into the objects' variables, with their current placement (TF: restore).

        ``save_path=None`` (TF's guide: ``ckpt.restore(manager.latest_checkpoint)``
        before the first save) restores nothing and returns an
        :class:`InitializationOnlyStatus`, as TF.

        Checks every variable of the built objects first and assigns only when
        all match, so an error leaves every variable as it was.  An object not
        built yet (a model or optimizer whose variables do not exist) gets its
        values when it is built, as TF's deferred restoration; an unbuilt
        optimizer is built at once with the trainable variables of this
        checkpoint's built models (TF creates slot variables on restore).

        Returns:
            A status; ``assert_consumed()`` passes once nothing waits for a build.

        Raises:
            ValueError: no such checkpoint, or a variable missing, extra, or of
                another shape, dtype or name than saved; the message names it.
        """
        if save_path is None:
            # TF's guide: ckpt.restore(manager.latest_checkpoint) on a fresh start restores nothing.
            return InitializationOnlyStatus()
        path = os.fspath(save_path)
        location = _storage.checkpoint_path(path)
        strategy = self._strategy()
        record, arrays = _storage.read(location, _num_workers(strategy))
        saved = _state.entries_by_object(record)
        missing = [name for name in self._objects if name not in saved]
        if missing:
            raise ValueError(
                f"checkpoint {path!r} has no object {missing[0]!r} (it has {sorted(saved)}); create the "
                f"Checkpoint with the same names as when saving, e.g. Checkpoint({', '.join(f'{n}=...' for n in sorted(saved))})."
            )
        self._build_optimizers(saved)
        plan, waiting = [], {}
        for name, obj in self._objects.items():
            if _state.is_unbuilt(obj) and saved[name]:
                waiting[name] = obj
                continue
            plan += _state.match(path, name, _state.variables_of(name, obj), saved[name], arrays[name])
        _state.assign(plan)
        self.save_counter = SaveCounter(int(record.get("save_counter", 0)))
        status = RestoreStatus(path, len(plan), record.get("extra"), waiting)
        for name, obj in waiting.items():
            _state.defer(obj, self._deferred(path, name, obj, saved[name], arrays[name], status, saved))
        return status

    read = restore

    def _deferred(self, path: str, name: str, obj: Any, entries: list[dict], values: list, status: RestoreStatus,
                  saved: dict[str, list[dict]]) -> Any:
        def apply() -> None:
            _state.assign(_state.match(path, name, _state.variables_of(name, obj), entries, values))
            status._waiting.pop(name, None)
            status.num_variables += len(entries)
            if not _state.is_optimizer(obj):
                self._build_optimizers(saved)  # its optimizer's slots can exist now, and take their values

        return apply

    def _build_optimizers(self, saved: dict[str, list[dict]]) -> None:
        """Builds unbuilt optimizers that have saved slot variables, with the built models' trainable variables."""
        trainable = [v for other in self._objects.values() if not _state.is_optimizer(other) and not _state.is_unbuilt(other)
                     for v in getattr(other, "trainable_variables", [])]
        for name, obj in self._objects.items():
            if not _state.is_optimizer(obj) or obj.built or len(saved.get(name, [])) <= len(obj.variables):
                continue
            if trainable:
                with _state.scope_of(_state.strategy_of(trainable)), _state.outside_name_scopes():
                    obj.build(trainable)
