"""The Dataset class, registered by ``dataset.py``, for the modules below it that build datasets.

``dataset.py`` composes the sources and transformations of ``_sources``, ``_more``
and ``_files``; those build new ``Dataset`` objects without importing it back.
"""

from __future__ import annotations

from typing import Any

_CLASS: list = []


def register(cls: type) -> None:
    _CLASS[:] = [cls]


def dataset_class() -> Any:
    """``distribute.data.Dataset`` (registered when ``distribute.data`` is imported)."""
    return _CLASS[0]
