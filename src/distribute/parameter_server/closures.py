"""The closure queue and the per-worker dispatch threads (TF's ``_CoordinatedClosureQueue`` and ``Worker``).

One thread per worker takes the next closure and sends it to its worker actor
over the worker's channel (``channel.py``; the step's plan and program go
through Ray, once), keeping up to 2 in flight (the next one waits in the
connection while the previous runs, hiding the coordinator's round trip; a
closure whose predecessor on that worker raised does not run, so it is cancelled
as if it had still been queued), delivers each result as soon as it exists, and
classifies failures as TF's ``WorkerPreemptionHandler`` does (a broken channel
is a lost worker: Ray restarts it):

=====================================================  ==============================================
failure                                                what happens
=====================================================  ==============================================
a ps actor died (also when a worker's call to it died)  ``PSUnavailableError`` naming the ps, raised by
                                                       the next schedule/join/done; queued closures
                                                       cancelled
this worker's actor died or is restarting              the closure goes back on the queue (any worker
                                                       may run it: at-least-once; one run's update is
                                                       applied, once), the worker's iterators are
                                                       rebuilt once Ray restarted it
the function raised                                    its error, with its own type, raised by the next
                                                       schedule/join/done; queued closures cancelled
=====================================================  ==============================================
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any

from distribute.parameter_server.actors import LOST
from distribute.parameter_server.errors import (
    CANCELLED_MESSAGE,
    CancelledError,
    ClosureAbortedError,
    UnavailableError,
)
from distribute.parameter_server.dataset import ElementSpecChanged
from distribute.parameter_server.values import RemoteValue

_WORKER_RECOVERY_SECONDS = 600.0  # TF waits up to an hour (_WORKER_MAXIMUM_RECOVERY_SEC)
_PING_SECONDS = 5.0
# Closures sent to a worker before the previous one returned: the worker's next step is
# already waiting in its channel when one ends, so the coordinator's round trip overlaps
# the worker's work.  TF keeps one per worker; 2 keep the order and
# semantics (Worker.run's ``after``) while hiding the round trip.
_IN_FLIGHT = 2
_CLOSURE_IDS = itertools.count()
_MAX_RETRACES = 16  # one program per element signature; each is traced once and cached


class Closure:
    """One scheduled function call: its step program, its array arguments, its RemoteValue."""

    def __init__(self, step: Any, args: list, remote_value: RemoteValue):
        self.step, self.args, self.remote_value = step, args, remote_value
        self.id = next(_CLOSURE_IDS)  # the same on a re-run: the update of one run is applied, once
        # ElementSpecChanged -> the Step for those element shapes (ClusterCoordinator.schedule sets it)
        self.retrace: Any = None
        self.retraces = 0

    def cancel(self) -> None:
        self.remote_value._set_error(CancelledError(CANCELLED_MESSAGE))


class ClosureQueue:
    """Closures waiting to run, the count in flight, and the first error (TF's semantics)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[Closure] = collections.deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self._stopped = False
        self.live_workers = 0
        self.finished = 0  # closures completed so far (the coordinator refreshes its copies after progress)

    def put(self, closure: Closure) -> None:
        with self._cond:
            self._raise_if_stopped()
            self._raise_if_error()
            self._queue.append(closure)
            self._cond.notify_all()

    def put_check(self) -> None:
        """Raises (and clears) the pending error, once nothing is in flight (TF: schedule raises it)."""
        with self._cond:
            self._raise_if_stopped()
            self._raise_if_error()

    def _raise_if_stopped(self) -> None:
        if self._stopped:
            raise RuntimeError(
                "this ClusterCoordinator's ParameterServerStrategy was shut down (its workers and ps are gone), so it "
                "cannot schedule: create a new ParameterServerStrategy and ClusterCoordinator, re-create the model "
                "in its scope and restore the last checkpoint."
            )

    def get(self, block: bool = True) -> Closure | None:
        """The next closure (counted in flight); None once stopped, or (``block=False``) when none is queued."""
        with self._cond:
            if block:
                self._cond.wait_for(lambda: self._queue or self._stopped)
            if self._stopped or not self._queue:
                return None
            self._inflight += 1
            return self._queue.popleft()

    def mark_finished(self) -> None:
        with self._cond:
            self._inflight -= 1
            self.finished += 1
            self._cond.notify_all()

    def mark_cancelled(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    def put_back(self, closure: Closure) -> None:
        with self._cond:
            self._inflight -= 1
            if self._error is not None:
                closure.cancel()
            else:
                self._queue.appendleft(closure)
            self._cond.notify_all()

    def mark_failed(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            while self._queue:
                self._queue.popleft().cancel()
            self._inflight -= 1
            self._cond.notify_all()

    def wait(self) -> None:
        """Blocks until nothing is queued or in flight; raises (and clears) the first error."""
        with self._cond:
            while True:
                if self._inflight == 0 and (self._error is not None or not self._queue):
                    break
                if self.live_workers == 0 and not self._stopped:
                    raise UnavailableError(
                        f"every worker is lost and none came back; {len(self._queue)} scheduled functions "
                        "cannot run. Restart the job (restore the last checkpoint)."
                    )
                self._cond.wait(1.0)
            self._raise_if_error()

    def busy(self) -> bool:
        """Whether closures are queued or in flight (they may be changing the ps)."""
        with self._cond:
            return bool(self._queue) or self._inflight > 0

    def done(self) -> bool:
        with self._cond:
            if self._error is not None and self._inflight == 0:
                self._raise_if_error()
            return not self._queue and self._inflight == 0 and self._error is None

    def _raise_if_error(self) -> None:
        if self._error is None:
            return
        self._cond.wait_for(lambda: self._inflight == 0)
        error, self._error = self._error, None
        raise error

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            while self._queue:
                self._queue.popleft().cancel()
            self._cond.notify_all()

    def notify(self) -> None:
        with self._cond:
            self._cond.notify_all()


class WorkerThread:
    """Runs closures on one worker actor (TF: ``WorkerClosureProcessingLoop-<i>``)."""

    def __init__(self, index: int, cluster: Any, queue: ClosureQueue):
        self.index, self._cluster, self._queue = index, cluster, queue
        self.resources: dict[int, tuple[Any, Any]] = {}  # resource id -> (dataset_fn, RemoteValue)
        self._sent_plans: set[int] = set()  # program ids whose plan this worker's actor has
        self._lock = threading.Lock()
        self._creating: list = []  # create_iterator calls a step sent on the channel must not overtake
        self._connection: Any = None  # channel.Connection to the worker actor, opened on first use
        with queue._cond:
            queue.live_workers += 1
        self._thread = threading.Thread(target=self._loop, name=f"WorkerClosureProcessingLoop-{index}", daemon=True)
        self._thread.start()

    @property
    def actor(self) -> Any:
        return self._cluster.workers[self.index]

    def add_resource(self, resource_id: int, dataset_fn: Any, remote_value: Any) -> None:
        with self._lock:
            self._create(resource_id, dataset_fn, remote_value)
            self.resources[resource_id] = (dataset_fn, remote_value)

    def _create(self, resource_id: int, dataset_fn: Any, remote_value: Any) -> None:
        try:
            ref = self.actor.create_iterator.remote(resource_id, dataset_fn)
        except TypeError as err:  # Ray could not pickle it: say whose function and what to do first
            name = getattr(getattr(dataset_fn, "_fn", None), "__qualname__", None)
            what = f"the dataset function {name!r}" if name else "the dataset"
            raise TypeError(
                f"{what} given to create_per_worker_dataset runs on every worker, so it must be picklable "
                "(cloudpickle), and it captures an object that is not (a lock, an open file, a connection, ...): "
                f"create such objects inside the function. Ray's report follows.\n{err}"
            ) from err
        self._creating.append(ref)
        remote_value._start(ref)

    def _loop(self) -> None:
        try:
            sent: collections.deque[tuple[Closure, Any]] = collections.deque()
            while True:
                if len(sent) < _IN_FLIGHT:
                    closure = self._queue.get(block=not sent)
                    if closure is not None:
                        sent.append((closure, self._send(closure, sent[-1][0].id if sent else None)))
                        continue
                    if not sent:
                        return  # stopped
                self._receive(sent)
                if not self._cluster.alive:
                    for closure, _ in sent:  # shut down: what is still sent will not be delivered
                        closure.cancel()
                        self._queue.mark_cancelled()
                    return
        finally:
            with self._queue._cond:
                self._queue.live_workers -= 1
                self._queue._cond.notify_all()

    def _send(self, closure: Closure, after: int | None) -> Any:
        """Sends ``closure`` to the worker over its channel (its plan through Ray, once).

        Returns True (sent), False (the worker is lost) or the error that keeps it
        from running (e.g. its program does not load there), raised by ``_finish``.
        """
        import ray

        step = closure.step
        try:
            with self._lock:
                creating, self._creating = self._creating, []
            if creating:  # Ray and the channel keep no order between them: iterators exist before steps use them
                ray.wait(creating, num_returns=len(creating))
            if step.plan.program_id not in self._sent_plans:
                ray.get(self.actor.load_plan.remote(step.plan, step.box))
                self._sent_plans.add(step.plan.program_id)
            self._channel().send(("run", closure.id, step.plan.program_id, None, closure.args, after, self._cluster.seen()))
            return True
        except OSError:
            self._drop_channel()
            return False
        except Exception as error:  # noqa: BLE001 - a dead worker, or an error raised like the closure's own
            if self._cluster.classify(error)[0] != "worker":
                return error
            self._drop_channel()
            return False

    def _channel(self) -> Any:
        if self._connection is None:
            import ray

            from distribute.parameter_server.channel import Connection

            self._connection = Connection(ray.get(self.actor.channel.remote()), self._waiting)
        return self._connection

    def _drop_channel(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _waiting(self) -> None:
        """Asked while a reply is slow: a worker Ray reports dead ends the wait (ConnectionError); a live one continues."""
        import ray

        try:
            ray.get(self.actor.ping.remote(), timeout=_PING_SECONDS)
        except ray.exceptions.GetTimeoutError:
            return
        except ray.exceptions.RayActorError as error:
            raise ConnectionError(f"worker {self.index} died") from error

    def _receive(self, sent: collections.deque) -> None:
        """Waits for the oldest closure sent; on a lost worker, also for the rest, then re-queues them in order."""
        lost = []
        while sent:
            closure, status = sent.popleft()
            if not self._finish(closure, status):
                lost.append(closure)
            if not lost:
                return
        for closure in reversed(lost):
            self._queue.put_back(closure)
        self._recover()

    def _finish(self, closure: Closure, sent: Any) -> bool:
        """Delivers one closure's result or error; False if its worker was lost (the caller re-queues it)."""
        from distribute.parameter_server.channel import RemoteError

        step = closure.step
        if sent is False or self._connection is None and sent is True:
            return False
        try:
            if sent is not True:
                raise RemoteError(sent)
            reply = self._connection.receive()
        except OSError:
            self._drop_channel()
            return False
        except RemoteError as remote:
            kind, cause = self._cluster.classify(remote.error)
            if kind == "worker":
                self._drop_channel()
                return False
            if kind == "ps":
                cause = self._cluster.ps_lost(cause)
            closure.remote_value._set_error(cause)
            self._queue.mark_failed(cause)
            return True
        if reply is None:  # the closure sent before it raised on the worker: cancelled (or re-queued) as if queued
            self._queue.put_back(closure)
            return True
        if isinstance(reply, ElementSpecChanged):
            return self._retrace(closure, reply)
        if reply == LOST:  # Ray restarted the worker before this thread saw it die
            return False
        import jax

        outs, versions = reply
        self._cluster.observe(versions)  # before the result is visible: later steps see this one's update
        closure.remote_value._set_value(jax.tree_util.tree_unflatten(step.out_tree, outs))
        self._queue.mark_finished()
        return True

    def _retrace(self, closure: Closure, changed: ElementSpecChanged) -> bool:
        """Gives ``closure`` the program for the element shapes its worker found, and queues it first (TF retraces).

        The worker reads a closure's elements before it pulls, runs or pushes anything;
        when their shapes are not the program's, and it has not run the program of
        their shapes before, it puts them back and answers ``ElementSpecChanged``; the
        closure runs again with the program traced (once, cached) for those shapes: no
        element is skipped or read twice, no update applied twice.  (A closure sent
        behind it on the same worker may take those elements first: each element is
        still read once.)
        """
        closure.retraces += 1
        if closure.retraces > _MAX_RETRACES:
            error = RuntimeError(
                f"worker {self.index}'s elements changed shape {_MAX_RETRACES} times in a row for one scheduled "
                "function; give the dataset a fixed element shape (batch with drop_remainder=True)."
            )
            closure.remote_value._set_error(error)
            self._queue.mark_failed(error)
            return True
        try:
            closure.step = closure.retrace(changed)
        except Exception as error:  # noqa: BLE001 - the function's own error at trace time, raised by the next call
            closure.remote_value._set_error(error)
            self._queue.mark_failed(error)
            return True
        self._queue.put_back(closure)
        return True

    def _recover(self) -> None:
        """Waits for Ray to restart this worker, then rebuilds its iterators (TF: _on_worker_recovery)."""
        import ray

        self._sent_plans = set()
        self._drop_channel()
        with self._lock:
            for _, remote_value in self.resources.values():
                remote_value._set_aborted(ClosureAbortedError("the worker holding this iterator was lost; it is being rebuilt."))
        deadline = time.monotonic() + _WORKER_RECOVERY_SECONDS
        while self._cluster.alive and time.monotonic() < deadline:
            try:
                ray.get(self.actor.ping.remote(), timeout=_PING_SECONDS)
                break
            except Exception:  # noqa: BLE001 - still restarting
                time.sleep(0.2)
        else:
            self._cluster.alive_workers.discard(self.index)
            return
        self.actor.adopt.remote()  # before its iterators (Ray keeps one caller's order); closures wait for those
        with self._lock:
            for resource_id, (dataset_fn, remote_value) in self.resources.items():
                self._create(resource_id, dataset_fn, remote_value)
        self._cluster.recoveries += 1
