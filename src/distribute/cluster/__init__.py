"""Cluster resolution: which cluster this process belongs to and which task it is.

Mirrors `tf.train.ClusterSpec` and `tf.distribute.cluster_resolver`. Nothing
here imports JAX, so a launcher or a resolver costs milliseconds.
"""

from distribute.cluster.cluster_spec import ClusterSpec
from distribute.cluster.ray_train import RayTrainClusterResolver, in_ray_train_worker
from distribute.cluster.resolver import ClusterResolver, SimpleClusterResolver, format_master_url
from distribute.cluster.roles import (
    CHIEF,
    EVALUATOR,
    PS,
    TASK_TYPES,
    WORKER,
    coordinator_address,
    is_chief,
    num_workers,
    validate_task,
    worker_index,
)
from distribute.cluster.slurm import SlurmClusterResolver, expand_hostlist, expand_tasks_per_node
from distribute.cluster.tf_config import TaskSpec, TFConfig, parse_tf_config
from distribute.cluster.tfconfig_resolver import TFConfigClusterResolver

__all__ = [
    "CHIEF",
    "EVALUATOR",
    "PS",
    "TASK_TYPES",
    "WORKER",
    "ClusterResolver",
    "ClusterSpec",
    "RayTrainClusterResolver",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfig",
    "TFConfigClusterResolver",
    "TaskSpec",
    "coordinator_address",
    "expand_hostlist",
    "expand_tasks_per_node",
    "format_master_url",
    "in_ray_train_worker",
    "is_chief",
    "num_workers",
    "parse_tf_config",
    "validate_task",
    "worker_index",
]
