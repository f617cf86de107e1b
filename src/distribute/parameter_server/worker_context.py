"""Which worker is running (``experimental_get_current_worker_index``); light, no Ray, no Keras."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_WORKER_INDEX: contextvars.ContextVar[int | None] = contextvars.ContextVar("distribute_ps_worker_index", default=None)


def experimental_get_current_worker_index() -> int:
    """The index of the worker running the current ``dataset_fn`` (TF: same name).

    Call it inside the ``dataset_fn`` given to ``create_per_worker_dataset`` to shard
    input per worker (TF gives every worker input pipeline id 0, so nothing else
    shards across workers): ``dataset.shard(num_workers, experimental_get_current_worker_index())``.

    Raises:
        RuntimeError: called anywhere else (TF raises too: the index exists only
            while a worker builds its dataset).
    """
    index = _WORKER_INDEX.get()
    if index is None:
        raise RuntimeError(
            "experimental_get_current_worker_index() may only be called inside the dataset_fn "
            "given to ClusterCoordinator.create_per_worker_dataset, while a worker builds its "
            "dataset; it was called elsewhere (on the coordinator)."
        )
    return index


@contextlib.contextmanager
def worker_index_scope(index: int) -> Iterator[None]:
    token = _WORKER_INDEX.set(index)
    try:
        yield
    finally:
        _WORKER_INDEX.reset(token)
