"""TFConfigClusterResolver: the cluster and task from the TF_CONFIG environment variable.

Matches tensorflow/python/distribute/cluster_resolver/tfconfig_cluster_resolver.py,
except that TF_CONFIG is read and checked once, when the resolver is created
(TF re-reads it on every property access and checks nothing).
"""

from __future__ import annotations

import distribute.cluster._env as _env
import distribute.cluster.roles as roles
from distribute.cluster.cluster_spec import ClusterSpec
from distribute.cluster.resolver import ClusterResolver, format_master_url
from distribute.cluster.tf_config import TFConfig, parse_task_index, parse_tf_config, require_task

__all__ = ["TFConfigClusterResolver"]


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster and this process's task from TF_CONFIG.

    As `tf.distribute.cluster_resolver.TFConfigClusterResolver`, with each
    process of a two-worker cluster given, e.g.::

        TF_CONFIG='{"cluster": {"worker": ["host0:2222", "host1:2222"]},
                    "task": {"type": "worker", "index": 1}}'

    Arguments override what TF_CONFIG says. Unlike TF, the environment variable
    is read once, here, and checked completely (see `parse_tf_config`).

    Args:
        task_type: Overrides TF_CONFIG's task type.
        task_id: Overrides TF_CONFIG's task index (converted with `int`, as TF).
        rpc_layer: Overrides TF_CONFIG's 'rpc_layer'.
        environment: Returned by the `environment` property (as TF).

    Raises:
        ValueError: If TF_CONFIG is malformed (see `parse_tf_config`), if an
            override names no task of the cluster, or if the cluster has more
            than one task and neither TF_CONFIG nor the arguments say which one
            this process is.
    """

    def __init__(self, task_type: str | None = None, task_id: int | str | None = None,
                 rpc_layer: str | None = None, environment: str | None = None):
        self._init(parse_tf_config(_env.tf_config_text(), task_required=False),
                   task_type, task_id, rpc_layer, environment)

    @classmethod
    def from_tf_config(cls, tf_config: TFConfig | str | None, task_type: str | None = None,
                       task_id: int | str | None = None, rpc_layer: str | None = None,
                       environment: str | None = None) -> TFConfigClusterResolver:
        """Builds a resolver from a TF_CONFIG given directly instead of the environment.

        Args:
            tf_config: A parsed `TFConfig`, or TF_CONFIG's JSON text, or None.
            task_type: As the constructor.
            task_id: As the constructor.
            rpc_layer: As the constructor.
            environment: As the constructor.

        Returns:
            The resolver.

        Raises:
            ValueError: As the constructor.
        """
        if not isinstance(tf_config, TFConfig):
            tf_config = parse_tf_config(tf_config, task_required=False)
        resolver = cls.__new__(cls)
        resolver._init(tf_config, task_type, task_id, rpc_layer, environment)
        return resolver

    def _init(self, config: TFConfig, task_type: str | None, task_id: int | str | None,
              rpc_layer: str | None, environment: str | None) -> None:
        self._config = config
        self._task_type = None
        self._task_id = None
        self._rpc_layer = rpc_layer
        self._environment = environment
        if task_type is not None:
            self.task_type = task_type
        if task_id is not None:
            self.task_id = task_id
        if self._config.cluster:
            require_task(self._config.cluster, self.task_type, self.task_id)
            if self.task_type is not None and self.task_id is not None:
                roles.validate_task(self._config.cluster, self.task_type, self.task_id)

    @property
    def tf_config(self) -> TFConfig:
        """The parsed, checked TF_CONFIG (a frozen value)."""
        return self._config

    @property
    def task_type(self) -> str | None:
        """The task type: the override, else TF_CONFIG's `task.type`, else None."""
        if self._task_type is not None:
            return self._task_type
        return self._config.task.type if self._config.task else None

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        if task_type is not None:
            task_type = str(task_type)
            if task_type not in roles.TASK_TYPES:
                raise ValueError(
                    f"task_type {task_type!r} is not a task type; use one of "
                    f"{', '.join(map(repr, roles.TASK_TYPES))}."
                )
            cluster = self._config.cluster
            if cluster and task_type not in cluster.jobs:
                raise ValueError(
                    f"task_type {task_type!r} is not a job of the TF_CONFIG cluster "
                    f"(jobs: {cluster.jobs}); use one of those."
                )
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """The task index: the override, else TF_CONFIG's `task.index`, else None."""
        if self._task_id is not None:
            return self._task_id
        return self._config.task.index if self._config.task else None

    @task_id.setter
    def task_id(self, task_id: int | str | None) -> None:
        self._task_id = None if task_id is None else parse_task_index(task_id, "task_id")

    @property
    def rpc_layer(self) -> str | None:
        """The rpc layer: the override, else TF_CONFIG's 'rpc_layer', else None."""
        return self._rpc_layer if self._rpc_layer is not None else self._config.rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str | None:
        """The `environment` given to the constructor (as TF)."""
        return self._environment

    def cluster_spec(self) -> ClusterSpec:
        """Returns TF_CONFIG's cluster; an empty `ClusterSpec` when there is none (as TF)."""
        return self._config.cluster

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """Returns the address of a task, as TF's `TFConfigClusterResolver.master`.

        TF_CONFIG's 'session_master' wins if set; '' when the cluster is empty or
        holds a single task; otherwise the address of (`task_type`, `task_id`),
        defaulting to this task, prefixed with `rpc_layer://` when set.

        Raises:
            ValueError: If the task is not in the cluster (or is unknown).
        """
        if self._config.session_master is not None:
            return self._config.session_master
        spec = self._config.cluster
        if not spec.jobs or (len(spec.jobs) == 1 and len(spec.job_tasks(spec.jobs[0])) == 1):
            return ""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        rpc_layer = rpc_layer if rpc_layer is not None else self.rpc_layer
        return format_master_url(spec.task_address(task_type, task_id), rpc_layer)
