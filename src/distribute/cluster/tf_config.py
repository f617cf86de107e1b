"""TF_CONFIG parsed once into frozen value objects, with every check up front.

TF_CONFIG is the JSON document TensorFlow reads to learn the cluster and this
process's task::

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
     "task": {"type": "worker", "index": 1},
     "rpc_layer": "grpc"}

TF reads it lazily and checks little (a bad index shows up much later); here
`parse_tf_config` checks the whole document at once and every error names the
key, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from distribute.cluster.cluster_spec import ClusterSpec
from distribute.cluster.roles import CHIEF, EVALUATOR, TASK_TYPES

__all__ = [
    "TFConfig",
    "TaskSpec",
    "parse_task_index",
    "parse_tf_config",
    "require_task",
    "validate_address",
]

_EXAMPLE = (
    '{"cluster": {"worker": ["host0:2222", "host1:2222"]}, '
    '"task": {"type": "worker", "index": 0}}'
)
_VALID_TYPES = "'chief', 'worker', 'ps', 'evaluator'"
_ONE_FIX = {
    CHIEF: "Make the others 'worker' tasks.",
    EVALUATOR: "Remove the others: one evaluator evaluates every checkpoint.",
}
_ADDRESS = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.%a-zA-Z]+\]|[A-Za-z0-9_.\-]+):(?P<port>\d{1,5})$")
_INTEGER = re.compile(r"^[+-]?\d+$")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """This process's task: `type` ('chief', 'worker', 'ps', 'evaluator') and `index`."""

    type: str
    index: int


@dataclasses.dataclass(frozen=True)
class TFConfig:
    """A checked TF_CONFIG.

    Attributes:
        cluster: The cluster; empty when TF_CONFIG is unset (local training).
        task: This process's task, or None when TF_CONFIG names none.
        rpc_layer: TF_CONFIG's 'rpc_layer' (e.g. 'grpc'), or None.
        session_master: TF_CONFIG's 'session_master', or None.
        environment: TF_CONFIG's 'environment' (e.g. 'cloud'), or None.
    """

    cluster: ClusterSpec = dataclasses.field(default_factory=lambda: ClusterSpec({}))
    task: TaskSpec | None = None
    rpc_layer: str | None = None
    session_master: str | None = None
    environment: str | None = None


def validate_address(address: Any, where: str) -> str:
    """Checks that `address` is a `"host:port"` string and returns it.

    Args:
        address: The value to check, e.g. 'localhost:2222' or '[::1]:2222'.
        where: What holds it, for the error, e.g. "TF_CONFIG['cluster']['worker'][1]".

    Returns:
        `address`.

    Raises:
        ValueError: If it is not a string of the form host:port with a port in
            1..65535.
    """
    match = _ADDRESS.match(address) if isinstance(address, str) else None
    if match is None or not 1 <= int(match.group("port")) <= 65535:
        raise ValueError(
            f"{where} is {address!r}, which is not a 'host:port' address; write each "
            "task as a string 'host:port' with a port in 1..65535, e.g. 'localhost:2222'."
        )
    return address


def parse_task_index(value: Any, where: str) -> int:
    """Converts a task index to an int as TF's `int(task['index'])` does.

    An int, an integral float and a string of digits ("1") are accepted, as TF
    accepts them; anything else ("one", 1.5, True, null) is rejected.

    Args:
        value: The index as given.
        where: What holds it, for the error, e.g. "TF_CONFIG['task']['index']".

    Returns:
        The index (not yet checked against a range, but never negative).

    Raises:
        ValueError: If `value` is not an integer, or is negative.
    """
    index: int | None = None
    if isinstance(value, bool):
        index = None
    elif isinstance(value, int):
        index = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        index = int(value)
    elif isinstance(value, str) and _INTEGER.match(value.strip()):
        index = int(value.strip())
    if index is None:
        raise ValueError(
            f"{where} is {value!r}, which is not an integer; give the task's index "
            "in its job as a number, e.g. 0 (a digit string such as \"1\" also works)."
        )
    if index < 0:
        raise ValueError(
            f"{where} is {index}, which is negative; task indices start at 0."
        )
    return index


def _parse_job(name: Any, tasks: Any) -> dict[int, str] | list[str]:
    where = f"TF_CONFIG['cluster'][{name!r}]"
    if name not in TASK_TYPES:
        raise ValueError(
            f"TF_CONFIG['cluster'] has a job {name!r}, which is not a task type; "
            f"use only {_VALID_TYPES} as job names."
        )
    if isinstance(tasks, list):
        if not tasks:
            raise ValueError(f"{where} is an empty list; list at least one 'host:port', or remove the job.")
        return [validate_address(a, f"{where}[{i}]") for i, a in enumerate(tasks)]
    if isinstance(tasks, Mapping) and tasks:
        # The sparse form tf.train.ClusterSpec accepts: {"1": "host:port"}.
        return {
            parse_task_index(i, f"{where} key {i!r}"): validate_address(a, f"{where}[{i!r}]")
            for i, a in tasks.items()
        }
    raise ValueError(
        f"{where} is {tasks!r}; a job must be a non-empty list of 'host:port' strings, "
        f"e.g. {{{name!r}: ['host0:2222', 'host1:2222']}}."
    )


def _parse_cluster(cluster: Any) -> ClusterSpec:
    if not isinstance(cluster, Mapping):
        raise ValueError(
            f"TF_CONFIG['cluster'] is {cluster!r}, which is not a mapping; it must map "
            f"job names to lists of 'host:port', e.g. {_EXAMPLE}."
        )
    jobs = {name: _parse_job(name, tasks) for name, tasks in cluster.items()}
    for single in (CHIEF, EVALUATOR):
        if single in jobs and len(jobs[single]) > 1:
            raise ValueError(
                f"TF_CONFIG['cluster'][{single!r}] has {len(jobs[single])} tasks; there "
                f"must be at most one {single!r}. {_ONE_FIX[single]}"
            )
    spec = ClusterSpec(jobs)
    seen: dict[str, str] = {}
    for job in spec.jobs:
        for index in spec.task_indices(job):
            address = spec.task_address(job, index)
            task = f"{job} {index}"
            if address in seen:
                raise ValueError(
                    f"TF_CONFIG['cluster'] gives address {address!r} to both {seen[address]} "
                    f"and {task}; every task needs its own 'host:port' (change one port)."
                )
            seen[address] = task
    return spec


def _parse_task(task: Any, cluster: ClusterSpec) -> TaskSpec:
    if not isinstance(task, Mapping):
        raise ValueError(
            f"TF_CONFIG['task'] is {task!r}, which is not a mapping; give it as "
            '{"type": "worker", "index": 0}.'
        )
    for key in ("type", "index"):
        if key not in task:
            raise ValueError(
                f"TF_CONFIG['task'] has no {key!r} key; give both, e.g. "
                '"task": {"type": "worker", "index": 0}.'
            )
    task_type = task["type"]
    if task_type not in TASK_TYPES:
        raise ValueError(
            f"TF_CONFIG['task']['type'] is {task_type!r}, which is not a task type; "
            f"use one of {_VALID_TYPES}."
        )
    if task_type not in cluster.jobs:
        raise ValueError(
            f"TF_CONFIG['task']['type'] is {task_type!r}, but TF_CONFIG['cluster'] has no "
            f"{task_type!r} job (jobs: {cluster.jobs}); add the job or fix the type."
        )
    index = parse_task_index(task["index"], "TF_CONFIG['task']['index']")
    indices = cluster.task_indices(task_type)
    if index not in indices:
        raise ValueError(
            f"TF_CONFIG['task']['index'] is {index}, but job {task_type!r} has "
            f"{len(indices)} task(s) with indices {indices}; use one of those."
        )
    return TaskSpec(type=task_type, index=index)


def _optional_string(config: Mapping, key: str) -> str | None:
    value = config.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(
            f"TF_CONFIG[{key!r}] is {value!r}, which is not a string; give a string "
            f"(e.g. \"grpc\" for 'rpc_layer') or leave it out."
        )
    return value


def require_task(cluster: ClusterSpec, task_type: str | None, task_id: int | None) -> None:
    """Checks that a task is named whenever the cluster has more than one task.

    TF leaves `task_type`/`task_id` as None when TF_CONFIG has no 'task'; a
    single-task cluster is then fine (TF's `master()` returns ''), but with more
    tasks no process could tell which one it is (TF's MultiWorkerMirroredStrategy
    raises "When `cluster_spec` is given, you must also specify `task_type` and
    `task_id`"), so this raises at once.

    Raises:
        ValueError: If the cluster has more than one task and either is None.
    """
    num_tasks = sum(cluster.num_tasks(job) for job in cluster.jobs)
    if num_tasks > 1 and (task_type is None or task_id is None):
        if task_type is None and task_id is None:
            missing = "TF_CONFIG has no 'task'"
        else:
            missing = f"the task {'type' if task_type is None else 'index'} is not set"
        raise ValueError(
            f"{missing}, but the cluster has {num_tasks} tasks, so this process cannot "
            "tell which one it is; set \"task\": {\"type\": \"worker\", \"index\": i} in "
            "each process's TF_CONFIG (or pass task_type= and task_id=)."
        )


def parse_tf_config(text: str | None, *, task_required: bool = True) -> TFConfig:
    """Parses and checks the text of TF_CONFIG.

    As TF, an unset TF_CONFIG (None), an empty one and `{}` mean no cluster:
    local training, `TFConfig()`. Index strings such as "1" are converted with
    `int` as TF does. Beyond TF, every structural error is caught here.

    Args:
        text: The value of the TF_CONFIG environment variable, or None.
        task_required: Whether a cluster with more than one task must name
            this process's task (see `require_task`); resolvers whose caller
            overrides the task pass False and check afterwards.

    Returns:
        A frozen `TFConfig`.

    Raises:
        ValueError: If the text is not JSON or not an object; if 'cluster' is
            missing while 'task' is given, or is not a mapping; if a job is not
            a known task type, or not a non-empty list of 'host:port' strings;
            if there are two chiefs (or two evaluators); if one address is used
            twice; if 'task' lacks 'type' or 'index', names an unknown type or a
            job not in the cluster, or its index is not an integer, negative or
            out of range; if 'task' is missing while the cluster has more than
            one task and `task_required`.
    """
    if text is None or not text.strip():
        return TFConfig()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"TF_CONFIG is not valid JSON ({e}): {text[:200]!r}; set it to a JSON "
            f"object such as {_EXAMPLE} (in a shell, quote it with single quotes)."
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"TF_CONFIG is {config!r}, which is not a JSON object; set it to an "
            f"object such as {_EXAMPLE}."
        )
    cluster_value = config.get("cluster")
    if cluster_value is None or cluster_value == {}:
        if config.get("task") is not None:
            raise ValueError(
                "TF_CONFIG has a 'task' but no 'cluster'; add the cluster every task "
                f"belongs to, e.g. {_EXAMPLE}, or unset TF_CONFIG to train locally."
            )
        cluster = ClusterSpec({})
    else:
        cluster = _parse_cluster(cluster_value)
    task = None if config.get("task") is None else _parse_task(config["task"], cluster)
    if task_required:
        require_task(cluster, *((task.type, task.index) if task else (None, None)))
    return TFConfig(
        cluster=cluster,
        task=task,
        rpc_layer=_optional_string(config, "rpc_layer"),
        session_master=_optional_string(config, "session_master"),
        environment=_optional_string(config, "environment"),
    )
