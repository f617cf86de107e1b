"""Local multi-worker launcher: start N workers on loopback, each with its TF_CONFIG.

Usage::

    python -m distribute.launch --num-workers 2 [--devices-per-worker 4] [--chief]
        [--timeout-seconds 600] [--grace-seconds 3] train.py [ARGS...]
    python -m distribute.launch --num-workers 2 -m my_package.train [ARGS...]
    python -m distribute.launch --num-workers 2 --num-ps 1 train.py [ARGS...]

Every worker is the same Python program; each gets a TF_CONFIG naming the
whole cluster (free 127.0.0.1 ports) and its own task, as
`tf.distribute.cluster_resolver.TFConfigClusterResolver` expects. With
`--devices-per-worker K` each worker sees K CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=K`, `JAX_PLATFORMS=cpu`).
Output lines are prefixed with the task (`[worker 1] ...`). If one task
exits non-zero the others get a grace period to stop by themselves (a
MultiWorkerMirroredStrategy worker then names the lost one), then are stopped
(SIGTERM, then SIGKILL after the grace period) and the launcher exits non-zero naming it; Ctrl-C and SIGTERM are
forwarded to every task (a PreemptionCheckpointHandler then saves and exits;
give it `--grace-seconds` longer than a step plus a save). The exit status is
0 only when every task exits 0.

With `--num-ps N` the cluster is ParameterServerStrategy's (see
`launch_parameter_server`): a chief runs the program as the coordinator; N ps
and the workers run `distribute.Server` (`python -m distribute.parameter_server.nodes`),
which hosts their Ray actors; every task ends when the chief's program ends.

Standard library only (POSIX: tasks run in their own process groups); it never
imports JAX. `launch()` is the same launcher as a function, for tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

__all__ = ["LaunchResult", "TaskResult", "build_cluster", "build_ps_cluster", "free_ports", "launch",
           "launch_parameter_server", "main", "task_environment"]

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


def free_ports(count: int) -> list[int]:
    """Returns `count` distinct TCP ports that are free on 127.0.0.1 right now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


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
                 output: _Output):
        self.task_type, self.task_id = task_type, task_id
        self.name = f"{task_type} {task_id}"
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
    output = _Output(echo)
    tasks: list[_Task] = []
    failed: _Task | None = None
    timed_out = False
    returncode = 0
    with _Signals() as signals:
        try:
            for task_type, addresses in cluster.items():
                for task_id in range(len(addresses)):
                    task_env = task_environment(base, cluster, task_type, task_id, devices_per_worker)
                    tasks.append(_Task(task_type, task_id, command, task_env, output))
            deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
            while True:
                failed = next((t for t in tasks if t.proc.poll() not in (None, 0)), None)
                if failed is not None:
                    others = [t.name for t in tasks if t is not failed and t.proc.poll() is None]
                    output.note(f"{failed.name} {_describe(failed.proc.returncode)}; stopping "
                                f"{', '.join(others) if others else 'nothing (all others exited)'}"
                                f"{f' (SIGTERM unless they stop within {grace_seconds:g} s)' if others else ''}")
                    _let_stop_by_themselves(tasks, grace_seconds, signals)
                    _stop(tasks, signal.SIGTERM, grace_seconds, signals)
                    returncode = _status(failed.proc.returncode)
                    break
                if all(t.proc.poll() == 0 for t in tasks):
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
    results = tuple(
        TaskResult(t.task_type, t.task_id, t.proc.returncode, "".join(output.by_task.get(t.name, [])))
        for t in tasks
    )
    summary = ", ".join(f"{r.name}: {r.exit_code}" for r in results)
    output.note(f"exit codes: {summary}; exiting with {returncode}")
    return LaunchResult(returncode, results, "".join(output.lines),
                        failed.name if failed is not None else None, timed_out)


# -- ParameterServerStrategy clusters (--num-ps) -----------------------------------------------------------------
PS_HOST_COMMAND = ("-m", "distribute.parameter_server.nodes")
"""What ps and worker tasks run: `distribute.Server(TF_CONFIG).join()`, hosting their Ray actors."""


def build_ps_cluster(num_workers: int, num_ps: int) -> dict[str, list[str]]:
    """Returns a loopback ParameterServerStrategy cluster: one 'chief', `num_workers` 'worker', `num_ps` 'ps'.

    As TF's `multi_worker_test_base.create_cluster_spec(has_chief=True, ...)`; the
    chief's port becomes the Ray head's.
    """
    addresses = [f"127.0.0.1:{port}" for port in free_ports(1 + num_workers + num_ps)]
    return {"chief": addresses[:1], "worker": addresses[1:1 + num_workers], "ps": addresses[1 + num_workers:]}


def launch_parameter_server(argv_or_command: Sequence[str] | str, num_workers: int, num_ps: int,
                            env: Mapping[str, str] | None = None, timeout_seconds: float | None = None, *,
                            grace_seconds: float = 10.0, echo: bool = True) -> LaunchResult:
    """Runs a ParameterServerStrategy program on a loopback cluster: chief, workers and ps tasks.

    The chief runs the program (the coordinator: its `ParameterServerStrategy()`
    reads TF_CONFIG and starts the Ray head at the chief's address); every ps and
    worker task runs `python -m distribute.parameter_server.nodes` (TF's
    `tf.distribute.Server(...).join()`), which joins the head as the Ray node that
    hosts that task's actor.  When the chief exits, the other tasks are stopped
    (SIGTERM, SIGKILL after `grace_seconds`) and the result's returncode is the
    chief's status.  A ps or worker task that dies first is named and ends the job
    (this launcher restarts nothing).

    Args:
        argv_or_command, env, timeout_seconds, echo: as `launch`.
        num_workers: 'worker' tasks (at least 1).
        num_ps: 'ps' tasks (at least 1).
        grace_seconds: between SIGTERM and SIGKILL.

    Returns:
        A `LaunchResult`, chief first, then workers, then ps tasks.

    Raises:
        ValueError: a count below 1, `timeout_seconds` <= 0, or an empty command.
    """
    for name, value in (("num_workers", num_workers), ("num_ps", num_ps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} is {value!r}; ParameterServerStrategy needs an integer >= 1, e.g. 1.")
    if timeout_seconds is not None and timeout_seconds <= 0:
        raise ValueError(f"timeout_seconds is {timeout_seconds!r}; it must be > 0 or None for no limit.")
    command, host = _command(argv_or_command), _command(list(PS_HOST_COMMAND))
    cluster = build_ps_cluster(num_workers, num_ps)
    base = {**os.environ, **(env or {})}
    base.setdefault("RAY_AUTH_MODE", "token")  # every task's Ray agrees (Ray >= 2.59 defaults differ by role)
    output, tasks = _Output(echo), []
    failed: _Task | None = None
    timed_out, returncode = False, 0
    with _Signals() as signals:
        try:
            for task_type, addresses in cluster.items():
                for task_id in range(len(addresses)):
                    task_env = task_environment(base, cluster, task_type, task_id)
                    tasks.append(_Task(task_type, task_id, command if task_type == "chief" else host, task_env, output))
            chief, deadline = tasks[0], None if timeout_seconds is None else time.monotonic() + timeout_seconds
            while True:
                if chief.proc.poll() is not None:
                    output.note(f"chief 0 {_describe(chief.proc.returncode)}; stopping the ps and worker tasks")
                    _stop(tasks, signal.SIGTERM, grace_seconds, signals)
                    returncode = _status(chief.proc.returncode)
                    failed = chief if returncode else None
                    break
                failed = next((t for t in tasks[1:] if t.proc.poll() not in (None, 0)), None)
                if failed is not None:
                    output.note(f"{failed.name} {_describe(failed.proc.returncode)} while the chief was running; "
                                "stopping every task")
                    _stop(tasks, signal.SIGTERM, grace_seconds, signals)
                    returncode = _status(failed.proc.returncode)
                    break
                if signals.received:
                    signum = signals.received[0]
                    output.note(f"got {signal.Signals(signum).name}; forwarding it to every task")
                    _stop(tasks, signum, grace_seconds, signals)
                    returncode = 128 + signum
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    output.note(f"timed out after {timeout_seconds} s; stopping every task")
                    _stop(tasks, signal.SIGTERM, grace_seconds, signals)
                    timed_out, returncode = True, EXIT_TIMEOUT
                    break
                time.sleep(_POLL_SECONDS)
        finally:
            _stop(tasks, signal.SIGKILL, 0.0, signals)
            for task in tasks:
                task.join_readers(2.0)
    results = tuple(TaskResult(t.task_type, t.task_id, t.proc.returncode, "".join(output.by_task.get(t.name, [])))
                    for t in tasks)
    output.note(f"exit codes: {', '.join(f'{r.name}: {r.exit_code}' for r in results)}; exiting with {returncode}")
    return LaunchResult(returncode, results, "".join(output.lines), failed.name if failed is not None else None,
                        timed_out)


_VALUE_OPTIONS = ("--num-workers", "--num-ps", "--devices-per-worker", "--timeout-seconds", "--grace-seconds")


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Splits argv into the launcher's options and the program (SCRIPT... or -m MODULE...)."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return list(argv[:i]), list(argv[i + 1:])
        if token == "-m":
            return list(argv[:i]), list(argv[i:])
        if token in _VALUE_OPTIONS:
            i += 2
        elif token.startswith("-"):
            i += 1
        else:
            return list(argv[:i]), list(argv[i:])
    return list(argv), []


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m distribute.launch",
        usage="%(prog)s --num-workers N [--num-ps P] [--devices-per-worker K] [--chief] "
              "[--timeout-seconds S] [--grace-seconds S] (SCRIPT | -m MODULE) [ARGS...]",
        description="Run a program as every worker of a local (127.0.0.1) cluster, each with its TF_CONFIG.",
    )
    parser.add_argument("--num-workers", type=int, required=True, help="number of 'worker' tasks")
    parser.add_argument("--num-ps", type=int, default=None,
                        help="ParameterServerStrategy: P 'ps' tasks and a chief (the coordinator, which alone runs "
                             "the program); ps and workers host their Ray actors; stopped tasks get at least 10 s")
    parser.add_argument("--devices-per-worker", type=int, default=None,
                        help="CPU devices per task (sets XLA_FLAGS and JAX_PLATFORMS=cpu)")
    parser.add_argument("--chief", action="store_true", help="add one 'chief' task besides the workers")
    parser.add_argument("--timeout-seconds", type=float, default=None,
                        help="stop every task after this many seconds (exit status 124)")
    parser.add_argument("--grace-seconds", type=float, default=3.0,
                        help="how long stopped tasks get between SIGTERM (or a forwarded signal) and SIGKILL "
                             "(default 3; a preemption checkpoint needs a step plus a save)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (see `LaunchResult.returncode`)."""
    options, program = _split_argv(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(options)
    if not program or program == ["-m"]:
        parser.error("give the program to run: SCRIPT [ARGS...] or -m MODULE [ARGS...]")
    try:
        if args.grace_seconds < 0:
            raise ValueError(f"--grace-seconds is {args.grace_seconds!r}; it must be >= 0.")
        if args.num_ps is not None:
            result = _main_parameter_server(args, program)
        else:
            result = launch([sys.executable, "-u", *program], args.num_workers, args.devices_per_worker,
                            args.chief, timeout_seconds=args.timeout_seconds, grace_seconds=args.grace_seconds)
    except ValueError as e:
        parser.error(str(e))
    return result.returncode


def _main_parameter_server(args: argparse.Namespace, program: list[str]) -> LaunchResult:
    if args.devices_per_worker is not None or args.chief:
        raise ValueError("--num-ps cannot be combined with --devices-per-worker or --chief (a ps cluster always has "
                         "one chief, and each worker runs one replica).")
    return launch_parameter_server([sys.executable, "-u", *program], args.num_workers, args.num_ps,
                                   timeout_seconds=args.timeout_seconds, grace_seconds=max(args.grace_seconds, 10.0))


if __name__ == "__main__":
    sys.exit(main())
