"""ParameterServerStrategy clusters for the launcher (`--num-ps`): a chief, ps and worker tasks."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from distribute.launch._tasks import (
    LaunchResult, _command, _describe, _Output, _status, _stop, free_ports, supervise, task_environment,
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
    specs = [(task_type, task_id, command if task_type == "chief" else host,
              task_environment(base, cluster, task_type, task_id))
             for task_type, addresses in cluster.items() for task_id in range(len(addresses))]

    def ended(tasks: list, output: Any, signals: Any) -> tuple[int, Any] | None:
        chief = tasks[0]
        if chief.proc.poll() is not None:
            output.note(f"chief 0 {_describe(chief.proc.returncode)}; stopping the ps and worker tasks")
            _stop(tasks, signal.SIGTERM, grace_seconds, signals)
            returncode = _status(chief.proc.returncode)
            return returncode, chief if returncode else None
        failed = next((t for t in tasks[1:] if t.proc.poll() not in (None, 0)), None)
        if failed is not None:
            output.note(f"{failed.name} {_describe(failed.proc.returncode)} while the chief was running; "
                        "stopping every task")
            _stop(tasks, signal.SIGTERM, grace_seconds, signals)
            return _status(failed.proc.returncode), failed
        return None

    return supervise(specs, ended, _Output(echo), timeout_seconds, grace_seconds)
