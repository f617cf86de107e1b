"""The launcher as an elastic agent (``--num-workers MIN:MAX``): generations of workers, state kept in memory.

Generation g starts k workers (MIN <= k <= MAX; k = the slots the hosts command
lists, or MAX without one) with a fresh TF_CONFIG of k workers on fresh ports,
``DISTRIBUTE_ELASTIC_GENERATION=g`` and ``DISTRIBUTE_ELASTIC_AGENT`` (this
process's in-memory store, ``runtime/elastic_store.py``).  When a worker is lost, the survivors
hand their committed state to the store and exit 75; the agent starts the next
generation with the slots available then, which restores that state.  When the
hosts command lists more slots than the generation has (and it is below MAX),
the agent sends SIGUSR1 to its workers: they stop at their next step boundary
the same way, and a larger generation starts.  Failures are counted against
``max_restarts``; regroups to grow are not.  Every generation shares a JAX
persistent compilation cache in a launcher-owned temporary directory, so a
generation of a size seen before does not compile again.

Standard library only.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

from distribute.runtime.elastic_store import StateStore
from distribute.launch._spares import Spare, program_of
from distribute.launch._tasks import (
    EXIT_TIMEOUT,
    LaunchResult,
    TaskResult,
    _command,
    _describe,
    _let_stop_by_themselves,
    _Output,
    _Signals,
    _status,
    _stop,
    _Task,
    build_cluster,
    task_environment,
)
from distribute.runtime.service import EXIT_WORKER_LOST

_POLL_SECONDS = 0.02
HOSTS_POLL_SECONDS = 1.0  # Horovod's host discovery interval
_HOSTS_COMMAND_TIMEOUT_SECONDS = 10.0
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
# How long the survivors of a lost worker get to hand off their state and stop by themselves (they stop
# within their CommunicationOptions.timeout_seconds; usually at once, when the lost worker's connection closes).
_SURVIVOR_WAIT_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """An elastic launch's sizes and limits (validated by ``parse_num_workers`` and ``launch_elastic``)."""

    min_workers: int
    max_workers: int
    max_restarts: int = 3
    hosts_command: str | None = None
    wait_seconds: float = 600.0


def parse_num_workers(text: str) -> tuple[int, int] | int:
    """``'3'`` -> 3 (a fixed-size launch); ``'2:3'`` -> (2, 3) (elastic, torchrun's MIN:MAX).

    Raises:
        ValueError: anything else, naming the value and the form.
    """
    parts = text.split(":")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(parts) not in (1, 2) or not numbers or any(n < 1 for n in numbers):
        raise ValueError(f"--num-workers is {text!r}; give N (a fixed number of workers >= 1) or MIN:MAX "
                         "(an elastic launch, 1 <= MIN <= MAX), e.g. --num-workers 2:3.")
    if len(numbers) == 1:
        return numbers[0]
    if numbers[0] > numbers[1]:
        raise ValueError(f"--num-workers is {text!r}: MIN {numbers[0]} is above MAX {numbers[1]}; "
                         f"give MIN <= MAX, e.g. --num-workers {numbers[1]}:{numbers[0]}.")
    return numbers[0], numbers[1]


def available_slots(hosts_command: str) -> int:
    """The worker slots ``hosts_command`` prints: one line per ``host`` (1 slot) or ``host:slots``.

    Raises:
        ValueError: the command fails, times out, or prints a line that is not
            ``host[:slots]`` with a local host (workers start on this machine only).
    """
    try:
        done = subprocess.run(hosts_command, shell=True, capture_output=True, text=True,
                              timeout=_HOSTS_COMMAND_TIMEOUT_SECONDS, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ValueError(f"--hosts-command {hosts_command!r} did not finish within "
                         f"{_HOSTS_COMMAND_TIMEOUT_SECONDS:g} s; it must print the available slots and exit.") from None
    if done.returncode != 0:
        raise ValueError(f"--hosts-command {hosts_command!r} exited with status {done.returncode}: "
                         f"{done.stderr.strip()[-300:]}")
    total = 0
    for line in done.stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        host, _, slots = line.partition(":")
        if not slots.strip().isdigit() and slots:
            raise ValueError(f"--hosts-command {hosts_command!r} printed {line!r}; each line must be HOST or "
                             "HOST:SLOTS with SLOTS an integer, e.g. 'localhost:2'.")
        if host not in _LOCAL_HOSTS:
            raise ValueError(f"--hosts-command {hosts_command!r} listed host {host!r}; this launcher starts "
                             f"workers on this machine only: list {' or '.join(_LOCAL_HOSTS[:2])}.")
        total += int(slots) if slots else 1
    return total


class _Slots(threading.Thread):
    """Polls the hosts command every HOSTS_POLL_SECONDS; ``count`` is the last answer (MAX without a command)."""

    def __init__(self, config: ElasticConfig, output: _Output):
        super().__init__(name="distribute-hosts", daemon=True)
        self._config, self._output = config, output
        self.count = config.max_workers if config.hosts_command is None else available_slots(config.hosts_command)
        self._stop_event = threading.Event()

    def refresh(self) -> int:
        if self._config.hosts_command is not None:
            try:
                self.count = available_slots(self._config.hosts_command)
            except ValueError as err:
                self._output.note(f"{err}; keeping the last answer ({self.count} slots)")
        return self.count

    def run(self) -> None:
        while not self._stop_event.wait(HOSTS_POLL_SECONDS):
            self.refresh()

    def stop(self) -> None:
        self._stop_event.set()


def _wait_for_slots(config: ElasticConfig, slots: _Slots, signals: _Signals, output: _Output) -> int | None:
    """The next generation's size, once at least MIN slots are listed; None when a signal came first.

    Raises:
        TimeoutError: fewer than MIN slots for ``config.wait_seconds``, naming what it waits for.
    """
    deadline = time.monotonic() + config.wait_seconds
    noted = False
    while True:
        count = slots.refresh()
        if count >= config.min_workers:
            return min(count, config.max_workers)
        if signals.received:
            return None
        if not noted:
            output.note(f"{count} worker slot(s) available, below MIN {config.min_workers}: waiting up to "
                        f"{config.wait_seconds:g} s for more (--hosts-command {config.hosts_command!r})")
            noted = True
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"waited {config.wait_seconds:g} s for {config.min_workers} worker slots (--num-workers "
                f"{config.min_workers}:{config.max_workers}); --hosts-command {config.hosts_command!r} lists {count}. "
                "Make more slots available, or lower MIN.")
        time.sleep(HOSTS_POLL_SECONDS)


def _elastic_environment(base: Mapping[str, str], store: StateStore, cache_dir: str) -> dict[str, str]:
    env = dict(base)
    env["DISTRIBUTE_ELASTIC_AGENT"] = store.address
    env.setdefault("JAX_COMPILATION_CACHE_DIR", cache_dir)
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return env


def launch_elastic(argv_or_command: Sequence[str] | str, config: ElasticConfig, devices_per_worker: int | None = None,
                   env: Mapping[str, str] | None = None, timeout_seconds: float | None = None, *,
                   grace_seconds: float = 3.0, echo: bool = True) -> LaunchResult:
    """Runs the program as generations of workers until one generation ends with every worker exiting 0.

    Args:
        argv_or_command: as ``launch``.
        config: MIN, MAX, the restart bound, the hosts command, how long to wait below MIN.
        devices_per_worker, env, timeout_seconds, grace_seconds, echo: as ``launch``.

    Returns:
        A ``LaunchResult`` whose ``tasks`` are the last generation's workers and
        whose output has every generation's lines (``[worker 1 g2] ...``).

    Raises:
        ValueError: a bad config or hosts command output.
        TimeoutError: fewer than MIN slots for ``config.wait_seconds``.
    """
    if not 1 <= config.min_workers <= config.max_workers:
        raise ValueError(f"MIN {config.min_workers} and MAX {config.max_workers}: need 1 <= MIN <= MAX.")
    if isinstance(config.max_restarts, bool) or not isinstance(config.max_restarts, int) or config.max_restarts < 0:
        raise ValueError(f"--max-restarts is {config.max_restarts!r}; it must be an integer >= 0 (default 3).")
    if not config.wait_seconds > 0:
        raise ValueError(f"--elastic-timeout-seconds is {config.wait_seconds!r}; it must be > 0.")
    command = _command(argv_or_command)
    output = _Output(echo)
    slots = _Slots(config, output)
    store = StateStore()
    cache_dir = tempfile.mkdtemp(prefix="distribute-jax-cache-")
    base = _elastic_environment({**os.environ, **(env or {})}, store, cache_dir)
    deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
    spare_env = {k: v for k, v in task_environment(base, {"worker": []}, "worker", 0, devices_per_worker).items()
                 if k != "TF_CONFIG"}
    pool: list[Spare] = []
    slots.start()
    restarts, generation = 0, 0
    try:
        with _Signals() as signals:
            while True:
                size = _wait_for_slots(config, slots, signals, output)
                if size is None:
                    return _ended([], output, 128 + signals.received[0], None, False)
                held = store.step()
                output.note(f"generation {generation}: {size} worker(s)"
                            + (f", restoring step {held} from the agent's memory" if held is not None else ""))
                outcome = _run_generation(command, size, generation, base, devices_per_worker, store, slots, config,
                                          output, signals, deadline, grace_seconds, (pool, spare_env))
                kind, tasks, code, failed = outcome
                if kind in ("done", "signal", "timeout"):
                    return _ended(tasks, output, code, failed, kind == "timeout")
                if kind == "failed":
                    restarts += 1
                    if restarts > config.max_restarts:
                        output.note(f"{failed.name} {_describe(failed.proc.returncode)}; --max-restarts "
                                    f"{config.max_restarts} used up: stopping")
                        return _ended(tasks, output, code, failed, False)
                    output.note(f"{failed.name} {_describe(failed.proc.returncode)}; restart {restarts} of "
                                f"{config.max_restarts}")
                generation += 1
                base = {**base, "DISTRIBUTE_ELASTIC_GENERATION": str(generation)}
    finally:
        for spare in pool:
            spare.discard()
        slots.stop()
        store.close()
        shutil.rmtree(cache_dir, ignore_errors=True)


def _run_generation(command: list[str], size: int, generation: int, base: dict[str, str], devices: int | None,
                    store: StateStore, slots: _Slots, config: ElasticConfig, output: _Output, signals: _Signals,
                    deadline: float | None, grace_seconds: float,
                    spares: tuple[list[Spare], dict[str, str]]) -> tuple[str, list[_Task], int, _Task | None]:
    """Runs one generation; ``(kind, tasks, returncode, failed task)`` with kind done/failed/grow/signal/timeout.

    Its workers are spares from ``spares[0]`` where there are some; once every
    worker trains, the pool is filled up to MAX for the next generation.
    """
    cluster = build_cluster(size)
    env = {**base, "DISTRIBUTE_ELASTIC_GENERATION": str(generation)}
    pool, spare_env = spares
    program = program_of(command)
    tasks: list[_Task] = []
    asked_to_grow, pool_filled = False, program is None
    try:
        for task_id in range(size):
            name, task_env = f"worker {task_id} g{generation}", task_environment(env, cluster, "worker", task_id, devices)
            while pool:
                spare = pool.pop(0)
                if spare.assign(task_id, name, {k: task_env[k] for k in ("TF_CONFIG", "DISTRIBUTE_ELASTIC_GENERATION")},
                                program or []):
                    tasks.append(spare)
                    break
                spare.discard()
            else:
                tasks.append(_Task("worker", task_id, command, task_env, output, name=name))
        while True:
            codes = [t.proc.poll() for t in tasks]
            if all(c == 0 for c in codes):
                return "done", tasks, 0, None
            bad = [t for t, c in zip(tasks, codes) if c not in (None, 0)]
            if bad:
                # The survivors hand off their state and stop by themselves (exit 75).
                _let_stop_by_themselves(tasks, _SURVIVOR_WAIT_SECONDS, signals)
                _stop(tasks, signal.SIGTERM, grace_seconds, signals)
                failed = next((t for t in bad if t.proc.returncode != EXIT_WORKER_LOST), None)
                if failed is None:
                    failed = next((t for t in tasks if t.proc.returncode not in (0, EXIT_WORKER_LOST)), None)
                if asked_to_grow and failed is None:
                    return "grow", tasks, 0, None
                failed = failed or bad[0]
                return "failed", tasks, _status(failed.proc.returncode), failed
            if signals.received:
                signum = signals.received[0]
                output.note(f"got {signal.Signals(signum).name}; forwarding it to every task")
                _stop(tasks, signum, grace_seconds, signals)
                return "signal", tasks, 128 + signum, None
            if deadline is not None and time.monotonic() >= deadline:
                output.note("timed out; stopping every worker")
                _stop(tasks, signal.SIGTERM, grace_seconds, signals)
                return "timeout", tasks, EXIT_TIMEOUT, None
            if not pool_filled and all(t.proc.pid in store.ready for t in tasks):
                pool += [Spare(spare_env, output) for _ in range(config.max_workers - len(pool))]
                pool_filled = True
            if (not asked_to_grow and size < config.max_workers and slots.count > size
                    and all(t.proc.pid in store.ready for t in tasks)):
                output.note(f"{slots.count} slots available (generation {generation} has {size}): asking the "
                            "workers to stop at their next step boundary and regroup")
                for t in tasks:
                    if t.proc.poll() is None:
                        os.kill(t.proc.pid, signal.SIGUSR1)
                asked_to_grow = True
            time.sleep(_POLL_SECONDS)
    finally:
        _stop(tasks, signal.SIGKILL, 0.0, signals)
        for task in tasks:
            task.join_readers(2.0)


def _ended(tasks: list[_Task], output: _Output, returncode: int, failed: _Task | None, timed_out: bool) -> LaunchResult:
    results = tuple(TaskResult(t.task_type, t.task_id, t.proc.returncode, "".join(output.by_task.get(t.name, [])))
                    for t in tasks)
    output.note(f"exit codes: {', '.join(f'{t.name}: {t.proc.returncode}' for t in tasks)}; exiting with {returncode}")
    return LaunchResult(returncode, results, "".join(output.lines), failed.name if failed is not None else None,
                        timed_out)
