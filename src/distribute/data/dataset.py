"""``Dataset``: tf.data's API (TensorFlow 2.21 semantics) over grain pipelines.

Elements come out as numpy values in the dataset's structure: a leaf is an
``np.ndarray`` or a numpy scalar; tuples and dicts stay tuples and dicts.

Datasets built from in-memory arrays (``from_tensor_slices``, ``range``)
followed only by ``shuffle``/``take``/``skip``/``shard``/``repeat``/``cache``
and one ``batch`` run on a vectorised index plan (see ``_plan``): a batch is
one fancy-index per array. Everything else runs on grain ``IterDataset``
transformations (see ``_pipeline``, ``_combine``). Both follow tf.data's
semantics, and a shuffle gives the same order for one seed on either path
(the same numpy window permutations).

Sources are in ``_sources`` and the combining methods (``zip``,
``padded_batch``, ``interleave``, ``element_spec``...) in ``_more``; both are
base classes of ``Dataset``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import grain

import distribute.data._cardinality as _cardinality
import distribute.data._checks as _checks
import distribute.data._combine as _combine
import distribute.data._kind as _kind
import distribute.data._more as _more
import distribute.data._pipeline as _pipeline
import distribute.data._plan as _plan
import distribute.data._sources as _sources
import distribute.data._spec as _spec
import distribute.data._structure as _structure
from distribute.data.options import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Options,
)

_AUTOTUNE_PREFETCH = 2  # buffer used for prefetch(AUTOTUNE)
_KEEP = object()  # _derive(): keep the parent's batch info


class DatasetIterator:
    """An iterator over one pass of a ``Dataset``; yields numpy elements.

    ``next(iterator)`` and ``iterator.get_next()`` return the next element and
    raise ``StopIteration`` at the end, like a tf.data iterator in eager mode.
    """

    def __init__(self, grain_iterator: grain.DatasetIterator) -> None:
        self._iterator = grain_iterator

    def __iter__(self) -> DatasetIterator:
        return self

    def __next__(self) -> Any:
        return next(self._iterator)

    def get_next(self) -> Any:
        """Returns the next element (``tf.data.Iterator.get_next``)."""
        return next(self._iterator)

    def close(self) -> None:
        """Stops background prefetching and releases the pipeline."""
        self._iterator.close()


class Dataset(_sources.SourcesMixin, _more.MoreMixin):
    """A tf.data-style input pipeline: an immutable description, iterated any number of times.

    Create one with ``from_tensor_slices``, ``range`` or ``from_generator``,
    chain transformations (each returns a new ``Dataset``), and iterate it.
    Every ``iter(dataset)`` starts a new pass; with
    ``reshuffle_each_iteration=True`` each pass has a new order.

    Example::

        ds = Dataset.from_tensor_slices((x, y)).shuffle(60_000, seed=1).batch(128)
        for features, labels in ds:   # numpy arrays, (128, 784) and (128,)
            ...
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Dataset cannot be constructed directly; create one with "
                        "Dataset.from_tensor_slices(...), Dataset.range(...) or Dataset.from_generator(...).")

    @classmethod
    def _create(cls, node: _pipeline.Node, cardinality: int, batch_info: tuple[int, bool] | None,
                options: Options, array: _sources.ArrayState | None, spec: Any = None,
                seeds: tuple[_plan.SeedStream, ...] = ()) -> Dataset:
        """A new dataset. ``spec``: its element_spec, or a zero-argument function computing it.

        ``seeds``: the SeedStreams of the unseeded random ops upstream (workers
        agree on them, see ``_random_seeds``).
        """
        if not _KERAS_ADAPTER and _kind.keras_adapter_wanted():
            _install_keras_adapter()
        dataset = cls.__new__(cls)
        dataset._node = node
        dataset._cardinality_value = cardinality
        dataset._batch_info_value = batch_info
        dataset._options_value = options
        dataset._array = array
        dataset._spec_source = spec
        dataset._seeds = seeds
        dataset._files_root = None  # a file source upstream (see _files.py), for AutoShardPolicy.FILE
        dataset._recipe = None  # (parent, method name, args, kwargs) when _files_root is set
        return dataset

    def _derive(self, cardinality: int | None = None, node: _pipeline.Node | None = None,
                array: _sources.ArrayState | None = None, batch_info: Any = _KEEP,
                options: Options | None = None, spec: Any = _KEEP,
                seeds: tuple[_plan.SeedStream, ...] = ()) -> Dataset:
        """Returns a child dataset; with ``array`` the node is derived from it."""
        if array is not None:
            node = array.node()
        return Dataset._create(
            node=node if node is not None else self._node,
            cardinality=self._cardinality_value if cardinality is None else cardinality,
            batch_info=self._batch_info_value if batch_info is _KEEP else batch_info,
            options=self._options_value if options is None else options,
            array=array,
            spec=self._spec_source if spec is _KEEP else spec,
            seeds=self._seeds + seeds)

    # --------------------------------------------------------- transformations

    @_more.recorded
    def shuffle(self, buffer_size: int, seed: int | None = None,
                reshuffle_each_iteration: bool | None = None) -> Dataset:
        """Randomly shuffles the elements (``tf.data.Dataset.shuffle``).

        Every element appears exactly once per pass. With ``buffer_size`` at
        least the dataset size the order is a uniform random permutation, as in
        tf.data. A smaller buffer shuffles within consecutive windows of
        ``buffer_size`` elements (grain's window shuffle), where tf.data uses a
        sliding buffer; both keep only ``buffer_size`` elements in memory.

        Args:
          buffer_size: elements held for shuffling, >= 1.
          seed: int for a reproducible order; None draws a random seed.
          reshuffle_each_iteration: True (the default, also for None) gives each
            pass (each ``iter()``, each epoch of a later ``repeat``) a new order.

        Returns:
          The shuffled dataset; same cardinality and ``_batch_info``.

        Raises:
          TypeError, ValueError: bad ``buffer_size`` or ``seed``.
        """
        size = _checks.shuffle_buffer(buffer_size)
        reshuffle = True if reshuffle_each_iteration is None else _checks.boolean(
            reshuffle_each_iteration, "reshuffle_each_iteration", "shuffle()")
        seeds = _plan.SeedStream(_checks.seed(seed), reshuffle)
        unseeded = () if seed is not None else (seeds,)
        if self._array is not None:
            return self._derive(array=self._array.with_plan(_plan.ShufflePlan(self._array.plan, size, seeds)),
                                seeds=unseeded)
        return self._derive(node=_pipeline.ShuffleNode(self._node, size, seeds), seeds=unseeded)

    @_more.recorded
    def batch(self, batch_size: int, drop_remainder: bool = False, num_parallel_calls: int | None = None,
              deterministic: bool | None = None) -> Dataset:
        """Stacks consecutive elements into batches (``tf.data.Dataset.batch``).

        Each leaf of shape ``(...)`` becomes ``(batch_size, ...)``; the last
        batch is smaller unless ``drop_remainder``.

        Args:
          batch_size: elements per batch, >= 1.
          drop_remainder: drop a final batch smaller than ``batch_size``.
          num_parallel_calls: accepted for compatibility (None, AUTOTUNE or >= 1).
          deterministic: accepted for compatibility; output is always in order.

        Returns:
          The batched dataset; ``_batch_info`` becomes ``(batch_size, drop_remainder)``.

        Raises:
          TypeError, ValueError: bad arguments. Iterating raises ValueError if
            elements of one batch differ in shape.
        """
        size = _checks.positive(batch_size, "batch_size", "batch()")
        drop = _checks.boolean(drop_remainder, "drop_remainder", "batch()")
        _checks.parallel_calls(num_parallel_calls)
        _checks.optional_bool(deterministic, "deterministic", "batch()")
        cardinality = _cardinality.batch(self._cardinality_value, size, drop)
        spec = self._lazy_spec(lambda parent: _spec.batched(parent, size if drop else None))
        if self._array is not None and not self._array.batched:
            plan = _plan.BatchPlan(self._array.plan, size, drop)
            return self._derive(cardinality, array=self._array.with_plan(plan, batched=True),
                                batch_info=(size, drop), spec=spec)
        return self._derive(cardinality, node=_pipeline.BatchNode(self._node, size, drop), batch_info=(size, drop),
                            spec=spec)

    @_more.recorded
    def map(self, map_func: Callable[..., Any], num_parallel_calls: int | None = None,
            deterministic: bool | None = None) -> Dataset:
        """Applies ``map_func`` to every element (``tf.data.Dataset.map``).

        A tuple element is passed as positional arguments (``map_func(x, y)``);
        any other element, dicts included, as one argument. The result is
        converted to numpy (a returned list becomes a tuple, as in tf.data).
        ``map_func`` runs as plain Python. Without ``num_parallel_calls`` it
        runs in order on the iterating thread (or the ``prefetch`` thread); with
        ``num_parallel_calls=N`` it runs on N threads (``AUTOTUNE``: one per CPU
        core, at most 16), with at most 2 N elements in flight. Threads overlap
        work that releases the GIL (numpy, I/O, decoding); pure-Python work does
        not get faster.

        Args:
          map_func: function from an element to a new element.
          num_parallel_calls: None (sequential), AUTOTUNE or an int >= 1.
          deterministic: None or True keep the input order (as tf.data's
            default); False yields elements as they finish.

        Returns:
          The mapped dataset; same cardinality and ``_batch_info``.

        Raises:
          TypeError: ``map_func`` is not callable; ValueError: bad ``num_parallel_calls``.
        """
        fn = _checks.callable_arg(map_func, "map_func", "map()")
        threads = _checks.parallel_calls(num_parallel_calls)
        ordered = _checks.optional_bool(deterministic, "deterministic", "map()") is not False
        spec = self._lazy_spec(lambda parent: _more.traced_or_error(
            lambda element: _structure.normalize_fn_output(_structure.call_unpacked(fn, element)), parent, "map()"))
        if threads is None or threads == 1:
            return self._derive(node=_pipeline.MapNode(self._node, fn), spec=spec)
        num_threads = _more.autotune_threads() if threads == AUTOTUNE else threads
        node = _combine.ParallelMapNode(
            self._node, lambda element: _structure.normalize_fn_output(_structure.call_unpacked(fn, element)),
            num_threads, ordered)
        return self._derive(node=node, spec=spec)

    @_more.recorded
    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        """Keeps the elements for which ``predicate`` is True (``tf.data.Dataset.filter``).

        ``predicate`` gets the element unpacked like ``map`` and must return a
        scalar bool. The cardinality becomes ``UNKNOWN_CARDINALITY``.

        Args:
          predicate: function from an element to a bool.

        Returns:
          The filtered dataset.

        Raises:
          TypeError: ``predicate`` is not callable (or, while iterating, returns a non-bool).
        """
        fn = _checks.callable_arg(predicate, "predicate", "filter()")
        return self._derive(UNKNOWN_CARDINALITY, node=_pipeline.FilterNode(self._node, fn))

    @_more.recorded
    def prefetch(self, buffer_size: int) -> Dataset:
        """Prepares up to ``buffer_size`` elements ahead on a background thread.

        Args:
          buffer_size: elements to buffer, >= 0, or AUTOTUNE (a small buffer).

        Returns:
          A dataset with the same elements.

        Raises:
          TypeError, ValueError: bad ``buffer_size``.
        """
        size = _checks.buffer_size(buffer_size, "prefetch()", allow_zero=True)
        if size == 0:
            return self._derive(array=self._array)
        size = _AUTOTUNE_PREFETCH if size == AUTOTUNE else size
        return self._derive(node=_pipeline.PrefetchNode(self._node, size))

    @_more.recorded
    def repeat(self, count: int | None = None) -> Dataset:
        """Repeats the dataset ``count`` times; None or -1 repeats forever.

        Each repetition is a new pass, so an upstream ``shuffle`` with
        ``reshuffle_each_iteration=True`` gives every epoch a new order. Batches
        after ``repeat`` may span epochs, as in tf.data.

        Args:
          count: number of repetitions >= 0, or None/-1 for forever.

        Returns:
          The repeated dataset (cardinality ``INFINITE_CARDINALITY`` when forever
          and the input is not empty).

        Raises:
          TypeError, ValueError: ``count`` is not an int >= -1.
        """
        times = -1 if count is None else _checks.count_or_all(count, "count", "repeat()")
        cardinality = _cardinality.repeat(self._cardinality_value, times)
        plan_count = None if times == -1 else times
        if self._array is not None:
            return self._derive(cardinality, array=self._array.with_plan(_plan.RepeatPlan(self._array.plan, plan_count)))
        return self._derive(cardinality, node=_pipeline.RepeatNode(self._node, plan_count))

    @_more.recorded
    def take(self, count: int) -> Dataset:
        """Keeps the first ``count`` elements; -1 keeps all (``tf.data.Dataset.take``).

        Args:
          count: elements to keep, >= 0, or -1.

        Returns:
          The truncated dataset.

        Raises:
          TypeError, ValueError: ``count`` is not an int >= -1.
        """
        number = _checks.count_or_all(count, "count", "take()")
        cardinality = _cardinality.take(self._cardinality_value, number)
        if number == -1:
            return self._derive(array=self._array)
        if self._array is not None:
            return self._derive(cardinality, array=self._array.with_plan(_plan.TakePlan(self._array.plan, number)))
        return self._derive(cardinality, node=_pipeline.TakeNode(self._node, number))

    @_more.recorded
    def skip(self, count: int) -> Dataset:
        """Drops the first ``count`` elements; -1 drops all (``tf.data.Dataset.skip``).

        Args:
          count: elements to drop, >= 0, or -1.

        Returns:
          The remaining dataset.

        Raises:
          TypeError, ValueError: ``count`` is not an int >= -1.
        """
        number = _checks.count_or_all(count, "count", "skip()")
        cardinality = _cardinality.skip(self._cardinality_value, number)
        if number == 0:
            return self._derive(array=self._array)
        if self._array is not None:
            plan = _plan.TakePlan(self._array.plan, 0) if number == -1 else _plan.SkipPlan(self._array.plan, number)
            return self._derive(cardinality, array=self._array.with_plan(plan))
        node = _pipeline.EmptyNode() if number == -1 else _pipeline.SliceNode(self._node, number, 1)
        return self._derive(cardinality, node=node)

    @_more.recorded
    def shard(self, num_shards: int, index: int) -> Dataset:
        """Keeps elements ``index, index + num_shards, ...`` (``tf.data.Dataset.shard``).

        Two-worker example on ``range(5)``: ``shard(2, 0)`` gives 0, 2, 4 and
        ``shard(2, 1)`` gives 1, 3.

        Args:
          num_shards: number of shards, >= 1.
          index: this shard, ``0 <= index < num_shards``.

        Returns:
          The shard.

        Raises:
          TypeError, ValueError: bad ``num_shards`` or ``index``.
        """
        shards = _checks.positive(num_shards, "num_shards", "shard()")
        position = _checks.integer(index, "index", "shard()")
        if not 0 <= position < shards:
            raise ValueError(f"shard(): index={position} must be in [0, num_shards={shards}); "
                             f"pass 0..{shards - 1}, e.g. the worker id.")
        cardinality = _cardinality.shard(self._cardinality_value, shards, position)
        if self._array is not None:
            plan = _plan.ShardPlan(self._array.plan, shards, position)
            return self._derive(cardinality, array=self._array.with_plan(plan))
        return self._derive(cardinality, node=_pipeline.SliceNode(self._node, position, shards))

    @_more.recorded
    def cache(self, filename: str = "") -> Dataset:
        """Caches the elements of the first complete pass in memory and replays them.

        Later passes skip the upstream work (and replay the first pass's order,
        even after a reshuffling ``shuffle``), as ``tf.data.Dataset.cache()``.

        Args:
          filename: must be "" (the in-memory cache).

        Returns:
          The cached dataset.

        Raises:
          TypeError: ``filename`` is not a str.
          NotImplementedError: a file cache was requested.
        """
        if not isinstance(filename, str):
            raise TypeError(f"cache(): filename={filename!r} must be a str; use cache() for memory.")
        if filename:
            raise NotImplementedError(f"cache(filename={filename!r}): file caches are not supported; only the "
                                      "in-memory cache is. Call cache() without a filename.")
        if self._array is not None:
            return self._derive(array=self._array.with_plan(_plan.CachePlan(self._array.plan)))
        return self._derive(node=_pipeline.CacheNode(self._node))

    @_more.recorded
    def with_options(self, options: Options) -> Dataset:
        """Returns this dataset with ``options`` merged in (options set later win).

        Args:
          options: an ``Options``.

        Returns:
          The same elements with the merged options.

        Raises:
          TypeError: ``options`` is not an ``Options``.
        """
        return self._derive(array=self._array, options=self._options_value.merge(options))

    # ------------------------------------------------------------- inspection

    def options(self) -> Options:
        """Returns a copy of the merged options of this dataset."""
        return copy.deepcopy(self._options_value)

    def cardinality(self) -> int:
        """Returns the number of elements, ``INFINITE_CARDINALITY`` (-1) or ``UNKNOWN_CARDINALITY`` (-2).

        Computed without iterating, with tf.data's rules: unknown after
        ``filter`` and ``from_generator``.
        """
        return self._cardinality_value

    def __len__(self) -> int:
        """Returns the number of elements.

        Raises:
          TypeError: the dataset is infinite or its length is unknown (as tf.data).
        """
        if self._cardinality_value == INFINITE_CARDINALITY:
            raise TypeError("The dataset is infinite (cardinality -1, e.g. after repeat()); it has no len(). "
                            "Use take(n) for a finite part.")
        if self._cardinality_value == UNKNOWN_CARDINALITY:
            raise TypeError("The dataset length is unknown (cardinality -2, e.g. after filter() or "
                            "from_generator()); check cardinality() first or count by iterating.")
        return self._cardinality_value

    def __bool__(self) -> bool:
        return True  # as tf.data: a dataset is truthy even when len() cannot be computed

    @property
    def _batch_info(self) -> tuple[int, bool] | None:
        """``(batch_size, drop_remainder)`` of the last ``batch()`` upstream, or None if never batched.

        A tf.data or grain dataset (``_foreign``) finds it when first asked.
        """
        info = self._batch_info_value
        return info.get() if hasattr(info, "get") else info

    def __iter__(self) -> DatasetIterator:
        """Starts a new pass; yields numpy elements."""
        return DatasetIterator(iter(self._node.build()))

    def as_numpy_iterator(self) -> DatasetIterator:
        """Returns an iterator over numpy elements (``tf.data.Dataset.as_numpy_iterator``)."""
        return iter(self)

    def _lazy_spec(self, fn: Callable[[Any], Any]) -> Callable[[], Any]:
        """A lazy element_spec: ``fn`` of this dataset's element_spec, computed when first read."""
        return lambda: fn(self.element_spec)

    def __repr__(self) -> str:
        return f"<Dataset cardinality={self._cardinality_value} batch_info={self._batch_info_value}>"


_kind.register(Dataset)

_KERAS_ADAPTER: list[bool] = []


def _install_keras_adapter() -> None:
    """Keras fit/evaluate/predict accept a Dataset from the first one built (data/keras_adapter.py)."""
    import distribute.data.keras_adapter as keras_adapter  # loads Keras: only once a Dataset exists

    keras_adapter.install()
    _KERAS_ADAPTER.append(True)
