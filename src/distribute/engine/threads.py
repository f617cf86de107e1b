"""The eager uneven step: one thread per local replica, meeting at every collective.

Code that cannot be one program per replica (an ``all_gather``, whose result
shape depends on the other replicas; a Python branch on a value) runs as TF's
eager MirroredStrategy runs every step: each replica's thread calls the
function on its own device and rows, and the threads meet at every collective
(:class:`_Meeting`), where the last to arrive combines everyone's values on the
host (``host.py``).  A thread only ever waits at a meeting, never on a device
program that waits on it, and every wait is bounded: past the timeout it
raises, naming the collective, who arrived and what the others were doing.

The caller's thread waits for the replicas interruptibly: Ctrl-C stops them
(at their next collective) and waits for them, bounded, before re-raising, so a
KeyboardInterrupt never leaves a replica thread running into interpreter exit.
"""

from __future__ import annotations

import contextvars
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distribute import _context, collectives
from distribute.engine.context import UnevenReplicaContext, under_transformation_error
from distribute.engine.host import HostCollectives

MEETING_TIMEOUT_SECONDS = 300.0
STOP_SECONDS = 1.5  # how long an interrupted step waits for its replica threads


class Aborted(Exception):
    """Another replica failed (or the step was interrupted); this one stops without a message of its own."""


class _Meeting:
    """Where this worker's replica threads meet at each collective.

    Every replica calls :meth:`exchange` with its value; the last to arrive
    computes ``combine(values)`` (one result per replica) and wakes the others.
    A replica that returned early (it skipped a collective the others make), a
    failure in another replica, or a wait past ``timeout_seconds`` ends the wait
    with an error instead of a hang.
    """

    def __init__(self, num_replicas: int, timeout_seconds: float, first_replica: int = 0):
        self._num = num_replicas
        self._timeout = timeout_seconds
        self._first = first_replica
        self._cond = threading.Condition()
        self._round = 0
        self._values: dict[int, Any] = {}
        self._results: dict[int, Any] = {}
        self._readers: dict[int, int] = {}
        self._finished: dict[int, int] = {}  # replica -> collectives it made before returning
        self._last: dict[int, str] = {}  # replica -> the last collective it reached
        self._failed = False

    def exchange(self, replica: int, value: Any, combine: Callable[[list], list], what: str = "a collective") -> Any:
        with self._cond:
            round_ = self._round
            self._check(replica, round_)
            self._values[replica] = value
            self._last[replica] = f"#{round_ + 1} ({what})"
            if len(self._values) == self._num:
                values = [self._values[r] for r in range(self._num)]
                self._values = {}
                try:
                    results = combine(values)
                except BaseException:
                    self._fail()
                    raise
                self._results[round_] = results
                self._readers[round_] = self._num
                self._round += 1
                self._cond.notify_all()
            else:
                deadline = time.monotonic() + self._timeout
                while self._round == round_:
                    self._check(replica, round_)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._fail()
                        raise self._timeout_error(replica, round_, what)
                    self._cond.wait(left)
            result = self._results[round_][replica]
            self._readers[round_] -= 1
            if not self._readers[round_]:
                del self._results[round_], self._readers[round_]
            return result

    def _timeout_error(self, replica: int, round_: int, what: str) -> RuntimeError:
        arrived = sorted(self._first + r for r in self._values)
        doing = ", ".join(
            f"replica {self._first + r} {'after collective ' + self._last[r] if r in self._last else 'before its first collective'}"
            for r in range(self._num) if r not in self._values
        )
        return RuntimeError(
            f"replica {self._first + replica} waited {self._timeout:.0f} s at collective #{round_ + 1} ({what}) of an "
            f"uneven step; replicas {arrived} reached it, the others are still computing ({doing}). Every replica must "
            "make the same collective calls (all_reduce, all_gather, apply_gradients) in the same order, whatever "
            "its number of rows."
        )

    def finished(self, replica: int, num_collectives: int) -> None:
        with self._cond:
            self._finished[replica] = num_collectives
            if self._values:
                self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._fail()

    def _fail(self) -> None:
        self._failed = True
        self._cond.notify_all()

    def _check(self, replica: int, round_: int) -> None:
        if self._failed:
            raise Aborted()
        early = sorted(r for r, n in self._finished.items() if n <= round_)
        if early:
            self._failed = True
            self._cond.notify_all()
            raise RuntimeError(
                f"replica {self._first + replica} reached collective #{round_ + 1} of an uneven step, but replicas "
                f"{[self._first + r for r in early]} returned after {min(self._finished[r] for r in early)} collectives. "
                "Every replica must make the same collective calls (all_reduce, all_gather, apply_gradients) in the "
                "same order, whatever its number of rows: do not skip them for an empty replica."
            )


class ThreadedReplicaContext(UnevenReplicaContext):
    """The replica context of one replica thread of an eager uneven step.

    Collectives need concrete values: under ``jax.jit``, ``vmap`` or
    ``lax.scan`` they raise TypeError here (the per-replica programs of
    ``per_replica.py`` take ``jax.jit``).
    """

    _runs_eagerly = True

    def __init__(self, strategy: Any, replica: int, local_index: int, meeting: _Meeting, host: HostCollectives,
                 rows: int | None, global_rows: int | None):
        super().__init__(strategy, replica, rows, global_rows)
        self._local = local_index
        self._meeting = meeting
        self._host = host
        self._calls = 0
        self._device = strategy.extended.replica_mesh.local_devices[local_index]

    @property
    def replica_id_in_sync_group(self) -> Any:
        return jnp.asarray(self._replica, jnp.int32)

    def _exchange(self, leaves: list, what: str, combine: Callable[[list], list]) -> list:
        """Meets the other replicas with this replica's ``leaves``; ``combine`` gets everyone's numpy values."""
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            raise under_transformation_error()
        self._calls += 1
        signature = (what, len(leaves))
        first = self._replica - self._local
        calls = self._calls

        def checked(entries: list) -> list:
            signatures = [sig for sig, _ in entries]
            if any(sig != signatures[0] for sig in signatures):
                kinds = ", ".join(f"replica {first + r}: {sig[0]}" for r, sig in enumerate(signatures))
                raise RuntimeError(
                    f"The replicas of an uneven step made different collective calls at collective "
                    f"#{calls} ({kinds}). Every replica must make the same collective calls "
                    "(all_reduce, all_gather, apply_gradients) in the same order, whatever its number of rows."
                )
            return combine([v for _, v in entries])

        out = self._meeting.exchange(self._local, (signature, [np.asarray(x) for x in leaves]), checked, what)
        return [jax.device_put(x, self._device) for x in out]

    def _meet(self, leaves: list, combine: Callable[[list], list], what: str) -> Any:
        """Meets the other replicas with ``leaves`` as they are; ``combine`` gets every replica's and returns
        one result per replica (``merge_call``)."""
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            raise under_transformation_error()
        self._calls += 1
        return self._meeting.exchange(self._local, leaves, combine, what)

    def merge_call(self, merge_fn: Callable, args: Any = (), kwargs: Any = None) -> Any:
        from distribute import merge_call

        return merge_call.threaded(self, merge_fn, args, kwargs, collectives.per_replica_from_local)

    def _sum_tree(self, tree: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return jax.tree_util.tree_unflatten(treedef, self._exchange(leaves, "all_reduce", self._host.sum))

    def _everyones(self, tree: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return jax.tree_util.tree_unflatten(treedef, self._exchange(leaves, "exchange", self._host.stack))

    def _gather_tree(self, tree: Any, axis: int) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return jax.tree_util.tree_unflatten(treedef, self._exchange(leaves, "all_gather", lambda values: self._host.gather(values, axis)))

    def _combine(self, specs: tuple, new: list, old: list) -> list:
        n = len(specs)
        return self._exchange([*new, *old], "variable combination",
                              lambda values: self._host.combine(specs, [v[:n] for v in values], [v[n:] for v in values]))


def timeout_seconds(strategy: Any) -> float:
    """How long an uneven step waits for a replica (the strategy's collective timeout, else 300 s)."""
    return float(getattr(strategy.extended, "_timeout_seconds", None) or MEETING_TIMEOUT_SECONDS)


def run_replicas(strategy: Any, body: Callable[[ThreadedReplicaContext], Any], rows: Sequence[int] | None) -> list:
    """Runs ``body(context)`` once per local replica, each in its own thread, and returns the results.

    ``rows``: the real rows of every replica in the job (``num_replicas_in_sync``
    counts), or None when the step has no batch.  Each thread runs in a copy of
    the caller's context, on its replica's device (``jax.default_device``), with
    Keras' thread-local settings (dtype policy) copied from the caller.

    Raises:
        The first exception a replica raised (the others stop at their next
        collective).  An exception in the caller's thread while it waits
        (KeyboardInterrupt) stops the replicas and waits for them (at most
        ``STOP_SECONDS``) before it propagates.
    """
    from distribute._keras import copy_thread_state

    mesh = strategy.extended.replica_mesh
    num_local = len(mesh.local_devices)
    first = mesh.devices.index(mesh.local_devices[0])
    meeting = _Meeting(num_local, timeout_seconds(strategy), first)
    host = HostCollectives(strategy, rows)
    global_rows = None if rows is None else int(sum(rows))
    results: list = [None] * num_local
    errors: list = [None] * num_local
    keras_state = copy_thread_state()
    contexts = [
        ThreadedReplicaContext(strategy, first + local, local, meeting, host, None if rows is None else int(rows[first + local]), global_rows)
        for local in range(num_local)
    ]

    done = [threading.Event() for _ in range(num_local)]

    def work(local: int) -> None:
        context = contexts[local]
        try:
            keras_state.apply()
            with jax.default_device(mesh.local_devices[local]), _context.enter_replica(strategy, context):
                results[local] = body(context)
        except BaseException as err:  # noqa: BLE001 - re-raised by the caller's thread
            errors[local] = err
            if not isinstance(err, Aborted):
                meeting.abort()
        finally:
            meeting.finished(local, context._calls)
            done[local].set()

    # Not daemons: a replica thread still computing when the interpreter exits is waited for, not ended
    # inside XLA (which aborts the process: "terminate called ...").
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(work, i), name=f"distribute-replica-{i}")
               for i in range(num_local)]
    try:
        for thread in threads:
            thread.start()
        # Events, not Thread.join: a join interrupted by Ctrl-C marks a running thread finished (CPython
        # 3.11), and the interpreter would then end it inside XLA at exit, which aborts the process.
        for event in done:
            event.wait()
    except BaseException:
        # Interrupted (Ctrl-C) while the replicas run: stop them at their next collective and give them
        # a moment to finish what they compute (the interpreter waits for the rest at exit).
        meeting.abort()
        deadline = time.monotonic() + STOP_SECONDS
        for event in done:
            event.wait(max(deadline - time.monotonic(), 0.0))
        raise
    for thread in threads:
        thread.join()
    real = [e for e in errors if e is not None and not isinstance(e, Aborted)]
    if real:
        raise real[0]
    if any(errors):  # pragma: no cover - an abort always has a cause
        raise RuntimeError("an uneven step was aborted without an error")
    return results
