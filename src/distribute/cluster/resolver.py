"""ClusterResolver (the abstract base) and SimpleClusterResolver.

Match tensorflow/python/distribute/cluster_resolver/cluster_resolver.py.
"""

from __future__ import annotations

import abc

import distribute.cluster.roles as roles
from distribute.cluster.cluster_spec import ClusterSpec

__all__ = ["ClusterResolver", "SimpleClusterResolver", "format_master_url"]


def format_master_url(master: str, rpc_layer: str | None = None) -> str:
    """Returns `rpc_layer://master`, or `master` when `rpc_layer` is empty (as TF)."""
    return f"{rpc_layer}://{master}" if rpc_layer else master


class ClusterResolver(abc.ABC):
    """Abstract base of every cluster resolver, as `tf.distribute.cluster_resolver.ClusterResolver`.

    A resolver tells a process which cluster it belongs to (`cluster_spec()`)
    and which task it is (`task_type`, `task_id`). Subclasses implement
    `cluster_spec` and `master`, and either set `self._task_type`,
    `self._task_id`, `self._rpc_layer` (so the base getters and setters work, as
    in TF) or override those properties.
    """

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """Returns the current cluster as a `ClusterSpec`."""
        raise NotImplementedError

    @abc.abstractmethod
    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """Returns the address of the given task (TF: the session master, TF 1.x)."""
        raise NotImplementedError

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: object = None) -> dict[str, int]:
        """Returns a map from accelerator type to count for a task.

        TF's base class lists the devices of a running session. Querying JAX
        here would start its backend before `jax.distributed.initialize`, which
        must come first, so this base returns `{}` (what TF returns on a machine
        without accelerators); strategies count `jax.local_devices()` after
        initialization. `SimpleClusterResolver` and `SlurmClusterResolver`
        return their configured counts, as in TF.

        Args:
            task_type: Unused here.
            task_id: Unused here.
            config_proto: Unused (TF's session config).

        Returns:
            A dict such as `{"GPU": 2}`; `{}` here.
        """
        del task_type, task_id, config_proto
        return {}

    @property
    def environment(self) -> str:
        """The environment TF runs in: "google" or "" (always "" here, as TF outside Google)."""
        return ""

    @property
    def task_type(self) -> str | None:
        """This task's job: 'chief', 'worker', 'ps' or 'evaluator'; None if unknown."""
        return getattr(self, "_task_type", None)

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """This task's index within its job; None if unknown."""
        return getattr(self, "_task_id", None)

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        """The protocol between tasks, e.g. 'grpc' (recorded, not used by JAX)."""
        return getattr(self, "_rpc_layer", None)

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def is_chief(self) -> bool:
        """Whether this task is the chief, as TF's `multi_worker_util.is_chief`.

        The 'chief' task is chief; without a chief job, worker 0 is; the
        evaluator is its own chief. With no cluster (local training), or a
        single-task cluster and no task named, this process is chief.

        Raises:
            ValueError: If the cluster has several tasks and this resolver does
                not know which one it is, or the task is not in the cluster.
        """
        spec = self.cluster_spec()
        if not spec:
            return True
        if self.task_type is None or self.task_id is None:
            if sum(spec.num_tasks(job) for job in spec.jobs) <= 1:
                return True
            raise ValueError(
                f"{type(self).__name__} has task_type={self.task_type!r}, "
                f"task_id={self.task_id!r} but the cluster {spec!r} has several tasks, "
                "so it cannot tell whether this task is the chief; set task_type and "
                "task_id (TF_CONFIG's 'task')."
            )
        return roles.is_chief(spec, self.task_type, self.task_id)


class SimpleClusterResolver(ClusterResolver):
    """A resolver that returns exactly what it is given, as TF's `SimpleClusterResolver`.

    Example (on worker 1 of two)::

        spec = ClusterSpec({"worker": ["w0.example.com:2222", "w1.example.com:2222"]})
        resolver = SimpleClusterResolver(spec, task_type="worker", task_id=1,
                                         num_accelerators={"GPU": 8}, rpc_layer="grpc")

    Args:
        cluster_spec: The cluster, a `ClusterSpec`.
        master: Returned by `master()` when no task is given (TF 1.x's session master).
        task_type: This task's job.
        task_id: This task's index in its job.
        environment: "google" or "" (as TF).
        num_accelerators: Returned by `num_accelerators()`, e.g. `{"GPU": 8}`;
            None means `{}`.
        rpc_layer: The protocol, e.g. 'grpc', used by `master()`.

    Raises:
        TypeError: If `cluster_spec` is not a `ClusterSpec` or `master` not a
            string (as TF).
    """

    def __init__(self, cluster_spec: ClusterSpec, master: str = "",
                 task_type: str | None = None, task_id: int | None = None,
                 environment: str = "", num_accelerators: dict[str, int] | None = None,
                 rpc_layer: str | None = None):
        if not isinstance(cluster_spec, ClusterSpec):
            raise TypeError(
                f"cluster_spec must be a ClusterSpec, got {type(cluster_spec).__name__} "
                f"{cluster_spec!r}; wrap it: SimpleClusterResolver(ClusterSpec({cluster_spec!r}))."
            )
        if not isinstance(master, str):
            raise TypeError(f"master must be a string, got {master!r}; pass e.g. master=''.")
        self._cluster_spec = cluster_spec
        self._master = master
        self._task_type = task_type
        self._task_id = task_id
        self._environment = environment
        self._num_accelerators = num_accelerators
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """Returns the `ClusterSpec` given to the constructor."""
        return self._cluster_spec

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """Returns the address of (`task_type`, `task_id`), or the constructor's `master`.

        As TF: with both `task_type` and `task_id` given, the task's address from
        the cluster; otherwise the `master` string given to the constructor;
        prefixed with `rpc_layer://` (argument, else the resolver's) when set.

        Raises:
            ValueError: If the given task is not in the cluster.
        """
        if task_type is not None and task_id is not None:
            address = self._cluster_spec.task_address(task_type, task_id)
        else:
            address = self._master
        return format_master_url(address, rpc_layer or self._rpc_layer)

    @property
    def environment(self) -> str:
        """The `environment` given to the constructor."""
        return self._environment

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: object = None) -> dict[str, int]:
        """Returns the `num_accelerators` given to the constructor, or `{}` (as TF)."""
        del task_type, task_id, config_proto
        return {} if self._num_accelerators is None else dict(self._num_accelerators)
