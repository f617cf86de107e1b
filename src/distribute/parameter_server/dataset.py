"""Per-worker datasets and iterators (TF: PerWorkerDataset, PerWorkerDistributedIterator) and DatasetCreator."""

from __future__ import annotations

import dataclasses
import itertools
import threading
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


class _PipelineFn:
    """The picklable ``dataset_fn`` a worker calls: a dataset, a no-argument function, or fn(InputContext)."""

    def __init__(self, dataset: Any = None, fn: Callable | None = None, with_context: bool = False):
        self._dataset, self._fn, self._with_context = dataset, fn, with_context

    def __call__(self) -> Any:
        if self._fn is None:
            return self._dataset
        if self._with_context:
            from distribute.input.input_context import InputContext

            return self._fn(InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1))
        return self._fn()


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
        import ray

        with self._lock:
            ref = self._ref
        if self._status is RemoteValueStatus.ABORTED:
            raise self._error
        spec = ray.get(ref, timeout=timeout)
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
        self._element_spec: Any = None

    def _spec(self) -> Any:
        if self._element_spec is None:
            errors = []
            for value in self._values:
                try:
                    spec = value._spec(timeout=600)
                except Exception as err:  # noqa: BLE001 - try the next worker
                    errors.append(err)
                    continue
                if spec is None:
                    raise ValueError("the per-worker dataset is empty; a scheduled function cannot call next() on it.")
                self._element_spec = spec
                break
            else:
                raise errors[0]
        return self._element_spec

    def __next__(self) -> Any:
        raise NotImplementedError("Iterating over an `AsyncDistributedIterator` is not supported right now.")

    def __iter__(self) -> PerWorkerDistributedIterator:
        return self


class PerWorkerDataset:
    """The result of ``create_per_worker_dataset``; ``iter()`` builds an iterator on every worker."""

    def __init__(self, coordinator: Any, fn: _PipelineFn):
        self._coordinator, self._fn = coordinator, fn

    def __iter__(self) -> PerWorkerDistributedIterator:
        resource_id = next(_RESOURCE_IDS)
        values = tuple(ResourceRemoteValue() for _ in self._coordinator._threads)
        for thread, value in zip(self._coordinator._threads, values):
            thread.add_resource(resource_id, self._fn, value)
        return PerWorkerDistributedIterator(values, resource_id)

    @property
    def element_spec(self) -> Any:
        """The element structure: ``(treedef, [(shape, dtype), ...])`` of one element."""
        return iter(self)._spec()
