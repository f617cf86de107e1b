"""ClusterSpec: the set of tasks in a cluster, organized into jobs.

Matches `tf.train.ClusterSpec` (tensorflow/python/training/server_lib.py),
without the `ClusterDef` protocol buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ClusterSpec"]


def _as_address(job_name: str, address: Any) -> str:
    if isinstance(address, bytes):
        return address.decode("utf-8")
    if not isinstance(address, str):
        raise TypeError(
            f"Task address {address!r} in job {job_name!r} must be a string; "
            "give each task as 'host:port', e.g. 'localhost:2222'."
        )
    return address


def _as_index(job_name: str, index: Any) -> int:
    if isinstance(index, bool):
        raise TypeError(
            f"Task index {index!r} in job {job_name!r} is a bool; task indices "
            "are non-negative integers, e.g. {0: 'host:2222'}."
        )
    try:
        value = int(index)
    except (TypeError, ValueError):
        raise ValueError(
            f"Task index {index!r} in job {job_name!r} is not an integer; task "
            "indices are non-negative integers, e.g. {0: 'host:2222'}."
        ) from None
    if value < 0:
        raise ValueError(
            f"Task index {index!r} in job {job_name!r} is negative; task indices "
            "are non-negative integers, e.g. {0: 'host:2222'}."
        )
    return value


def _job_name(job_name: Any) -> str:
    if isinstance(job_name, bytes):
        return job_name.decode("utf-8")
    if not isinstance(job_name, str):
        raise TypeError(f"Job name {job_name!r} must be a string, e.g. 'worker'.")
    return job_name


def _job_tasks(job_name: str, tasks: Any) -> dict[int, str]:
    if isinstance(tasks, (list, tuple)):
        return {i: _as_address(job_name, task) for i, task in enumerate(tasks)}
    if isinstance(tasks, Mapping):
        return {
            _as_index(job_name, i): _as_address(job_name, task)
            for i, task in tasks.items()
        }
    raise TypeError(
        f"The tasks for job {job_name!r} must be a list or a dictionary from "
        f"integers to strings, got {type(tasks).__name__} {tasks!r}; give e.g. "
        f"{{{job_name!r}: ['host0:2222', 'host1:2222']}}."
    )


class ClusterSpec:
    """Represents a cluster as a set of tasks, organized into jobs.

    Matches `tf.train.ClusterSpec`: each job maps either to a list of network
    addresses (task `i` is the `i`-th address) or to a sparse dictionary from
    task index to address. A `ClusterSpec` is immutable.

    Example:
        >>> spec = ClusterSpec({"chief": ["c0:2222"],
        ...                     "worker": ["w0:2222", "w1:2222"]})
        >>> spec.num_tasks("worker"), spec.task_address("worker", 1)
        (2, 'w1:2222')

    Args:
        cluster: A mapping from job name to a list of `"host:port"` strings or to
            a mapping `{task_index: "host:port"}` (index keys may be integer-like
            strings, as JSON gives them, converted with `int` as TF does); or
            another `ClusterSpec` (copied).

    Raises:
        TypeError: If `cluster` is not such a mapping, as TF raises.
        ValueError: If a sparse task index is not a non-negative integer.
    """

    __slots__ = ("_cluster_spec",)

    def __init__(self, cluster: Mapping[str, Sequence[str] | Mapping[int, str]] | ClusterSpec):
        if isinstance(cluster, ClusterSpec):
            spec = {job: dict(tasks) for job, tasks in cluster._cluster_spec.items()}
        elif isinstance(cluster, Mapping):
            spec = {}
            for job_name, tasks in cluster.items():
                name = _job_name(job_name)
                spec[name] = _job_tasks(name, tasks)
        else:
            raise TypeError(
                "`cluster` must be a dictionary mapping one or more job names to "
                f"lists of network addresses, got {type(cluster).__name__} "
                f"{cluster!r}; give e.g. ClusterSpec({{'worker': ['host0:2222']}})."
            )
        self._cluster_spec: dict[str, dict[int, str]] = spec

    def __bool__(self) -> bool:
        return bool(self._cluster_spec)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ClusterSpec):
            return self._cluster_spec == other._cluster_spec
        if isinstance(other, Mapping):
            # TF compares its {job: {index: address}} dict with `other`; a
            # dict in `as_dict()` form (lists) is accepted as well.
            return self._cluster_spec == other or self.as_dict() == other
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    def __hash__(self) -> int:
        return hash(
            tuple(sorted((job, tuple(sorted(tasks.items()))) for job, tasks in self._cluster_spec.items()))
        )

    def __repr__(self) -> str:
        key_values = self.as_dict()
        items = [repr(k) + ": " + repr(key_values[k]) for k in sorted(key_values)]
        return "ClusterSpec({" + ", ".join(items) + "})"

    def as_dict(self) -> dict[str, list[str | None] | dict[int, str]]:
        """Returns a dictionary from job names to their tasks.

        As TF: a job with dense task indices `0..n-1` maps to a list of
        addresses; a sparse job maps to `{index: address}`; an empty job to `{}`.

        Returns:
            A new dictionary (mutating it does not change this spec).
        """
        ret: dict[str, list[str | None] | dict[int, str]] = {}
        for job in self.jobs:
            indices = self.task_indices(job)
            if not indices:
                ret[job] = {}
            elif max(indices) + 1 == len(indices):
                ret[job] = self.job_tasks(job)
            else:
                ret[job] = {i: self.task_address(job, i) for i in indices}
        return ret

    @property
    def jobs(self) -> list[str]:
        """The job names in this cluster, in the order they were given."""
        return list(self._cluster_spec.keys())

    def _job(self, job_name: str) -> dict[int, str]:
        try:
            return self._cluster_spec[job_name]
        except KeyError:
            raise ValueError(
                f"No such job in cluster: {job_name!r}; the jobs are {self.jobs}."
            ) from None

    def num_tasks(self, job_name: str) -> int:
        """Returns the number of tasks defined in `job_name`.

        Raises:
            ValueError: If `job_name` does not name a job in this cluster (as TF).
        """
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """Returns the sorted list of valid task indices in `job_name`.

        Raises:
            ValueError: If `job_name` does not name a job in this cluster (as TF).
        """
        return sorted(self._job(job_name).keys())

    def task_address(self, job_name: str, task_index: int) -> str:
        """Returns the address of task `task_index` in job `job_name`.

        Raises:
            ValueError: If there is no such job or no such task (as TF).
        """
        job = self._job(job_name)
        try:
            return job[task_index]
        except (KeyError, TypeError):
            raise ValueError(
                f"No task with index {task_index!r} in job {job_name!r}; its task "
                f"indices are {sorted(job)}."
            ) from None

    def job_tasks(self, job_name: str) -> list[str | None]:
        """Returns the addresses of `job_name`'s tasks, indexed by task index.

        As TF, a sparse job gives `None` at indices without a task, so the list
        length may exceed `num_tasks(job_name)`.

        Raises:
            ValueError: If `job_name` does not name a job in this cluster (as TF).
        """
        job = self._job(job_name)
        if not job:
            return []
        ret: list[str | None] = [None] * (max(job) + 1)
        for i, task in job.items():
            ret[i] = task
        return ret
