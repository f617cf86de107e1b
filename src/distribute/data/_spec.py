"""``TensorSpec`` and the rules that give every ``Dataset`` its ``element_spec``.

A spec is a structure (tuples, dicts) of ``TensorSpec`` leaves with tf.data's
meaning: ``shape`` is a tuple whose ``None`` dims vary between elements (or
``None`` for an unknown rank), ``dtype`` a numpy dtype; strings have the dtype
``np.dtype("S")`` (printed ``string``, ``tf.string`` in TensorFlow).

Sources and shape-changing transformations compute their spec statically, as
tf.data does. A function whose output shape tf.data learns by tracing (``map``,
``flat_map``, ``interleave``) is run here on two dummy inputs instead: every
``None`` dim of the input spec is 2 in the first and 3 in the second, and so
is every value (strings of 1 and 2 letters); output dims that differ between
the two runs are ``None``, as tracing would leave them. A dim that depends on
the values in a way these two inputs do not reveal (e.g. a mask that keeps
both 2s and 3s) is reported as measured on them.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

import distribute.data._structure as _structure

STRING = np.dtype("S")
DUMMY_SIZES = (2, 3)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """The type of one component of an element (``tf.TensorSpec``).

    Args:
      shape: a tuple of ints and ``None`` (unknown dims), or ``None`` for an unknown rank.
      dtype: a numpy dtype (or anything ``np.dtype`` takes; a ``tf.DType`` is
        read through its ``as_numpy_dtype``); strings are ``np.dtype("S")``.
      name: an optional name.
    """

    shape: tuple[int | None, ...] | None
    dtype: np.dtype
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(None if d is None else int(d) for d in self.shape))

    def is_compatible_with(self, value: Any) -> bool:
        """Whether ``value`` (an array or a spec) has a compatible dtype and shape."""
        other = value if isinstance(value, TensorSpec) else spec_of_value(value)
        if other.dtype != self.dtype:
            return False
        if self.shape is None or other.shape is None:
            return True
        return len(self.shape) == len(other.shape) and all(
            a is None or b is None or a == b for a, b in zip(self.shape, other.shape))

    def __repr__(self) -> str:
        return f"TensorSpec(shape={self.shape}, dtype={dtype_name(self.dtype)}, name={self.name!r})"


def as_dtype(dtype: Any) -> np.dtype:
    """Returns a numpy dtype for ``dtype``: numpy dtypes, Python types, strings, ``tf.DType``.

    Raises:
      TypeError: ``dtype`` names no numpy dtype.
    """
    numpy_dtype = getattr(dtype, "as_numpy_dtype", None)  # tf.DType
    if numpy_dtype is not None:
        dtype = numpy_dtype
    if dtype in (str, bytes, object) or getattr(dtype, "name", None) == "string":
        return STRING
    try:
        result = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype {dtype!r} is not a dtype; use a numpy dtype such as np.float32, "
                        "or str/bytes for strings.") from None
    return STRING if result.kind in "SUO" else result


def dtype_name(dtype: np.dtype) -> str:
    return "string" if dtype == STRING else dtype.name


def spec_of_value(value: Any) -> TensorSpec:
    """The spec of one leaf value (a numpy array, numpy scalar or bytes)."""
    array = np.asarray(value)
    return TensorSpec(array.shape, STRING if array.dtype.kind in "SUO" else array.dtype)


def spec_of_element(element: Any) -> Any:
    """The spec structure of one element."""
    return _structure.map_structure(spec_of_value, element)


def map_specs(fn: Callable[[TensorSpec], TensorSpec], spec: Any) -> Any:
    return _structure.map_structure(fn, spec)


def batched(spec: Any, batch_size: int | None) -> Any:
    """Prepends a batch dim (``batch_size``, or None when batches may be smaller)."""
    return map_specs(lambda s: TensorSpec(None if s.shape is None else (batch_size, *s.shape), s.dtype), spec)


def unbatched(spec: Any, what: str) -> Any:
    """Removes the first dim of every component.

    Raises:
      ValueError: a component is a scalar (there is nothing to unbatch).
    """
    def drop(s: TensorSpec) -> TensorSpec:
        if s.shape is not None and len(s.shape) == 0:
            raise ValueError(f"{what}: a component is a scalar ({s}); unbatch() needs every component to "
                             "have rank >= 1. Batch the dataset first or remove the scalar component.")
        return TensorSpec(None if s.shape is None else s.shape[1:], s.dtype)

    return map_specs(drop, spec)


def most_specific_compatible(first: Any, second: Any, what: str) -> Any:
    """The spec covering both (dims that differ become None), for ``concatenate``.

    Raises:
      TypeError: the structures or dtypes differ (tf.data raises TypeError too).
    """
    leaves_a, def_a = _structure.flatten(first)
    leaves_b, def_b = _structure.flatten(second)
    if def_a != def_b or any(a.dtype != b.dtype for a, b in zip(leaves_a, leaves_b)):
        raise TypeError(f"{what}: incompatible dataset elements: {first} and {second}; both datasets need "
                        "the same structure and dtypes. Cast one with map() first.")
    merged = []
    for a, b in zip(leaves_a, leaves_b):
        if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
            merged.append(TensorSpec(None, a.dtype))
        else:
            merged.append(TensorSpec(tuple(x if x == y else None for x, y in zip(a.shape, b.shape)), a.dtype))
    return _structure.unflatten(first, merged)


def dummy_element(spec: Any, size: int) -> Any:
    """An element matching ``spec``: ``size`` for every None dim (unknown rank: rank 1) and as every value.

    Strings are ``size - 1`` letters; booleans are True.
    """
    def make(s: TensorSpec) -> Any:
        shape = (size,) if s.shape is None else tuple(size if d is None else d for d in s.shape)
        if s.dtype == STRING:
            value = np.full(shape, b"a" * (size - 1), dtype=f"S{size - 1}")
        else:
            value = np.full(shape, size, dtype=s.dtype)
        return value[()] if value.ndim == 0 else value

    return map_specs(make, spec)


def traced_spec(fn: Callable[[Any], Any], spec: Any) -> Any:
    """The spec of ``fn``'s output, from running it on two dummy elements of ``spec`` (see the module doc).

    Raises:
      Exception: whatever ``fn`` raises on a dummy element.
    """
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        outputs = [spec_of_element(fn(dummy_element(spec, size))) for size in DUMMY_SIZES]
    return relaxed(outputs[0], outputs[1])


def relaxed(first: Any, second: Any) -> Any:
    """Specs equal except where the two runs differ (those dims become None)."""
    leaves_a, def_a = _structure.flatten(first)
    leaves_b, def_b = _structure.flatten(second)
    if def_a != def_b:
        raise TypeError(f"the function returned different structures for different input shapes: {first} "
                        f"and {second}; return one structure.")
    out = []
    for a, b in zip(leaves_a, leaves_b):
        if a.dtype != b.dtype:
            raise TypeError(f"the function returned dtype {dtype_name(a.dtype)} for one input and "
                            f"{dtype_name(b.dtype)} for another of the same dtype; return one dtype.")
        if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
            out.append(TensorSpec(None, a.dtype))
        else:
            out.append(TensorSpec(tuple(x if x == y else None for x, y in zip(a.shape, b.shape)), a.dtype))
    return _structure.unflatten(first, out)


def from_foreign(spec: Any) -> Any:
    """Converts a structure of ``tf.TensorSpec``-like specs (``shape``, ``dtype``) to ours."""
    def convert(s: Any) -> TensorSpec:
        if isinstance(s, TensorSpec):
            return s
        shape = getattr(s, "shape", None)
        try:
            dims = None if shape is None else tuple(shape)
        except (TypeError, ValueError):  # tf.TensorShape(None): unknown rank
            dims = None
        return TensorSpec(dims, s.dtype)

    return map_specs(convert, spec)
