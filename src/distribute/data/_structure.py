"""Nested element structures: conversion to numpy, flattening, stacking.

An element is a leaf (a numpy array or numpy scalar) or a nest of tuples
(namedtuples included) and dicts around leaves, as in tf.data. Python lists are
data, not structure: ``[1, 2]`` becomes one array, as ``tf.constant`` would
make it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

Element = Any
_INT32 = np.iinfo(np.int32)


def is_host_leaf(leaf: Any) -> bool:
    """Whether ``leaf`` cannot live on a device (strings, bytes, Python objects)."""
    kind = getattr(getattr(leaf, "dtype", None), "kind", None)
    if kind is None:
        return isinstance(leaf, (bytes, str))
    return kind in "SUO"


_LEAF, _TUPLE, _MAPPING = 0, 1, 2
_LEAF_TYPES = (np.ndarray, np.generic)


def _kind(value: Any) -> int:
    """Classifies a node; exact-type checks first because abc ``isinstance`` is slow."""
    kind = type(value)
    if kind is tuple:
        return _TUPLE
    if kind is dict:
        return _MAPPING
    if isinstance(value, _LEAF_TYPES):
        return _LEAF
    if isinstance(value, tuple):
        return _TUPLE
    if isinstance(value, Mapping):
        return _MAPPING
    return _LEAF


def is_structure(value: Any) -> bool:
    """Returns whether ``value`` is a tuple or dict node (not a leaf)."""
    return _kind(value) != _LEAF


def _rebuild(template: Any, children: list[Any]) -> Any:
    if type(template) is tuple:
        return tuple(children)
    if isinstance(template, Mapping):
        kind = type(template) if type(template) in (dict, collections.OrderedDict) else dict
        return kind(zip(template.keys(), children))
    if hasattr(template, "_fields"):  # namedtuple
        return type(template)(*children)
    return tuple(children)


def map_structure(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Applies ``fn`` to every leaf of ``tree``, keeping tuples and dicts."""
    kind = _kind(tree)
    if kind == _LEAF:
        return fn(tree)
    children = tree.values() if kind == _MAPPING else tree
    return _rebuild(tree, [map_structure(fn, child) for child in children])


def map_with_path(fn: Callable[[str, Any], Any], tree: Any, path: str = "") -> Any:
    """Like ``map_structure`` but ``fn`` also gets the leaf's path, e.g. ``[0]['x']``."""
    kind = _kind(tree)
    if kind == _MAPPING:
        return _rebuild(tree, [map_with_path(fn, v, f"{path}[{k!r}]") for k, v in tree.items()])
    if kind == _TUPLE:
        return _rebuild(tree, [map_with_path(fn, v, f"{path}[{i}]") for i, v in enumerate(tree)])
    return fn(path or "element", tree)


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """Returns the leaves of ``tree`` and a hashable description of its structure."""
    leaves: list[Any] = []

    def walk(node: Any) -> Any:
        kind = _kind(node)
        if kind == _MAPPING:
            return (type(node), tuple(node.keys()), tuple([walk(v) for v in node.values()]))
        if kind == _TUPLE:
            return (type(node), len(node), tuple([walk(v) for v in node]))
        leaves.append(node)
        return None

    return leaves, walk(tree)


def unflatten(template: Any, leaves: Sequence[Any]) -> Any:
    """Rebuilds ``template``'s structure around ``leaves`` (in flatten order)."""
    it = iter(leaves)
    return map_structure(lambda _: next(it), template)


def _all_numpy(tree: Any) -> bool:
    kind = _kind(tree)
    if kind == _LEAF:
        return isinstance(tree, _LEAF_TYPES) and (type(tree) is not np.ndarray or tree.dtype.kind != "U")
    children = tree.values() if kind == _MAPPING else tree
    return all(_all_numpy(child) for child in children)


def _is_python_number(value: Any) -> bool:
    """Whether ``value`` is a Python number or a (nested) list starting with one."""
    probe = value
    while isinstance(probe, list) and probe:
        probe = probe[0]
    return isinstance(probe, (int, float)) and not isinstance(probe, np.generic)


def to_numpy(value: Any, what: str = "element") -> np.ndarray | np.generic:
    """Converts one leaf to numpy the way tf.data converts values to tensors.

    Python floats become float32 and Python ints int32 (int64 when they do not
    fit), as ``tf.constant`` does; strings become bytes; numpy and JAX arrays
    keep their dtype.

    Args:
      value: the leaf.
      what: how to name the leaf in an error.

    Returns:
      A numpy array (rank >= 1) or numpy scalar.

    Raises:
      TypeError: ``value`` is None or cannot be converted to an array.
      ValueError: ``value`` is a ragged nested list.
    """
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, np.generic):
        return value
    elif value is None:
        raise TypeError(f"{what} is None; tf.data elements must be arrays or numbers. "
                        "Return or yield a value (e.g. np.zeros(0)) instead of None.")
    elif isinstance(value, str):
        return np.bytes_(value.encode("utf-8"))
    elif isinstance(value, bytes):
        return np.bytes_(value)
    else:
        arr = _convert_array_like(value, what)
    if arr.dtype.kind == "U":
        arr = np.char.encode(arr, "utf-8")
    return arr[()] if arr.ndim == 0 else arr


def _convert_array_like(value: Any, what: str) -> np.ndarray:
    is_python = _is_python_number(value)
    try:
        arr = np.asarray(value)
    except ValueError as err:
        raise ValueError(f"{what} cannot be converted to an array ({err}); nested lists must be "
                         "rectangular. Pad ragged rows to one length first.") from None
    if arr.dtype == object:
        raise TypeError(f"{what} of type {type(value).__name__} cannot be converted to a numeric "
                        "array; pass numbers, strings or numpy arrays.")
    if is_python and arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    elif is_python and arr.dtype == np.int64 and (arr.size == 0 or _INT32.min <= arr.min() <= arr.max() <= _INT32.max):
        arr = arr.astype(np.int32)
    return arr


def normalize(element: Any, what: str = "element") -> Element:
    """Converts every leaf of ``element`` with ``to_numpy`` (lists become arrays)."""
    if _all_numpy(element):
        return element
    return map_with_path(lambda path, leaf: to_numpy(leaf, f"{what}{path if path != 'element' else ''}"),
                         element)


def normalize_fn_output(value: Any) -> Element:
    """Normalizes a map function's return value; a top-level list becomes a tuple (as tf.data)."""
    if isinstance(value, list):
        value = tuple(value)
    return normalize(value, "map_func output")


def call_unpacked(fn: Callable[..., Any], element: Element) -> Any:
    """Calls ``fn`` as tf.data does: a plain tuple element is spread into positional args."""
    if type(element) is tuple:
        return fn(*element)
    return fn(element)


def copy_element(element: Element) -> Element:
    """Returns ``element`` with every array leaf copied (numpy scalars are immutable)."""
    return map_structure(lambda x: x.copy() if isinstance(x, np.ndarray) else x, element)


def stack(elements: Sequence[Element]) -> Element:
    """Stacks elements along a new first dim, as ``Dataset.batch`` does.

    Args:
      elements: one or more elements with the same structure and leaf shapes.

    Returns:
      One element of the same structure whose leaves have shape ``(len(elements), ...)``.

    Raises:
      ValueError: the elements differ in structure or in a leaf's shape.
    """
    first_leaves, first_def = flatten(elements[0])
    columns: list[list[Any]] = [[leaf] for leaf in first_leaves]
    for position, element in enumerate(elements[1:], start=1):
        leaves, treedef = flatten(element)
        if treedef != first_def:
            raise ValueError(f"batch() cannot combine elements of different structure: element 0 is "
                             f"{_describe(elements[0])} but element {position} is {_describe(element)}; "
                             "make map_func/generator return one structure.")
        for column, leaf in zip(columns, leaves):
            column.append(leaf)
    stacked = []
    for component, column in enumerate(columns):
        try:
            stacked.append(np.stack(column))
        except ValueError:
            shapes = [np.shape(x) for x in column]
            bad = next(i for i, s in enumerate(shapes) if s != shapes[0])
            raise ValueError(f"Cannot batch tensors with different shapes in component {component}: "
                             f"first element had shape {shapes[0]} and element {bad} had shape "
                             f"{shapes[bad]}; batch() needs equal shapes, so pad or resize the "
                             "elements (e.g. in map()) or use batch_size=1.") from None
    return unflatten(elements[0], stacked)


def _describe(element: Element) -> str:
    return repr(map_structure(lambda x: f"shape{np.shape(x)}", element))


def conform(element: Any, signature: Any, index: int) -> Element:
    """Checks a generator's element against ``output_signature`` and casts its leaves.

    Args:
      element: the generated value.
      signature: a structure whose leaves have ``shape`` and ``dtype``
        (``tf.TensorSpec``-like; ``None`` dims match any size).
      index: the element's position, for error messages.

    Returns:
      The element with leaves converted to the signature's dtypes.

    Raises:
      TypeError: the element's structure differs from the signature.
      ValueError: a leaf's shape is not compatible with the signature.
    """
    if isinstance(element, list) and isinstance(signature, tuple):
        element = tuple(element)
    spec_leaves, _ = flatten(signature)
    try:
        leaves = unflatten_leaves_like(signature, element)
    except (TypeError, ValueError, KeyError):
        raise TypeError(f"from_generator() element {index} has structure {_describe_raw(element)}, "
                        f"which does not match output_signature {spec_def_str(signature)}; "
                        "yield values of the declared structure.") from None
    out = []
    for position, (leaf, spec) in enumerate(zip(leaves, spec_leaves)):
        arr = np.asarray(to_numpy(leaf, f"from_generator() element {index}"), dtype=np.dtype(spec.dtype))
        shape = _spec_shape(spec)
        if shape is not None and (arr.ndim != len(shape) or any(
                want is not None and want != got for want, got in zip(shape, arr.shape))):
            raise ValueError(f"from_generator() element {index} component {position} has shape "
                             f"{arr.shape}, which is not compatible with output_signature shape "
                             f"{shape}; yield arrays of that shape or use None for variable dims.")
        out.append(arr[()] if arr.ndim == 0 else arr)
    return unflatten(signature, out)


def _spec_shape(spec: Any) -> tuple[int | None, ...] | None:
    try:
        return tuple(spec.shape)
    except (TypeError, ValueError):  # unknown rank, e.g. tf.TensorShape(None)
        return None


def unflatten_leaves_like(signature: Any, element: Any) -> list[Any]:
    """Returns ``element``'s leaves in ``signature``'s order, checking the structure matches."""
    if _kind(signature) == _MAPPING:
        if _kind(element) != _MAPPING or set(element) != set(signature):
            raise TypeError("structure mismatch")
        return [x for k in signature for x in unflatten_leaves_like(signature[k], element[k])]
    if _kind(signature) == _TUPLE:
        if _kind(element) != _TUPLE or len(element) != len(signature):
            raise TypeError("structure mismatch")
        return [x for s, e in zip(signature, element) for x in unflatten_leaves_like(s, e)]
    if is_structure(element):
        raise TypeError("structure mismatch")
    return [element]


def _describe_raw(element: Any) -> str:
    return repr(map_structure(lambda x: type(x).__name__, element))


def spec_def_str(signature: Any) -> str:
    return repr(map_structure(lambda s: f"spec(shape={_spec_shape(s)}, dtype={np.dtype(s.dtype)})",
                              signature))
