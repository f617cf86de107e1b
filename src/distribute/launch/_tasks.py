"""Starting, watching and stopping the tasks of a loopback cluster (`launch`): process plumbing."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any, Callable

from distribute.runtime.service import EXIT_WORKER_LOST
from distribute.cluster.ports import free_ports

EXIT_TIMEOUT = 124
_POLL_SECONDS = 0.02
_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count(=\S*)?")


@dataclasses.dataclass(frozen=True)
class TaskResult:
    """How one task ended.

    Attributes:
        task_type: 'chief' or 'worker'.
        task_id: Index within its job.
        exit_code: The process's exit status; negative `-N` when signal N ended it.
        output: This task's output lines (stdout and stderr), each prefixed.
    """

    task_type: str
    task_id: int
    exit_code: int
    output: str

    @property
    def name(self) -> str:
        """'worker 1', as in the output prefix."""
        return f"{self.task_type} {self.task_id}"


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """What `launch` returns.

    Attributes:
        returncode: The launcher's exit status: 0 when every task exited 0; else
            the first failed task's status (128 + N when signal N ended it), 124
            on timeout, 128 + N when the launcher got signal N (130 for Ctrl-C).
        tasks: One `TaskResult` per task, chief first, then workers by index.
        output: All prefixed lines, in arrival order, with the launcher's own
            `[launch] ` lines.
        failed_task: The name of the first task that exited non-zero
            ('worker 1'), or None.
        timed_out: Whether `timeout_seconds` ran out.
    """

    returncode: int
    tasks: tuple[TaskResult, ...]
    output: str
    failed_task: str | None = None
    timed_out: bool = False

    @property
    def exit_codes(self) -> dict[str, int]:
        """Exit status per task name, e.g. `{'worker 0': 0, 'worker 1': 3}`."""
        return {task.name: task.exit_code for task in self.tasks}

    def task_output(self, task_type: str, task_id: int) -> str:
        """Returns the prefixed output of one task.

        Raises:
            KeyError: If there is no such task.
        """
        for task in self.tasks:
            if (task.task_type, task.task_id) == (task_type, task_id):
                return task.output
        raise KeyError(f"no task {task_type} {task_id}; tasks: {[t.name for t in self.tasks]}")


def build_cluster(num_workers: int, chief: bool = False) -> dict[str, list[str]]:
    """Returns a loopback cluster: `num_workers` 'worker' tasks, plus one 'chief' if asked.

    As TF's `multi_worker_test_base.create_cluster_spec`, the chief is extra:
    `build_cluster(2, chief=True)` has 3 tasks.
    """
    ports = free_ports(num_workers + (1 if chief else 0))
    addresses = [f"127.0.0.1:{port}" for port in ports]
    cluster: dict[str, list[str]] = {}
    if chief:
        cluster["chief"] = [addresses.pop(0)]
    cluster["worker"] = addresses
    return cluster


def task_environment(base: Mapping[str, str], cluster: Mapping[str, list[str]], task_type: str,
                     task_id: int, devices_per_worker: int | None = None) -> dict[str, str]:
    """Returns one task's environment: `base` plus TF_CONFIG and device settings.

    Args:
        base: The environment to start from.
        cluster: The cluster, as TF_CONFIG's 'cluster'.
        task_type: This task's job.
        task_id: This task's index in its job.
        devices_per_worker: If given, the number of CPU devices the task sees:
            any `--xla_force_host_platform_device_count` in XLA_FLAGS is
            replaced, JAX_PLATFORMS is 'cpu', and an inherited
            JAX_NUM_CPU_DEVICES is set to the same number.

    Returns:
        A new dict.
    """
    env = dict(base)
    env["TF_CONFIG"] = json.dumps({"cluster": dict(cluster), "task": {"type": task_type, "index": task_id}})
    env["PYTHONUNBUFFERED"] = "1"
    if devices_per_worker is not None:
        flags = _DEVICE_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
        flags.append(f"--xla_force_host_platform_device_count={devices_per_worker}")
        env["XLA_FLAGS"] = " ".join(flags)
        env["JAX_PLATFORMS"] = "cpu"
        if "JAX_NUM_CPU_DEVICES" in env:
            env["JAX_NUM_CPU_DEVICES"] = str(devices_per_worker)
    return env


def _command(argv_or_command: Sequence[str] | str) -> list[str]:
    argv = shlex.split(argv_or_command) if isinstance(argv_or_command, str) else list(argv_or_command)
    if not argv:
        raise ValueError("argv_or_command is empty; give a script, e.g. ['train.py'], or ['-m', 'pkg.train'].")
    if argv[0] in ("-m", "-c") or argv[0].endswith(".py"):
        return [sys.executable, "-u", *argv]
    return argv


class _Output:
    """Collects prefixed lines from every task, echoing them as they arrive."""

    def __init__(self, echo: bool):
        self.echo = echo
        self.lock = threading.Lock()
        self.lines: list[str] = []
        self.by_task: dict[str, list[str]] = {}

    def add(self, line: str, task: str | None, to_stderr: bool) -> None:
        with self.lock:
            self.lines.append(line)
            if task is not None:
                self.by_task.setdefault(task, []).append(line)
            if self.echo:
                stream: IO[str] = sys.stderr if to_stderr else sys.stdout
                stream.write(line)
                stream.flush()

    def note(self, message: str) -> None:
        self.add(f"[launch] {message}\n", None, True)

    def pump(self, stream: IO[bytes], task: str, to_stderr: bool) -> None:
        prefix = f"[{task}] "
        try:
            for raw in iter(stream.readline, b""):
                text = raw.decode("utf-8", "replace").rstrip("\r\n")
                self.add(prefix + text + "\n", task, to_stderr)
        finally:
            stream.close()


class _Task:
    def __init__(self, task_type: str, task_id: int, command: list[str], env: dict[str, str],
                 output: _Output, name: str | None = None):
        self.task_type, self.task_id = task_type, task_id
        self.name = name or f"{task_type} {task_id}"
        self.proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.readers = [
            threading.Thread(target=output.pump, args=(self.proc.stdout, self.name, False), daemon=True),
            threading.Thread(target=output.pump, args=(self.proc.stderr, self.name, True), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def join_readers(self, timeout_seconds: float) -> None:
        deadline = time.monotonic() + timeout_seconds
        for reader in self.readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        if any(r.is_alive() for r in self.readers):
            # Something the task started still holds its output open: end it.
            self.signal_group(signal.SIGKILL)
            for reader in self.readers:
                reader.join(1.0)


class _Signals:
    """Records SIGINT/SIGTERM sent to the launcher while tasks run (main thread only)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, lambda s, _f: self.received.append(s))
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _stop(tasks: list[_Task], signum: int, grace_seconds: float, signals: _Signals) -> None:
    """Sends `signum` to running tasks; SIGKILLs those still running after the grace period."""
    for task in tasks:
        if task.proc.poll() is None:
            task.signal_group(signum)
    count = len(signals.received)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and len(signals.received) == count:
        if all(task.proc.poll() is not None for task in tasks):
            return
        time.sleep(_POLL_SECONDS)
    for task in tasks:
        if task.proc.poll() is None:
            task.signal_group(signal.SIGKILL)
    for task in tasks:
        try:
            task.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _let_stop_by_themselves(tasks: list[_Task], grace_seconds: float, signals: _Signals) -> None:
    """After a task failed: gives the others `grace_seconds` to stop on their own before they are signalled.

    A MultiWorkerMirroredStrategy worker stops by itself when a peer is lost,
    naming it (within its CommunicationOptions.timeout_seconds); a SIGTERM first
    would end it without that message (or start a preemption save that cannot
    complete without the lost worker).
    """
    count = len(signals.received)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and len(signals.received) == count:
        if all(task.proc.poll() is not None for task in tasks):
            return
        time.sleep(_POLL_SECONDS)


def _status(exit_code: int) -> int:
    return 128 - exit_code if exit_code < 0 else exit_code


def _describe(exit_code: int) -> str:
    if exit_code < 0:
        try:
            return f"was killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"was killed by signal {-exit_code}"
    return f"exited with code {exit_code}"


def launch(argv_or_command: Sequence[str] | str, num_workers: int, devices_per_worker: int | None = None,
           chief: bool = False, env: Mapping[str, str] | None = None, timeout_seconds: float | None = None,
           *, grace_seconds: float = 3.0, echo: bool = True) -> LaunchResult:
    """Runs one program as every task of a loopback cluster and supervises them.

    Args:
        argv_or_command: What each task runs. A script and its arguments
            (`['train.py', '--epochs', '2']`), `['-m', 'pkg.module', ...]` or
            `['-c', 'code']` run under this Python interpreter; anything else is
            a full command (`[sys.executable, 'train.py']`). A string is split
            with `shlex.split`.
        num_workers: Number of 'worker' tasks (at least 1).
        devices_per_worker: If given, CPU devices per task (see `task_environment`).
        chief: Whether to add one 'chief' task (so `num_workers + 1` tasks run).
        env: Variables set for every task on top of this process's environment.
        timeout_seconds: If given, tasks still running after this long are
            stopped and the result has `timed_out` and returncode 124.
        grace_seconds: How long stopped tasks get between SIGTERM (or a
            forwarded SIGINT) and SIGKILL; after a task failed, also how long
            the others get to stop by themselves before the SIGTERM.
        echo: Whether to print the prefixed output as it arrives.

    Returns:
        A `LaunchResult`.

    Raises:
        ValueError: If `num_workers` < 1, `devices_per_worker` < 1,
            `timeout_seconds` <= 0, or the command is empty.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers is {num_workers!r}; it must be an integer >= 1, e.g. 2.")
    if devices_per_worker is not None and (not isinstance(devices_per_worker, int) or devices_per_worker < 1):
        raise ValueError(f"devices_per_worker is {devices_per_worker!r}; it must be an integer >= 1 or None.")
    if timeout_seconds is not None and timeout_seconds <= 0:
        raise ValueError(f"timeout_seconds is {timeout_seconds!r}; it must be > 0 or None for no limit.")
    command = _command(argv_or_command)
    cluster = build_cluster(num_workers, chief)
    base = {**os.environ, **(env or {})}
    specs = [(task_type, task_id, command, task_environment(base, cluster, task_type, task_id, devices_per_worker))
             for task_type, addresses in cluster.items() for task_id in range(len(addresses))]

    def ended(tasks: list[_Task], output: _Output, signals: _Signals) -> tuple[int, _Task | None] | None:
        # A worker that stopped because another was lost (status 75) is not the cause when the lost one has
        # ended too by this poll (they end milliseconds apart).
        ended_badly = [t for t in tasks if t.proc.poll() not in (None, 0)]
        if ended_badly and all(t.proc.returncode == EXIT_WORKER_LOST for t in ended_badly):
            # Only workers that stopped for a lost peer have ended: the peer that failed may still be in its
            # interpreter's exit (it failed first, but its teardown can end later on a loaded machine). Wait a
            # moment (bounded) for it before naming a worker that only reacted to it.
            deadline = time.monotonic() + _LOST_PEER_WAIT_SECONDS
            while time.monotonic() < deadline and not any(t.proc.poll() not in (None, 0, EXIT_WORKER_LOST) for t in tasks):
                time.sleep(0.01)
            ended_badly = [t for t in tasks if t.proc.poll() not in (None, 0)]
        failed = next((t for t in ended_badly if t.proc.returncode != EXIT_WORKER_LOST), None) or next(iter(ended_badly), None)
        if failed is not None:
            others = [t.name for t in tasks if t is not failed and t.proc.poll() is None]
            output.note(f"{failed.name} {_describe(failed.proc.returncode)}; stopping "
                        f"{', '.join(others) if others else 'nothing (all others exited)'}"
                        f"{f' (SIGTERM unless they stop within {grace_seconds:g} s)' if others else ''}")
            _let_stop_by_themselves(tasks, grace_seconds, signals)
            _stop(tasks, signal.SIGTERM, grace_seconds, signals)
            return _status(failed.proc.returncode), failed
        return (0, None) if all(t.proc.poll() == 0 for t in tasks) else None

    return supervise(specs, ended, _Output(echo), timeout_seconds, grace_seconds)


# How long the launcher waits, once only status-75 workers have ended, for the peer they lost to end too.
_LOST_PEER_WAIT_SECONDS = 1.0


def supervise(specs: list[tuple[str, int, list[str], dict[str, str]]], ended: Callable[..., Any], output: _Output,
              timeout_seconds: float | None, grace_seconds: float) -> LaunchResult:
    """Starts a task per ``(task_type, task_id, command, env)`` and polls them until the job ends.

    The job ends when ``ended(tasks, output, signals)`` returns ``(returncode,
    failed task or None)`` (it stops what must stop), when this process gets
    SIGINT/SIGTERM (forwarded to every task: 128 + N), or at the deadline
    (SIGTERM to every task: 124).  Whatever still runs then is killed.
    """
    tasks: list[_Task] = []
    failed: _Task | None = None
    timed_out, returncode = False, 0
    with _Signals() as signals:
        try:
            for task_type, task_id, command, env in specs:
                tasks.append(_Task(task_type, task_id, command, env, output))
            deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
            while True:
                result = ended(tasks, output, signals)
                if result is not None:
                    returncode, failed = result
                    break
                if signals.received:
                    signum = signals.received[0]
                    output.note(f"got {signal.Signals(signum).name}; forwarding it to every task")
                    _stop(tasks, signum, grace_seconds, signals)
                    returncode = 128 + signum
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    running = [t.name for t in tasks if t.proc.poll() is None]
                    output.note(f"timed out after {timeout_seconds} s; stopping {', '.join(running)}")
                    _stop(tasks, signal.SIGTERM, grace_seconds, signals)
                    timed_out, returncode = True, EXIT_TIMEOUT
                    break
                time.sleep(_POLL_SECONDS)
        finally:
            _stop(tasks, signal.SIGKILL, 0.0, signals)  # no-op unless interrupted above
            for task in tasks:
                task.join_readers(2.0)
    return _result(tasks, output, returncode, failed, timed_out)


def _result(tasks: list[_Task], output: _Output, returncode: int, failed: _Task | None, timed_out: bool) -> LaunchResult:
    """The LaunchResult of ended ``tasks``, after noting every task's exit code."""
    results = tuple(
        TaskResult(t.task_type, t.task_id, t.proc.returncode, "".join(output.by_task.get(t.name, [])))
        for t in tasks
    )
    summary = ", ".join(f"{r.name}: {r.exit_code}" for r in results)
    output.note(f"exit codes: {summary}; exiting with {returncode}")
    return LaunchResult(returncode, results, "".join(output.lines),
                        failed.name if failed is not None else None, timed_out)
