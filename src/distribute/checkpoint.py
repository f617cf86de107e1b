"""Checkpoints for custom loops: every worker calls, only the chief writes (tf.train.Checkpoint).

A :class:`Checkpoint` groups Keras objects that hold variables (a model, an
optimizer, a metric, a layer, or a single Keras variable) under keyword names,
as ``tf.train.Checkpoint(model=model, optimizer=optimizer)``.  One checkpoint is
one ``.npz`` file holding every variable's value and a small JSON record (names,
shapes, dtypes, ``save_counter``).  Files are written atomically (a temporary
file in the same directory, then ``os.replace``), so a worker killed mid-write
leaves the previous checkpoint intact and never a half-written one.

Under a strategy, mirrored variables are replicated arrays: every worker holds
the whole value, so the chief (``strategy.extended.should_checkpoint``) writes
alone; in a multi-worker job all workers then meet at a barrier (with the
communication timeout) so nobody reads a checkpoint before it exists.  Restoring
puts each value back with the variable's current placement, so a checkpoint
written with 4 replicas restores under 1 or 2 (or on another worker count).

Variables are matched by object name and position (as TF matches by object
graph, not by variable name): the model saved must be the model restored.  Keras
numbers layer names per process (``dense`` / ``dense_1``); those suffixes are
ignored when checking names.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["Checkpoint", "CheckpointManager", "latest_checkpoint"]

_META_KEY = "__distribute_checkpoint__"
_FORMAT = 1
_SUFFIX = ".npz"


# -- files ------------------------------------------------------------------------------------
class _UnreadableCheckpointError(ValueError):
    """A checkpoint file that exists but cannot be read (truncated or not ours)."""


def _file_path(path: str | os.PathLike) -> str:
    """``'dir/ckpt-3'`` or ``'dir/ckpt-3.npz'`` -> ``'dir/ckpt-3.npz'``."""
    path = os.fspath(path)
    return path if path.endswith(_SUFFIX) else path + _SUFFIX


def _atomic_savez(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Writes ``arrays`` to ``path`` through a temporary file and ``os.replace``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def _read_file(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """Returns ``(record, arrays)`` of one checkpoint file.

    Raises:
        ValueError: no such file, or not a checkpoint written by this module.
    """
    if not os.path.isfile(path):
        raise ValueError(
            f"no checkpoint at {path!r}: the file does not exist. Pass a path returned by "
            "Checkpoint.save/write or CheckpointManager.latest_checkpoint (None when nothing "
            "was saved yet; then use CheckpointManager.restore_or_initialize())."
        )
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
        record = json.loads(bytes(arrays.pop(_META_KEY)).decode("utf-8"))
    except Exception as err:
        raise _UnreadableCheckpointError(
            f"{path!r} is not a readable distribute checkpoint ({type(err).__name__}: {err}); "
            "restore a file written by distribute.Checkpoint, e.g. an older one from "
            "CheckpointManager.checkpoints."
        ) from err
    return record, arrays


def _normalized(path: str) -> str:
    """Drops Keras' per-process numbering: ``'sequential_1/dense_3/kernel'`` -> ``'sequential/dense/kernel'``."""
    return re.sub(r"_\d+(?=$|[/_])", "", path)


# -- objects and variables --------------------------------------------------------------------
def _variables_of(name: str, obj: Any) -> list:
    from keras.src.backend.common.variables import Variable

    if isinstance(obj, Variable):
        return [obj]
    variables = getattr(obj, "variables", None)
    if variables is None:
        raise ValueError(
            f"Checkpoint object {name}={obj!r} holds no Keras variables; pass Keras models, layers, "
            "optimizers, metrics or variables, e.g. Checkpoint(model=model, optimizer=optimizer)."
        )
    return list(variables)


def _is_optimizer(obj: Any) -> bool:
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    return isinstance(obj, BaseOptimizer)


def _strategy_of(variables: list) -> Any:
    from distribute.strategy import get_strategy

    for v in variables:
        strategy = getattr(v, "_distribute_strategy", None)
        if strategy is not None:
            return strategy
    return get_strategy()


def _host_value(variable: Any) -> np.ndarray:
    value = variable.value
    if isinstance(value, jax.Array) and not (value.is_fully_addressable or value.is_fully_replicated):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)


def _placed(variable: Any, value: np.ndarray) -> Any:
    """``value`` with ``variable``'s placement (works for shardings spanning several workers)."""
    layout = getattr(variable, "_layout", None)
    if isinstance(layout, jax.sharding.Sharding):
        return jax.make_array_from_callback(value.shape, layout, lambda index: value[index])
    return value


def _barrier(strategy: Any, error: str | None, what: str) -> None:
    """Waits for every worker of a multi-worker job (with its timeout); the others raise if the chief failed."""
    exchange = getattr(strategy, "_exchange_obj", None)
    if exchange is None:
        return
    key = exchange.new_channel()  # its keys stay: a faster worker must not delete one another still reads
    payloads = exchange.all_gather(key, (error or "").encode("utf-8"), what)
    failures = [p.decode("utf-8") for p in payloads if p]
    if failures and not error:
        raise OSError(f"writing the checkpoint failed on the chief: {failures[0]}")


class _RestoreStatus:
    """What ``Checkpoint.restore`` returns (TF's load status); everything was matched or it raised."""

    def __init__(self, path: str, num_variables: int, extra: dict | None = None):
        self.path, self.num_variables = path, num_variables
        self._extra = dict(extra or {})

    def assert_consumed(self) -> _RestoreStatus:
        return self

    def assert_existing_objects_matched(self) -> _RestoreStatus:
        return self

    def expect_partial(self) -> _RestoreStatus:
        return self

    def __repr__(self) -> str:
        return f"RestoreStatus(path={self.path!r}, num_variables={self.num_variables})"


class Checkpoint:
    """Saves and restores Keras objects' variables (tf.train.Checkpoint).

    Every worker calls ``save``/``write``/``restore``; only the chief writes.

    Example::

        with strategy.scope():
            model, optimizer = make_model(), keras.optimizers.Adam()
        checkpoint = distribute.Checkpoint(model=model, optimizer=optimizer)
        path = checkpoint.save("ckpt/run")      # 'ckpt/run-1.npz'
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
            if not _is_optimizer(obj):
                _variables_of(name, obj)
        self._objects = dict(objects)
        self.save_counter = 0

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"Checkpoint has no object {name!r}; it holds {sorted(objects)}")

    # -- writing ----------------------------------------------------------------------------------
    def save(self, file_prefix: str | os.PathLike) -> str:
        """Writes ``{file_prefix}-{save_counter + 1}.npz`` and increments ``save_counter`` (TF: save).

        Returns:
            The file's path, on every worker.
        """
        self.save_counter += 1
        return self.write(f"{os.fspath(file_prefix)}-{self.save_counter}")

    def write(self, file_prefix: str | os.PathLike) -> str:
        """Writes the checkpoint to ``file_prefix`` (+ ``.npz``); the chief only, atomically (TF: write).

        Every worker must call it (a multi-worker job meets at a barrier afterwards).

        Returns:
            The file's path (ending ``.npz``), on every worker.

        Raises:
            OSError: the chief could not write the file (raised on every worker).
        """
        return self._write(file_prefix, {})

    def _write(self, file_prefix: str | os.PathLike, extra: dict) -> str:
        path = _file_path(file_prefix)
        entries, arrays = [], {}
        all_variables = []
        for name, obj in self._objects.items():
            for index, variable in enumerate(_variables_of(name, obj)):
                key = f"{name}/{index}"
                arrays[key] = _host_value(variable)
                entries.append({"key": key, "object": name, "index": index, "path": variable.path,
                                "shape": list(arrays[key].shape), "dtype": arrays[key].dtype.str})
                all_variables.append(variable)
        strategy = _strategy_of(all_variables)
        error = None
        if strategy.extended.should_checkpoint:
            record = {"format": _FORMAT, "save_counter": self.save_counter, "variables": entries, "extra": extra}
            arrays[_META_KEY] = np.frombuffer(json.dumps(record).encode("utf-8"), np.uint8)
            try:
                _atomic_savez(path, arrays)
            except Exception as err:
                if getattr(strategy, "_exchange_obj", None) is None:
                    raise
                error = f"{path!r}: {type(err).__name__}: {err}"
                _barrier(strategy, error, f"the checkpoint write of {path!r}")
                raise
        _barrier(strategy, error, f"the checkpoint write of {path!r}")
        return path

    # -- reading ----------------------------------------------------------------------------------
    def restore(self, save_path: str | os.PathLike) -> _RestoreStatus:
        """Puts the saved values back into the objects' variables, with their current placement (TF: restore).

        Checks every variable first and assigns only when all match, so an error
        leaves every variable as it was.  An optimizer that has no slot variables
        yet is built with the trainable variables of this checkpoint's other
        objects first (TF creates them on restore).

        Returns:
            A status object (``assert_consumed()`` passes: everything was matched).

        Raises:
            ValueError: no such file, or a variable missing, extra, or of another
                shape, dtype or name than saved; the message names it and the fix.
        """
        path = _file_path(save_path)
        record, arrays = _read_file(path)
        plan = self._match(path, record, arrays)
        for variable, value in plan:
            variable.assign(_placed(variable, value))
        self.save_counter = int(record.get("save_counter", 0))
        return _RestoreStatus(path, len(plan), record.get("extra"))

    read = restore

    def _match(self, path: str, record: dict, arrays: dict[str, np.ndarray]) -> list[tuple[Any, np.ndarray]]:
        saved: dict[str, list[dict]] = {}
        for entry in record["variables"]:
            saved.setdefault(entry["object"], []).append(entry)
        missing = [name for name in self._objects if name not in saved]
        if missing:
            raise ValueError(
                f"checkpoint {path!r} has no object {missing[0]!r} (it has {sorted(saved)}); create the "
                f"Checkpoint with the same names as when saving, e.g. Checkpoint({', '.join(f'{n}=...' for n in sorted(saved))})."
            )
        self._build_optimizers(saved)
        plan = []
        for name, obj in self._objects.items():
            variables, entries = _variables_of(name, obj), saved[name]
            if len(variables) != len(entries):
                extra = entries[len(variables)] if len(entries) > len(variables) else None
                which = (f"saved variable '{extra['path']}' has no counterpart" if extra else
                         f"variable '{variables[len(entries)].path}' was not saved")
                raise ValueError(
                    f"checkpoint {path!r}: object {name!r} has {len(variables)} variables here but "
                    f"{len(entries)} were saved ({which}). Build the same model/optimizer as when saving "
                    "(same layers in the same order; build the model before restoring)."
                )
            for variable, entry in zip(variables, entries):
                value = arrays[entry["key"]]
                problem = None
                if _normalized(variable.path) != _normalized(entry["path"]):
                    problem = f"its name differs from the saved variable '{entry['path']}'"
                elif tuple(value.shape) != tuple(variable.shape):
                    problem = f"its shape {tuple(variable.shape)} differs from the saved shape {tuple(value.shape)}"
                elif np.dtype(value.dtype) != np.dtype(variable.dtype):
                    problem = f"its dtype {variable.dtype} differs from the saved dtype {value.dtype}"
                if problem:
                    raise ValueError(
                        f"checkpoint {path!r}: variable '{variable.path}' of object {name!r} does not "
                        f"match: {problem}. Nothing was restored. Restore into the same model "
                        "architecture (layer types, sizes and order) and optimizer as when saving."
                    )
                plan.append((variable, value))
        return plan

    def _build_optimizers(self, saved: dict[str, list[dict]]) -> None:
        """Builds unbuilt optimizers that have saved slot variables, with the other objects' trainable variables."""
        for name, obj in self._objects.items():
            if not _is_optimizer(obj) or obj.built or len(saved[name]) <= len(obj.variables):
                continue
            trainable = [v for other in self._objects.values() if not _is_optimizer(other)
                         for v in getattr(other, "trainable_variables", [])]
            if not trainable:
                raise ValueError(
                    f"optimizer {name!r} was saved with slot variables but is not built, and this "
                    "Checkpoint holds no model to build it for. Call optimizer.build(model.trainable_variables) "
                    "before restore, or add the model: Checkpoint(model=model, optimizer=optimizer)."
                )
            strategy = _strategy_of(trainable)
            with strategy.scope():
                obj.build(trainable)


class CheckpointManager:
    """Keeps the last ``max_to_keep`` checkpoints in a directory (tf.train.CheckpointManager).

    Files are ``{directory}/{checkpoint_name}-{number}.npz``; the manager finds
    the ones already there when created, so a relaunched job sees the last one.

    Args:
        checkpoint: a :class:`Checkpoint`.
        directory: where checkpoints go (created on the first save).
        max_to_keep: how many to keep; older ones are deleted by the chief after
            each save. None keeps all.
        checkpoint_name: the file name prefix (TF's default ``"ckpt"``).
        init_fn: called by ``restore_or_initialize`` when there is no checkpoint.

    Raises:
        TypeError: ``checkpoint`` is not a Checkpoint.
        ValueError: ``max_to_keep`` < 1.
    """

    def __init__(self, checkpoint: Checkpoint, directory: str | os.PathLike, max_to_keep: int | None = 5,
                 checkpoint_name: str = "ckpt", init_fn: Callable[[], Any] | None = None):
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"checkpoint must be a distribute.Checkpoint, got {checkpoint!r}.")
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep={max_to_keep!r} must be an integer >= 1, or None to keep every checkpoint.")
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._max_to_keep = max_to_keep
        self._name = checkpoint_name
        self._init_fn = init_fn

    @property
    def directory(self) -> str:
        """The directory checkpoints are written to."""
        return self._directory

    @property
    def checkpoint(self) -> Checkpoint:
        """The Checkpoint this manager saves."""
        return self._checkpoint

    def _numbered(self) -> list[tuple[int, str]]:
        pattern = re.compile(rf"^{re.escape(self._name)}-(\d+){re.escape(_SUFFIX)}$")
        try:
            names = os.listdir(self._directory)
        except FileNotFoundError:
            return []
        found = [(int(m.group(1)), os.path.join(self._directory, n)) for n in names if (m := pattern.match(n))]
        return sorted(found)

    @property
    def checkpoints(self) -> list[str]:
        """The kept checkpoints' paths, oldest first."""
        return [path for _, path in self._numbered()]

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint's path, or None."""
        numbered = self._numbered()
        return numbered[-1][1] if numbered else None

    def save(self, checkpoint_number: int | None = None) -> str:
        """Writes a new checkpoint (every worker calls; the chief writes) and deletes the oldest beyond max_to_keep.

        Args:
            checkpoint_number: the number in the file name; default: one more
                than the newest checkpoint's (TF: the save counter).

        Returns:
            The new checkpoint's path.
        """
        return self._save(checkpoint_number, {})

    def _save(self, checkpoint_number: int | None, extra: dict) -> str:
        if checkpoint_number is None:
            numbered = self._numbered()
            checkpoint_number = max(self._checkpoint.save_counter, numbered[-1][0] if numbered else 0) + 1
        self._checkpoint.save_counter += 1
        path = self._checkpoint._write(os.path.join(self._directory, f"{self._name}-{int(checkpoint_number)}"), extra)
        strategy = _strategy_of([v for name, obj in self._checkpoint._objects.items() for v in _variables_of(name, obj)])
        if strategy.extended.should_checkpoint and self._max_to_keep is not None:
            for _, old in self._numbered()[: -self._max_to_keep]:
                if os.path.abspath(old) != os.path.abspath(path):
                    try:
                        os.remove(old)
                    except FileNotFoundError:
                        pass
        return path

    def restore_or_initialize(self) -> str | None:
        """Restores the latest checkpoint if there is one and returns its path; else calls ``init_fn`` and returns None."""
        latest = self.latest_checkpoint
        if latest is not None:
            self._checkpoint.restore(latest)
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None


def latest_checkpoint(checkpoint_dir: str | os.PathLike, checkpoint_name: str = "ckpt") -> str | None:
    """The newest ``{checkpoint_name}-N.npz`` in ``checkpoint_dir``, or None (tf.train.latest_checkpoint)."""
    numbered = CheckpointManager.__new__(CheckpointManager)
    numbered._directory, numbered._name = os.fspath(checkpoint_dir), checkpoint_name
    return numbered.latest_checkpoint
