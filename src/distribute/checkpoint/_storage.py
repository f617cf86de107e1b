"""Checkpoint files on orbax-checkpoint: paths, asynchronous atomic saves, reads.

One checkpoint is one orbax checkpoint directory (``dir/ckpt-3``) holding a
PyTree ``{object name: [value of variable 0, value of variable 1, ...]}`` of
NumPy arrays, with this project's record (variable paths, shapes, dtypes,
``save_counter``, extra values such as an epoch) in orbax's step metadata
(``custom_metadata["distribute"]``).  Variables this process holds no value
of (large ParameterServerStrategy tables) are written by their ps as zarr
arrays into the subdirectory ``tables/`` of the same checkpoint
(``_tables.py``), during orbax's save, inside orbax's temporary directory, so
orbax's commit commits them with the rest: a checkpoint is one directory to
copy, list or delete.  A user's own orbax code reads it (``tables/`` is not
part of the orbax tree)::

    orbax.checkpoint.StandardCheckpointer().restore("dir/ckpt-3")
    # {'model': [array(...), ...], 'optimizer': [...]}

Orbax writes into a temporary directory and renames it when every worker has
finished (atomic commit); a save returns once the values are copied to host
memory (and the ps wrote their tables) and the bytes are written by a
background thread.  Checkpoints of format 2 kept their tables in a sibling
directory ``<path>.tables-<ns>``; they still restore, and are deleted with
their checkpoint.  A later save,
``wait_until_finished()``, any read in this process (``restore``,
``latest_checkpoint``, ``CheckpointManager.checkpoints``) and the end of the
process wait for it.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import weakref
from typing import Any

import numpy as np

logger = logging.getLogger("distribute")

_RECORD_KEY = "distribute"
_FORMAT = 3  # 3: tables inside the checkpoint (``tables/``); 2: in a sibling ``<path>.tables-<ns>``
TABLES = "tables"  # the ps' zarr tables, a subdirectory of the checkpoint
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


@functools.cache
def _with_tables() -> tuple[type, type]:
    """``(SaveArgs, Handler)``: orbax's StandardSave and StandardCheckpointHandler, plus the ps' tables.

    ``SaveArgs(tree, write_tables=f)``: the handler's save first calls
    ``f(<orbax's temporary directory>/tables)`` (each ps writes its shards
    there; blocking, as the rest of the save's blocking part), then saves
    the tree into the same directory; orbax's commit (the rename) then
    commits both.  If ``f`` raises (a ps lost), the temporary directory is
    deleted and nothing is committed.
    """
    import dataclasses

    import orbax.checkpoint as ocp
    from etils import epath

    class Handler(ocp.StandardCheckpointHandler):
        async def async_save(self, directory: Any, item: Any = None, save_args: Any = None, args: Any = None) -> Any:
            write_tables = getattr(args, "write_tables", None)
            if write_tables is not None:
                try:
                    tables = epath.Path(directory) / TABLES
                    tables.mkdir(parents=True, exist_ok=False)
                    write_tables(str(tables))
                except BaseException:
                    epath.Path(directory).rmtree(missing_ok=True)  # orbax's temporary directory, never committed
                    raise
            return await super().async_save(directory, item, save_args, args)

    @ocp.args.register_with_handler(Handler, for_save=True)
    @dataclasses.dataclass
    class SaveArgs(ocp.args.StandardSave):
        write_tables: Any = None

    @ocp.args.register_with_handler(Handler, for_restore=True)
    @dataclasses.dataclass
    class RestoreArgs(ocp.args.StandardRestore):  # orbax wants both registered; reads use StandardCheckpointHandler
        pass

    return SaveArgs, Handler


class _Writer:
    """One asynchronous orbax writer per Checkpoint object; at most one save in flight."""

    def __init__(self, num_workers: int, timeout_seconds: float):
        import orbax.checkpoint as ocp

        options = _multiprocessing_options(num_workers)
        # Orbax's temporary directory exists when the handler's save starts (the ps write into it).
        self._checkpointer = ocp.AsyncCheckpointer(
            _with_tables()[1](multiprocessing_options=options),
            async_options=ocp.options.AsyncOptions(timeout_secs=max(int(timeout_seconds), 1),
                                                   create_directories_asynchronously=False),
            multiprocessing_options=options,
        )
        self._in_flight: str | None = None
        self._on_commit: Any = None
        _writers.add(self)

    def wait_for_background_write(self) -> None:
        """Blocks until orbax's background write and commit end, from any thread (errors are the waiter's to report)."""
        self._checkpointer.wait_until_finished()

    def save(self, path: Any, tree: dict, record: dict, on_commit: Any = None, write_tables: Any = None) -> None:
        """Starts writing ``tree`` to ``path`` (replacing a checkpoint already there); returns at once.

        ``write_tables(directory)``: writes the ps' tables into the checkpoint's
        ``tables/`` (inside orbax's temporary directory) before this returns.
        """
        self.wait()
        _wait_before_thread_shutdown()
        with _pending_lock:
            _pending.add(self)
        self._in_flight, self._on_commit = str(path), on_commit
        try:
            self._checkpointer.save(path, args=_with_tables()[0](tree, write_tables=write_tables), force=True,
                                    custom_metadata={_RECORD_KEY: record})
        except BaseException:  # nothing in flight: no commit to wait for
            self._in_flight, self._on_commit = None, None
            with _pending_lock:
                _pending.discard(self)
            raise

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


def delete_sibling_tables(path: Any) -> None:
    """Deletes the tables directories ``<path>.tables-<ns>`` a format-2 checkpoint ``path`` kept beside it."""
    if not path.parent.is_dir():
        return
    for child in path.parent.iterdir():
        if child.name.startswith(f"{path.name}.tables-"):
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

    tables = None
    if record.get("tables"):  # format 2: a sibling directory; 3: inside the checkpoint
        tables = str((path if record.get("format", 2) >= 3 else path.parent) / record["tables"])
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
