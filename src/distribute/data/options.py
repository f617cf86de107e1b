"""Dataset options: ``Options``, ``DistributeOptions`` and ``AutoShardPolicy``.

Mirrors ``tf.data.Options``: every option starts unset (reading it gives its
default), ``Dataset.with_options`` merges options so that values set later win,
and setting an attribute that does not exist raises ``AttributeError``.
"""

from __future__ import annotations

import copy
import enum
from typing import Any, ClassVar

AUTOTUNE = -1
"""Lets the runtime pick a value (``tf.data.AUTOTUNE``)."""

INFINITE_CARDINALITY = -1
"""``Dataset.cardinality()`` of an infinite dataset (``tf.data.INFINITE_CARDINALITY``)."""

UNKNOWN_CARDINALITY = -2
"""``Dataset.cardinality()`` when the size is not known without iterating (``tf.data.UNKNOWN_CARDINALITY``)."""


class AutoShardPolicy(enum.IntEnum):
    """How a distributed dataset is split across workers (``tf.data.experimental.AutoShardPolicy``).

    Values equal TensorFlow's: OFF = -1 (every worker reads everything),
    AUTO = 0 (FILE if the source has files, else DATA), FILE = 1 (workers read
    different files), DATA = 2 (every worker reads all data and keeps every
    num_workers-th element), HINT = 3 (shard where ``shard(SHARD_HINT, ...)``
    is placed).
    """

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


class _OptionsBase:
    """Attribute bag that remembers which options were set explicitly."""

    _DEFAULTS: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        object.__setattr__(self, "_values", {})

    def __getattr__(self, name: str) -> Any:
        defaults = type(self)._DEFAULTS
        if name in defaults:
            value = self._values.get(name, defaults[name])
            if isinstance(value, _Factory):
                value = value.make()
                self._values[name] = value
            return value
        raise AttributeError(f"{type(self).__name__} has no option {name!r}; "
                             f"the options are {sorted(defaults)}.")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in type(self)._DEFAULTS:
            raise AttributeError(f"Cannot set the property {name!r} on {type(self).__name__}; "
                                 f"the options are {sorted(type(self)._DEFAULTS)}.")
        self._values[name] = self._validate(name, value)

    def _validate(self, name: str, value: Any) -> Any:
        return value

    def merge(self, other: _OptionsBase) -> _OptionsBase:
        """Returns a copy of ``self`` with every option set in ``other`` applied (``other`` wins)."""
        result = copy.deepcopy(self)
        for name, value in other._values.items():
            if isinstance(value, _OptionsBase):
                mine = getattr(result, name)
                result._values[name] = mine.merge(value)
            else:
                result._values[name] = value
        return result

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in type(self)._DEFAULTS)

    def __repr__(self) -> str:
        body = ", ".join(f"{n}={getattr(self, n)!r}" for n in type(self)._DEFAULTS)
        return f"{type(self).__name__}({body})"


class _Factory:
    """A default that is a fresh mutable object per Options instance."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def make(self) -> Any:
        return self.cls()


class DistributeOptions(_OptionsBase):
    """Options for distributing a dataset (``tf.data.experimental.DistributeOptions``).

    Attributes:
      auto_shard_policy: an ``AutoShardPolicy``; default ``AutoShardPolicy.AUTO``.
      num_devices: the number of devices attached to this input pipeline, or
        None (the default) to let the strategy decide.
    """

    _DEFAULTS: ClassVar[dict[str, Any]] = {"auto_shard_policy": AutoShardPolicy.AUTO,
                                           "num_devices": None}

    def _validate(self, name: str, value: Any) -> Any:
        if name == "auto_shard_policy":
            try:
                return AutoShardPolicy(value)
            except ValueError:
                raise ValueError(f"auto_shard_policy={value!r} is not an AutoShardPolicy; use one of "
                                 f"{[p.name for p in AutoShardPolicy]}, e.g. AutoShardPolicy.DATA.") from None
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"num_devices={value!r} must be a positive int or None.")
        return value


class Options(_OptionsBase):
    """Options for a dataset (``tf.data.Options``).

    Example::

        options = Options()
        options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
        dataset = dataset.with_options(options)

    Attributes:
      deterministic: whether elements must come out in a deterministic order
        (bool or None, the default). This implementation is always
        deterministic, so the option is recorded but changes nothing.
      experimental_deterministic: deprecated alias of ``deterministic``, as in
        TensorFlow.
      experimental_distribute: a ``DistributeOptions``.
    """

    _DEFAULTS: ClassVar[dict[str, Any]] = {"deterministic": None,
                                           "experimental_distribute": _Factory(DistributeOptions)}

    def __getattr__(self, name: str) -> Any:
        if name == "experimental_deterministic":
            name = "deterministic"
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "experimental_deterministic":
            name = "deterministic"
        super().__setattr__(name, value)

    def _validate(self, name: str, value: Any) -> Any:
        if name == "deterministic" and value is not None and not isinstance(value, bool):
            raise TypeError(f"deterministic={value!r} must be True, False or None.")
        if name == "experimental_distribute" and not isinstance(value, DistributeOptions):
            raise TypeError(f"experimental_distribute={value!r} must be a DistributeOptions; set its "
                            "fields instead: options.experimental_distribute.auto_shard_policy = ...")
        return value

    def merge(self, other: Options) -> Options:
        """Returns these options overridden by every option set in ``other`` (``tf.data`` merge).

        Args:
          other: an ``Options``.

        Returns:
          A new ``Options``; neither input changes.

        Raises:
          TypeError: ``other`` is not an ``Options``.
        """
        if not isinstance(other, Options):
            raise TypeError(f"with_options() needs a distribute.data.Options, got {type(other).__name__}; "
                            "build one with Options() and set its attributes.")
        result = super().merge(other)
        assert isinstance(result, Options)
        return result
