"""ParameterServerStrategy clusters for the launcher (`--num-ps`): a chief, ps and worker tasks."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping, Sequence


from distribute.launch._tasks import (
    EXIT_TIMEOUT, _POLL_SECONDS, LaunchResult, _command, _describe, _Output, _result, _Signals, _status, _stop, _Task,
    free_ports, task_environment,
)

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
    return _result(tasks, output, returncode, failed, timed_out)
