"""The cross-worker runtime under MultiWorkerMirroredStrategy.

Reads the cluster once from a resolver, joins the workers through
``jax.distributed`` with every wait bounded (worker 0 starts the coordination
service in a process of its own, ``_coordination_service``), publishes heartbeats so a lost
worker is named within the timeout, and exchanges small values (batch sizes at
each step, the random seed) through the coordination service's key-value store.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from distribute._coordination_service import EXIT_WORKER_LOST, ServiceProcess

logger = logging.getLogger("distribute")


class WorkerLostError(RuntimeError):
    """A worker stopped answering within the communication timeout."""


@dataclasses.dataclass(frozen=True)
class _Cluster:
    """This job's synchronous workers, read once from a resolver."""

    num_workers: int
    worker_id: int
    is_chief: bool
    coordinator: str | None
    names: tuple[str, ...]  # per worker id: "worker 1 (127.0.0.1:1234)"


def _read_cluster(resolver: Any) -> _Cluster:
    from distribute.cluster import roles

    spec = resolver.cluster_spec()
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type not in (None, roles.CHIEF, roles.WORKER):
        raise ValueError(
            f"MultiWorkerMirroredStrategy runs on 'chief' and 'worker' tasks, not {task_type!r}; "
            "an evaluator uses its own (single-worker) strategy, ps tasks ParameterServerStrategy."
        )
    if not spec or roles.num_workers(spec) <= 1:
        return _Cluster(1, 0, True, None, ("worker 0",))
    if task_type is None or task_id is None:
        raise ValueError(
            f"The cluster {spec!r} has several workers but the resolver does not say which task "
            "this process is; set TF_CONFIG's 'task' (or task_type and task_id)."
        )
    if task_type not in (roles.CHIEF, roles.WORKER):
        raise ValueError(
            f"MultiWorkerMirroredStrategy runs on 'chief' and 'worker' tasks, not {task_type!r}; "
            "an evaluator uses its own (single-worker) strategy, ps tasks ParameterServerStrategy."
        )
    names = []
    for job in (roles.CHIEF, roles.WORKER):
        if job in spec.jobs:
            for i in sorted(spec.task_indices(job)):
                names.append(f"{job} {i} ({spec.task_address(job, i)})")
    return _Cluster(
        num_workers=roles.num_workers(spec),
        worker_id=roles.worker_index(task_type, task_id, spec),
        is_chief=roles.is_chief(spec, task_type, task_id),
        coordinator=roles.coordinator_address(spec),
        names=tuple(names),
    )


# -- joining the workers -------------------------------------------------------------------
def _join(cluster: _Cluster, timeout_seconds: float) -> Any:
    """Starts jax.distributed for ``cluster`` (once per process); returns its client.

    Like ``jax.distributed.initialize`` with every wait bounded by
    ``timeout_seconds``, and a heartbeat callback that names the lost worker
    instead of aborting with a bare status.
    """
    from jax._src import distributed as jax_distributed
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    state = jax_distributed.global_state
    if state.client is not None:
        if state.num_processes != cluster.num_workers or state.process_id != cluster.worker_id:
            raise RuntimeError(
                f"jax.distributed is already initialized as process {state.process_id} of "
                f"{state.num_processes}, but the cluster says worker {cluster.worker_id} of "
                f"{cluster.num_workers}; create the strategy once, from the same cluster."
            )
        return state.client
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "MultiWorkerMirroredStrategy must be created before JAX starts its backend (before any "
            "jax.devices() call or computation), since jax.distributed must join the workers first. "
            "Create the strategy at the start of the program."
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    seconds = max(int(round(timeout_seconds)), 1)
    backstop = 2 * seconds  # jax's own heartbeat abort; the watchdog below names the worker first
    port = cluster.coordinator.rsplit(":", 1)[1]
    if cluster.worker_id == 0:
        # In a process of its own, so that the survivors of a chief that dies keep it and name the chief.
        state.service = ServiceProcess(int(port), cluster.num_workers, heartbeat_timeout=backstop,
                                       shutdown_timeout=seconds, linger_seconds=seconds + 5,
                                       start_timeout_seconds=max(seconds, 60))
    state.num_processes = cluster.num_workers
    state.process_id = cluster.worker_id
    state.coordinator_address = cluster.coordinator
    state.client = _jax.get_distributed_runtime_client(
        cluster.coordinator,
        cluster.worker_id,
        init_timeout=backstop,  # jaxlib ends the process itself at its timeout; the timer below names the worker first
        shutdown_timeout=seconds,
        heartbeat_timeout=backstop,
        use_compression=True,
    )
    never_joined = _JoinWait(cluster, seconds)
    never_joined.start()
    try:
        state.client.connect()
    except Exception as err:
        raise WorkerLostError(
            f"{cluster.names[cluster.worker_id]} could not join the cluster within {seconds} s: "
            f"{_missing_text(cluster, range(cluster.num_workers))} did not connect to the "
            f"coordinator at {cluster.coordinator} ({err}). Start every worker, or raise "
            "CommunicationOptions.timeout_seconds."
        ) from err
    finally:
        never_joined.cancel()
    _start_preemption_service_keeping_sigterm(state)
    watchdog = _Watchdog(state.client, cluster, timeout_seconds)
    watchdog.start()
    _fail_fast_on_unhandled_exceptions(cluster, watchdog)
    _fail_fast_on_exit(cluster, watchdog)
    return state.client


def _start_preemption_service_keeping_sigterm(state: Any) -> None:
    """Starts jax's preemption sync manager (as ``jax.distributed.initialize``), keeping SIGTERM's Python handler.

    jaxlib's preemption notifier installs its own C++ SIGTERM handler, which
    swallows the signal: a worker of a job told to stop would train on until
    SIGKILL.  As in TF, SIGTERM ends the process (after a checkpoint save in
    flight is committed, see ``_end_on_sigterm``) unless the program handles
    it, e.g. through a ``PreemptionCheckpointHandler``
    (which agrees on a step through the key-value store, not through jax's
    manager; ``multihost_utils.reached_preemption_sync_point`` stays callable).
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    state.initialize_preemption_sync_manager()
    if main and previous is not None:
        signal.signal(signal.SIGTERM, _end_on_sigterm if previous == signal.SIG_DFL else previous)


# Waits run before a SIGTERM ends the process (checkpoint/_storage.py registers the wait
# for an asynchronous save in flight).
BEFORE_SIGTERM_EXIT: list = []


def _end_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM without a handler of the program's: the process ends by SIGTERM, as TF's, once the
    checkpoint being written (an asynchronous save in flight) is committed.

    The wait runs in a thread (a signal handler must not take the save's lock);
    a second SIGTERM ends the process at once; the launcher's SIGKILL bounds it.
    """
    del frame
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def end() -> None:
        for wait in BEFORE_SIGTERM_EXIT:
            wait()
        os.kill(os.getpid(), signum)

    threading.Thread(target=end, name="distribute-sigterm", daemon=True).start()


def _never_joined(cluster: _Cluster, seconds: int) -> None:
    """Runs when the cluster has not formed within the timeout (the main thread is blocked inside jaxlib)."""
    role = ("it hosts the coordination service and" if cluster.worker_id == 0
            else f"the coordinator at {cluster.coordinator} or")
    _stop_now(
        f"MultiWorkerMirroredStrategy on {cluster.names[cluster.worker_id]}: the cluster did not form within "
        f"{seconds} s (CommunicationOptions.timeout_seconds): {role} "
        f"{_missing_text(cluster, range(cluster.num_workers))} never joined. Start every worker "
        "(same TF_CONFIG cluster, reachable addresses), or raise the timeout.",
        EXIT_WORKER_LOST,
    )


JOIN_REPORT_SECONDS = 30.0  # while the cluster forms, who is still missing is said this often (a third of a short timeout)


class _JoinWait(threading.Thread):
    """While this worker waits for the cluster to form: every ~30 s a warning naming who is still missing and
    where; at the timeout, ``_never_joined`` (the main thread is blocked inside jaxlib meanwhile)."""

    def __init__(self, cluster: _Cluster, seconds: int):
        super().__init__(name="distribute-join-wait", daemon=True)
        self._cluster, self._seconds = cluster, seconds
        self._period = min(JOIN_REPORT_SECONDS, seconds / 3)
        self._stopped = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self._stopped.wait(max(min(self._period, self._seconds - (time.monotonic() - start)), 0.0)):
            waited = time.monotonic() - start
            if waited >= self._seconds:
                _never_joined(self._cluster, self._seconds)
                return
            logger.warning(_still_missing(self._cluster, waited, self._seconds))

    def cancel(self) -> None:
        self._stopped.set()


def _still_missing(cluster: _Cluster, waited: float, seconds: int) -> str:
    """Who this worker still waits for: the chief when its coordination service does not answer, else the others."""
    me = cluster.names[cluster.worker_id]
    head = f"{me} has waited {waited:.0f} s of {seconds} s (CommunicationOptions.timeout_seconds) for the cluster to form"
    if cluster.worker_id != 0 and not _answers(cluster.coordinator):
        return (f"{head}; still missing: {cluster.names[0]}, whose coordination service at {cluster.coordinator} does "
                "not answer (not started, or not reachable from here).")
    others = [name for i, name in enumerate(cluster.names) if i not in (0, cluster.worker_id)] if cluster.worker_id else list(cluster.names[1:])
    which = others[0] if len(others) == 1 else f"one or more of {', '.join(others)}"
    return f"{head}; still missing: {which} (not started, or not reachable)."


def _answers(address: str | None) -> bool:
    import socket

    if not address:
        return False
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except OSError:
        return False


def _stop_now(message: str, code: int) -> None:
    """Logs ``message`` and ends this process at once (a blocked collective cannot be interrupted)."""
    logger.error(message)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


class _ExitStatus:
    """Records the status given to ``sys.exit`` (Python does not expose it to atexit handlers).

    ``agreed`` is set when every worker leaves together on purpose (a
    preemption checkpoint was saved by all): the exit then goes as a normal
    one (through jax.distributed's shutdown barrier, which every worker
    reaches), so no peer reports this worker as lost.
    """

    code: int = 0
    agreed: bool = False

    @classmethod
    def install(cls) -> None:
        real_exit = sys.exit

        def exit(status: Any = None) -> None:
            cls.code = 0 if status is None else (status if isinstance(status, int) else 1)
            real_exit(status)

        exit.__doc__ = real_exit.__doc__
        sys.exit = exit


def agreed_exit(agreed: bool) -> None:
    """Marks the coming exit of this worker as agreed by every worker (not a failure to report), or not any more."""
    _ExitStatus.agreed = agreed


def _fail_fast_on_exit(cluster: _Cluster, watchdog: _Watchdog) -> None:
    """A worker that calls ``sys.exit(N)`` with N != 0 leaves at once and tells the others.

    Without this it waits at jax.distributed's shutdown barrier for workers that
    are themselves blocked in a step with it: the job never ends.  Its
    heartbeat key says ``failed:N``, so every other worker stops within a
    heartbeat period naming it (and the launcher names it from its exit status).
    """
    _ExitStatus.install()

    def at_exit() -> None:
        code = _ExitStatus.code
        if code == 0 or _ExitStatus.agreed:
            return  # every worker leaves: jax.distributed's shutdown barrier passes, as on a normal exit
        watchdog.stop(f"failed:{code}")
        _stop_now(f"{cluster.names[cluster.worker_id]} exits with status {code}; the other workers stop too.", code)

    atexit.register(at_exit)  # after the watchdog's own handler, so it runs first


def _fail_fast_on_unhandled_exceptions(cluster: _Cluster, watchdog: _Watchdog) -> None:
    """A worker that dies of an exception exits at once, skipping jax.distributed's shutdown barrier.

    Otherwise it would wait there for workers that are themselves blocked in a
    collective with it, and the job would hang until the shutdown timeout; exiting
    lets the launcher (or the others' heartbeat check) stop the job within seconds.
    A ``WorkerLostError`` exits with status 75 (``EXIT_WORKER_LOST``), as the watchdog does.
    """
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        text = str(exc)
        if "Gloo" in text and ("reset by peer" in text or "closed" in text or "Read error" in text or "EOF" in text):
            # A peer's process ended inside a collective: gloo's message has an address, not a worker.
            peers = [w for w in range(cluster.num_workers) if w != cluster.worker_id]
            if len(peers) > 1:  # the one whose heartbeat stopped (the watchdog may name it first, and exit)
                peers = watchdog.silent_peers() or peers
            which = _missing_text(cluster, peers) if len(peers) == 1 else f"one of {_missing_text(cluster, peers)}"
            _stop_now(
                f"MultiWorkerMirroredStrategy on {cluster.names[cluster.worker_id]}: lost {which} inside a step: "
                f"its connection closed ({text.splitlines()[0][:200]}); the worker died. Stopping this worker "
                "too; restart the job (BackupAndRestore resumes from the last backup).",
                EXIT_WORKER_LOST,
            )
        previous(exc_type, exc, tb)
        lost = issubclass(exc_type, WorkerLostError)  # a consequence of another worker's failure: not to be reported
        if not lost:
            watchdog.stop("failed:1")  # the others stop within a heartbeat period, naming this worker
        _stop_now(f"{cluster.names[cluster.worker_id]} stops on an unhandled {exc_type.__name__}; "
                  "the other workers will stop too.", EXIT_WORKER_LOST if lost else 1)

    sys.excepthook = hook


def _missing_text(cluster: _Cluster, ids: Any) -> str:
    return ", ".join(cluster.names[i] for i in ids if i != cluster.worker_id) or "the other workers"


class _Watchdog(threading.Thread):
    """Every worker publishes a heartbeat counter; a worker whose counter stops for
    ``timeout_seconds`` is lost: this worker prints whom and exits (a blocked
    collective cannot be interrupted from Python).  A worker that exits normally
    says so first and is not counted as lost."""

    def __init__(self, client: Any, cluster: _Cluster, timeout_seconds: float):
        super().__init__(name="distribute-watchdog", daemon=True)
        self._client, self._cluster, self._timeout = client, cluster, timeout_seconds
        self._period = min(1.0, timeout_seconds / 4)
        self._stopped = threading.Event()
        atexit.register(self.stop)

    def stop(self, final: str = "exited") -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            try:
                self._client.key_value_set(self._key(self._cluster.worker_id), final, allow_overwrite=True)
            except Exception:  # noqa: BLE001 - the service may be gone already
                pass

    def _key(self, worker_id: int) -> str:
        return f"distribute/alive/{worker_id}"

    def silent_peers(self) -> list[int]:
        """The other workers whose heartbeat does not advance over the next few periods (at most the timeout).

        Called after a collective failed because some peer's process ended: the
        live ones keep beating, so the dead one is the one left.  Empty when the
        store cannot be read.
        """
        others = [w for w in range(self._cluster.num_workers) if w != self._cluster.worker_id]
        try:
            before = {w: self._try_get(self._key(w)) for w in others}
            self._stopped.wait(min(self._timeout, 4 * self._period))
            after = {w: self._try_get(self._key(w)) for w in others}
        except Exception:  # noqa: BLE001 - the caller then names every candidate
            return []
        return [w for w in others if after[w] == before[w] and before[w] != "exited"]

    def run(self) -> None:
        cluster, beat = self._cluster, 0
        others = [w for w in range(cluster.num_workers) if w != cluster.worker_id]
        last = {w: (None, time.monotonic()) for w in others}
        service_ok = time.monotonic()
        while not self._stopped.wait(self._period):
            now = time.monotonic()
            beat += 1
            try:
                self._client.key_value_set(self._key(cluster.worker_id), str(beat), allow_overwrite=True)
                values = {w: self._try_get(self._key(w)) for w in others}
                service_ok = now
            except Exception as err:  # noqa: BLE001
                if now - service_ok > self._timeout and not self._stopped.is_set():
                    self._fail([0], f"the coordination service on it does not answer ({err})")
                continue
            for w, value in values.items():
                if value is not None and value.startswith("failed:") and not self._stopped.is_set():
                    self._fail([w], f"it exited with status {value.split(':', 1)[1]}")
                elif value == "exited" or value != last[w][0]:
                    last[w] = (value, now)
                elif now - last[w][1] > self._timeout and not self._stopped.is_set():
                    self._fail([w], f"it sent no heartbeat for {self._timeout:g} s")

    def _try_get(self, key: str) -> str | None:
        try:
            return self._client.key_value_try_get(key)
        except Exception as err:
            if "NOT_FOUND" in str(err) or "not found" in str(err).lower():
                return None
            raise

    def _fail(self, lost: list[int], why: str) -> None:
        cluster = self._cluster
        _stop_now(
            f"MultiWorkerMirroredStrategy on {cluster.names[cluster.worker_id]}: lost "
            f"{_missing_text(cluster, lost)}: {why} (CommunicationOptions.timeout_seconds="
            f"{self._timeout:g}). Stopping this worker too; restart the "
            "job (BackupAndRestore resumes from the last backup).",
            EXIT_WORKER_LOST,
        )


class _Exchange:
    """All-gathers a few bytes between workers through the coordination service, with a timeout."""

    def __init__(self, client: Any, cluster: _Cluster, timeout_seconds: float):
        self._client, self._cluster, self._timeout = client, cluster, timeout_seconds
        self._count = 0

    def new_channel(self) -> str:
        self._count += 1
        return f"distribute/{self._count}"

    def all_gather(self, key: str, payload: bytes, what: str) -> list[bytes]:
        cluster = self._cluster
        self._client.key_value_set_bytes(f"{key}/{cluster.worker_id}", payload)
        deadline = time.monotonic() + self._timeout
        out: list[bytes] = []
        for w in range(cluster.num_workers):
            if w == cluster.worker_id:
                out.append(payload)
                continue
            remaining_ms = max(int((deadline - time.monotonic()) * 1000), 1)
            try:
                out.append(self._client.blocking_key_value_get_bytes(f"{key}/{w}", remaining_ms))
            except Exception as err:
                missing = [v for v in range(w, cluster.num_workers) if v != cluster.worker_id and not self._has(f"{key}/{v}")]
                raise WorkerLostError(
                    f"{_missing_text(cluster, missing or [w])} did not reach {what} within "
                    f"{self._timeout:g} s (CommunicationOptions.timeout_seconds): the worker is lost "
                    f"or stuck. Restart the job; BackupAndRestore resumes from the last backup. ({err})"
                ) from err
        return out

    def _has(self, key: str) -> bool:
        try:
            return self._client.key_value_try_get_bytes(key) is not None
        except Exception:  # noqa: BLE001 - a missing key raises NOT_FOUND
            return False

    def delete(self, key: str) -> None:
        try:
            self._client.key_value_delete(f"{key}/{self._cluster.worker_id}")
        except Exception:  # noqa: BLE001 - cleanup only
            pass

    # -- single keys (the preemption protocol) --------------------------------------------------
    @property
    def cluster(self) -> _Cluster:
        return self._cluster

    @property
    def timeout_seconds(self) -> float:
        return self._timeout

    def claim(self, key: str, value: str) -> bool:
        """Sets ``key`` unless some worker set it first; True when this worker's value is the one stored."""
        try:
            self._client.key_value_set(key, value)
            return True
        except Exception as err:
            if "ALREADY_EXISTS" in str(err) or "already exists" in str(err).lower():
                return False
            raise

    def wait_for(self, key: str, timeout_seconds: float) -> str | None:
        """The value of ``key`` once some worker sets it, or None after ``timeout_seconds``."""
        try:
            return self._client.blocking_key_value_get(key, max(int(timeout_seconds * 1000), 1))
        except Exception as err:
            if "DEADLINE_EXCEEDED" in str(err) or "timed out" in str(err).lower():
                return None
            raise

    def barrier(self, name: str, what: str, worker_ids: Any = None) -> None:
        """Waits until every worker (or ``worker_ids``) reaches barrier ``name``, within the communication timeout.

        Raises:
            WorkerLostError: some worker did not reach it in time; the message names ``what``.
        """
        timeout_ms = max(int(self._timeout * 1000), 1)
        try:
            if worker_ids is None:
                self._client.wait_at_barrier(name, timeout_ms)
            else:
                self._client.wait_at_barrier(name, timeout_ms, list(worker_ids))
        except Exception as err:
            raise WorkerLostError(
                f"{_missing_text(self._cluster, range(self._cluster.num_workers))} did not reach {what} within "
                f"{self._timeout:g} s (CommunicationOptions.timeout_seconds): a worker is lost or stuck. ({err})"
            ) from err


# -- the strategy ---------------------------------------------------------------------------


def _agree_on_seed(exchange: _Exchange) -> None:
    """Gives every worker Keras' global seed of worker 0, unless one is set (as Keras' own multi-host init).

    Variables are initialized on every worker and must be identical there.
    """
    from distribute._keras import rng_utils

    if rng_utils.get_random_seed() is not None:
        return
    mine = int(np.random.SeedSequence().generate_state(1)[0] % (2**31 - 1))
    seeds = exchange.all_gather(exchange.new_channel(), str(mine).encode(), "the random-seed agreement")
    rng_utils.set_random_seed(int(seeds[0].decode()))
