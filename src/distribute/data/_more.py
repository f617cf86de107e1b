"""``Dataset`` methods beyond the basic chain: tf.data's combining and reshaping names, and ``element_spec``.

``MoreMixin`` is a base class of ``Dataset``; every method has tf.data's
signature and answers (TensorFlow 2.21).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np

import distribute.data._kind as _kind
import distribute.data._cardinality as _cardinality
import distribute.data._checks as _checks
import distribute.data._combine as _combine
import distribute.data._spec as _spec
import distribute.data._structure as _structure
from distribute.data.options import AUTOTUNE, INFINITE_CARDINALITY, UNKNOWN_CARDINALITY

_MAX_AUTOTUNE_THREADS = 16


def autotune_threads() -> int:
    """``num_parallel_calls=AUTOTUNE``: one thread per CPU core this process may use, at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, _MAX_AUTOTUNE_THREADS))


def recorded(method: Callable[..., Any]) -> Callable[..., Any]:
    """Remembers how a dataset was derived from a file-based parent, so FILE sharding can replay it."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if self._files_root is not None and result is not self:
            result._files_root = self._files_root
            result._recipe = (self, method.__name__, args, kwargs)
        return result

    return wrapper


def traced_or_error(fn: Callable[[Any], Any], spec: Any, method: str) -> Any:
    """``_spec.traced_spec`` with an error that says why the spec is unknown.

    Raises:
      ValueError: ``fn`` failed on a dummy element.
    """
    try:
        return _spec.traced_spec(fn, spec)
    except Exception as err:
        raise ValueError(f"element_spec after {method} is unknown: the function raised {type(err).__name__}: {err} "
                         f"when run on a dummy element of spec {spec} (tf.data traces it the same way). Make the "
                         "function work for any input of that shape and dtype.") from err


class MoreMixin:
    """tf.data's ``from_tensors`` / ``zip`` companions: methods that combine or reshape elements."""

    # ------------------------------------------------------------- inspection

    @property
    def element_spec(self) -> Any:
        """The type of every element: a structure of ``TensorSpec`` (``tf.data.Dataset.element_spec``).

        ``None`` dims vary between elements, e.g. ``range(5).batch(2)`` has
        ``TensorSpec(shape=(None,), dtype=int64)`` and with ``drop_remainder=True``
        ``shape=(2,)``. After ``map``/``flat_map``/``interleave`` the function
        is run on dummy elements to learn its output (see ``_spec``).

        Raises:
          ValueError: the spec cannot be inferred (the message says why).
        """
        source = self._spec_source
        if callable(source):
            source = source()
            self._spec_source = source
        return source

    # --------------------------------------------------------- transformations

    @recorded
    def concatenate(self, dataset: Any) -> Any:
        """The elements of this dataset, then those of ``dataset`` (``tf.data.Dataset.concatenate``).

        Raises:
          TypeError: ``dataset`` is not a Dataset, or the element structures or dtypes differ.
        """
        other = _as_dataset(dataset, "concatenate()")
        spec = _spec.most_specific_compatible(self.element_spec, other.element_spec, "concatenate()")
        first, second = self._cardinality_value, other._cardinality_value
        if INFINITE_CARDINALITY in (first, second):
            cardinality = INFINITE_CARDINALITY
        elif UNKNOWN_CARDINALITY in (first, second):
            cardinality = UNKNOWN_CARDINALITY
        else:
            cardinality = first + second
        return self._derive(cardinality, node=_combine.ConcatenateNode(self._node, other._node), spec=spec,
                            batch_info=None if self._batch_info_value != other._batch_info_value else self._batch_info_value,
                            seeds=other._seeds)

    @recorded
    def enumerate(self, start: int = 0) -> Any:
        """``(index, element)`` pairs, ``index`` int64 from ``start`` (``tf.data.Dataset.enumerate``)."""
        first = _checks.integer(start, "start", "enumerate()")
        spec = self._lazy_spec(lambda parent: (_spec.TensorSpec((), np.int64), parent))
        return self._derive(node=_combine.EnumerateNode(self._node, first), spec=spec, batch_info=None)

    @recorded
    def padded_batch(self, batch_size: int, padded_shapes: Any = None, padding_values: Any = None,
                     drop_remainder: bool = False) -> Any:
        """Batches elements of different shapes by padding them (``tf.data.Dataset.padded_batch``).

        Each component is padded at the end of every dim to ``padded_shapes``
        (a None dim, or ``padded_shapes=None``, pads to the largest size in the
        batch) with ``padding_values`` (default 0, ``b""`` for strings). Two
        images of 4x4 and 5x5 batched with ``padded_shapes=(None, None, 1)``
        give one ``(2, 5, 5, 1)`` batch.

        Args:
          batch_size: elements per batch, >= 1.
          padded_shapes: a shape (tuple/list of ints and None) per component, in
            the element's structure; None pads every dim to the batch maximum.
          padding_values: a scalar per component (or one scalar for all).
          drop_remainder: drop a final smaller batch.

        Returns:
          The batched dataset; ``_batch_info`` becomes ``(batch_size, drop_remainder)``.

        Raises:
          TypeError, ValueError: bad arguments; iterating raises ValueError when an
            element is larger than its padded shape or ranks differ.
        """
        size = _checks.positive(batch_size, "batch_size", "padded_batch()")
        drop = _checks.boolean(drop_remainder, "drop_remainder", "padded_batch()")
        spec = self.element_spec
        shapes = _padded_shapes(spec, padded_shapes)
        values = _padding_values(spec, padding_values)

        def inner_spec(s: _spec.TensorSpec, shape: tuple | None) -> _spec.TensorSpec:
            return _spec.TensorSpec(s.shape if shape is None else shape, s.dtype)

        leaves, _ = _structure.flatten(spec)
        padded_spec = _structure.unflatten(spec, [inner_spec(s, p) for s, p in zip(leaves, shapes)])
        node = _combine.PaddedBatchNode(self._node, size, drop, shapes, values)
        return self._derive(_cardinality.batch(self._cardinality_value, size, drop), node=node,
                            batch_info=(size, drop), spec=_spec.batched(padded_spec, size if drop else None))

    @recorded
    def unbatch(self) -> Any:
        """Splits every element into its rows along dim 0 (``tf.data.Dataset.unbatch``).

        The cardinality is tf.data's: the input's times the batch dim when
        every component has that dim statically (``batch(3,
        drop_remainder=True)``, ``from_tensor_slices`` of 2-D arrays), else
        ``UNKNOWN_CARDINALITY`` (infinite stays infinite).

        Raises:
          ValueError: a component is a scalar (also while iterating: components
            of one element differ in dim 0).
        """
        parent = self.element_spec
        spec = _spec.unbatched(parent, "unbatch()")
        dims = {s.shape[0] if s.shape is not None else None for s in _structure.flatten(parent)[0]}
        cardinality = self._cardinality_value
        if cardinality >= 0:
            cardinality = cardinality * dims.pop() if len(dims) == 1 and None not in dims else UNKNOWN_CARDINALITY
        return self._derive(cardinality, node=_combine.UnbatchNode(self._node), batch_info=None, spec=spec)

    @recorded
    def flat_map(self, map_func: Callable[..., Any]) -> Any:
        """The elements of ``map_func(element)``'s dataset for every element, in order (``tf.data.Dataset.flat_map``).

        Raises:
          TypeError: ``map_func`` is not callable, or (while iterating) returns no Dataset.
        """
        make = _dataset_maker(_checks.callable_arg(map_func, "map_func", "flat_map()"), "flat_map()")
        spec = self._lazy_spec(lambda parent: _inner_spec(make, parent, "flat_map()"))
        return self._derive(UNKNOWN_CARDINALITY, node=_combine.FlatMapNode(self._node, make), batch_info=None,
                            spec=spec)

    @recorded
    def interleave(self, map_func: Callable[..., Any], cycle_length: int | None = None,
                   block_length: int | None = None, num_parallel_calls: int | None = None,
                   deterministic: bool | None = None) -> Any:
        """Interleaves the datasets ``map_func`` makes from the elements (``tf.data.Dataset.interleave``).

        ``cycle_length`` inner datasets are open at once; ``block_length``
        elements come from each in turn (tf.data's order, see
        ``_combine.InterleaveNode``). Two-at-a-time example: ``range(1, 6)``
        with ``lambda x: from_tensors(x).repeat(4)``, ``cycle_length=2,
        block_length=2`` gives 1 1 2 2 1 1 2 2 3 3 4 4 3 3 4 4 5 5 5 5.

        Args:
          map_func: element -> Dataset.
          cycle_length: inner datasets open at once; None or AUTOTUNE: one per
            CPU core, as tf.data (so the order depends on the machine: pass a number).
          block_length: consecutive elements from each, default 1.
          num_parallel_calls: accepted (None, AUTOTUNE or >= 1); elements are
            produced on the iterating thread.
          deterministic: accepted; the order is always deterministic.

        Raises:
          TypeError, ValueError: bad arguments.
        """
        make = _dataset_maker(_checks.callable_arg(map_func, "map_func", "interleave()"), "interleave()")
        cycle = autotune_threads() if cycle_length in (None, AUTOTUNE) else _checks.positive(
            cycle_length, "cycle_length", "interleave()")
        block = 1 if block_length is None else _checks.positive(block_length, "block_length", "interleave()")
        _checks.parallel_calls(num_parallel_calls)
        _checks.optional_bool(deterministic, "deterministic", "interleave()")
        spec = self._lazy_spec(lambda parent: _inner_spec(make, parent, "interleave()"))
        return self._derive(UNKNOWN_CARDINALITY, node=_combine.InterleaveNode(self._node, make, cycle, block),
                            batch_info=None, spec=spec)

    @recorded
    def _read_files(self, read_file: Callable[[Any], Any], spec: Any) -> Any:
        """``flat_map(read_file)`` over a dataset of file names, with the readers' known ``spec``."""
        make = _dataset_maker(read_file, "reading files")
        if spec is None:
            spec = self._lazy_spec(lambda parent: _inner_spec(make, parent, "reading files"))
        return self._derive(UNKNOWN_CARDINALITY, node=_combine.FlatMapNode(self._node, make), batch_info=None,
                            spec=spec)

    def apply(self, transformation_func: Callable[[Any], Any]) -> Any:
        """Returns ``transformation_func(self)`` (``tf.data.Dataset.apply``).

        Raises:
          TypeError: the function is not callable or returns no Dataset.
        """
        fn = _checks.callable_arg(transformation_func, "transformation_func", "apply()")
        result = fn(self)
        return _as_dataset(result, "apply() transformation_func result")

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        """Folds every element into a state: ``state = reduce_func(state, element)`` (``tf.data.Dataset.reduce``).

        Returns the final state as numpy values (``initial_state`` converted
        like ``from_tensors`` for an empty dataset).

        Raises:
          TypeError: ``reduce_func`` is not callable.
        """
        fn = _checks.callable_arg(reduce_func, "reduce_func", "reduce()")
        state = _structure.normalize(initial_state, "reduce() initial_state")
        for element in self:
            state = _structure.normalize(fn(state, element), "reduce() reduce_func output")
        return state


def _as_dataset(value: Any, what: str) -> Any:
    Dataset = _kind.dataset_class()

    if isinstance(value, Dataset):
        return value
    import distribute.data._foreign as _foreign

    wrapped = _foreign.wrap(value)
    if wrapped is None:
        raise TypeError(f"{what} must be a distribute.data.Dataset, got {type(value).__name__}; build one with "
                        "Dataset.from_tensor_slices(...) or similar.")
    return wrapped


def _dataset_maker(fn: Callable[..., Any], method: str) -> Callable[[Any], Any]:
    def make(element: Any) -> Any:
        return _as_dataset(_structure.call_unpacked(fn, element), f"{method} map_func result")

    return make


def _inner_spec(make: Callable[[Any], Any], parent: Any, method: str) -> Any:
    """The inner datasets' element_spec, from the datasets made of two dummy elements (dims that differ: None)."""
    try:
        specs = [make(_spec.dummy_element(parent, size)).element_spec for size in _spec.DUMMY_SIZES]
    except Exception as err:
        raise ValueError(f"element_spec after {method} is unknown: map_func raised {type(err).__name__}: {err} "
                         f"when run on a dummy element of spec {parent} (tf.data traces it the same way). Make "
                         "map_func work for any input of that shape and dtype.") from err
    return _spec.relaxed(specs[0], specs[1])


def _padded_shapes(spec: Any, padded_shapes: Any) -> Any:
    """One shape (tuple with None) or None per component, in flatten order."""
    leaves, _ = _structure.flatten(spec)
    if padded_shapes is None:
        shapes = [None] * len(leaves)
    else:
        given = _shape_leaves(padded_shapes)
        if len(given) != len(leaves):
            raise ValueError(f"padded_batch(): padded_shapes={padded_shapes!r} gives {len(given)} shapes for an "
                             f"element of {len(leaves)} components ({spec}); give one shape per component.")
        shapes = given
        for s, shape in zip(leaves, shapes):
            if s.shape is not None and len(s.shape) != len(shape):
                raise ValueError(f"padded_batch(): padded shape {shape} has rank {len(shape)} but the component "
                                 f"{s} has rank {len(s.shape)}; give one size (or None) per dim.")
    return shapes


def _shape_leaves(padded_shapes: Any) -> list[tuple | None]:
    """Flattens ``padded_shapes``: a list/tuple of ints and None is one shape; tuples of those nest."""
    def is_shape(value: Any) -> bool:
        return isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (int, np.integer)) for v in value)

    if is_shape(padded_shapes):
        return [tuple(None if v is None else int(v) for v in padded_shapes)]
    if isinstance(padded_shapes, dict):
        return [s for key in padded_shapes for s in _shape_leaves(padded_shapes[key])]
    if isinstance(padded_shapes, (list, tuple)):
        return [s for part in padded_shapes for s in _shape_leaves(part)]
    if hasattr(padded_shapes, "as_list"):  # tf.TensorShape
        return [tuple(padded_shapes.as_list())]
    raise TypeError(f"padded_batch(): padded_shapes={padded_shapes!r} is not a shape; use a tuple of ints and "
                    "None, e.g. (None, None, 1).")


def _padding_values(spec: Any, padding_values: Any) -> Any:
    leaves, _ = _structure.flatten(spec)
    if padding_values is None:
        values = [_combine.default_padding(s) for s in leaves]
    elif not _structure.is_structure(padding_values):
        values = [padding_values] * len(leaves)
    else:
        values = _structure.flatten(padding_values)[0]
        if len(values) != len(leaves):
            raise ValueError(f"padded_batch(): padding_values={padding_values!r} gives {len(values)} values for "
                             f"{len(leaves)} components; give one scalar per component.")
    return [np.asarray(v).item() if np.ndim(v) == 0 else v for v in values]
