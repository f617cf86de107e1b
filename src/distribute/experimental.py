"""``distribute.experimental``: the names of ``tf.distribute.experimental``."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CentralStorageStrategy": "distribute.central_storage",
    "CommunicationImplementation": "distribute.multi_worker",
    "CommunicationOptions": "distribute.multi_worker",
    "MultiWorkerMirroredStrategy": "distribute.multi_worker",
    "CollectiveCommunication": "distribute.multi_worker",
    "TPUStrategy": "distribute.tpu",
    "ParameterServerStrategy": "distribute.parameter_server.strategy",
    "ValueContext": "distribute.strategy",
    "Sharding": "distribute.sharding",
    "PreemptionCheckpointHandler": "distribute.checkpoint.preemption",
    "TerminationConfig": "distribute.checkpoint.preemption",
    "RayTrainElasticState": "distribute.runtime.ray_train_elastic",  # beyond TF; imports Ray
}
_ALIASES = {"CollectiveCommunication": "CommunicationImplementation"}
_SUBMODULES = {"partitioners": "distribute.parameter_server.partitioners", "coordinator": "distribute.coordinator"}

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
        globals()[name] = value
        return value
    if name not in _EXPORTS:
        raise AttributeError(f"module 'distribute.experimental' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), _ALIASES.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
