"""The synchronous workers of a job, read once from a cluster resolver (MultiWorkerMirroredStrategy's cluster)."""

from __future__ import annotations

import dataclasses
from typing import Any

import distribute.cluster.roles as roles


@dataclasses.dataclass(frozen=True)
class Cluster:
    """This job's synchronous workers, read once from a resolver.

    Attributes:
        num_workers: workers in the job; worker_id: this process's; is_chief: whether
            it writes checkpoints; coordinator: ``host:port`` of the coordination
            service (worker 0's), None for one worker; names: per worker id,
            ``"worker 1 (127.0.0.1:1234)"``.
    """

    num_workers: int
    worker_id: int
    is_chief: bool
    coordinator: str | None
    names: tuple[str, ...]  # per worker id: "worker 1 (127.0.0.1:1234)"


def read_cluster(resolver: Any) -> Cluster:
    """This job's workers from ``resolver`` (one worker when it names no cluster).

    Raises:
        ValueError: a cluster of several workers that does not say which task this
            process is, or a task that is not a chief or a worker.
    """
    spec = resolver.cluster_spec()
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type not in (None, roles.CHIEF, roles.WORKER):
        raise ValueError(
            f"MultiWorkerMirroredStrategy runs on 'chief' and 'worker' tasks, not {task_type!r}; "
            "an evaluator uses its own (single-worker) strategy, ps tasks ParameterServerStrategy."
        )
    if not spec or roles.num_workers(spec) <= 1:
        return Cluster(1, 0, True, None, ("worker 0",))
    if task_type is None or task_id is None:
        raise ValueError(
            f"The cluster {spec!r} has several workers but the resolver does not say which task "
            "this process is; set TF_CONFIG's 'task' (or task_type and task_id)."
        )
    if task_type not in (roles.CHIEF, roles.WORKER):
        raise ValueError(
            f"MultiWorkerMirroredStrategy runs on 'chief' and 'worker' tasks, not {task_type!r}; "
            "an evaluator uses its own (single-worker) strategy, ps tasks ParameterServerStrategy."
        )
    names = []
    for job in (roles.CHIEF, roles.WORKER):
        if job in spec.jobs:
            for i in sorted(spec.task_indices(job)):
                names.append(f"{job} {i} ({spec.task_address(job, i)})")
    return Cluster(
        num_workers=roles.num_workers(spec),
        worker_id=roles.worker_index(task_type, task_id, spec),
        is_chief=roles.is_chief(spec, task_type, task_id),
        coordinator=roles.coordinator_address(spec),
        names=tuple(names),
    )



def missing_text(cluster: Cluster, ids: Any) -> str:
    """The workers ``ids`` (but this one) by name, for messages."""
    return ", ".join(cluster.names[i] for i in ids if i != cluster.worker_id) or "the other workers"


