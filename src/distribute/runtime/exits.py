"""How a worker of a synchronous job ends: SIGTERM, a lost peer, an unhandled error, ``sys.exit(N)``.

A blocked collective cannot be interrupted from Python, so a worker that must
stop (a peer lost, its own failure) ends its process at once (``stop_now``),
after telling the others through its heartbeat key; the exit status says why
(75, ``EXIT_WORKER_LOST``: a peer was lost, relaunch). SIGTERM ends a worker as
in TF, once a checkpoint save in flight is committed.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from distribute.runtime.cluster import Cluster, missing_text
from distribute.runtime.service import EXIT_WORKER_LOST

if TYPE_CHECKING:  # pragma: no cover
    from distribute.runtime.watchdog import Watchdog

logger = logging.getLogger("distribute")


class WorkerLostError(RuntimeError):
    """A worker stopped answering within the communication timeout."""


def start_preemption_service_keeping_sigterm(state: Any) -> None:
    """Starts jax's preemption sync manager (as ``jax.distributed.initialize``), keeping SIGTERM's Python handler.

    jaxlib's preemption notifier installs its own C++ SIGTERM handler, which
    swallows the signal: a worker of a job told to stop would train on until
    SIGKILL.  As in TF, SIGTERM ends the process (after a checkpoint save in
    flight is committed, see ``end_on_sigterm``) unless the program handles
    it, e.g. through a ``PreemptionCheckpointHandler``
    (which agrees on a step through the key-value store, not through jax's
    manager; ``multihost_utils.reached_preemption_sync_point`` stays callable).
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    state.initialize_preemption_sync_manager()
    if main and previous is not None:
        signal.signal(signal.SIGTERM, end_on_sigterm if previous == signal.SIG_DFL else previous)


# Waits run before a SIGTERM ends the process (checkpoint/_storage.py registers the wait
# for an asynchronous save in flight).
BEFORE_SIGTERM_EXIT: list = []


def end_on_sigterm(signum: int, frame: Any) -> None:
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


# Run before a worker stops at once (a lost peer, an unhandled error): an elastic launch's hand-off of the
# committed state (valid whatever the reason: it is the last step this worker completed).
BEFORE_LOST_EXIT: list = []


def stop_now(message: str, code: int) -> None:
    """Logs ``message`` and ends this process at once (a blocked collective cannot be interrupted).

    The ``BEFORE_LOST_EXIT`` hooks run first.
    """
    logger.error(message)
    if code != 0:
        for hook in BEFORE_LOST_EXIT:
            try:
                hook()
            except Exception as err:  # noqa: BLE001 - the process ends anyway
                logger.error("before stopping: %r failed: %s", hook, err)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


class ExitStatus:
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
    ExitStatus.agreed = agreed


def fail_fast_on_exit(cluster: Cluster, watchdog: Watchdog) -> None:
    """A worker that calls ``sys.exit(N)`` with N != 0 leaves at once and tells the others.

    Without this it waits at jax.distributed's shutdown barrier for workers that
    are themselves blocked in a step with it: the job never ends.  Its
    heartbeat key says ``failed:N``, so every other worker stops within a
    heartbeat period naming it (and the launcher names it from its exit status).
    """
    ExitStatus.install()

    def at_exit() -> None:
        code = ExitStatus.code
        if code == 0 or ExitStatus.agreed:
            return  # every worker leaves: jax.distributed's shutdown barrier passes, as on a normal exit
        watchdog.stop(f"failed:{code}")
        stop_now(f"{cluster.names[cluster.worker_id]} exits with status {code}; the other workers stop too.", code)

    atexit.register(at_exit)  # after the watchdog's own handler, so it runs first


def fail_fast_on_unhandled_exceptions(cluster: Cluster, watchdog: Watchdog) -> None:
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
            which = missing_text(cluster, peers) if len(peers) == 1 else f"one of {missing_text(cluster, peers)}"
            stop_now(
                f"MultiWorkerMirroredStrategy on {cluster.names[cluster.worker_id]}: lost {which} inside a step: "
                f"its connection closed ({text.splitlines()[0][:200]}); the worker died. Stopping this worker "
                "too; restart the job (BackupAndRestore resumes from the last backup).",
                EXIT_WORKER_LOST,
            )
        previous(exc_type, exc, tb)
        lost = issubclass(exc_type, WorkerLostError)  # a consequence of another worker's failure: not to be reported
        if not lost:
            watchdog.stop("failed:1")  # the others stop within a heartbeat period, naming this worker
        stop_now(f"{cluster.names[cluster.worker_id]} stops on an unhandled {exc_type.__name__}; "
                  "the other workers will stop too.", EXIT_WORKER_LOST if lost else 1)

    sys.excepthook = hook


