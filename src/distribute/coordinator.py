"""``distribute.coordinator``: the names of ``tf.distribute.coordinator`` (also ``distribute.experimental.coordinator``)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ClusterCoordinator": "distribute.parameter_server.coordinator",
    "RemoteValue": "distribute.parameter_server.values",
    "PerWorkerValues": "distribute.parameter_server.values",
    "experimental_get_current_worker_index": "distribute.parameter_server.worker_context",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'distribute.coordinator' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
