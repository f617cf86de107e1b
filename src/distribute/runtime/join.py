"""Joining the workers through ``jax.distributed``, every wait bounded (the one module using JAX's private runtime).

Like ``jax.distributed.initialize``, except: worker 0 starts the coordination
service in a process of its own (``service.py``) so that it outlives a chief
that dies; joining is bounded by the communication timeout, saying every ~30 s
who is still missing and ending with a message naming them; heartbeats
(``watchdog.py``) name a lost worker instead of jaxlib aborting with a bare
status.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import jax

from distribute.runtime.cluster import Cluster, missing_text
from distribute.runtime.exits import (
    WorkerLostError,
    fail_fast_on_exit,
    fail_fast_on_unhandled_exceptions,
    start_preemption_service_keeping_sigterm,
    stop_now,
)
from distribute.runtime.service import EXIT_WORKER_LOST, ServiceProcess
from distribute.runtime.watchdog import Watchdog

logger = logging.getLogger("distribute")


def join(cluster: Cluster, timeout_seconds: float) -> Any:
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
            f"MultiWorkerMirroredStrategy for {cluster.names[cluster.worker_id]} of {cluster.num_workers} "
            "workers (TF_CONFIG or the cluster resolver) must be created before JAX starts its backend "
            "(before any jax.devices() call or computation), since jax.distributed must join the workers "
            "first. A strategy created earlier in this process without TF_CONFIG (it trains this process "
            "alone) starts that backend too. Set TF_CONFIG before creating the first strategy, at the start "
            "of the program."
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
    waiting = JoinWait(cluster, seconds)
    waiting.start()
    try:
        state.client.connect()
    except Exception as err:
        raise WorkerLostError(
            f"{cluster.names[cluster.worker_id]} could not join the cluster within {seconds} s: "
            f"{missing_text(cluster, range(cluster.num_workers))} did not connect to the "
            f"coordinator at {cluster.coordinator} ({err}). Start every worker, or raise "
            "CommunicationOptions.timeout_seconds."
        ) from err
    finally:
        waiting.cancel()
    start_preemption_service_keeping_sigterm(state)
    watchdog = Watchdog(state.client, cluster, timeout_seconds)
    watchdog.start()
    fail_fast_on_unhandled_exceptions(cluster, watchdog)
    fail_fast_on_exit(cluster, watchdog)
    return state.client


def never_joined(cluster: Cluster, seconds: int) -> None:
    """Runs when the cluster has not formed within the timeout (the main thread is blocked inside jaxlib)."""
    role = ("it hosts the coordination service and" if cluster.worker_id == 0
            else f"the coordinator at {cluster.coordinator} or")
    stop_now(
        f"MultiWorkerMirroredStrategy on {cluster.names[cluster.worker_id]}: the cluster did not form within "
        f"{seconds} s (CommunicationOptions.timeout_seconds): {role} "
        f"{missing_text(cluster, range(cluster.num_workers))} never joined. Start every worker "
        "(same TF_CONFIG cluster, reachable addresses), or raise the timeout.",
        EXIT_WORKER_LOST,
    )




JOIN_REPORT_SECONDS = 30.0  # while the cluster forms, who is still missing is said this often (a third of a short timeout)


class JoinWait(threading.Thread):
    """While this worker waits for the cluster to form: every ~30 s a warning naming who is still missing and
    where; at the timeout, ``never_joined`` (the main thread is blocked inside jaxlib meanwhile)."""

    def __init__(self, cluster: Cluster, seconds: int):
        super().__init__(name="distribute-join-wait", daemon=True)
        self._cluster, self._seconds = cluster, seconds
        self._period = min(JOIN_REPORT_SECONDS, seconds / 3)
        self._stopped = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self._stopped.wait(max(min(self._period, self._seconds - (time.monotonic() - start)), 0.0)):
            waited = time.monotonic() - start
            if waited >= self._seconds:
                never_joined(self._cluster, self._seconds)
                return
            logger.warning(_still_missing(self._cluster, waited, self._seconds))

    def cancel(self) -> None:
        self._stopped.set()


def _still_missing(cluster: Cluster, waited: float, seconds: int) -> str:
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
    if not address:
        return False
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except OSError:
        return False
