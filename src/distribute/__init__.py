"""distribute: TensorFlow's tf.distribute programming model on JAX.

Pick a strategy, build model, optimizer and metrics inside ``strategy.scope()``,
then train with Keras ``model.fit`` or a custom loop
(``experimental_distribute_dataset``, ``run``, ``reduce``).

Importing the package is light: it only makes Keras use JAX; the public names
load on first use, so a program (like ``python -m distribute train --replicas 4``)
can still choose the number of CPU devices before JAX starts.
"""

from __future__ import annotations

import importlib
from typing import Any

from distribute._backend import require_jax_backend_at_import as _require_jax_backend

_require_jax_backend()

__version__ = "0.1.0"

_EXPORTS = {
    "DistributedValues": "distribute.values",
    "Mirrored": "distribute.values",
    "PerReplica": "distribute.values",
    "ReduceOp": "distribute.values",
    "BackupAndRestore": "distribute.keras_support.backup",
    "Checkpoint": "distribute.checkpoint",
    "CheckpointManager": "distribute.checkpoint",
    "latest_checkpoint": "distribute.checkpoint",
    "checkpoints_iterator": "distribute.checkpoint",
    "CrossDeviceOps": "distribute.cross_device_ops",
    "HierarchicalCopyAllReduce": "distribute.cross_device_ops",
    "NcclAllReduce": "distribute.cross_device_ops",
    "ReductionToOneDevice": "distribute.cross_device_ops",
    "InputContext": "distribute.input",
    "InputOptions": "distribute.input",
    "InputReplicationMode": "distribute.input",
    "compute_gradients": "distribute.keras_support.gradients",
    "GradientTape": "distribute.tape",
    "function": "distribute.step_function",
    "UnconnectedGradients": "distribute.tape",
    "compute_average_loss": "distribute.losses",
    "scale_regularization_loss": "distribute.losses",
    "MirroredStrategy": "distribute.mirrored",
    "ParameterServerStrategy": "distribute.parameter_server.strategy",
    "DatasetCreator": "distribute.parameter_server.dataset",
    "ShardedVariable": "distribute.parameter_server.values",
    "Server": "distribute.parameter_server.nodes",
    "MultiWorkerMirroredStrategy": "distribute.multi_worker",
    "TPUStrategy": "distribute.tpu",
    "OneDeviceStrategy": "distribute.mirrored",
    "ReplicaContext": "distribute.replica",
    "RunOptions": "distribute.spmd",
    "Strategy": "distribute.strategy",
    "StrategyExtended": "distribute.extended",
    "ValueContext": "distribute.strategy",
    "get_replica_context": "distribute.default",
    "get_strategy": "distribute.default",
    "has_strategy": "distribute.strategy",
    "in_cross_replica_context": "distribute.strategy",
}
_SUBMODULES = {"data", "cluster_resolver", "coordinator", "experimental", "checkpoint"}

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"distribute.{name}")
    else:
        raise AttributeError(f"module 'distribute' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
