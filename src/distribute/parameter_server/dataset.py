"""Per-worker datasets and iterators (TF: PerWorkerDataset, PerWorkerDistributedIterator) and DatasetCreator."""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from distribute.parameter_server.values import (
    PerWorkerValues,
    RemoteValue,
    RemoteValueStatus,
)

_RESOURCE_IDS = itertools.count()


class DatasetCreator:
    """A dataset function for ``model.fit`` under ParameterServerStrategy (TF: ``tf.keras.utils.experimental.DatasetCreator``).

    ``dataset_fn(input_context)`` returns a ``distribute.data.Dataset`` of
    per-worker batches; every worker calls it (TF gives each worker
    ``input_pipeline_id=0``; shard with ``experimental_get_current_worker_index()``).

    Raises:
        TypeError: ``dataset_fn`` is not callable (TF's message).
    """

    def __init__(self, dataset_fn: Callable, input_options: Any = None):
        if not callable(dataset_fn):
            raise TypeError("`dataset_fn` for `DatasetCreator` must be a `callable`.")
        self.dataset_fn = dataset_fn
        self.input_options = input_options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dataset = self.dataset_fn(*args, **kwargs)
        if not hasattr(dataset, "__iter__"):
            raise TypeError(
                "The `callable` provided to `DatasetCreator` must return a Dataset; it returned "
                f"{type(dataset).__name__}."
            )
        return dataset


@dataclasses.dataclass
class DistributedDatasetSpec:
    """What ``experimental_distribute_dataset`` / ``distribute_datasets_from_function`` return under PS."""

    dataset: Any = None
    dataset_fn: Callable | None = None
    options: Any = None

    def __iter__(self):
        raise ValueError(
            "A dataset distributed by ParameterServerStrategy is built on the workers: pass it to "
            "ClusterCoordinator.create_per_worker_dataset(...) and iterate that inside scheduled functions."
        )


@dataclasses.dataclass(frozen=True)
class ElementSpecChanged:
    """A worker's answer to a run whose elements do not have its program's shapes (a partial batch).

    ``specs``: per iterator of the plan, ``(resource_id, element treedef, [[(shape,
    dtype str), ...] per element read])``.  The elements went back to their
    iterators; the coordinator runs the closure again with the program of this
    signature (TF's ``tf.function`` retraces for a new input signature).
    """

    specs: tuple


def _input_context(num_replicas_in_sync: int = 1) -> Any:
    from distribute.input.input_context import InputContext

    # TF (parameter_server_strategy_v2._distribute_datasets_from_function): "no synchronization beyond
    # a worker": every worker's pipeline is input pipeline 0 of 1.
    return InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=num_replicas_in_sync)


class WorkerStrategy:
    """A ParameterServerStrategy as a ``dataset_fn`` sees it on a worker (its pickled form).

    A ``dataset_fn`` given to ``create_per_worker_dataset`` may close over the strategy
    and call ``strategy.distribute_datasets_from_function(fn)`` or
    ``strategy.experimental_distribute_dataset(dataset)`` (TF's tutorial does); on the
    worker these give the worker's own input, as TF builds it there: ``fn`` gets
    ``InputContext(num_input_pipelines=1, input_pipeline_id=0)`` (TF: every worker's
    pipeline is its own; shard with ``experimental_get_current_worker_index()``).
    Devices and Ray handles stay on the coordinator.
    """

    def __init__(self, num_replicas_in_sync: int = 1):
        self._num_replicas_in_sync = num_replicas_in_sync
        self.extended = _WorkerExtended()

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        return dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        return dataset_fn(_input_context(self._num_replicas_in_sync))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"ParameterServerStrategy.{name} is not available inside a dataset_fn on a worker: there the strategy "
            "offers only distribute_datasets_from_function, experimental_distribute_dataset and "
            "num_replicas_in_sync. Read what else the dataset_fn needs on the coordinator, outside the function."
        )


_NO_VARIABLES = "Creating variables in `dataset_fn` is not allowed."  # TF's message (coordinator/values.py)


class _WorkerExtended:
    """Refuses the question a Keras variable created in its scope asks: where it lives."""

    def place_variable(self, variable: Any) -> Any:
        raise ValueError(_NO_VARIABLES)


def _fresh_seeds(dataset: Any) -> Any:
    """Gives each unseeded shuffle of a shipped Dataset a seed of this worker's own (TF: shuffled differently)."""
    for stream in getattr(dataset, "_seeds", ()):
        if not stream.agreed:
            stream.agree(secrets.randbits(63))
    return dataset


class _PipelineFn:
    """The picklable ``dataset_fn`` a worker calls: a dataset, a no-argument function, or fn(InputContext).

    ``fresh_iterators``: the worker keeps the dataset (``PerWorkerDataset.build()``)
    and every scheduled call that uses it starts a new iterator.
    """

    def __init__(self, dataset: Any = None, fn: Callable | None = None, with_context: bool = False,
                 fresh_iterators: bool = False):
        self._dataset, self._fn, self._with_context = dataset, fn, with_context
        self.fresh_iterators = fresh_iterators

    def built(self) -> _PipelineFn:
        return _PipelineFn(self._dataset, self._fn, self._with_context, fresh_iterators=True)

    def __call__(self) -> Any:
        """Runs on a worker; a Keras variable created meanwhile is TF's ValueError."""
        if self._fn is None:
            return _fresh_seeds(self._dataset)
        if "keras" not in sys.modules:  # the function cannot create Keras variables
            return self._call()
        from distribute import _context
        from distribute.keras_support import patches

        patches.install_parameter_server()
        with _context.enter_scope(WorkerStrategy()):
            return self._call()

    def _call(self) -> Any:
        # A Dataset the function closes over was pickled with the coordinator's seeds: draw this worker's.
        return _fresh_seeds(self._fn(_input_context()) if self._with_context else self._fn())


def element_specs(dataset: Any) -> Any:
    """The public ``element_spec`` of a worker's dataset: the Dataset's own (TensorSpec structure), else its first element's.

    None for an empty dataset that has no ``element_spec`` of its own.
    """
    from distribute.data import _spec

    if hasattr(type(dataset), "element_spec"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return dataset.element_spec
        except Exception:  # noqa: BLE001 - fall back to the element itself
            pass
    try:
        return _spec.spec_of_element(next(iter(dataset)))
    except StopIteration:
        return None
    except Exception:  # noqa: BLE001 - a leaf without a spec (a Python object)
        return None


def pipeline_fn(dataset_fn: Any) -> _PipelineFn:
    """Normalizes create_per_worker_dataset's argument (TF accepts the same four kinds)."""
    if isinstance(dataset_fn, DistributedDatasetSpec):
        if dataset_fn.dataset_fn is not None:
            return _PipelineFn(fn=dataset_fn.dataset_fn, with_context=True)
        return _PipelineFn(dataset=dataset_fn.dataset)
    if isinstance(dataset_fn, DatasetCreator):
        return _PipelineFn(fn=dataset_fn, with_context=True)
    if hasattr(dataset_fn, "__iter__") and not callable(dataset_fn):
        return _PipelineFn(dataset=dataset_fn)
    if hasattr(dataset_fn, "cardinality"):  # a distribute.data.Dataset (callable or not)
        return _PipelineFn(dataset=dataset_fn)
    if callable(dataset_fn):
        return _PipelineFn(fn=dataset_fn)
    raise TypeError(
        f"create_per_worker_dataset takes a dataset function, a Dataset or a distributed dataset; got "
        f"{type(dataset_fn).__name__}."
    )


class ResourceRemoteValue(RemoteValue):
    """A worker's iterator: READY once the worker built it (its value is the element spec)."""

    def __init__(self) -> None:
        super().__init__()
        self._ref: Any = None
        self._lock = threading.Lock()

    def _start(self, ref: Any) -> None:
        with self._lock:
            self._reset()
            self._ref = ref

    def _spec(self, timeout: float | None = None) -> Any:
        """``(treedef, [(shape, dtype), ...])`` of the first element, or None (an empty dataset).

        Raises:
            Exception: what the worker's ``dataset_fn`` raised, with its own type.
        """
        import ray
        from ray import exceptions as rx

        with self._lock:
            ref = self._ref
        if self._status is RemoteValueStatus.ABORTED:
            raise self._error
        try:
            spec = ray.get(ref, timeout=timeout)
        except rx.RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise
        self._set_value(spec)
        return spec

    def fetch(self) -> Any:
        raise ValueError("a per-worker iterator has no value to fetch; pass it to a scheduled function.")


class PerWorkerDistributedIterator(PerWorkerValues):
    """``iter(per_worker_dataset)``: one iterator per worker; pass it to scheduled functions.

    Raises:
        NotImplementedError: ``next()`` on the coordinator (TF's message).
    """

    def __init__(self, values: tuple, resource_id: int):
        super().__init__(values)
        self._resource_id = resource_id
        self._answer: Any = None

    def _spec(self) -> Any:
        """``(treedef, [(shape, dtype), ...])`` of the first element of a worker's dataset.

        Raises:
            ValueError: the dataset is empty (a scheduled function needs an element's shapes).
        """
        if self._answer is None:
            errors = []
            for value in self._values:
                try:
                    spec = value._spec(timeout=600)
                except Exception as err:  # noqa: BLE001 - try the next worker
                    errors.append(err)
                    continue
                if spec is None:
                    raise ValueError("the per-worker dataset is empty; a scheduled function cannot call next() on it.")
                self._answer = spec
                break
            else:
                raise errors[0]
        return self._answer

    def __next__(self) -> Any:
        raise NotImplementedError("Iterating over an `AsyncDistributedIterator` is not supported right now.")

    def __iter__(self) -> PerWorkerDistributedIterator:
        return self


class PerWorkerDatasetValues(PerWorkerDistributedIterator):
    """``PerWorkerDataset.build()``: the dataset built on every worker (TF: a PerWorkerValues of datasets).

    A scheduled function given it receives the executing worker's dataset; each
    ``iter()`` on it (once per call) starts a fresh iterator there, as ``iter()`` in
    a ``tf.function`` does: ``next(iter(dataset))`` is the first element every call.
    """


class PerWorkerDataset:
    """The result of ``create_per_worker_dataset``; ``iter()`` builds an iterator on every worker."""

    def __init__(self, coordinator: Any, fn: _PipelineFn):
        self._coordinator, self._fn = coordinator, fn
        self._built: PerWorkerDatasetValues | None = None

    def _create(self, fn: _PipelineFn, cls: type) -> Any:
        resource_id = next(_RESOURCE_IDS)
        values = tuple(ResourceRemoteValue() for _ in self._coordinator._threads)
        for thread, value in zip(self._coordinator._threads, values):
            thread.add_resource(resource_id, fn, value)
        return cls(values, resource_id)

    def __iter__(self) -> PerWorkerDistributedIterator:
        return self._create(self._fn, PerWorkerDistributedIterator)

    def build(self) -> PerWorkerDatasetValues:
        """Builds the dataset on every worker without an iterator (TF: same name); pass the result to ``schedule``."""
        if self._built is None:
            self._built = self._create(self._fn.built(), PerWorkerDatasetValues)
        return self._built

    @property
    def element_spec(self) -> Any:
        """The type of an element (TF: same name): the dataset's ``element_spec``, a structure of ``TensorSpec``.

        Read from a worker's built dataset (built once, on the first call); None for an
        empty dataset without an ``element_spec`` of its own.
        """
        import ray

        built = self.build()
        errors = []
        for thread, value in zip(self._coordinator._threads, built._values):
            try:
                value._spec(timeout=600)  # built there, or what its dataset_fn raised
                return ray.get(thread.actor.element_spec.remote(built._resource_id), timeout=600)
            except Exception as err:  # noqa: BLE001 - try the next worker
                errors.append(err)
        raise errors[0]
