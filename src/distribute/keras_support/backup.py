"""BackupAndRestore for ``model.fit`` under any strategy (tf.keras.callbacks.BackupAndRestore).

Keras 3's callback (``keras.callbacks.BackupAndRestore``) writes
``latest.weights.h5`` and then ``training_metadata.json`` in place from every
process.  Under MultiWorkerMirroredStrategy that means every worker writing the
same files at once, and a worker killed between (or during) the two writes
leaves weights that do not match the recorded epoch, or a truncated file.

This subclass keeps Keras' arguments and behaviour (resume at the epoch after
the last backup; the backup is deleted when ``fit`` ends) and changes the
storage: each backup is ONE orbax checkpoint (model and optimizer variables plus
the epoch) committed atomically and written asynchronously through
:mod:`distribute.checkpoint` (the chief writes the files), and on a restart every worker
reads the same file and puts the values back with the current strategy's
placement (so a job may even resume with another number of replicas).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import keras

import numpy as np

import distribute.checkpoint._elastic as _elastic
from distribute.checkpoint import Checkpoint, CheckpointManager, UnreadableCheckpointError
from distribute.checkpoint._state import host_value, should_checkpoint, strategy_of

_NAME = "backup"


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Backs up the training state each epoch and resumes from it after an interruption.

    As ``tf.keras.callbacks.BackupAndRestore``: pass the same ``backup_dir``
    on every worker and relaunch the same job after a failure; ``fit`` then
    starts at the epoch after the last backup, with the model's and the
    optimizer's variables as they were then.

    Args:
        backup_dir: directory for the backups (``backup-N`` orbax checkpoints); used by
            this callback only.
        save_freq: ``"epoch"`` (back up at the end of every epoch) or an
            integer number of batches.  As Keras 3, a restart resumes at the
            start of the epoch in progress, from the last backup's variables.
        double_checkpoint: keep the previous backup too, and fall back to it
            when the latest cannot be read.
        delete_checkpoint: delete ``backup_dir`` when ``fit`` ends.

    Raises:
        ValueError: an empty ``backup_dir`` or a bad ``save_freq`` (as Keras).
    """

    def __init__(self, backup_dir: str | os.PathLike, save_freq: Any = "epoch", double_checkpoint: bool = False,
                 delete_checkpoint: bool = True):
        super().__init__(os.fspath(backup_dir) if backup_dir else backup_dir, save_freq=save_freq,
                         double_checkpoint=double_checkpoint, delete_checkpoint=delete_checkpoint)

    def _manager(self) -> CheckpointManager:
        model = self.model
        cached = getattr(self, "_backup_manager", None)
        if cached is not None and cached[0] is model and cached[1] is getattr(model, "optimizer", None):
            return cached[2]
        objects = {"model": model}
        if getattr(model, "optimizer", None) is not None:
            objects["optimizer"] = model.optimizer
        manager = CheckpointManager(Checkpoint(**objects), self.backup_dir,
                                    max_to_keep=2 if self.double_checkpoint else 1, checkpoint_name=_NAME)
        self._backup_manager = (model, getattr(model, "optimizer", None), manager)
        return manager

    def on_train_begin(self, logs: Any = None) -> None:
        self.resumed_step: int | None = None  # the global step an elastic generation restored (None: none)
        self._elastic_resume: tuple[int, int, dict, list] | None = None
        self._skip_until = 0  # batches of the current epoch an earlier generation applied (fit reads past them)
        self._step_logs: dict = {}
        if _elastic.enabled():
            _elastic.ready()
            held = _elastic.restore(self._elastic_objects())
            if held is not None:  # the newest step any worker committed: no disk read
                meta, held_logs = held
                metric_values = [host_value(v) for v in self._model.metrics_variables]
                self._elastic_resume = (int(meta["epoch"]), int(meta["batch"]), held_logs, metric_values)
                self._current_epoch = int(meta["epoch"])
                self._model._initial_epoch = self._current_epoch
                self.resumed_step = int(meta["step"])
                return
        self._load_model()

    # -- an elastic launch: commit each step in memory, resume at the committed step -----------------------------
    def _elastic_objects(self) -> dict[str, Any]:
        model = self._model
        objects: dict[str, Any] = {"model": model, "metrics": _Variables(model.metrics_variables)}
        if getattr(model, "optimizer", None) is not None:
            objects["optimizer"] = model.optimizer
        return objects

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_begin(epoch, logs)
        self._skip_until = 0
        resume, self._elastic_resume = self._elastic_resume, None
        if resume is None or resume[0] != epoch:
            return
        _, batches, held_logs, metric_values = resume
        for variable, value in zip(self._model.metrics_variables, metric_values):  # fit reset them at epoch begin
            variable.assign(value)
        if batches:
            self._step_logs = {k: np.asarray(v) for k, v in held_logs.items()}
            self._skip(batches, self._step_logs)

    def _skip(self, batches: int, held_logs: dict) -> None:
        """The next ``batches`` batches of this epoch were applied by an earlier generation: read past them only."""
        model = self._model
        real = model.train_function
        remaining = [batches]
        self._skip_until = batches

        def train_function(state: Any, iterator: Any) -> Any:
            if remaining[0] <= 0:
                model.train_function = real
                return real(state, iterator)
            for _ in range(min(max(int(model.steps_per_execution), 1), remaining[0])):
                next(iterator)
                remaining[0] -= 1
            return dict(held_logs), state

        model.train_function = train_function

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        """Under an elastic launch: commits the state before this batch, then regroups if the agent asked.

        Before the next step rather than after the last one, so that every
        callback's batch end and, at an epoch's end, ``on_epoch_end`` (its logs,
        validation, checkpoints) have run for the committed steps, once.
        """
        if batch < self._skip_until or not _elastic.enabled():
            return
        model = self.model  # syncs the steps' state into the variables (Keras' JAX trainer keeps it apart)
        steps = int(self.params.get("steps") or 0)
        meta = {"step": self._current_epoch * steps + batch, "epoch": int(self._current_epoch), "batch": batch}
        del model
        _elastic.commit(self._elastic_objects(), meta, self._step_logs)  # no wait for the last step's values
        _elastic.at_step_boundary()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if batch < self._skip_until:
            return  # an earlier generation applied this batch
        super().on_train_batch_end(batch, logs)
        self._step_logs = dict(logs or {})

    def _load_model(self) -> None:
        model = self.model
        if not model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, the model must be built before fit(): "
                f"{model} is unbuilt. Build it (model.build(input_shape) or call it on a batch) first."
            )
        manager = self._manager()
        candidates = list(reversed(manager.checkpoints))
        for position, path in enumerate(candidates):
            try:
                status = manager.checkpoint.restore(path)
            except UnreadableCheckpointError:
                if position + 1 < len(candidates):
                    continue  # double_checkpoint: fall back to the previous backup
                raise
            self._current_epoch = int(status.extra.get("epoch", 0))
            model._initial_epoch = self._current_epoch
            return

    def _save_model(self) -> None:
        self._manager()._save(None, {"epoch": int(self._current_epoch), "batch": int(self._last_batch_seen)})

    def on_train_end(self, logs: Any = None) -> None:
        self._model._initial_epoch = None  # a later fit() starts where it is told again
        self._manager().wait_until_finished()  # the last backup is on disk before anything is deleted
        if not self.delete_checkpoint:
            return
        if should_checkpoint(strategy_of(list(self.model.variables))):
            shutil.rmtree(self.backup_dir, ignore_errors=True)


class _Variables:
    """A list of variables as an object with ``variables`` (the metrics' state, committed with the model)."""

    def __init__(self, variables: list) -> None:
        self.variables = list(variables)
