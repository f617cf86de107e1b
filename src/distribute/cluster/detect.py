"""Which cluster resolver ``MultiWorkerMirroredStrategy()`` uses when given none.

Order (documented in the README): an explicit resolver; the Ray Train worker
group when this process runs a Ray Train training function (its workers inherit
one environment, so a TF_CONFIG or Slurm variables there name no worker of the
group); ``TF_CONFIG`` when it is set; a Slurm step of several tasks (``SLURM_STEP_ID``, ``SLURM_PROCID`` and
``SLURM_STEP_NUM_TASKS`` > 1, as ``srun`` sets them, the way ``jax.distributed``
detects Slurm); else one local worker (TF's ``TFConfigClusterResolver`` with no
TF_CONFIG).
"""

from __future__ import annotations

from collections.abc import MutableMapping

import distribute.cluster._env as _env
from distribute.cluster.resolver import ClusterResolver


def in_slurm_step(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether this process is one task of a Slurm step with several tasks."""
    tasks = _env.read("SLURM_STEP_NUM_TASKS", environ)
    return (_env.read("SLURM_STEP_ID", environ) is not None and _env.read("SLURM_PROCID", environ) is not None
            and tasks is not None and tasks.isdigit() and int(tasks) > 1)


def default_resolver(environ: MutableMapping[str, str] | None = None) -> ClusterResolver:
    """RayTrainClusterResolver inside a Ray Train worker, TFConfigClusterResolver when TF_CONFIG is set,
    SlurmClusterResolver inside a multi-task Slurm step, else a one-worker TFConfigClusterResolver.

    ``environ`` (tests) replaces ``os.environ``; the Ray Train check reads no environment.
    """
    from distribute.cluster.ray_train import RayTrainClusterResolver, in_ray_train_worker, ray_train_v1_world_size
    from distribute.cluster.slurm import SlurmClusterResolver
    from distribute.cluster.tfconfig_resolver import TFConfigClusterResolver

    if in_ray_train_worker():
        return RayTrainClusterResolver()
    v1_workers = ray_train_v1_world_size()
    if v1_workers is not None and v1_workers > 1:
        raise NotImplementedError(
            f"MultiWorkerMirroredStrategy() runs in a worker of a Ray Train v1 job of {v1_workers} workers "
            "(RAY_TRAIN_V2_ENABLED=0), which it cannot take its cluster from; run the job on Ray Train v2 (the "
            "default of Ray 2.60: unset RAY_TRAIN_V2_ENABLED, use ray.train.v2.jax.JaxTrainer), or give the "
            "strategy a cluster_resolver."
        )
    if _env.tf_config_text(environ) is None and in_slurm_step(environ):
        return SlurmClusterResolver(env=environ)
    text = _env.tf_config_text(environ)
    return TFConfigClusterResolver() if environ is None or text is None else TFConfigClusterResolver.from_tf_config(text)
