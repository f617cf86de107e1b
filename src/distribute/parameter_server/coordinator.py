"""ClusterCoordinator (tf.distribute.coordinator.ClusterCoordinator): schedule, join, done, fetch, datasets."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from distribute.parameter_server.closures import Closure, ClosureQueue, WorkerThread
from distribute.parameter_server.dataset import (
    ElementSpecChanged,
    PerWorkerDataset,
    PerWorkerDatasetValues,
    PerWorkerDistributedIterator,
    pipeline_fn,
)
from distribute.parameter_server.values import PerWorkerValues, RemoteValue
from distribute.strategy import CoordinatedStrategy


class ClusterCoordinator:
    """Schedules functions onto the workers of a ParameterServerStrategy (TF: same name).

    One per strategy: ``ClusterCoordinator(strategy)`` twice returns the same object.

    Two workers, one ps::

        coordinator = distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            v = keras.Variable(0.0)
        def add():
            v.assign_add(2.0)
            return v.value
        for _ in range(5):
            coordinator.schedule(add)
        coordinator.join()
        float(v.numpy())   # 10.0: assign_add is additive on the ps, so totals are exact

    Raises:
        ValueError: ``strategy`` is not a ParameterServerStrategy (TF's message).
    """

    def __new__(cls, strategy: Any):
        if not isinstance(strategy, CoordinatedStrategy):
            raise ValueError(
                "Only `tf.distribute.experimental.ParameterServerStrategy` is supported to work with "
                "`tf.distribute.experimental.coordinator.ClusterCoordinator` currently."
            )
        existing = strategy._cluster_coordinator
        if existing is not None:
            return existing
        self = super().__new__(cls)
        self._strategy = strategy
        self._cluster = strategy.extended._cluster
        self._queue = ClosureQueue()
        self._refreshed_at = 0
        self._threads = [WorkerThread(i, self._cluster, self._queue) for i in range(len(self._cluster.workers))]
        self._steps: dict = {}  # (function key, signature, iterator ids) -> Step
        self._traced: dict = {}  # (function key, signature) -> the Step traced for it (any iterators)
        self._families: dict = {}  # (function key, result treedef) -> the family id of its programs
        self._trace_lock = threading.RLock()  # schedule and the dispatch threads' re-traces share self._steps
        strategy._cluster_coordinator = self
        strategy.extended._used_with_coordinator = True
        return self

    def __init__(self, strategy: Any):  # all done in __new__ (a singleton per strategy)
        pass

    @property
    def strategy(self) -> Any:
        return self._strategy

    # -- scheduling ------------------------------------------------------------------------
    def schedule(self, fn: Callable, args: Any = None, kwargs: Any = None) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` to run on some worker; returns its RemoteValue at once.

        ``fn`` is a plain Python function, traced on the coordinator once per input
        signature (as TF traces a ``tf.function``; a ``jax.jit``-wrapped function,
        the port of a ``@tf.function``, is traced as the function it wraps): array arguments are inputs,
        Python values are constants, a per-worker iterator gives the executing
        worker's elements.  It runs at least once (more if a worker is lost midway,
        as in TF), but its variable updates take effect exactly once: each ps
        skips a re-run's update it already applied.

        Raises:
            TypeError: ``fn`` is not callable (TF's message).
            ValueError: a RemoteValue is an argument (TF's message).
            Exception: the first error of an earlier scheduled function (then
                cleared), or ``PSUnavailableError`` when a ps was lost.
        """
        from distribute.keras_support.ps_hooks import KerasVariable
        import distribute.parameter_server.program as program

        if not callable(fn):
            raise TypeError("Function passed to `ClusterCoordinator.schedule` must be a callable object.")
        fn = _unwrap_jit(fn)
        args = tuple(args or ())
        kwargs = dict(kwargs or {})
        self._queue.put_check()
        leaves, treedef = jax.tree_util.tree_flatten(
            (args, kwargs), is_leaf=lambda x: isinstance(x, (RemoteValue, PerWorkerValues, KerasVariable))
        )
        kinds, statics, arrays, avals, iter_specs, key_parts, datasets = [], [], [], [], [], [], set()
        for leaf in leaves:
            if isinstance(leaf, RemoteValue):
                raise ValueError(
                    "`tf.distribute.experimental.coordinator.RemoteValue` used as an input to scheduled "
                    "function is not yet supported."
                )
            if isinstance(leaf, PerWorkerDistributedIterator):
                if leaf._resource_id not in self._threads[0].resources:
                    raise ValueError(
                        "a per-worker iterator (or dataset) made by another ClusterCoordinator was passed to this "
                        "one's schedule: its workers do not hold it. Create it with this coordinator's "
                        "create_per_worker_dataset."
                    )
                el_treedef, specs = leaf._spec()
                kinds.append(program.ITER)
                iter_specs.append((leaf._resource_id, el_treedef, [_canonical(specs)]))
                # Not the iterator's id: a new iterator of the same signature reuses the program (TF keys a
                # tf.function's per-worker iterator argument by its element spec).
                key_parts.append(("iter", isinstance(leaf, PerWorkerDatasetValues)))
                if isinstance(leaf, PerWorkerDatasetValues):
                    datasets.add(leaf._resource_id)
            elif isinstance(leaf, PerWorkerValues):
                raise NotImplementedError(
                    "a PerWorkerValues other than a per-worker iterator as a scheduled input is not supported yet; "
                    "pass iter(coordinator.create_per_worker_dataset(...)), or plain arrays."
                )
            elif isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
                value = np.asarray(leaf)
                kinds.append(program.ARRAY)
                arrays.append(value)
                avals.append(jax.ShapeDtypeStruct(value.shape, value.dtype))
                key_parts.append(("array", value.shape, value.dtype.str))
            else:
                kinds.append(program.STATIC)
                statics.append(leaf)
                key_parts.append(("static", _static_key(leaf)))
        step_for = functools.partial(self._step_for, (_function_key(fn), treedef, tuple(key_parts)),
                                     fn, treedef, kinds, statics, avals, frozenset(datasets))
        step = step_for(iter_specs)
        remote_value = RemoteValue()
        remote_value._after_fetch = self._refresh_after_progress
        closure = Closure(step, arrays, remote_value)
        closure.retrace = functools.partial(_retrace, step_for)
        self._queue.put(closure)
        return remote_value

    def _step_for(self, key: Any, fn: Callable, treedef: Any, kinds: list, statics: list, avals: list,
                  datasets: frozenset, iter_specs: list) -> Any:
        """The step program of ``fn`` for this input signature, traced on first use (TF: one per signature).

        The signature is the arguments' (``key``) and, per iterator input, its
        elements' structure, shapes and dtypes; not which iterator it is: a new
        iterator of the same signature gets the traced programs with its own
        plan (``program.with_iterators``), no new trace.
        """
        import distribute.parameter_server.program as program

        signature = tuple((el_treedef, tuple(tuple(s) for s in specs)) for _, el_treedef, specs in iter_specs)
        resource_ids = tuple(rid for rid, _, _ in iter_specs)
        with self._trace_lock:
            step = self._steps.get((key, signature, resource_ids))
            if step is None:
                traced = self._traced.get((key, signature))
                if traced is None:
                    step = program.trace_step(self._strategy, fn, treedef, kinds, statics, avals, iter_specs, datasets)
                    family = self._families.setdefault((key, step.out_tree), len(self._families))
                    step.plan = dataclasses.replace(step.plan, family=family)
                    self._traced[(key, signature)] = step
                else:
                    step = program.with_iterators(traced, resource_ids)
                self._steps[(key, signature, resource_ids)] = step
        return step

    def join(self) -> None:
        """Blocks until every scheduled function has run; then the coordinator's variables hold the ps values.

        Raises:
            Exception: the first error of a scheduled function (queued functions are
                cancelled and the error cleared), or ``PSUnavailableError``.
        """
        self._queue.wait()
        self._strategy.extended._refresh()

    def done(self) -> bool:
        """Whether every scheduled function has run (raises the pending error like ``join``)."""
        finished = self._queue.done()
        if finished:
            self._strategy.extended._refresh()
        return finished

    def fetch(self, val: Any) -> Any:
        """``RemoteValue.fetch()`` over a nested structure; other leaves are returned unchanged.

        Afterwards the coordinator's variables hold the ps values (TF reads them
        from the ps), so a variable read after ``fetch`` sees the fetched
        functions' updates: one read of every ps variable when closures finished
        since the last refresh.
        """
        out = jax.tree_util.tree_map(
            lambda v: v._fetch_value() if isinstance(v, RemoteValue) else v, val, is_leaf=lambda x: isinstance(x, RemoteValue)
        )
        self._refresh_after_progress()
        return out

    def _refresh_after_progress(self) -> None:
        """Reads the ps values into the coordinator's copies, when closures finished since the last read."""
        finished = self._queue.finished
        if finished != self._refreshed_at:
            self._refreshed_at = finished
            self._strategy.extended._refresh()

    # -- datasets ------------------------------------------------------------------------------
    def create_per_worker_dataset(self, dataset_fn: Any) -> PerWorkerDataset:
        """A dataset built on every worker (TF: same name); ``iter()`` it and pass the iterator to ``schedule``.

        Accepts a function without arguments returning a ``distribute.data.Dataset``,
        a Dataset, the result of ``strategy.experimental_distribute_dataset`` /
        ``distribute_datasets_from_function``, or a ``DatasetCreator``.  The function
        (and a Dataset) are pickled to the workers, which run it; inside it,
        ``experimental_get_current_worker_index()`` tells which worker runs it.
        Datasets are rebuilt when a worker is restarted.
        """
        return PerWorkerDataset(self, pipeline_fn(dataset_fn))

    def _stop(self) -> None:
        self._queue.stop()


def _canonical(specs: list) -> list:
    """A worker's ``[(shape, dtype str), ...]`` as the program's inputs: dtypes as JAX has them (x64 off: 32 bits)."""
    return [(tuple(shape), np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(dtype)))) for shape, dtype in specs]


def _retrace(step_for: Callable, changed: ElementSpecChanged) -> Any:
    """The step for the element shapes a worker found (a partial batch): per iterator, one spec per element read."""
    iter_specs = []
    for rid, el_treedef, elements in changed.specs:
        specs = [_canonical(e) for e in elements]
        iter_specs.append((rid, el_treedef, specs[:1] if all(s == specs[0] for s in specs) else specs))
    return step_for(iter_specs)  # every element alike: the same signature as schedule's (one cached step)


def _unwrap_jit(fn: Callable) -> Callable:
    """The Python function of a ``jax.jit`` wrapper (schedule compiles the whole step itself)."""
    while hasattr(fn, "__wrapped__") and hasattr(fn, "lower") and hasattr(fn, "trace"):
        fn = fn.__wrapped__
    return fn


def _function_key(fn: Callable) -> Any:
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", None)
    if owner is not None and func is not None:
        return ("method", func, id(owner))
    return fn


def _static_key(leaf: Any) -> Any:
    try:
        hash(leaf)
    except TypeError:
        return ("id", id(leaf))
    if hasattr(leaf, "_distribute_placement") or not isinstance(leaf, (int, float, str, bool, type(None), tuple)):
        return ("id", id(leaf))
    return (type(leaf), leaf)
