"""The Dataset class, registered by ``dataset.py``, for the modules below it that build datasets.

``dataset.py`` composes the sources and transformations of ``_sources``, ``_more``
and ``_files``; those build new ``Dataset`` objects without importing it back.
"""

from __future__ import annotations

from typing import Any

_CLASS: list = []
_KERAS_ADAPTER_WANTED: list[bool] = [True]


def register(cls: type) -> None:
    _CLASS[:] = [cls]


def dataset_class() -> Any:
    """``distribute.data.Dataset`` (registered when ``distribute.data`` is imported)."""
    return _CLASS[0]


def without_keras_adapter() -> None:
    """This process never gives a Dataset to Keras ``fit``: building one does not load Keras for the adapter.

    A ParameterServerStrategy worker calls it: it builds datasets for the
    coordinator's programs only, and loading Keras there (seconds) delayed the
    first step (issue 27).
    """
    _KERAS_ADAPTER_WANTED[:] = [False]


def keras_adapter_wanted() -> bool:
    """Whether building a Dataset installs the Keras adapter (``without_keras_adapter``)."""
    return _KERAS_ADAPTER_WANTED[0]
