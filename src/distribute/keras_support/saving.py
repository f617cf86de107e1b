"""Keras ``Model.save`` / ``Model.save_weights`` (and so ``ModelCheckpoint``) under MultiWorkerMirroredStrategy.

The one place this project patches Keras saving.  As TF's
``distributed_file_utils``: the chief writes the real path; any other worker
writes to ``{dirname}/workertemp_{worker_id}/{basename}`` and deletes that
directory afterwards, so every worker may call ``model.save(path)`` (the TF
tutorial's pattern, and ``ModelCheckpoint`` on every worker) without two
processes writing one file.

Saving runs outside the strategy's scope: Keras' saver creates throw-away
objects (``saving_lib.get_attr_skipset`` builds a reference ``Optimizer``, once per
process), and inside the scope those would be cross-worker variables whose
creation is a collective, so a save on the chief alone (``if chief:
model.save(...)``, or ``ModelCheckpoint`` given to the chief only) waited for
the other workers and failed.

Keras' ``TensorBoard`` callback likewise writes from the chief only, as TF's
(``distributed_file_utils.write_dirpath``): another worker's writers go to
``{log_dir}/workertemp_{worker_id}``, which it deletes at the end of ``fit``.
"""

from __future__ import annotations

import os
import shutil
from typing import Any


from distribute import _context

def write_filepath(filepath: str, cluster: Any) -> str:
    """The path this worker writes: ``filepath`` on the chief, ``dir/workertemp_N/base`` elsewhere (TF's name)."""
    if cluster is None or cluster.is_chief:
        return filepath
    return os.path.join(os.path.dirname(filepath), f"workertemp_{cluster.worker_id}", os.path.basename(filepath))


def _cluster_of(model: Any) -> Any:
    from distribute.checkpoint._state import strategy_of

    strategy = strategy_of(list(model.variables))
    runtime = None if strategy is None else strategy.extended.runtime
    cluster = None if runtime is None else runtime.cluster
    return cluster if cluster is not None and cluster.num_workers > 1 else None


def save_wrapper(original: Any) -> Any:
    def save(self: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        cluster = _cluster_of(self)
        with _context.outside_scope():
            if cluster is None or cluster.is_chief or not isinstance(filepath, (str, os.PathLike)):
                return original(self, filepath, *args, **kwargs)
            temp = write_filepath(os.fspath(filepath), cluster)
            os.makedirs(os.path.dirname(temp) or ".", exist_ok=True)
            try:
                return original(self, temp, *args, **kwargs)
            finally:
                shutil.rmtree(os.path.dirname(temp), ignore_errors=True)

    return save


def _tensorboard_temp_dir(callback: Any, model: Any) -> str | None:
    """A non-chief worker's TensorBoard directory, ``log_dir/workertemp_N``; None on the chief or a single worker."""
    cluster = _cluster_of(model)
    if cluster is None or cluster.is_chief:
        return None
    return os.path.join(callback.log_dir, f"workertemp_{cluster.worker_id}")


def tensorboard_set_model(original: Any) -> Any:
    def set_model(self: Any, model: Any) -> None:
        temp = _tensorboard_temp_dir(self, model)
        if temp is None:
            return original(self, model)
        log_dir = self.log_dir
        os.makedirs(temp, exist_ok=True)  # as TF's write_dirpath
        self.log_dir = temp  # Keras' set_model derives every writer's directory from log_dir
        try:
            original(self, model)
        except BaseException:  # e.g. Keras' own error when TensorFlow is not installed: leave nothing behind
            shutil.rmtree(temp, ignore_errors=True)
            raise
        finally:
            self.log_dir = log_dir

    return set_model


def tensorboard_on_train_end(original: Any) -> Any:
    def on_train_end(self: Any, logs: Any = None) -> None:
        try:
            original(self, logs)  # closes the writers
        finally:
            temp = _tensorboard_temp_dir(self, self.model)
            if temp is not None:
                shutil.rmtree(temp, ignore_errors=True)  # as TF's remove_temp_dirpath

    return on_train_end
