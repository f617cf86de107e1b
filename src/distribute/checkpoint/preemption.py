"""Preemption checkpoints: ``distribute.experimental.PreemptionCheckpointHandler`` and ``TerminationConfig``.

Matches ``tensorflow/python/distribute/failure_handling/failure_handling.py``
(TF 2.21) for MirroredStrategy, OneDeviceStrategy and MultiWorkerMirroredStrategy
off Google's platforms: SIGTERM (or ``TerminationConfig.termination_watcher_fn``)
is the notice; every worker saves at the same ``run`` count; then the process
exits with ``sys.exit(42)`` (TF's default ``exit_fn`` there) unless an
``exit_fn`` is given.  A relaunched program restores the checkpoint when it
creates the handler, and ``total_run_calls`` continues from the saved count.

How the workers agree (TF's protocol, over the coordination service's
key-value store, see ``_preemption_sync``): the first worker to get the
notice publishes "save after run N + 1" (N: its own count), where N + 1 is one
run it has not started yet; every worker's watcher thread acknowledges it
before that run starts, so none can pass it (synchronous training keeps the
workers within one run of each other).  Each worker then saves when its own
count reaches N + 1, waits until the checkpoint is committed and every worker
has saved, and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import distribute.checkpoint._elastic as _elastic
import distribute.checkpoint._storage as _storage
from distribute.checkpoint._preemption_sync import (
    INITIAL_RUN_COUNT_KEY,
    LAST_RUN_COUNT_KEY,
    cluster_sync,
)
from distribute.checkpoint.checkpoint import Checkpoint
from distribute.checkpoint.manager import CheckpointManager, latest_checkpoint

logger = logging.getLogger("distribute")

EXIT_CODE_PREEMPTED = 42  # TF's default exit_fn off Google Cloud: sys.exit(42) (BorgTerminationConfig)
_ITERATION_VARIABLE = "checkpointed_runs"  # TF's name for the run count stored in the checkpoint
_POLL_SECONDS = 1.0  # how often termination_watcher_fn is called (TF: every second)


def _exit_preempted() -> None:
    sys.exit(EXIT_CODE_PREEMPTED)


class TerminationConfig:
    """How a :class:`PreemptionCheckpointHandler` learns of, and reacts to, a coming termination (TF's).

    Args:
        termination_watcher_fn: called about every second from a thread; returns
            True once a termination notice is available.  None: SIGTERM is the
            notice (TF's default off Google's platforms).
        exit_fn: called after the checkpoint is saved.  None: ``sys.exit(42)``
            (TF's default off Google's platforms; the launcher then exits with 42).
            A function that returns lets training go on.
        grace_period: seconds between the notice and the actual termination.
            None or 0: save and exit at once (TF's default).  > 0: save a first
            checkpoint at once, keep training, and save the final checkpoint and
            exit when about ``grace_period - 6 x (mean run time)`` has passed
            since the notice (TF's two-phase countdown).
        save_fn: called instead of ``CheckpointManager.save`` (with the arguments
            given to ``save_checkpoint_if_preempted``); None: the manager saves.

    Raises:
        TypeError: a function argument that is not callable, or a grace period
            that is not a number.
        ValueError: a negative grace period.
    """

    def __init__(self, termination_watcher_fn: Callable[[], bool] | None = None, exit_fn: Callable[[], Any] | None = None,
                 grace_period: float | None = None, save_fn: Callable[..., Any] | None = None):
        for name, fn in (("termination_watcher_fn", termination_watcher_fn), ("exit_fn", exit_fn), ("save_fn", save_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"TerminationConfig({name}={fn!r}): it must be a function (or None for TF's default).")
        if grace_period is not None:
            if isinstance(grace_period, bool) or not isinstance(grace_period, (int, float)):
                raise TypeError(f"TerminationConfig(grace_period={grace_period!r}): it must be a number of seconds, or None.")
            if grace_period < 0:
                raise ValueError(f"TerminationConfig(grace_period={grace_period!r}): it must be >= 0 seconds (0: save and exit at once).")
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn
        self.grace_period = grace_period
        self.save_fn = save_fn

    def __repr__(self) -> str:
        return (f"TerminationConfig(termination_watcher_fn={self.termination_watcher_fn!r}, exit_fn={self.exit_fn!r}, "
                f"grace_period={self.grace_period!r}, save_fn={self.save_fn!r})")


class PreemptionCheckpointHandler:
    """Saves a checkpoint on every worker when any worker is told to terminate, then exits (TF's).

    Creating the handler restores the latest checkpoint of ``checkpoint_dir``
    (or of the manager's directory), including the number of ``run`` calls made
    before, and starts watching for a termination notice (SIGTERM by default).
    After a notice to any worker, every worker saves at the same ``run`` count,
    the next run after the one the first notified worker was about to start,
    and exits (``sys.exit(42)`` by default).  Relaunched, ``total_run_calls``
    continues from the saved count, so training ends with the same weights as
    an uninterrupted run::

        strategy = distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model, optimizer = make_model(), keras.optimizers.SGD(0.1)
        checkpoint = distribute.Checkpoint(model=model, optimizer=optimizer)
        handler = distribute.experimental.PreemptionCheckpointHandler(
            strategy.cluster_resolver, checkpoint, "ckpt_dir")
        for epoch in range(handler.total_run_calls // STEPS_PER_EPOCH, EPOCHS):
            for step in range(handler.total_run_calls % STEPS_PER_EPOCH, STEPS_PER_EPOCH):
                loss = handler.run(distributed_train_step, batches[epoch][step])

    Give ``run`` a single-step function: a notice is acted on between calls.

    Args:
        cluster_resolver: the strategy's resolver (``strategy.cluster_resolver``);
            None or a one-worker cluster: a single worker.
        checkpoint_or_checkpoint_manager: a :class:`Checkpoint` (a
            ``CheckpointManager`` with ``max_to_keep=1`` is made for it in
            ``checkpoint_dir``) or a :class:`CheckpointManager` (the handler
            saves through it, so its other checkpoints share the numbering).
        checkpoint_dir: where checkpoints go; needed with a Checkpoint.
        termination_config: a :class:`TerminationConfig`; None: TF's defaults.

    Raises:
        ValueError: a Checkpoint without ``checkpoint_dir`` (TF raises
            InvalidArgumentError), or the resolver's cluster differs from the strategy's.
        TypeError: an argument of the wrong type.
        NotImplementedError: a cluster with parameter servers (as TF).
        RuntimeError: SIGTERM is the notice but the handler is created outside
            the main thread (Python handles signals there only).
    """

    def __init__(self, cluster_resolver: Any, checkpoint_or_checkpoint_manager: Checkpoint | CheckpointManager,
                 checkpoint_dir: str | None = None, termination_config: TerminationConfig | None = None):
        manager, checkpoint = _manager_and_checkpoint(checkpoint_or_checkpoint_manager, checkpoint_dir)
        if termination_config is not None and not isinstance(termination_config, TerminationConfig):
            raise TypeError(f"termination_config must be a distribute.experimental.TerminationConfig or None, got {termination_config!r}.")
        _check_resolver(cluster_resolver)
        config = termination_config or TerminationConfig()
        self._watcher_fn = config.termination_watcher_fn
        self._exit_fn = config.exit_fn or _exit_preempted
        self._grace_period = float(config.grace_period or 0)
        self._save_fn = config.save_fn
        self._cluster_resolver = cluster_resolver
        self._manager, self._checkpoint = manager, checkpoint
        self._sync = cluster_sync(checkpoint._strategy(), cluster_resolver, self._grace_period)
        self._checkpointed_runs = _run_count_variable()
        if not _tracks(checkpoint, _ITERATION_VARIABLE):
            setattr(checkpoint, _ITERATION_VARIABLE, self._checkpointed_runs)
        else:
            self._checkpointed_runs = getattr(checkpoint, _ITERATION_VARIABLE)
        self._elastic = _elastic.enabled()
        with _quiet_int64():
            held = _elastic.restore(checkpoint._objects) if self._elastic else None
            if held is None:
                self._restore()  # the disk checkpoint: the fallback when no worker handed its state over
            else:
                self._checkpointed_runs.assign(int(held[0]["step"]))
        self._run_counter = int(self._checkpointed_runs.numpy())
        self._estimated_run_time = 0.0
        self._final_checkpoint_countdown = False
        self._target_time_for_termination = 0.0
        self._received_own_sigterm = threading.Event()
        self._received_own_sigterm_time = 0.0
        self._stop_polling = threading.Event()
        self._poll_thread: threading.Thread | None = None
        if self._watcher_fn is not None:
            self._poll_thread = threading.Thread(target=self._poll_termination_signal, daemon=True,
                                                 name=f"WorkerTerminationSignalWatcher-{self._sync.id_in_cluster}")
            self._poll_thread.start()
        else:
            self._watch_sigterm()
        self._sync.start()
        if self._elastic:
            _elastic.ready()
        atexit.register(self._stop_watching)
        logger.info("PreemptionCheckpointHandler initialized or restored (total_run_calls=%d).", self._run_counter)

    # -- public API, as TF -------------------------------------------------------------------------
    @property
    def total_run_calls(self) -> int:
        """How many times ``run`` (or ``save_checkpoint_if_preempted``) was called, counting those before a restart."""
        return self._run_counter

    def run(self, distributed_train_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``distributed_train_function(*args, **kwargs)``, after saving and exiting if a termination was agreed.

        With several workers it returns once the run's result is computed (its
        arrays; every dispatched array when it returns none), as TF's call does:
        JAX dispatches asynchronously, and a worker whose host ran ahead could
        pass the run the workers agree to save at before it learns of it.

        Returns:
            What ``distributed_train_function`` returns.
        """
        self._at_run_boundary()
        self._check_preemption_and_maybe_checkpoint()
        begin = time.time()
        result = distributed_train_function(*args, **kwargs)
        self._sync.wait_for_run(result)
        self._run_counter += 1
        self._estimated_run_time += (time.time() - begin - self._estimated_run_time) / self._run_counter
        return result

    def save_checkpoint_if_preempted(self, *args: Any, **kwargs: Any) -> None:
        """Saves (with ``CheckpointManager.save(*args, **kwargs)`` or ``save_fn``) and exits if a termination was agreed.

        The alternative to ``run`` for a loop that calls its step function
        itself; each call counts as one run, as in TF.
        """
        self._at_run_boundary()
        self._check_preemption_and_maybe_checkpoint(*args, **kwargs)
        self._run_counter += 1
        self._estimated_run_time = 0.0

    def _at_run_boundary(self) -> None:
        """Under an elastic launch: commits the state of ``total_run_calls`` runs, then regroups if asked.

        At the start of a run, as TF's preemption check: the loop's own code
        after the previous run (a metric read, a variable reset at an epoch's
        end) is part of the state a new generation restores, and runs once.
        """
        if self._elastic:
            _elastic.commit(self._checkpoint._objects, {"step": self._run_counter})
            _elastic.at_step_boundary()

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """A scope for TPU training loops in TF; with these strategies it only runs the block (as TF's for MWMS).

        Preemption is handled by ``run`` and ``save_checkpoint_if_preempted``;
        an error on one worker already stops every worker (see the README's
        fault-tolerance section).
        """
        yield

    # -- the notice -----------------------------------------------------------------------------
    def _watch_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "PreemptionCheckpointHandler watches SIGTERM, which Python handles in the main thread only; "
                "create the handler in the main thread, or pass TerminationConfig(termination_watcher_fn=...)."
            )
        signal.signal(signal.SIGTERM, self._sigterm_handler_fn)

    def _sigterm_handler_fn(self, signum: int, frame: Any) -> None:
        del signum, frame
        self._set_received_own_sigterm()

    def _poll_termination_signal(self) -> None:
        while not self._stop_polling.is_set() and not self._final_checkpoint_countdown:
            if self._watcher_fn():
                self._set_received_own_sigterm()
                return
            self._stop_polling.wait(_POLL_SECONDS)

    def _set_received_own_sigterm(self) -> None:
        if not self._received_own_sigterm.is_set():
            self._received_own_sigterm_time = time.time()
            self._received_own_sigterm.set()

    # -- agreeing, saving, exiting -------------------------------------------------------------
    def _check_preemption_and_maybe_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        sync = self._sync
        if sync.step_received.is_set():
            if sync.step_to_checkpoint == self._run_counter:
                self._save_checkpoint(*args, **kwargs)
                if self._time_to_exit():
                    self._exit()
                else:
                    logger.info("PreemptionCheckpointHandler: training on for the grace period.")
                    self._final_checkpoint_countdown = True
                    sync.step_received.clear()
                    sync.countdown_started.set()
            return
        if not self._received_own_sigterm.is_set():
            return
        if self._final_checkpoint_countdown:
            if self._target_time_for_termination >= time.time():
                return
            logger.info("PreemptionCheckpointHandler: the grace period is almost over; saving the final checkpoint.")
            key = LAST_RUN_COUNT_KEY
        else:
            if not sync.claim():
                logger.info("%s got a termination notice too; the worker notified first decides when to save.", sync.name)
                self._received_own_sigterm.clear()
                return
            key = INITIAL_RUN_COUNT_KEY
        logger.info("%s got a termination notice: every worker saves a checkpoint after run %d.", sync.name, self._run_counter + 1)
        sync.publish(key, self._run_counter + 1)
        if self._grace_period > 0 and not self._final_checkpoint_countdown:
            buffer_factor = 3  # TF's margin, times 2 since some workers may still need up to 2 runs
            self._target_time_for_termination = (
                self._received_own_sigterm_time + self._grace_period - buffer_factor * self._estimated_run_time * 2)

    def _time_to_exit(self) -> bool:
        return self._grace_period <= 0 or self._final_checkpoint_countdown

    def _save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        logger.info("PreemptionCheckpointHandler: saving a checkpoint at run %d.", self._run_counter)
        with _quiet_int64():
            self._checkpointed_runs.assign(self._run_counter)
        begin = time.monotonic()
        if self._save_fn is not None:
            self._save_fn(*args, **kwargs)
        else:
            self._manager.save(*args, **kwargs)
        self._manager.wait_until_finished()
        _storage.wait_for_pending_saves()  # a save_fn's own saves too: on disk before any exit
        self._sync.all_saved(self._run_counter)
        logger.info("PreemptionCheckpointHandler: checkpoint saved in %s (%.2f s).", self._manager.directory,
                    time.monotonic() - begin)

    def _exit(self) -> None:
        self._stop_watching()
        logger.info("PreemptionCheckpointHandler: checkpoint saved. Exiting.")
        with self._sync.agreed_exit():
            self._exit_fn()

    def _stop_watching(self) -> None:
        self._stop_polling.set()
        if self._poll_thread is not None and self._poll_thread is not threading.current_thread():
            self._poll_thread.join(timeout=2 * _POLL_SECONDS)
        self._sync.stop()

    # -- restoring -----------------------------------------------------------------------------
    def _restore(self) -> None:
        """Restores the newest checkpoint of the chief's directory on every worker (else calls the manager's init_fn)."""
        directory = self._sync.chief_value(self._manager.directory)
        if directory == self._manager.directory:
            self._manager.restore_or_initialize()
            return
        latest = latest_checkpoint(directory, self._manager.checkpoint_name)
        if latest is None:
            self._manager.restore_or_initialize()
        else:
            self._checkpoint.restore(latest)


def _manager_and_checkpoint(given: Any, checkpoint_dir: str | None) -> tuple[CheckpointManager, Checkpoint]:
    if isinstance(given, CheckpointManager):
        return given, given.checkpoint
    if isinstance(given, Checkpoint):
        if not checkpoint_dir:
            raise ValueError(
                "When a checkpoint is passed, a checkpoint_dir must be passed as well: "
                "PreemptionCheckpointHandler(cluster_resolver, checkpoint, checkpoint_dir='ckpt_dir'), "
                "or pass a CheckpointManager instead."
            )
        return CheckpointManager(given, directory=checkpoint_dir, max_to_keep=1), given
    raise TypeError(
        f"checkpoint_or_checkpoint_manager must be a distribute.Checkpoint or distribute.CheckpointManager, got {given!r}."
    )


def _check_resolver(resolver: Any) -> None:
    if resolver is None:
        return
    if not hasattr(resolver, "cluster_spec"):
        raise TypeError(f"cluster_resolver must be a ClusterResolver (strategy.cluster_resolver) or None, got {resolver!r}.")
    if "ps" in resolver.cluster_spec().as_dict():
        raise NotImplementedError(
            "PreemptionCheckpointHandler does not support usage with ParameterServerStrategy (as TF); "
            "a ps cluster recovers lost workers itself (see the README's parameter-server section)."
        )


def _run_count_variable() -> Any:
    """TF's int64 ``checkpointed_runs`` variable (stored as int64; JAX without x64 holds it as int32, silently)."""
    import keras

    from distribute import _context

    with _context.outside_scope(), _quiet_int64():
        return keras.Variable(0, shape=(), dtype="int64", trainable=False, name=_ITERATION_VARIABLE)


@contextlib.contextmanager
def _quiet_int64() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Explicitly requested dtype int64")
        yield


def _tracks(checkpoint: Checkpoint, name: str) -> bool:
    try:
        getattr(checkpoint, name)
    except AttributeError:
        return False
    return True
