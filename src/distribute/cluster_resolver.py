"""``distribute.cluster_resolver``: the names of ``tf.distribute.cluster_resolver``.

Re-exports :mod:`distribute.cluster` (which never imports JAX).
"""

from distribute.cluster import (
    ClusterResolver,
    ClusterSpec,
    RayTrainClusterResolver,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
)

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "RayTrainClusterResolver",  # beyond TF: the worker group of a Ray Train job
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TPUClusterResolver",  # noqa: F822 - loaded by __getattr__ below
]


def __getattr__(name: str):
    if name == "TPUClusterResolver":  # loads JAX; only on use
        from distribute.tpu import TPUClusterResolver

        return TPUClusterResolver
    raise AttributeError(f"module 'distribute.cluster_resolver' has no attribute {name!r}")
