"""Checkpoint files on orbax-checkpoint: paths, asynchronous atomic saves, reads.

One checkpoint is one orbax checkpoint directory (``dir/ckpt-3``) holding a
PyTree ``{object name: [value of variable 0, value of variable 1, ...]}`` of
NumPy arrays, with this project's record (variable paths, shapes, dtypes,
``save_counter``, extra values such as an epoch) in orbax's step metadata
(``custom_metadata["distribute"]``).  Variables this process holds no value
of (large ParameterServerStrategy tables) are written by their ps into the
sibling directory ``<path>.tables-<ns>`` before the orbax save begins
(``_tables.py``); the record names it.  A user's own orbax code reads it::

    orbax.checkpoint.StandardCheckpointer().restore("dir/ckpt-3")
    # {'model': [array(...), ...], 'optimizer': [...]}

Orbax writes into a temporary directory and renames it when every worker has
finished (atomic commit); a save returns once the values are copied to host
memory and the bytes are written by a background thread.  A later save,
``wait_until_finished()``, any read in this process (``restore``,
``latest_checkpoint``, ``CheckpointManager.checkpoints``) and the end of the
process wait for it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import Any

import numpy as np

logger = logging.getLogger("distribute")

_RECORD_KEY = "distribute"
_FORMAT = 2
_REMOTE_SCHEMES = ("gs", "s3")

_pending: set[_Writer] = set()  # strong references: a Checkpoint dropped right after save still commits
_pending_lock = threading.Lock()
_writers: weakref.WeakSet = weakref.WeakSet()  # every writer, for wait_for_background_writes


class UnreadableCheckpointError(ValueError):
    """A checkpoint that exists but cannot be read (truncated, or not one of ours)."""


def checkpoint_path(path: str | os.PathLike) -> Any:
    """``path`` as an ``etils.epath.Path`` orbax can write to.

    Local paths (and ``file://``) and the schemes orbax opens through etils
    (``gs://``, ``s3://``, with their file-system packages installed) are accepted.

    Raises:
        ValueError: another scheme (``hdfs://x``), or a remote scheme whose
            file-system package is missing; the message names it and the fix.
    """
    from etils import epath

    text = os.fspath(path)
    if not isinstance(text, str):
        raise ValueError(f"checkpoint path {path!r} must be a str or os.PathLike of str.")
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        scheme = text.split("://", 1)[0]
        if scheme not in _REMOTE_SCHEMES:
            raise ValueError(
                f"checkpoint path {text!r} uses the scheme {scheme!r}, which orbax-checkpoint cannot open; "
                f"use a local path (or a shared file system mounted on every worker), or one of "
                f"{', '.join(s + '://' for s in _REMOTE_SCHEMES)}."
            )
        try:
            remote = epath.Path(text)
            remote.exists()
        except Exception as err:
            package = "gcsfs" if scheme == "gs" else "s3fs"
            raise ValueError(
                f"checkpoint path {text!r}: the {scheme}:// file system is not usable here "
                f"({type(err).__name__}: {err}); install its backend (pip install {package}) "
                "and its credentials, or use a local path."
            ) from err
        return remote
    return epath.Path(os.path.abspath(text))


def _multiprocessing_options(num_workers: int) -> Any:
    import orbax.checkpoint as ocp

    # An explicit process set makes orbax use the coordination service's barriers
    # (a key-value wait) instead of a device collective.
    return ocp.options.MultiprocessingOptions(
        primary_host=0, active_processes=set(range(num_workers)) if num_workers > 1 else None
    )


class _Writer:
    """One asynchronous orbax writer per Checkpoint object; at most one save in flight."""

    def __init__(self, num_workers: int, timeout_seconds: float):
        import orbax.checkpoint as ocp

        options = _multiprocessing_options(num_workers)
        self._checkpointer = ocp.AsyncCheckpointer(
            ocp.StandardCheckpointHandler(multiprocessing_options=options),
            async_options=ocp.options.AsyncOptions(timeout_secs=max(int(timeout_seconds), 1)),
            multiprocessing_options=options,
        )
        self._in_flight: str | None = None
        self._on_commit: Any = None
        _writers.add(self)

    def wait_for_background_write(self) -> None:
        """Blocks until orbax's background write and commit end, from any thread (errors are the waiter's to report)."""
        self._checkpointer.wait_until_finished()

    def save(self, path: Any, tree: dict, record: dict, on_commit: Any = None) -> None:
        """Starts writing ``tree`` to ``path`` (replacing a checkpoint already there); returns at once."""
        import orbax.checkpoint as ocp

        self.wait()
        _wait_before_thread_shutdown()
        with _pending_lock:
            _pending.add(self)
        self._in_flight, self._on_commit = str(path), on_commit
        self._checkpointer.save(path, args=ocp.args.StandardSave(tree), force=True,
                                custom_metadata={_RECORD_KEY: record})

    def wait(self) -> None:
        """Blocks until the save in flight is committed; re-raises its error."""
        if self._in_flight is None:
            return
        path, self._in_flight = self._in_flight, None
        on_commit, self._on_commit = self._on_commit, None
        with _pending_lock:
            _pending.discard(self)
        try:
            self._checkpointer.wait_until_finished()
        except Exception as err:
            raise OSError(f"writing the checkpoint {path!r} failed: {type(err).__name__}: {err}") from err
        if on_commit is not None:
            on_commit()


def wait_for_pending_saves() -> None:
    """Waits for every save of this process still in flight (all Checkpoint objects)."""
    with _pending_lock:
        writers = list(_pending)
    for writer in writers:
        writer.wait()


def wait_for_background_writes() -> None:
    """Waits for orbax's background writes and commits of every Checkpoint, also those another thread is waiting for.

    For a process about to end on a signal (the main thread may be inside a
    ``wait``); errors are left to the thread that waits for the save.
    """
    for writer in list(_writers):
        try:
            writer.wait_for_background_write()
        except Exception as err:  # noqa: BLE001 - the save's own waiter reports it
            logger.error("a checkpoint save did not finish: %s", err)


def _wait_at_exit() -> None:
    try:
        wait_for_pending_saves()
    except Exception as err:  # noqa: BLE001 - the interpreter is ending; say what was lost
        logger.error("a checkpoint save did not finish before the process ended: %s", err)


atexit.register(_wait_at_exit)
_registered_before_thread_shutdown = False


def _wait_before_thread_shutdown() -> None:
    """Also waits for pending saves when the interpreter starts shutting threads down.

    ``concurrent.futures`` refuses new work once threads shut down, which is
    before ``atexit`` handlers run; a multi-worker orbax commit still needs it
    (``asyncio.to_thread``), so a program whose last line is ``manager.save()``
    (TF's multi_worker_with_ctl tutorial) lost that checkpoint and its workers
    hung at the commit barrier. Registered at the first save, after
    ``concurrent.futures`` registered its own hook, so this one runs first.
    """
    global _registered_before_thread_shutdown
    if _registered_before_thread_shutdown:
        return
    _registered_before_thread_shutdown = True
    register = getattr(threading, "_register_atexit", None)  # CPython >= 3.9
    if register is not None:
        try:
            register(_wait_at_exit)
        except RuntimeError:  # the interpreter is already shutting down: atexit still waits
            pass


def new_tables_dir(path: Any) -> Any:
    """A new sibling directory for the tables of the checkpoint ``path`` (``_tables.py``): ``<path>.tables-<ns>``."""
    import time

    tables = path.parent / f"{path.name}.tables-{time.time_ns()}"
    tables.mkdir(parents=True, exist_ok=False)
    return tables


def delete_tables(path: Any, keep: str | None = None) -> None:
    """Deletes the tables directories of the checkpoint ``path`` (all but ``keep``, a directory name)."""
    if not path.parent.is_dir():
        return
    for child in path.parent.iterdir():
        if child.name.startswith(f"{path.name}.tables-") and child.name != keep:
            child.rmtree(missing_ok=True)


def is_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a committed checkpoint directory written by this module."""
    return path.is_dir() and (path / "_CHECKPOINT_METADATA").exists()


def started_at(path: Any) -> int:
    """When the save of the committed checkpoint ``path`` began (orbax's step metadata, ns); 0 if unknown."""
    import orbax.checkpoint as ocp

    try:
        return int(ocp.metadata.get_step_metadata(path).init_timestamp_nsecs or 0)
    except Exception:  # noqa: BLE001 - an unreadable checkpoint sorts first (oldest)
        return 0


def read(path: Any, num_workers: int) -> tuple[dict, dict[str, list[np.ndarray]]]:
    """Returns ``(record, {object: [arrays]})`` of one checkpoint, every dtype as saved.

    Raises:
        ValueError: no checkpoint at ``path``.
        UnreadableCheckpointError: a directory that orbax cannot read or that
            was not written by distribute.
    """
    import orbax.checkpoint as ocp

    wait_for_pending_saves()
    if not path.exists():
        raise ValueError(
            f"no checkpoint at {str(path)!r}: it does not exist. Pass a path returned by "
            "Checkpoint.save/write or CheckpointManager.latest_checkpoint (None when nothing "
            "was saved yet; then use CheckpointManager.restore_or_initialize())."
        )
    options = _multiprocessing_options(num_workers)
    try:
        checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler(multiprocessing_options=options),
                                        multiprocessing_options=options)
        record = (checkpointer.metadata(path).custom_metadata or {})[_RECORD_KEY]
        target = {
            name: [np.empty(entry["shape"], np.dtype(entry["dtype"])) for entry in entries if _in_tree(entry)]
            for name, entries in _by_object(record).items()
        }
        stored = checkpointer.restore(path, args=ocp.args.StandardRestore(target)) if any(target.values()) else {}
    except Exception as err:
        raise UnreadableCheckpointError(
            f"{str(path)!r} is not a readable distribute checkpoint ({type(err).__name__}: {err}); "
            "restore one written by distribute.Checkpoint, e.g. an older one from CheckpointManager.checkpoints."
        ) from err
    from distribute.checkpoint._tables import TableRef

    tables = str(path.parent / record["tables"]) if record.get("tables") else None
    arrays: dict[str, list[np.ndarray]] = {}
    for name, entries in _by_object(record).items():
        values = iter(stored.get(name, []))
        arrays[name] = [TableRef(tables, e) if "table" in e else
                        np.zeros(e["shape"], np.dtype(e["dtype"])) if e["empty"] else np.asarray(next(values))
                        for e in entries]
    return record, arrays


def _in_tree(entry: dict) -> bool:
    """Whether the orbax tree holds the entry's value (not an empty array, not a table the ps wrote)."""
    return not entry["empty"] and "table" not in entry


def _by_object(record: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for entry in record["variables"]:
        out.setdefault(entry["object"], []).append(entry)
    return out


def _register_sigterm_wait() -> None:
    import distribute.runtime.exits as exits

    if wait_for_background_writes not in exits.BEFORE_SIGTERM_EXIT:
        exits.BEFORE_SIGTERM_EXIT.append(wait_for_background_writes)


_register_sigterm_wait()
