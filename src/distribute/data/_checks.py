"""Argument checks for ``Dataset`` methods: each error names the value, the rule and the fix."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from distribute.data.options import AUTOTUNE


def integer(value: Any, name: str, method: str) -> int:
    """Returns ``value`` as an int, rejecting bools, floats and other types.

    Raises:
      TypeError: ``value`` is not an integer.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{method}: {name}={value!r} must be an int "
                        f"(got {type(value).__name__}); pass a whole number, e.g. {name}=32.")
    return int(value)


def positive(value: Any, name: str, method: str) -> int:
    """Returns ``value`` if it is an int >= 1.

    Raises:
      TypeError: not an int.
      ValueError: less than 1.
    """
    number = integer(value, name, method)
    if number < 1:
        raise ValueError(f"{method}: {name}={number} must be >= 1; pass a positive count.")
    return number


def count_or_all(value: Any, name: str, method: str) -> int:
    """Returns ``value`` if it is an int >= 0, or -1 meaning "all".

    Raises:
      TypeError: not an int.
      ValueError: less than -1.
    """
    number = integer(value, name, method)
    if number < -1:
        raise ValueError(f"{method}: {name}={number} must be >= 0, or -1 for all elements.")
    return number


def buffer_size(value: Any, method: str, allow_zero: bool) -> int:
    """Returns a buffer size: an int >= 1 (>= 0 if ``allow_zero``) or AUTOTUNE (-1).

    Raises:
      TypeError: not an int.
      ValueError: out of range.
    """
    number = integer(value, "buffer_size", method)
    low = 0 if allow_zero else 1
    if number != AUTOTUNE and number < low:
        raise ValueError(f"{method}: buffer_size={number} must be >= {low} or AUTOTUNE (-1); "
                         "a negative size other than AUTOTUNE has no meaning.")
    return number


def shuffle_buffer(value: Any) -> int:
    """Returns a shuffle buffer size (an int >= 1).

    Raises:
      TypeError: not an int.
      ValueError: less than 1.
    """
    number = integer(value, "buffer_size", "shuffle()")
    if number < 1:
        raise ValueError(f"shuffle(): buffer_size={number} must be >= 1; use the dataset size "
                         "(dataset.cardinality()) for a full shuffle.")
    return number


def seed(value: Any) -> int | None:
    """Returns a shuffle seed: None or an int.

    Raises:
      TypeError: not an int or None.
    """
    if value is None:
        return None
    return integer(value, "seed", "shuffle()")


def callable_arg(value: Any, name: str, method: str) -> Any:
    """Returns ``value`` if it is callable.

    Raises:
      TypeError: not callable.
    """
    if not callable(value):
        raise TypeError(f"{method}: {name} must be callable, got {type(value).__name__} ({value!r}); "
                        f"pass a function, e.g. {method.rstrip('()')}(lambda x: ...).")
    return value


def parallel_calls(value: Any) -> int | None:
    """Checks ``map(num_parallel_calls=...)``: None, AUTOTUNE or an int >= 1.

    Raises:
      TypeError: not an int or None.
      ValueError: 0 or a negative number other than AUTOTUNE.
    """
    if value is None:
        return None
    number = integer(value, "num_parallel_calls", "map()")
    if number != AUTOTUNE and number < 1:
        raise ValueError(f"map(): num_parallel_calls={number} must be >= 1, AUTOTUNE (-1) or None.")
    return number


def optional_bool(value: Any, name: str, method: str) -> bool | None:
    """Returns ``value`` if it is a bool or None.

    Raises:
      TypeError: anything else.
    """
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{method}: {name}={value!r} must be True, False or None.")
    return value


def boolean(value: Any, name: str, method: str) -> bool:
    """Returns ``value`` if it is a bool (numpy bools included).

    Raises:
      TypeError: anything else.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{method}: {name}={value!r} must be True or False.")
    return bool(value)
