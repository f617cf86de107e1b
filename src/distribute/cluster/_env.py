"""The one place where cluster resolution reads (and writes) environment variables.

Every resolver takes its environment from here, so tests can pass a plain dict
instead of touching `os.environ`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

__all__ = ["TF_CONFIG", "Watch", "read", "tf_config_text", "write"]

TF_CONFIG = "TF_CONFIG"


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def read(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Returns environment variable `name`, or None when it is unset.

    Args:
        name: The variable, e.g. 'SLURM_PROCID'.
        environ: A mapping to read instead of `os.environ` (tests use a dict).
    """
    return _environ(environ).get(name)


def tf_config_text(environ: Mapping[str, str] | None = None) -> str | None:
    """Returns the raw text of `TF_CONFIG`, or None when it is unset."""
    return read(TF_CONFIG, environ)


def write(name: str, value: str, environ: MutableMapping[str, str] | None = None) -> None:
    """Sets environment variable `name` (in `environ` when given, else `os.environ`).

    Used for `CUDA_VISIBLE_DEVICES`, which TF's SlurmClusterResolver sets.
    """
    target: MutableMapping[str, str] = os.environ if environ is None else environ
    target[name] = value


class Watch:
    """Notices when environment variable `name` changes after it was first read.

    A strategy reads its cluster (TF_CONFIG) once, at creation; a later change
    does not move it to another cluster.  `changed()` runs at every step, so it
    is one mapping look-up and a string comparison (about a microsecond).

    Args:
        name: The variable, e.g. 'TF_CONFIG'.
        environ: A mapping to read instead of `os.environ` (tests use a dict).
    """

    def __init__(self, name: str, environ: Mapping[str, str] | None = None):
        self.name = name
        self._environ = _environ(environ)
        self.first = self._environ.get(name)
        self.value = self.first

    def changed(self) -> bool:
        """Whether the variable differs from the value last seen (then `value` is the new one, None when unset)."""
        now = self._environ.get(self.name)
        if now == self.value:
            return False
        self.value = now
        return True
