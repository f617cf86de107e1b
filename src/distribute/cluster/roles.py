"""Task roles in a cluster: who is chief, how synchronous workers are numbered.

Matches tensorflow/python/distribute/multi_worker_util.py (`is_chief`,
`worker_count`, `id_in_cluster`, `_validate_cluster_spec`, `collective_leader`),
plus `coordinator_address`, the address `jax.distributed.initialize` is given.
"""

from __future__ import annotations

from collections.abc import Mapping

from distribute.cluster.cluster_spec import ClusterSpec

__all__ = [
    "CHIEF",
    "EVALUATOR",
    "PS",
    "TASK_TYPES",
    "WORKER",
    "coordinator_address",
    "is_chief",
    "normalize_cluster_spec",
    "num_workers",
    "validate_task",
    "worker_index",
]

CHIEF = "chief"
WORKER = "worker"
PS = "ps"
EVALUATOR = "evaluator"
TASK_TYPES = (CHIEF, WORKER, PS, EVALUATOR)
"""The task types a cluster may hold, as TF's `_validate_cluster_spec` allows."""

_VALID = "'chief', 'worker', 'ps' or 'evaluator'"


def normalize_cluster_spec(cluster_spec: ClusterSpec | Mapping) -> ClusterSpec:
    """Makes `cluster_spec` into a `ClusterSpec`, as TF's `normalize_cluster_spec`.

    Args:
        cluster_spec: A `ClusterSpec` or a dict accepted by `ClusterSpec`.

    Returns:
        A `ClusterSpec` (the same object if one was given).

    Raises:
        ValueError: If `cluster_spec` is neither (TF raises ValueError too).
    """
    if isinstance(cluster_spec, ClusterSpec):
        return cluster_spec
    if isinstance(cluster_spec, Mapping):
        return ClusterSpec(cluster_spec)
    raise ValueError(
        f"cluster_spec {cluster_spec!r} is a {type(cluster_spec).__name__}; it must be "
        "a dict or a ClusterSpec, e.g. ClusterSpec({'worker': ['host0:2222']})."
    )


def validate_task(cluster_spec: ClusterSpec | Mapping, task_type: str, task_id: int) -> None:
    """Checks that (`task_type`, `task_id`) names a task of `cluster_spec`.

    Matches TF's `multi_worker_util._validate_cluster_spec`: the task type is one
    of 'chief', 'worker', 'ps', 'evaluator' and is a job of the cluster; there is
    at most one chief and at most one evaluator; the task exists in its job.

    Args:
        cluster_spec: The cluster.
        task_type: The job of the task.
        task_id: The index of the task in its job.

    Raises:
        ValueError: If any check fails; the message names the value and the fix.
    """
    spec = normalize_cluster_spec(cluster_spec)
    if task_type not in TASK_TYPES:
        raise ValueError(
            f"Unrecognized task_type {task_type!r}; valid task types are {_VALID}. "
            "Set the task type to one of them."
        )
    if task_type not in spec.jobs:
        raise ValueError(
            f"task_type {task_type!r} is not a job of the cluster (jobs: {spec.jobs}); "
            f"add a {task_type!r} job to the cluster or use one of its jobs."
        )
    for single in (CHIEF, EVALUATOR):
        if single in spec.jobs and spec.num_tasks(single) > 1:
            raise ValueError(
                f"The cluster has {spec.num_tasks(single)} {single!r} tasks; there must "
                f"be at most one {single!r} task. "
                + ("Make the others 'worker' tasks." if single == CHIEF
                   else "Remove the others: one evaluator evaluates every checkpoint.")
            )
    if isinstance(task_id, bool) or not isinstance(task_id, int):
        raise ValueError(
            f"task_id {task_id!r} is not an integer; give the index of the task in "
            f"job {task_type!r}, e.g. 0."
        )
    indices = spec.task_indices(task_type)
    if task_id not in indices:
        raise ValueError(
            f"task_id {task_id} is out of range for job {task_type!r}, which has "
            f"task indices {indices}; use one of those."
        )


def is_chief(cluster_spec: ClusterSpec | Mapping, task_type: str, task_id: int) -> bool:
    """Returns whether the given task is the chief, as TF's `multi_worker_util.is_chief`.

    The 'chief' task is chief; without a chief job, worker 0 is. The evaluator is
    its own chief, since it runs apart from the training cluster. An empty cluster
    means local training, whose single task is chief.

    Args:
        cluster_spec: The cluster.
        task_type: The job of the task.
        task_id: The index of the task in its job.

    Returns:
        True for the chief task.

    Raises:
        ValueError: If the task is not in the cluster (see `validate_task`).
    """
    spec = normalize_cluster_spec(cluster_spec)
    if not spec:
        return True
    validate_task(spec, task_type, task_id)
    if task_type in (CHIEF, EVALUATOR):
        return True
    return CHIEF not in spec.jobs and task_type == WORKER and task_id == 0


def num_workers(cluster_spec: ClusterSpec | Mapping) -> int:
    """Returns the number of synchronous workers: chief tasks plus worker tasks.

    Matches TF's `multi_worker_util.worker_count` for a chief or worker task
    (the chief is also a worker; ps and evaluator tasks are not counted).

    Args:
        cluster_spec: The cluster.

    Returns:
        The count; 0 for a cluster without chief and worker jobs.
    """
    spec = normalize_cluster_spec(cluster_spec)
    return sum(spec.num_tasks(job) for job in (CHIEF, WORKER) if job in spec.jobs)


def worker_index(task_type: str, task_id: int, cluster_spec: ClusterSpec | Mapping) -> int:
    """Returns the global index of a synchronous worker, as TF's `id_in_cluster`.

    The chief is 0 and worker `i` is `i + 1` when a chief exists, else `i`; this is
    how MultiWorkerMirroredStrategy numbers workers, and the `process_id` given to
    `jax.distributed.initialize`. The evaluator runs in its own cluster, so its
    index is its `task_id`, as in TF.

    Example: with `{"chief": [c], "worker": [w0, w1]}`, chief 0 -> 0,
    worker 0 -> 1, worker 1 -> 2.

    Args:
        task_type: 'chief', 'worker' or 'evaluator'.
        task_id: The index of the task in its job.
        cluster_spec: The cluster.

    Returns:
        An index in `[0, num_workers(cluster_spec))` for chief and worker tasks.

    Raises:
        ValueError: If the task is not in the cluster, or is a 'ps' task (as TF:
            parameter servers are not synchronous workers).
    """
    spec = normalize_cluster_spec(cluster_spec)
    validate_task(spec, task_type, task_id)
    if task_type == CHIEF:
        return 0
    if task_type == WORKER:
        return task_id + (spec.num_tasks(CHIEF) if CHIEF in spec.jobs else 0)
    if task_type == EVALUATOR:
        return task_id
    raise ValueError(
        f"There is no worker index for task_type {task_type!r}: only 'chief', "
        "'worker' and 'evaluator' tasks take part in synchronous training; "
        "use ParameterServerStrategy for 'ps' tasks."
    )


def coordinator_address(cluster_spec: ClusterSpec | Mapping) -> str:
    """Returns the address of the task that coordinates synchronous workers.

    That is the chief if the cluster has one, else worker 0, as TF's
    `collective_leader` picks; it is the `coordinator_address` given to
    `jax.distributed.initialize`.

    Args:
        cluster_spec: The cluster.

    Returns:
        A `"host:port"` string.

    Raises:
        ValueError: If the cluster has neither a chief nor a worker 0.
    """
    spec = normalize_cluster_spec(cluster_spec)
    for job in (CHIEF, WORKER):
        if job in spec.jobs and 0 in spec.task_indices(job):
            return spec.task_address(job, 0)
    raise ValueError(
        f"The cluster {spec!r} has no 'chief' task and no 'worker' task 0, so no "
        "task can coordinate the workers; add a 'chief' job or a 'worker' job."
    )
