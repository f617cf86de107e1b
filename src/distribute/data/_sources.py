"""``Dataset`` sources with tf.data's names: slices, range, tensors, generators, zip, file lists.

``SourcesMixin`` is a base class of ``Dataset``; each source is a classmethod
called as ``Dataset.from_tensor_slices(...)`` exactly like tf.data's static methods.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

import distribute.data._pipeline as _pipeline
import distribute.data._plan as _plan
import distribute.data._spec as _spec
import distribute.data._structure as _structure
from distribute.data.options import UNKNOWN_CARDINALITY, Options


@dataclasses.dataclass(frozen=True)
class ArrayState:
    """The vectorised form of an in-memory dataset: a source and its row order."""

    source: _plan.Source
    plan: _plan.Plan
    batched: bool

    def with_plan(self, plan: _plan.Plan, batched: bool | None = None) -> ArrayState:
        return ArrayState(self.source, plan, self.batched if batched is None else batched)

    def node(self) -> _pipeline.Node:
        return _pipeline.PlanNode(self.source, self.plan, self.batched)


class SourcesMixin:
    """The ways to create a ``Dataset`` (tf.data's static constructors)."""

    @classmethod
    def from_tensor_slices(cls, tensors: Any) -> Any:
        """Creates a dataset whose i-th element is row i of every array in ``tensors``.

        Matches ``tf.data.Dataset.from_tensor_slices``: tuples and dicts are the
        element structure, lists are data. Python floats become float32 and
        Python ints int32, as in TensorFlow; numpy arrays keep their dtype.
        The arrays are read in place, not copied; yielded values are copies.

        Args:
          tensors: an array, or a tuple/dict (possibly nested) of arrays, all
            with the same size in dim 0: ``(num_elements, ...)``.

        Returns:
          A dataset of ``num_elements`` elements with leaves of shape ``(...)``.

        Raises:
          ValueError: a component is a scalar, the structure is empty, or the
            components differ in dim 0 (the error names each one's size).
        """
        source = _plan.SliceSource.from_tensors(tensors)
        array = ArrayState(source, _plan.SourcePlan(len(source)), batched=False)
        return cls._create(array.node(), len(source), None, Options(), array, spec=source.element_spec())

    @classmethod
    def range(cls, *args: int, output_type: Any = np.int64) -> Any:
        """Creates a dataset of evenly spaced integers, like Python's ``range``.

        Matches ``tf.data.Dataset.range``: ``range(stop)``, ``range(start, stop)``
        or ``range(start, stop, step)``; elements are int64 scalars unless
        ``output_type`` says otherwise. Nothing is materialised.

        Args:
          *args: one to three ints.
          output_type: numpy dtype of the elements (default ``np.int64``).

        Returns:
          A dataset of ``len(range(*args))`` scalars.

        Raises:
          TypeError: wrong number of arguments or a non-int argument.
          ValueError: ``step`` is 0.
        """
        dtype = _spec.as_dtype(output_type)
        source = _plan.RangeSource.from_args(args, dtype)
        array = ArrayState(source, _plan.SourcePlan(len(source)), batched=False)
        return cls._create(array.node(), len(source), None, Options(), array, spec=_spec.TensorSpec((), dtype))

    @classmethod
    def from_tensors(cls, tensors: Any) -> Any:
        """Creates a dataset of one element, ``tensors`` itself (``tf.data.Dataset.from_tensors``).

        Values are converted like ``from_tensor_slices`` (Python floats to
        float32, ints to int32, strings to bytes; lists are data).

        Raises:
          TypeError, ValueError: a component cannot be converted to an array.
        """
        element = _structure.normalize(tensors, "from_tensors() component")
        source = _plan.SliceSource.from_tensors(_structure.map_structure(lambda leaf: np.asarray(leaf)[None], element))
        array = ArrayState(source, _plan.SourcePlan(1), batched=False)
        return cls._create(array.node(), 1, None, Options(), array, spec=source.element_spec())

    @classmethod
    def from_generator(cls, generator: Callable[..., Any], output_types: Any = None, output_shapes: Any = None,
                       args: Any = None, output_signature: Any = None, name: str | None = None) -> Any:
        """Creates a dataset from a Python generator function (``tf.data.Dataset.from_generator``).

        ``generator(*args)`` is called anew for every pass (so ``repeat`` re-runs
        it); ``args`` are converted as tf.data converts them (Python ints to
        numpy int32 scalars, floats to float32, strings to bytes). The
        cardinality is ``UNKNOWN_CARDINALITY``.

        Give the element type with ``output_signature`` (a structure of
        ``TensorSpec``, ``None`` dims allowed) or, the older way, with
        ``output_types`` (a structure of dtypes) and optionally
        ``output_shapes`` (same structure, shapes with ``None`` dims; without
        them the rank is unknown). Yielded values are checked against it and
        cast to its dtypes. Beyond tf.data (which raises TypeError there),
        neither may be given: values are then converted like
        ``from_tensor_slices`` and ``element_spec`` reads the first element.

        Raises:
          TypeError: ``generator`` is not callable (e.g. a generator object was
            passed instead of the function that makes one), or both
            ``output_signature`` and ``output_types``/``output_shapes`` are given.
        """
        if not callable(generator):
            raise TypeError(f"from_generator(): generator must be a callable that returns an iterator, got "
                            f"{type(generator).__name__}; pass the function itself, e.g. "
                            "from_generator(gen) rather than from_generator(gen()).")
        if output_signature is not None and (output_types is not None or output_shapes is not None):
            raise TypeError("from_generator(): give either output_signature or output_types/output_shapes, "
                            "not both (as tf.data).")
        if output_signature is None and output_types is None and output_shapes is not None:
            raise TypeError("from_generator(): output_shapes needs output_types (as tf.data); give "
                            "output_types too, or use output_signature.")
        signature = None
        if output_signature is not None:
            signature = _spec.from_foreign(output_signature)
        elif output_types is not None:
            signature = _signature_from_types(output_types, output_shapes)
        call_args = () if args is None else tuple(_generator_arg(a) for a in args)
        node = _pipeline.GeneratorNode(lambda: generator(*call_args), signature)
        dataset = cls._create(node, UNKNOWN_CARDINALITY, None, Options(), None, spec=signature)
        if signature is None:
            dataset._spec_source = lambda: _first_element_spec(dataset, "from_generator() without output_signature")
        return dataset

    @classmethod
    def zip(cls, *args: Any, datasets: Any = None, name: str | None = None) -> Any:
        """Zips datasets into a dataset of tuples or dicts (``tf.data.Dataset.zip``).

        ``zip(a, b)`` and ``zip((a, b))`` give ``(a_i, b_i)``; a nested
        structure or a dict of datasets gives elements of that structure. The
        result ends with the shortest dataset.

        Raises:
          TypeError: no datasets, both ``args`` and ``datasets``, or a leaf that is not a Dataset.
        """
        if args and datasets is not None:
            raise TypeError("zip(): pass the datasets either positionally or as datasets=, not both.")
        structure = datasets if datasets is not None else (args[0] if len(args) == 1 else args)
        if not args and datasets is None:
            raise TypeError("zip() needs at least one dataset, e.g. Dataset.zip(a, b).")
        from distribute.data._more import _as_dataset

        leaves, _ = _structure.flatten(structure)
        members = [_as_dataset(leaf, "zip() argument") for leaf in leaves]
        positions = iter(range(len(members)))
        template = _structure.map_structure(lambda _: next(positions), structure)
        cardinality = _zip_cardinality([m._cardinality_value for m in members])
        seeds = tuple(seed for m in members for seed in m._seeds)
        specs = [m._spec_source for m in members]
        spec = _structure.unflatten(template, specs) if not any(callable(s) for s in specs) else (
            lambda: _structure.unflatten(template, [m.element_spec for m in members]))
        node = _pipeline_zip(members, template)
        return cls._create(node, cardinality, None, Options(), None, spec=spec, seeds=seeds)

    @classmethod
    def list_files(cls, file_pattern: Any, shuffle: bool | None = None, seed: int | None = None,
                   name: str | None = None) -> Any:
        """A dataset of the file names matching ``file_pattern`` (``tf.data.Dataset.list_files``).

        Names are bytes, in sorted order; with ``shuffle`` (the default, as
        tf.data) they are shuffled, newly every pass. A pipeline that reads
        these files (``interleave``/``flat_map`` of a reader, or the readers
        in ``distribute.data``) is split by file between workers under
        ``AutoShardPolicy.FILE`` (and AUTO): with 2 workers and 4 files each
        worker reads 2 files.

        Args:
          file_pattern: a glob pattern or a list of them.
          shuffle: shuffle the names (default True).
          seed: the shuffle seed.

        Raises:
          ValueError: no file matches (tf.data raises InvalidArgumentError).
        """
        import distribute.data._files as _files

        return _files.list_files(cls, file_pattern, shuffle, seed)


def _signature_from_types(output_types: Any, output_shapes: Any) -> Any:
    """``output_types`` / ``output_shapes`` (same structure) as a structure of TensorSpec."""
    if _structure.is_structure(output_types):
        if isinstance(output_types, dict):
            return {k: _signature_from_types(v, None if output_shapes is None else output_shapes[k])
                    for k, v in output_types.items()}
        shapes = [None] * len(output_types) if output_shapes is None else list(output_shapes)
        if len(shapes) != len(output_types):
            raise ValueError(f"from_generator(): output_shapes={output_shapes!r} does not match the structure of "
                             f"output_types={output_types!r}; give one shape per type.")
        return tuple(_signature_from_types(t, s) for t, s in zip(output_types, shapes))
    shape = None if output_shapes is None else tuple(getattr(output_shapes, "as_list", lambda: output_shapes)())
    return _spec.TensorSpec(shape, output_types)


def _generator_arg(value: Any) -> Any:
    converted = _structure.to_numpy(value, "from_generator() args")
    return bytes(converted) if isinstance(converted, np.bytes_) else converted


def _zip_cardinality(values: list[int]) -> int:
    known = [v for v in values if v >= 0]
    if known:
        return min(known)
    return UNKNOWN_CARDINALITY if UNKNOWN_CARDINALITY in values else values[0]


def _pipeline_zip(members: list[Any], template: Any) -> Any:
    from distribute.data._combine import ZipNode

    return ZipNode([m._node for m in members], template)


def _first_element_spec(dataset: Any, what: str) -> Any:
    """The spec of a dataset's first element (datasets whose spec tf.data would have been told)."""
    for element in dataset:
        return _spec.spec_of_element(element)
    raise ValueError(f"element_spec of {what} is unknown: the dataset is empty. Give output_signature.")
