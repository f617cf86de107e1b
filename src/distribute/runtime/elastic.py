"""A worker's side of an elastic launch (``python -m distribute.launch --num-workers MIN:MAX``).

The launcher is the elastic agent: it runs generations of workers and keeps,
in its own memory, the newest committed state a worker handed to it (see
``distribute/runtime/elastic_store.py``).  A worker of an elastic launch finds the
agent's loopback address in ``DISTRIBUTE_ELASTIC_AGENT`` and its generation in
``DISTRIBUTE_ELASTIC_GENERATION``.

What a worker does here:

- ``commit(meta, arrays)``: keeps host copies of the newest completed step's
  state (every variable, in a fixed order, and a small JSON ``meta``: epoch,
  step, ...).  Under MultiWorkerMirroredStrategy every worker holds the whole
  replicated state, so any survivor's commit is the full state.
- when the worker stops because a peer was lost (the exit-75 path of
  ``runtime/exits.py``) or because the agent asks the generation to regroup
  (SIGUSR1, when more slots became available), it first hands its commit to
  the agent (``hand_off``), a loopback HTTP PUT of the raw bytes.
- ``fetch()``: the state the agent holds (the newest step handed over by any
  worker of an earlier generation), restored by the next generation at any
  size instead of a checkpoint from disk.

Under Ray Train (``DISTRIBUTE_ELASTIC_SCHEDULER=ray-train``, set with the two
others by ``distribute.experimental.RayTrainElasticState`` in each worker) the
agent is a Ray actor of the training run and Ray Train's controller decides
when a worker group stops (a lost worker, or a resize): the workers hand off
when the controller stops them (that callback's ``before_worker_shutdown``),
and no regroup signal is used.

Standard library and numpy only.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import struct
import sys
import threading
import time
from typing import Any

import numpy as np

import distribute.runtime.exits as exits

logger = logging.getLogger("distribute")

AGENT_ENV = "DISTRIBUTE_ELASTIC_AGENT"
GENERATION_ENV = "DISTRIBUTE_ELASTIC_GENERATION"
SCHEDULER_ENV = "DISTRIBUTE_ELASTIC_SCHEDULER"  # "launch" (the default) or "ray-train"
RAY_TRAIN = "ray-train"
REGROUP_SIGNAL = signal.SIGUSR1
_HTTP_TIMEOUT_SECONDS = 30.0


def agent_address() -> str | None:
    """``host:port`` of the elastic agent (the launcher), or None outside an elastic launch."""
    return os.environ.get(AGENT_ENV) or None


def scheduler() -> str:
    """Who starts the generations: ``"launch"`` (``python -m distribute.launch``) or ``"ray-train"``."""
    return os.environ.get(SCHEDULER_ENV) or "launch"


def generation() -> int:
    """This worker's generation: 0 for the first set of workers, +1 at each membership change."""
    return int(os.environ.get(GENERATION_ENV, "0") or 0)


# -- the wire format: 8-byte header length, JSON header, raw array bytes ------------------------------------------
def encode(meta: dict, arrays: list, dtypes: list[str] | None = None) -> list[bytes | memoryview]:
    """The pieces of one state message (sent back to back).

    ``arrays``: numpy arrays or anything ``np.asarray`` reads (a device array is
    read to host memory here); ``dtypes``: the dtype each is sent as (None: its own).
    """
    arrays = [np.asarray(a) if dtypes is None else np.asarray(a).astype(np.dtype(d), copy=False)
              for a, d in zip(arrays, dtypes or [None] * len(arrays))]
    entries, offset = [], 0
    for a in arrays:
        entries.append({"dtype": a.dtype.str, "shape": list(a.shape), "offset": offset, "nbytes": a.nbytes})
        offset += a.nbytes
    header = json.dumps({"meta": meta, "arrays": entries}).encode("utf-8")
    return [struct.pack("<Q", len(header)), header, *(memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays)]


def decode(body: bytes) -> tuple[dict, list[np.ndarray]]:
    """``(meta, arrays)`` of a message made by ``encode`` (arrays are read-only views of ``body``)."""
    (size,) = struct.unpack_from("<Q", body, 0)
    header = json.loads(body[8:8 + size].decode("utf-8"))
    start = 8 + size
    arrays = [np.frombuffer(body, dtype=np.dtype(e["dtype"]), count=int(np.prod(e["shape"], dtype=np.int64)),
                            offset=start + e["offset"]).reshape(e["shape"]) for e in header["arrays"]]
    return header["meta"], arrays


def _request(method: str, path: str, pieces: list | None = None) -> tuple[int, bytes]:
    host, port = agent_address().rsplit(":", 1)  # type: ignore[union-attr]
    connection = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=_HTTP_TIMEOUT_SECONDS)
    try:
        length = sum(len(p) for p in pieces) if pieces else 0
        connection.putrequest(method, path)
        connection.putheader("Content-Length", str(length))
        connection.endheaders()
        for piece in pieces or ():
            connection.send(piece)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


class _Commit:
    """This process's newest committed state (replaced whole, so a hand-off from another thread sees one step)."""

    lock = threading.Lock()
    # The newest commits, oldest first: the newest one's values may still be computing (a step is dispatched
    # without waiting), the one before is being waited for by the next commit, the one before that is complete.
    states: list[tuple[dict, list, list[str] | None]] = []
    handed_off = False
    regroup = threading.Event()


def commit(meta: dict, arrays: list, dtypes: list[str] | None = None) -> None:
    """Keeps ``(meta, arrays)`` as this worker's newest committed state.

    ``arrays``: copies the caller made (numpy arrays, or device arrays that no
    step will donate: read to host memory only by ``hand_off``); ``dtypes``: the
    dtype each is handed over as.
    """
    _Commit.states = [*_Commit.states[-2:], (dict(meta, generation=generation()), arrays, dtypes)]


def newest() -> tuple[dict, list, list[str] | None] | None:
    """The newest commit as given (its arrays may still be computing), or None."""
    return _Commit.states[-1] if _Commit.states else None


def committed() -> tuple[dict, list[np.ndarray]] | None:
    """The newest committed state of this process, as host arrays, or None."""
    state = newest()
    if state is None:
        return None
    return decode(b"".join(bytes(piece) for piece in encode(*state)))


def hand_off(reason: str, wait_seconds: float | None = None) -> bool:
    """Sends the committed state to the agent (once per process); True when the agent has it.

    The newest commits may hold device values of a step that never completed (a
    peer died inside it, and the step was dispatched without waiting): reading
    one then fails, and the one before it is handed over instead.  With
    ``wait_seconds``, a commit whose values are not computed within that time
    (a step still blocked in a collective) is passed over the same way; the one
    before it is always complete.
    """
    if agent_address() is None:
        return False
    with _Commit.lock:
        if _Commit.handed_off:
            return True
        begin = time.monotonic()
        for state in reversed(list(_Commit.states)):
            if wait_seconds is not None and not _computed_within(state[1], begin + wait_seconds):
                logger.warning("elastic: the commit of step %s is still computing after %g s; handing over the one "
                               "before", state[0].get("step"), wait_seconds)
                continue
            try:
                pieces = encode(*state)
            except Exception as err:  # noqa: BLE001 - the step's values failed with the lost peer
                logger.warning("elastic: the commit of step %s cannot be read (%s); handing over the one before",
                               state[0].get("step"), str(err).splitlines()[0][:200])
                continue
            try:
                status, _ = _request("PUT", "/state", pieces)
            except OSError as err:
                logger.error("elastic: could not hand the committed state to the agent at %s: %s", agent_address(), err)
                return False
            _Commit.handed_off = status == 200
            logger.warning("elastic: %s; handed the state of step %s to the agent (%.3f s)", reason,
                           state[0].get("step"), time.monotonic() - begin)
            return _Commit.handed_off
        return False


def _computed_within(arrays: list, deadline: float) -> bool:
    """Whether every device value of ``arrays`` is computed (or failed) by ``deadline`` (a monotonic time)."""
    pending = [a for a in arrays if callable(getattr(a, "is_ready", None))]
    while True:
        try:
            pending = [a for a in pending if not a.is_ready()]
        except Exception:  # noqa: BLE001 - a failed value: reading it says so, and the one before is taken
            return True
        if not pending:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def fetch() -> tuple[dict, list[np.ndarray]] | None:
    """The newest state the agent holds (handed over by an earlier generation), or None (none, or no agent)."""
    if agent_address() is None:
        return None
    status, body = _request("GET", "/state")
    if status == 204:
        return None
    if status != 200:
        raise RuntimeError(f"elastic: the agent at {agent_address()} answered {status} to GET /state: {body[:200]!r}")
    return decode(body)


def _on_regroup_signal(signum: int, frame: Any) -> None:
    del signum, frame
    _Commit.regroup.set()


_READY = threading.Event()


def ready() -> None:
    """Tells the agent this worker trains and stops at a step boundary when asked to regroup (main thread only).

    Installs the SIGUSR1 handler first; before that, the agent never asks this
    generation to grow (SIGUSR1 would end a process without the handler).
    """
    if agent_address() is None or _READY.is_set() or scheduler() == RAY_TRAIN:
        return  # under Ray Train the controller stops a generation; no signal (the training runs in a thread)
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("elastic training state must be set up in the main thread (it installs a signal handler).")
    signal.signal(REGROUP_SIGNAL, _on_regroup_signal)
    _READY.set()
    _request("PUT", f"/ready?worker={os.getpid()}", [b""])


def regroup_requested() -> bool:
    """Whether the agent asked this generation to stop at its next step boundary (more workers are available)."""
    return _Commit.regroup.is_set()


def stop_for_regroup() -> None:
    """Hands the committed state to the agent and ends this process (exit 75), at a step boundary."""
    hand_off("more workers are available: this generation stops at a step boundary")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(exits.EXIT_WORKER_LOST)


# A lost peer: the newest commit may belong to a step blocked in a collective with it (the watchdog names the
# peer before any collective fails); reading it would block, so it is passed over after this long.
LOST_PEER_WAIT_SECONDS = 2.0


def _hand_off_for_lost_peer() -> None:
    hand_off("a peer was lost", wait_seconds=LOST_PEER_WAIT_SECONDS)


exits.BEFORE_LOST_EXIT.append(_hand_off_for_lost_peer)
