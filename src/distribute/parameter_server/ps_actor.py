"""The ps actor: holds variable shards (``/job:ps/replica:0/task:<j>``) and applies updates as they arrive.

See ``actors.py`` for how ps and workers work together, ``row_plan.py`` for row reads and row updates.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np

from distribute.parameter_server.actor_common import _load, _locked, _rows, _Served
from distribute.parameter_server.row_plan import local_rows

# A re-run closure reaches the ps within seconds of the failure; remembering the last
# 2**16 applied closures (about 4 MB) covers that with a wide margin.
_REMEMBERED_CLOSURES = 1 << 16
# Staged parts are committed right after their push's decision, or dropped when their
# closure is applied; only the parts of dead workers' attempts stay. Those are kept
# until no re-run can need them: a re-run comes within the coordinator's wait for a
# restarted worker (closures._WORKER_RECOVERY_SECONDS, 600 s), so twice that.
_STAGED_SECONDS = 1200.0
# The attempt of an update sent to its deciding ps only (``update``): no other ps has a part.
SINGLE_ATTEMPT = 0


class ParameterServer(_Served):
    """Holds variable storage keys -> arrays of one ps task (``/job:ps/replica:0/task:<j>``).

    Its workers reach it through its channel (``channel.py``: ``read``, ``rows``
    and ``update`` requests); the coordinator and program loads through Ray.  A
    lock makes each of them atomic.  Stored arrays are replaced by whole updates;
    a row update writes the rows of a private copy in place (``_writable``), so
    a whole reply of such an array is a copy taken under the lock (a reply is
    sent after the lock is released).
    """

    REQUESTS = ("read", "rows", "update", "stage", "decide", "commit")

    def __init__(self, task_id: int) -> None:
        self._task_id = task_id
        self._name = f"ps {task_id}"
        self._lock = threading.Lock()
        self._values: dict[int, np.ndarray] = {}
        self._programs: dict[int, Any] = {}
        self._num_updates = 0
        self._version = 0  # mutations so far (applied updates, creates)
        self._num_reads = 0
        self._applied: collections.OrderedDict[int, int] = collections.OrderedDict()  # closure id -> attempt applied
        # closure id -> (time of its last stage, {attempt: update}), least recently staged first
        self._staged: collections.OrderedDict[int, tuple[float, dict]] = collections.OrderedDict()
        self._private: set[int] = set()  # keys whose array is this ps's own copy, written in place by row updates
        self._server: Any = None

    def ping(self) -> int:
        return self._task_id

    @_locked
    def create(self, values: dict) -> int:
        """Stores ``values`` (key -> array); returns this ps's version after the write."""
        for key, value in values.items():
            self._replace(key, np.asarray(value))
        self._version += 1
        return self._version

    @_locked
    def create_from(self, specs: dict) -> int:
        """Makes and stores values from initializer descriptions (key -> ``(spec, shape, dtype, start)``,
        ``initializers.make``): a variable created on this ps, never sent whole.  Returns the version."""
        from distribute.parameter_server.initializers import make

        for key, (spec, shape, dtype, start) in specs.items():
            self._replace(key, make(spec, shape, dtype, start))
        self._version += 1
        return self._version

    def save_table(self, key: int, path: str) -> None:
        """Writes ``key``'s value to the zarr array ``path`` (a checkpoint's table part, ``checkpoint/_tables.py``).

        Taken under the lock and written outside it: the value becomes
        copy-on-write (a row update meanwhile writes a copy), so the part is
        the value at this call, and updates go on during the write.
        """
        from distribute.checkpoint._tables import write_array

        with self._lock:
            value = self._values[key]
            self._private.discard(key)
        write_array(path, value)

    @_locked
    def load_table(self, key: int, directory: str, parts: list, start: int, shape: tuple, dtype: str) -> int:
        """Reads rows ``[start, start + shape[0])`` of a saved table into ``key`` (in place when the shapes agree)."""
        from distribute.checkpoint._tables import read_rows

        current = self._values.get(key)
        if current is None or tuple(current.shape) != tuple(shape) or current.dtype != np.dtype(dtype):
            self._replace(key, np.empty(shape, dtype))
        read_rows(directory, parts, start, self._writable(key))
        self._version += 1
        return self._version

    @_locked
    def write_rows(self, key: int, start: int, rows: Any, shape: tuple, dtype: str) -> int:
        """Writes ``rows`` at ``start`` of ``key``'s value (created as zeros of ``shape`` if new or of another shape).

        The coordinator sends a large value in pieces of at most one message
        (``cluster.MAX_MESSAGE_BYTES``) this way.  Returns the version after the write.
        """
        current = self._values.get(key)
        if current is None or tuple(current.shape) != tuple(shape) or current.dtype != np.dtype(dtype):
            self._replace(key, np.zeros(shape, dtype))
        self._writable(key)[start : start + len(rows)] = rows
        self._version += 1
        return self._version

    @_locked
    def read(self, keys: tuple) -> list:
        self._num_reads += 1
        return [self._whole(k) for k in keys]

    @_locked
    def rows(self, requests: list) -> list:
        """The rows ``local ids`` of each ``(key, local ids)`` (a step's row read)."""
        return [self._values[key][ids] for key, ids in requests]

    @_locked
    def peek(self, keys: tuple, start: int = 0, stop: int | None = None) -> list:
        """The values of ``keys`` (rows ``[start, stop)`` of each) for the coordinator (not counted in ``num_reads``)."""
        if start == 0 and stop is None:
            return [self._whole(k) for k in keys]
        return [np.array(self._values[k][start:stop]) for k in keys]

    def _whole(self, key: int) -> np.ndarray:
        value = self._values[key]
        return value.copy() if key in self._private else value

    def _replace(self, key: int, value: np.ndarray) -> None:
        self._values[key] = value
        self._private.discard(key)

    def _writable(self, key: int) -> np.ndarray:
        """``key``'s array, made this ps's own (a copy, once) so that rows can be written in place."""
        if key not in self._private:
            self._values[key] = np.array(self._values[key], copy=True)
            self._private.add(key)
        return self._values[key]

    def num_reads(self) -> int:
        """How many ``read`` calls (a worker's pulls; a step that reads a push's read-back makes none)."""
        return self._num_reads

    @_locked
    def read_all(self, keys: Any = None) -> dict:
        """Key -> value of every stored variable (of ``keys`` only, when given)."""
        return {k: self._whole(k) for k in (self._values if keys is None else keys)}

    @_locked
    def sizes(self) -> dict:
        """Key -> bytes of every stored value."""
        return {k: int(v.nbytes) for k, v in self._values.items()}

    def num_updates(self) -> int:
        return self._num_updates

    @_locked
    def load(self, program_id: int, box: list) -> None:
        """Deserializes an apply program a worker sends once, before its first update that uses it."""
        _load(self._programs, program_id, box)

    @_locked
    def update(self, closure_id: int, applies: list, deltas: list, sets: list, read_back: tuple | None = None) -> Any:
        """Applies one step's updates (a push to this ps only): optimizer programs, then additive deltas, then sets.

        ``applies``: ``(program id, owned keys, written keys, foreign values,
        gradients, rows)`` per program, each loaded before; ``rows``: None, or
        ``(ApplyRows, the sorted ids of each of its tables on this ps)`` (a row
        gradient is those ids' rows).  A second update for the
        same ``closure_id`` (a re-run closure) is skipped.  Returns ``(version,
        values of the read_back keys or None)`` after the update.
        """
        return self._decide(closure_id, SINGLE_ATTEMPT, (applies, deltas, sets), read_back)[:2]

    @_locked
    def decide(self, closure_id: int, attempt: int, applies: list, deltas: list, sets: list,
               read_back: tuple | None = None) -> Any:
        """The deciding ps of a push that spans several ps: the first attempt of a closure to reach it wins.

        Every other ps of the push has staged its part (``stage``) before this
        call.  If no attempt of ``closure_id`` was decided here, ``attempt`` is,
        and this ps's part (``applies``, ``deltas``, ``sets``) is applied; a later
        attempt (a re-run closure, or a dead worker's delayed request) gets the
        decided one back and commits it on the other ps.  Returns ``(version,
        values of the read_back keys or None, the decided attempt)``.
        """
        return self._decide(closure_id, attempt, (applies, deltas, sets), read_back)

    @_locked
    def stage(self, closure_id: int, attempt: int, applies: list, deltas: list, sets: list) -> None:
        """Keeps, without applying it, this ps's part of ``attempt`` of closure ``closure_id`` (a push that spans
        several ps, before its deciding ps decides); nothing once the closure is applied here."""
        if closure_id in self._applied:
            return
        now = time.monotonic()
        attempts = self._staged.pop(closure_id, (now, {}))[1]
        attempts[attempt] = (applies, deltas, sets)
        self._staged[closure_id] = (now, attempts)
        while next(iter(self._staged.values()))[0] < now - _STAGED_SECONDS:  # dead workers' parts no re-run needs
            self._staged.popitem(last=False)

    @_locked
    def commit(self, closure_id: int, attempt: int, read_back: tuple | None = None) -> Any:
        """Applies the part ``stage`` kept for ``attempt`` (the one the deciding ps decided) of ``closure_id``, once.

        The decided attempt staged its part on every ps of its push before it
        was decided, so a ps without it staged had no part in it (a re-run that
        reaches other ps): it applies nothing, and no later attempt of the
        closure.  Returns ``(version, values of the read_back keys or None)``.
        """
        staged = self._staged.pop(closure_id, (0.0, {}))[1].get(attempt)
        if closure_id not in self._applied:
            if staged is None:
                self._remember(closure_id, attempt)
            else:
                self._apply(closure_id, attempt, *staged)
        return self._version, None if read_back is None else [self._whole(k) for k in read_back]

    def _decide(self, closure_id: int, attempt: int, update: tuple, read_back: tuple | None) -> tuple:
        decided = self._applied.get(closure_id)
        if decided is None:
            self._staged.pop(closure_id, None)
            self._apply(closure_id, attempt, *update)
            decided = attempt
        return self._version, None if read_back is None else [self._whole(k) for k in read_back], decided

    def _remember(self, closure_id: int, attempt: int) -> None:
        self._applied[closure_id] = attempt
        if len(self._applied) > _REMEMBERED_CLOSURES:
            self._applied.popitem(last=False)

    def _apply(self, closure_id: int, attempt: int, applies: list, deltas: list, sets: list) -> None:
        self._remember(closure_id, attempt)
        for program_id, owned, written, foreign_vals, grads, rows in applies:
            program = _load(self._programs, program_id, None)
            if rows is not None:
                self._apply_rows(program, owned, written, list(foreign_vals), list(grads), *rows)
                continue
            owned_vals = [_rows([self._values[k] for k in keys]) for keys in owned]
            self._write(written, program(owned_vals, list(foreign_vals), list(grads)))
        for key, delta in deltas:
            self._replace(key, np.asarray(self._values[key] + np.asarray(delta, self._values[key].dtype)))
        for key, value in sets:
            self._replace(key, np.asarray(value, self._values[key].dtype))
        self._num_updates += 1
        self._version += 1

    def _write(self, written: tuple, new_vals: list) -> None:
        for keys, value in zip(written, new_vals):
            value = np.asarray(value)
            start = 0
            for key in keys:
                stop = start + self._values[key].shape[0] if len(keys) > 1 else None
                self._replace(key, value if stop is None else value[start:stop])
                start = stop or 0

    def _apply_rows(self, program: Any, owned: tuple, written: tuple, foreign_vals: list, grads: list, meta: Any,
                    ids: list) -> None:
        """One apply program with row tables (``row_plan.ApplyRows``); ``ids[r]``: the sorted ids of table ``r`` here."""
        def local(keys, r):
            return [local_rows(ids[r], start, len(self._values[k])) for k, start in zip(keys, meta.starts[r])]

        for g, r in enumerate(meta.grads):
            if r < 0:
                continue
            if meta.mode == "rows":
                grads[g] = _padded(np.asarray(grads[g]), meta.sizes[r])
            else:  # the whole gradient of the rows here: zeros but at the looked-up rows
                keys = owned[g]
                dense = np.zeros((sum(len(self._values[k]) for k in keys), *np.shape(grads[g])[1:]), np.asarray(grads[g]).dtype)
                offset, done = 0, 0
                for k, rows_k in zip(keys, local(keys, r)):
                    dense[offset + rows_k] = grads[g][done : done + len(rows_k)]
                    offset, done = offset + len(self._values[k]), done + len(rows_k)
                grads[g] = dense
        owned_vals = []
        for keys, r in zip(owned, meta.owned):
            if r < 0:
                owned_vals.append(_rows([self._values[k] for k in keys]))
            else:
                parts = [self._values[k][rows_k] for k, rows_k in zip(keys, local(keys, r))]
                owned_vals.append(_padded(_rows(parts), meta.sizes[r]))
        new_vals = program(owned_vals, foreign_vals, grads)
        whole = [(keys, value) for keys, value, r in zip(written, new_vals, meta.written) if r < 0]
        self._write(tuple(k for k, _ in whole), [v for _, v in whole])
        for keys, value, r in zip(written, new_vals, meta.written):
            if r < 0:
                continue
            value, done = np.asarray(value), 0
            for k, rows_k in zip(keys, local(keys, r)):
                self._writable(k)[rows_k] = value[done : done + len(rows_k)]
                done += len(rows_k)


def _padded(rows: np.ndarray, size: int) -> np.ndarray:
    """``rows`` with zero rows after them up to ``size`` (a row program's fixed row count)."""
    if len(rows) == size:
        return rows
    return np.concatenate([rows, np.zeros((size - len(rows), *rows.shape[1:]), rows.dtype)], axis=0)
