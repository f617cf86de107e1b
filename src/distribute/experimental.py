"""``distribute.experimental``: the names of ``tf.distribute.experimental``."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CommunicationImplementation": "distribute.multi_worker",
    "CommunicationOptions": "distribute.multi_worker",
    "MultiWorkerMirroredStrategy": "distribute.multi_worker",
    "CollectiveCommunication": "distribute.multi_worker",
    "TPUStrategy": "distribute.tpu",
    "ValueContext": "distribute.strategy",
}
_ALIASES = {"CollectiveCommunication": "CommunicationImplementation"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'distribute.experimental' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), _ALIASES.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
