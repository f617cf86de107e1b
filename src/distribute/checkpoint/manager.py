"""distribute.CheckpointManager and latest_checkpoint (tf.train.CheckpointManager, tf.train.latest_checkpoint)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import distribute.checkpoint._state as _state
import distribute.checkpoint._storage as _storage
from distribute.checkpoint.checkpoint import Checkpoint


def _numbered(directory: str, name: str, wait: bool = True) -> list[tuple[int, str]]:
    """Committed ``{name}-N`` checkpoints in ``directory``, in the order they were saved (as TF), oldest first.

    Orbax's temporary (uncommitted) directories are not listed.  ``wait``: first
    wait for this process's saves in flight.
    """
    if wait:
        _storage.wait_for_pending_saves()
    location = _storage.checkpoint_path(directory)
    pattern = re.compile(rf"^{re.escape(name)}-(\d+)$")
    if not location.is_dir():
        return []
    found = [(_storage.started_at(child), int(m.group(1)), child) for child in location.iterdir()
             if (m := pattern.match(child.name)) and _storage.is_checkpoint(child)]
    return [(number, os.path.join(directory, child.name)) for _, number, child in sorted(found)]


def latest_checkpoint(checkpoint_dir: str | os.PathLike, checkpoint_name: str = "ckpt") -> str | None:
    """The newest committed ``{checkpoint_name}-N`` in ``checkpoint_dir``, or None (tf.train.latest_checkpoint).

    Waits for this process's saves in flight first, so a checkpoint just saved
    is found.  A directory that does not exist gives None, as TF.

    Raises:
        ValueError: a path scheme orbax cannot open.
    """
    numbered = _numbered(os.fspath(checkpoint_dir), checkpoint_name)
    return numbered[-1][1] if numbered else None


class CheckpointManager:
    """Keeps the last ``max_to_keep`` checkpoints in a directory (tf.train.CheckpointManager).

    Checkpoints are ``{directory}/{checkpoint_name}-{number}`` orbax directories;
    the manager finds the ones already there (ordered by when they were saved,
    as TF's), so a relaunched job sees the last one.  Old checkpoints are deleted (by the chief) only once a newer one is
    committed (when this process next waits for the save: the next save,
    ``checkpoints``, ``latest_checkpoint``, ``wait_until_finished()``, exit), so a
    crash during an asynchronous save never leaves fewer than ``max_to_keep``.

    Under MultiWorkerMirroredStrategy every worker creates a manager and calls
    ``save``; TF's tutorials give non-chief workers a temporary directory of
    their own: that directory is created (so their cleanup ``rmtree`` works),
    and the checkpoint itself is written once, into the chief's directory.

    Args:
        checkpoint: a :class:`Checkpoint`.
        directory: where checkpoints go (created on the first save).
        max_to_keep: how many to keep; None keeps all.
        checkpoint_name: the name prefix (TF's default ``"ckpt"``).
        init_fn: called by ``restore_or_initialize`` when there is no checkpoint.

    Raises:
        TypeError: ``checkpoint`` is not a Checkpoint.
        ValueError: ``max_to_keep`` < 1, or a path scheme orbax cannot open.
    """

    def __init__(self, checkpoint: Checkpoint, directory: str | os.PathLike, max_to_keep: int | None = 5,
                 checkpoint_name: str = "ckpt", init_fn: Callable[[], Any] | None = None):
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"checkpoint must be a distribute.Checkpoint, got {checkpoint!r}.")
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep={max_to_keep!r} must be an integer >= 1, or None to keep every checkpoint.")
        _storage.checkpoint_path(directory)
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
    def checkpoint_name(self) -> str:
        """The name prefix of this manager's checkpoints (``"ckpt"`` for ``ckpt-3``)."""
        return self._name

    @property
    def checkpoint(self) -> Checkpoint:
        """The Checkpoint this manager saves."""
        return self._checkpoint

    def _prune(self) -> None:
        """The chief deletes committed checkpoints beyond ``max_to_keep`` (after waiting for saves in flight)."""
        numbered = _numbered(self._directory, self._name)
        if self._max_to_keep is None or not _state.should_checkpoint(self._checkpoint._strategy()):
            return
        for _, old in numbered[: -self._max_to_keep]:
            _storage.checkpoint_path(old).rmtree(missing_ok=True)
            _storage.delete_sibling_tables(_storage.checkpoint_path(old))  # a format-2 checkpoint's tables

    @property
    def checkpoints(self) -> list[str]:
        """The kept checkpoints' paths, oldest first (waits for a save in flight)."""
        self._prune()
        return [path for _, path in _numbered(self._directory, self._name)]

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint's path, or None."""
        return latest_checkpoint(self._directory, self._name)

    def wait_until_finished(self) -> None:
        """Blocks until the last save is on disk, then deletes the checkpoints beyond max_to_keep."""
        self._checkpoint.wait_until_finished()
        self._prune()

    def save(self, checkpoint_number: int | None = None) -> str:
        """Starts a new checkpoint (every worker calls) and returns its path at once.

        Args:
            checkpoint_number: the number in the name; default: the
                checkpoint's ``save_counter`` after this save (as TF: restore
                the latest checkpoint first, or a new run numbers from 1 again
                and replaces ``ckpt-1``).

        Returns:
            The new checkpoint's path.
        """
        return self._save(checkpoint_number, {})

    def _save(self, checkpoint_number: int | None, extra: dict) -> str:
        self._prune()  # waits for the previous save, so it counts among the kept ones
        self._checkpoint.save_counter += 1
        if checkpoint_number is None:
            checkpoint_number = self._checkpoint.save_counter  # TF: the checkpoint's save counter
        return self._checkpoint._write(os.path.join(self._directory, f"{self._name}-{int(checkpoint_number)}"), extra,
                                       on_commit=self._prune)

    def restore_or_initialize(self) -> str | None:
        """Restores the latest checkpoint if there is one and returns its path; else calls ``init_fn`` and returns None."""
        latest = self.latest_checkpoint
        if latest is not None:
            self._checkpoint.restore(latest)
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None
