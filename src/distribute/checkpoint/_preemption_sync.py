"""How the workers of a PreemptionCheckpointHandler agree on the run to save at (TF's protocol).

One worker: nothing to agree; the notified process picks "after run N + 1".

Several workers (MultiWorkerMirroredStrategy): through the coordination
service's key-value store, with the keys of TF's failure_handling.py:

1. The first notified worker claims ``TERMINATED_WORKER`` (a key set only once,
   so a second notified worker leaves the decision to the first).
2. At its next ``run`` it sets ``RUN_TO_CHECKPOINT`` = its run count + 1 and
   waits until every worker acknowledged it (``RECEIVED_SIGNAL_...``) before
   starting that run.
3. Every worker's watcher thread waits for that key, records the run and
   acknowledges; its main thread saves when its own count reaches the run.
4. After saving, every worker waits at a barrier until all have saved (the
   checkpoint is committed), then exits; the exit is announced as agreed so no
   worker is reported lost.

With a grace period, ``LAST_RUN_TO_CHECKPOINT`` repeats steps 2-3 for the final
checkpoint.  Why not jax's preemption sync manager (``jax.distributed`` starts
one): it picks "the largest step any worker reached, + 1" about a second after
the notice (its notifier polls), offers no way to feed it a
``termination_watcher_fn``, has no grace-period phase, and does not exist with
one worker; this protocol is TF's own on every count of workers.  Every wait
is bounded by ``CommunicationOptions.timeout_seconds``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger("distribute")

INITIAL_RUN_COUNT_KEY = "RUN_TO_CHECKPOINT"
LAST_RUN_COUNT_KEY = "LAST_RUN_TO_CHECKPOINT"
_PREEMPTION_WORKER_KEY = "TERMINATED_WORKER"
_ACKNOWLEDGE_KEY = "RECEIVED_SIGNAL"
_WAIT_CHUNK_SECONDS = 0.5  # the watcher's longest blocking wait, so it can stop promptly


@contextlib.contextmanager
def _ignoring_sigterm() -> Iterator[None]:
    """SIGTERM is ignored while the process exits after its checkpoint is saved.

    The launcher (or a scheduler) may signal a worker that is still ending
    after another one left; the exit status stays ``exit_fn``'s.  (Python resets
    a Python-function handler to the default action while it shuts down, but
    keeps SIG_IGN.)  Restored if ``exit_fn`` returns.
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
    yield
    if main:
        signal.signal(signal.SIGTERM, previous)


class _LocalSync:
    """One worker: the run to save at is this process's own choice."""

    id_in_cluster = "single_worker"
    name = "this worker"

    def __init__(self) -> None:
        self.step_received = threading.Event()
        self.countdown_started = threading.Event()
        self.step_to_checkpoint: int | None = None

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def claim(self) -> bool:
        return True

    def wait_for_run(self, result: Any) -> None:
        """One worker decides alone: its runs may stay queued."""

    def publish(self, key: str, run: int) -> None:
        del key
        self.step_to_checkpoint = run
        self.step_received.set()

    def all_saved(self, run: int) -> None:
        pass

    @contextlib.contextmanager
    def agreed_exit(self) -> Iterator[None]:
        with _ignoring_sigterm():
            yield

    def chief_value(self, text: str) -> str:
        return text


class _ClusterSync(_LocalSync):
    """Several workers: TF's key-value protocol over the strategy's coordination client."""

    def __init__(self, exchange: Any, grace_period: float):
        super().__init__()
        self._exchange = exchange
        self._cluster = exchange.cluster
        self._grace_period = grace_period
        self._prefix = exchange.new_channel() + "/preemption"  # every worker creates its handler at the same point
        self.id_in_cluster = str(self._cluster.worker_id)
        self.name = self._cluster.names[self._cluster.worker_id]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch_step_to_save_key, daemon=True,
                                        name=f"PeerTerminationWatcher-{self.id_in_cluster}")

    def _key(self, *parts: Any) -> str:
        return "/".join([self._prefix, *map(str, parts)])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=4 * _WAIT_CHUNK_SECONDS)

    def claim(self) -> bool:
        return self._exchange.claim(self._key(_PREEMPTION_WORKER_KEY), self.id_in_cluster)

    def wait_for_run(self, result: Any) -> None:
        """Waits until the run that returned ``result`` is computed (every dispatched array if it holds none).

        The protocol's premise (TF's calls are synchronous): a worker finishes
        run N + 1 only after the notified worker started it, which it does only
        once every worker acknowledged the run to save at, so each worker checks
        at N + 1 knowing it.  With JAX's asynchronous dispatch a worker's host can
        be runs ahead of its computation (on GPUs without bound) and pass N + 1
        before its watcher sees the key; then it never saves, and the others wait
        for it at the barrier.
        """
        import jax

        arrays = [x for x in jax.tree_util.tree_leaves(result) if isinstance(x, jax.Array)]
        jax.block_until_ready(arrays or jax.live_arrays())

    def publish(self, key: str, run: int) -> None:
        """Sets the run to save at and waits for every worker's acknowledgement.

        Raises:
            WorkerLostError: a worker did not acknowledge within the communication timeout.
        """
        from distribute.runtime.exits import WorkerLostError

        self._exchange.claim(self._key(key), str(run))
        logger.info("%s set %s to %d.", self.name, key, run)
        timeout = self._exchange.timeout_seconds
        for worker_id in range(self._cluster.num_workers):
            if self._exchange.wait_for(self._key(_ACKNOWLEDGE_KEY, key, worker_id), timeout) is None:
                raise WorkerLostError(
                    f"{self._cluster.names[worker_id]} did not acknowledge the preemption checkpoint at run {run} "
                    f"within {timeout:g} s (CommunicationOptions.timeout_seconds): the worker is lost or stuck."
                )

    def all_saved(self, run: int) -> None:
        self._exchange.barrier(self._key("saved", run), f"the end of the preemption checkpoint at run {run}")

    @contextlib.contextmanager
    def agreed_exit(self) -> Iterator[None]:
        import distribute.runtime.exits as exits

        exits.agreed_exit(True)
        with _ignoring_sigterm():
            yield  # exit_fn: a SystemExit leaves the exit marked as agreed
        exits.agreed_exit(False)  # exit_fn returned: training goes on

    def chief_value(self, text: str) -> str:
        values = self._exchange.all_gather(self._exchange.new_channel(), text.encode("utf-8"),
                                           "the preemption handler's checkpoint directory")
        return values[0].decode("utf-8")

    # -- the watcher thread -----------------------------------------------------------------------
    def _wait(self, key: str) -> str | None:
        while not self._stopped.is_set():
            try:
                value = self._exchange.wait_for(key, _WAIT_CHUNK_SECONDS)
            except Exception as err:  # noqa: BLE001 - the service is gone (the process is ending); the watchdog reports losses
                logger.debug("preemption watcher stops: %s", err)
                return None
            if value is not None:
                return value
        return None

    def _acknowledge(self, key: str) -> None:
        self._exchange.claim(self._key(_ACKNOWLEDGE_KEY, key, self.id_in_cluster), "1")
        logger.info("%s acknowledged %s.", self.name, key)

    def _watch_step_to_save_key(self) -> None:
        value = self._wait(self._key(INITIAL_RUN_COUNT_KEY))
        if value is None:
            return
        self.step_to_checkpoint = int(value)  # before the acknowledgement, so the main thread sees it in time
        self.step_received.set()
        self._acknowledge(INITIAL_RUN_COUNT_KEY)
        if self._grace_period <= 0:
            return
        value = self._wait(self._key(LAST_RUN_COUNT_KEY))
        if value is None:
            return
        self._acknowledge(LAST_RUN_COUNT_KEY)
        while not self.countdown_started.wait(_WAIT_CHUNK_SECONDS):  # the first checkpoint is saved first
            if self._stopped.is_set():
                return
        self.step_to_checkpoint = int(value)
        self.step_received.set()


def cluster_sync(strategy: Any, resolver: Any, grace_period: float) -> _LocalSync:
    """The agreement for ``strategy``'s workers (one worker: local).

    Raises:
        ValueError: ``resolver`` names another number of workers than the strategy joined.
    """
    from distribute.cluster import roles

    runtime = None if strategy is None else strategy.extended.runtime
    exchange = None if runtime is None else runtime.exchange
    num_workers = exchange.cluster.num_workers if exchange is not None else 1
    if resolver is not None:
        spec = resolver.cluster_spec()
        wanted = roles.num_workers(spec) if spec and spec.jobs else 1
        if wanted != num_workers:
            raise ValueError(
                f"cluster_resolver names {wanted} worker(s) but the checkpoint's strategy {strategy!r} runs on "
                f"{num_workers}; pass strategy.cluster_resolver of the strategy the model was built under."
            )
    return _LocalSync() if exchange is None else _ClusterSync(exchange, grace_period)
