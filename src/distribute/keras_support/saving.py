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
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Any

import keras

from distribute import _context

_PATCHED = ("save", "save_weights")


def write_filepath(filepath: str, cluster: Any) -> str:
    """The path this worker writes: ``filepath`` on the chief, ``dir/workertemp_N/base`` elsewhere (TF's name)."""
    if cluster is None or cluster.is_chief:
        return filepath
    return os.path.join(os.path.dirname(filepath), f"workertemp_{cluster.worker_id}", os.path.basename(filepath))


def _cluster_of(model: Any) -> Any:
    from distribute.checkpoint._state import strategy_of

    cluster = getattr(strategy_of(list(model.variables)), "_cluster_info", None)
    return cluster if cluster is not None and cluster.num_workers > 1 else None


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
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

    save._distribute_saving = True  # type: ignore[attr-defined]
    return save


def install() -> None:
    """Patches ``keras.Model.save`` and ``save_weights`` once per process (idempotent)."""
    for name in _PATCHED:
        current = getattr(keras.Model, name)
        if not getattr(current, "_distribute_saving", False):
            setattr(keras.Model, name, _wrap(current))
