"""ParameterServerStrategy (tf.distribute.ParameterServerStrategy) on Ray.

Variables created in the scope live on ps actors; functions scheduled with
``ClusterCoordinator.schedule`` run on worker actors; updates are applied by each
ps as they arrive (asynchronous training).  See ``cluster.py`` for the Ray side,
``program.py`` for how a scheduled function becomes programs, ``registry.py`` for
variable placement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import contextvars
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distribute import _context, _invocation
from distribute.keras_support import patches, ps_hooks
from distribute.parameter_server import transfer
from distribute.keras_support.ps_init import describe
from distribute.parameter_server.registry import OnPs, VariableRegistry, is_remote, ps_device
from distribute.replica import ReplicaContext
from distribute.extended import StrategyExtended
from distribute.placement import Placement
from distribute.strategy import CoordinatedStrategy, ValueContext
from distribute.values import ReduceOp, is_distributed

_SCHEDULING: contextvars.ContextVar[bool] = contextvars.ContextVar("distribute_ps_scheduling", default=False)
_LOG = logging.getLogger("distribute")
_DEFAULT_NUM_WORKERS, _DEFAULT_NUM_PS = 2, 1

USED_WITHOUT_COORDINATOR_WARNING = (
    "A `tf.distribute.experimental.ParameterServerStrategy` method is invoked without using "
    "`ClusterCoordinator.schedule`. If you are not tracing a tf.function, this method is possibly "
    "executed on the coordinator, which can be slow. To properly dispatch functions to run on "
    "workers, methods like `run` or `reduce` should be used within a function passed to "
    "`tf.distribute.experimental.coordinator.ClusterCoordinator.schedule`."
)


class _OnParameterServer(Placement):
    """A variable on a ps (``place_variable``'s answer): registered at creation, read and pushed through the cluster."""

    def __init__(self, extended: "ParameterServerStrategyExtended"):
        self._extended = extended

    def on_created(self, variable: Any) -> None:
        self._extended._on_variable_created(variable, ps_hooks.colocated_with())

    def before_read(self, variable: Any) -> None:
        self._extended._before_read(variable)

    def on_assign(self, variable: Any) -> None:
        self._extended._on_assign(variable)

    def initialize_with(self, variable: Any, initializer: Any) -> bool:
        return self._extended._initialize_on_ps(variable, initializer)

    def remote(self, variable: Any) -> bool:
        return isinstance(variable._value, OnPs)

    def table_parts(self, variable: Any, name: str) -> list:
        return self._extended._table_parts(variable, name)

    def save_parts(self, variable: Any, directory: str, name: str) -> list:
        return self._extended._save_parts(variable, directory, name)

    def load_parts(self, variable: Any, table: Any) -> None:
        self._extended._load_parts(variable, table)

    def row_pieces(self, variable: Any) -> Any:
        return transfer.row_pieces(self._extended._cluster, self._extended._registry.entry(variable))

    def read_shard(self, variable: Any, index: int) -> Any:
        return self._extended._read_shard(variable, index)

    def assign_shard(self, variable: Any, index: int, rows: Any) -> None:
        self._extended._assign_shard(variable, index, rows)

    def stored(self, variable: Any) -> Any:
        value = variable._value
        return jnp.asarray(value) if isinstance(value, OnPs) else value


class ParameterServerStrategyExtended(StrategyExtended):
    """The extended half of ParameterServerStrategy: variable placement and the cluster."""

    def __init__(self, strategy: ParameterServerStrategy):
        super().__init__(strategy)
        self._registry: VariableRegistry | None = None
        self._cluster: Any = None
        self._push_lock = threading.Lock()

    # -- TF's public names ----------------------------------------------------------------
    @property
    def worker_devices(self) -> tuple[str, ...]:
        """Each worker's devices as a scheduled function sees them (TF: ``("/device:CPU:0",)`` without GPUs)."""
        return ("/device:CPU:0",)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The ps tasks' devices, ``/job:ps/replica:0/task:<j>/device:CPU:0``."""
        return tuple(ps_device(j) for j in range(self._registry.num_ps))

    @property
    def num_workers(self) -> int:
        """The number of worker tasks (this project's addition; TF keeps it private)."""
        return self._num_workers

    @property
    def num_ps(self) -> int:
        """The number of ps tasks (this project's addition; TF keeps it private)."""
        return self._num_ps

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Places variables created inside on ``colocate_with_variable``'s ps (never partitioned), as TF."""
        with ps_hooks.colocate(colocate_with_variable):
            yield

    # -- where a variable lives -------------------------------------------------------------
    def place_variable(self, variable: Any) -> Placement:
        """On a ps: round-robin per variable (or per shard, with a ``variable_partitioner``) in creation
        order, an optimizer slot with its variable, as TF's ParameterServerStrategy."""
        return _OnParameterServer(self)

    def _on_variable_created(self, var: Any, colocate_with: Any) -> None:
        entry = self._registry.register(var, colocate_with)
        if len(entry.shards) == 1:
            var.device = ps_device(entry.shards[0].ps)
        else:
            from distribute.parameter_server.values import make_sharded

            make_sharded(var, [(s.start, s.stop) for s in entry.shards], [ps_device(s.ps) for s in entry.shards])
        if entry.remote:
            spec = var.__dict__.pop("_distribute_ps_init", None)
            if spec is not None:
                transfer.create_from(self._cluster, entry, spec)
                entry.on_ps = True
            elif var._value is not None:  # an initial array (the user's), or an initializer no ps can run
                self._send_remote(entry, var._value)

    def _initialize_on_ps(self, var: Any, initializer: Any) -> bool:
        """A large variable's first value is made on its ps from ``initializer``'s description
        (``keras_support/ps_init.py``); the coordinator keeps ``OnPs``.  False: made here, as Keras does."""
        if not is_remote(var):
            return False
        spec = describe(initializer, tuple(var.shape), var.dtype)
        if spec is None:
            return False
        var._value = self._on_ps(var)
        entry = self._registry.entry(var)
        if entry is None:  # in its constructor: created on the ps once registered (_on_variable_created)
            var.__dict__["_distribute_ps_init"] = spec
        else:  # a deferred variable (created while a function was traced), registered already
            transfer.create_from(self._cluster, entry, spec)
            entry.on_ps = True
        return True

    def _on_ps(self, var: Any) -> OnPs:
        return OnPs(tuple(var.shape), var.dtype, lambda: self._gather(var))

    def _gather(self, var: Any) -> Any:
        """The whole value of a remote variable, read from its ps (kept by the caller only)."""
        return transfer.gather(self._cluster, self._registry.entry(var))

    def _table_parts(self, var: Any, name: str) -> list:
        """The parts ``var`` is saved as: one zarr array per shard, ``{"file", "start", "stop"}`` (rows)."""
        rows = int(tuple(var.shape)[0])
        return [{"file": f"{name}_part_{i}", "start": s.start or 0, "stop": rows if s.stop is None else s.stop}
                for i, s in enumerate(self._registry.entry(var).shards)]

    def _save_parts(self, var: Any, directory: str, name: str) -> list:
        """Each ps writes its shards of ``var`` into ``directory`` (a checkpoint's tables); returns the parts."""
        entry = self._registry.entry(var)
        parts = self._table_parts(var, name)
        refs = [self._cluster.ps[s.ps].save_table.remote(s.key, f"{directory}/{part['file']}")
                for s, part in zip(entry.shards, parts)]
        try:
            self._cluster.get_from_ps(refs)
        except BaseException:
            import ray

            ray.wait(refs, num_returns=len(refs), timeout=600)  # the live ps finish before the caller deletes the parts
            raise
        return parts

    def _load_parts(self, var: Any, table: Any) -> None:
        """Each ps reads its shards of ``var`` from a saved table (any saved layout)."""
        entry = self._registry.entry(var)
        shape = tuple(var.shape)
        refs = []
        for s in entry.shards:
            start, stop = (0, shape[0]) if s.start is None else (s.start, s.stop)
            refs.append((s.ps, self._cluster.ps[s.ps].load_table.remote(
                s.key, table.directory, table.parts, start, (stop - start, *shape[1:]), np.dtype(var.dtype).name)))
        versions: dict = {}
        for (j, _), version in zip(refs, self._cluster.get_from_ps([r for _, r in refs])):
            versions[j] = max(versions.get(j, 0), version)
        self._cluster.observe(versions)
        entry.on_ps, entry.stale = True, False

    def _read_shard(self, var: Any, index: int) -> np.ndarray:
        """Shard ``index`` of a remote variable, read from its ps alone."""
        shard = self._registry.entry(var).shards[index]
        return transfer.gather(self._cluster, _OneShard(var, shard))

    def _assign_shard(self, var: Any, index: int, rows: Any) -> None:
        """Writes shard ``index`` of a remote variable on its ps alone, in pieces."""
        shard = self._registry.entry(var).shards[index]
        transfer.push(self._cluster, self._registry, [(_OneShard(var, shard), rows)])

    def _send_remote(self, entry: Any, value: Any) -> None:
        """Sends a remote variable's value to its ps in pieces; the coordinator keeps ``OnPs`` only."""
        transfer.push(self._cluster, self._registry, [(entry, value)])
        entry.on_ps, entry.stale = True, False
        entry.var._value = self._on_ps(entry.var)

    def _before_read(self, var: Any) -> None:
        """A read of ``var`` on the coordinator (not while a scheduled function is traced) sees its ps's value.

        TF reads the ps.  Here the coordinator keeps copies: after closures
        finished (``join``, ``fetch``) small ones are refreshed at once and larger
        ones (``transfer.EAGER_REFRESH_BYTES``) are marked stale and read when read
        here; while closures are queued or running, the read asks ``var``'s ps for
        its current value.
        """
        coordinator = self._container_strategy._cluster_coordinator
        if _SCHEDULING.get() or coordinator is None or self._cluster is None or not self._cluster.alive:
            return
        entry = self._registry.entry(var)
        if entry is None or not entry.on_ps or entry.remote:
            return
        if coordinator._queue.busy():
            transfer.pull(self._cluster, self._registry, [entry])
            return
        coordinator._refresh_after_progress()
        if entry.stale:
            transfer.pull(self._cluster, self._registry, [entry])

    def _on_assign(self, var: Any) -> None:
        """A coordinator-side assignment (set_weights, restore, reset_state): pushed to the ps at once."""
        entry = self._registry.entry(var)
        if entry is None or self._cluster is None:
            return
        if entry.remote:
            self._send_remote(entry, var._value)
            return
        if not entry.on_ps:
            return
        transfer.push(self._cluster, self._registry, [(entry, var._value)])
        entry.stale = False

    def _flush(self) -> None:
        """Sends every variable not yet on its ps there (initial values)."""
        with self._push_lock:
            pending = self._registry.pending()
            if not pending:
                return
            transfer.push(self._cluster, self._registry, [(entry, entry.var._value) for entry in pending])
            for entry in pending:
                entry.on_ps = True
                if entry.remote:
                    entry.var._value = self._on_ps(entry.var)

    def _refresh(self) -> None:
        """After closures finished: the coordinator's copies of small variables are read from the ps; larger ones
        are marked stale (read when read on the coordinator)."""
        entries = [e for e in self._registry.entries() if e.on_ps and not e.remote]
        for entry in entries:
            entry.stale = True
        transfer.pull(self._cluster, self._registry, [e for e in entries if transfer.nbytes(e.var) <= transfer.EAGER_REFRESH_BYTES])

    def keras_fit(self, model: Any, args: tuple, kwargs: dict) -> Any:
        """``model.fit(*args, **kwargs)`` under this strategy (called by the Keras seam, ``ps_hooks``)."""
        from distribute.parameter_server.keras_fit import fit

        return fit(self._container_strategy, model, *args, **kwargs)

    def keras_evaluate(self, model: Any, args: tuple, kwargs: dict) -> Any:
        """``model.evaluate(*args, **kwargs)`` on the workers (called by the Keras seam, ``ps_hooks``)."""
        from distribute.parameter_server.keras_eval import evaluate

        return evaluate(self._container_strategy, model, *args, **kwargs)

    def keras_predict(self, model: Any, args: tuple, kwargs: dict) -> Any:
        """``model.predict(*args, **kwargs)`` on the workers (called by the Keras seam, ``ps_hooks``)."""
        from distribute.parameter_server.keras_eval import predict

        return predict(self._container_strategy, model, *args, **kwargs)

    @contextlib.contextmanager
    def _scheduling(self) -> Iterator[None]:
        token = _SCHEDULING.set(True)
        try:
            yield
        finally:
            _SCHEDULING.reset(token)


class _OneShard:
    """One shard of a remote variable as ``transfer`` takes an entry: the shard's rows as a whole variable."""

    def __init__(self, var: Any, shard: Any):
        rows = int(tuple(var.shape)[0]) if shard.start is None else shard.stop - shard.start
        self.var = jax.ShapeDtypeStruct((rows, *tuple(var.shape)[1:]), var.dtype)
        self.shards = (dataclasses.replace(shard, start=None, stop=None),)


class ParameterServerStrategy(CoordinatedStrategy):
    """Asynchronous training with parameter servers (tf.distribute.ParameterServerStrategy), on Ray.

    Variables created in ``scope()`` (Keras layers, optimizer slots, metrics) live
    on ps tasks, round-robin per variable or shard (``variable.device`` names the
    task, ``/job:ps/replica:0/task:<j>/device:CPU:0``); functions scheduled with
    :class:`~distribute.coordinator.ClusterCoordinator` run on workers, each
    ps applying updates as they arrive.

    Cluster, in order: ``cluster_resolver`` gives the number of ps and worker
    tasks; without a resolver and counts, a TF_CONFIG with ``ps`` tasks is read
    (``TFConfigClusterResolver()``).  Ray: ``address=`` (or ``RAY_ADDRESS``) joins
    a running Ray cluster; a resolver whose task is the ``chief`` starts (or joins)
    the Ray head at the chief's ``host:port`` and waits for every ps and worker
    task to join it (each runs ``distribute.Server(...).join()``; see
    ``nodes.py`` and ``python -m distribute.launch --num-ps``); otherwise an
    embedded local Ray instance is started (2 workers and 1 ps by default) and
    shut down at exit.

    Args:
        cluster_resolver: a cluster resolver whose spec has ``ps`` and ``worker``
            jobs (and optionally a ``chief``: the coordinator, this process).
        variable_partitioner: a ``distribute.experimental.partitioners`` partitioner
            (axis 0 only), or None.
        num_workers: the number of worker tasks without a resolver (default 2).
        num_ps: the number of ps tasks without a resolver (default 1).
        address: a Ray address to join.

    Raises:
        ValueError: the cluster spec has no ps or no worker, is empty, or the counts
            disagree with the resolver (TF's messages).
    """

    _extended_cls = ParameterServerStrategyExtended

    def __init__(
        self,
        cluster_resolver: Any = None,
        variable_partitioner: Any = None,
        *,
        num_workers: int | None = None,
        num_ps: int | None = None,
        address: str | None = None,
    ):
        from distribute.parameter_server import cluster as ray_cluster

        if cluster_resolver is None and num_workers is None and num_ps is None:
            cluster_resolver = ray_cluster.tf_config_resolver()
        num_workers, num_ps = _task_counts(cluster_resolver, num_workers, num_ps)
        patches.install_parameter_server()
        super().__init__()
        self._cluster_resolver = cluster_resolver
        self._cluster_coordinator = None
        ray_cluster.connect_for(cluster_resolver, address, num_workers, num_ps)
        self._extended._registry = VariableRegistry(num_ps, variable_partitioner)
        self._extended._cluster = ray_cluster.Cluster(num_workers, num_ps)
        self._extended._num_workers, self._extended._num_ps = num_workers, num_ps
        self._finalizer = weakref.finalize(self, _shutdown, self._extended._cluster)

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas per worker (TF: GPUs per worker, or 1); each worker runs one here."""
        return 1

    def __reduce__(self) -> tuple:
        """Pickles to a :class:`~distribute.parameter_server.dataset.WorkerStrategy` (a dataset_fn that closes over
        the strategy, shipped to a worker): its input methods give the worker's own input, as TF's do there."""
        from distribute.parameter_server.dataset import WorkerStrategy

        return (WorkerStrategy, (self.num_replicas_in_sync,))

    def __deepcopy__(self, memo: dict) -> ParameterServerStrategy:
        return self  # one strategy owns the cluster; a copy would be the worker stand-in of __reduce__

    def __repr__(self) -> str:
        ext = self._extended
        return f"<ParameterServerStrategy num_workers={ext._num_workers} num_ps={ext._num_ps} at {id(self):#x}>"

    # -- run / reduce inside scheduled functions ---------------------------------------------
    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None, options: Any = None) -> Any:
        """Runs ``fn`` on the worker's replica (one per worker here), inside a scheduled function.

        Outside ``ClusterCoordinator.schedule`` it logs TF's warning and runs on the
        coordinator.
        """
        if not _SCHEDULING.get():
            _LOG.warning(USED_WITHOUT_COORDINATOR_WARNING)
        with _context.enter_replica(self, ReplicaContext(self, in_program=False)):
            return _invocation.call(fn, tuple(args), kwargs)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combines one worker's replicas (TF: only the local replicas, never across workers).

        One replica per worker: ``axis=None`` returns ``value``; an axis is summed or
        averaged.
        """
        if not _SCHEDULING.get():
            _LOG.warning(USED_WITHOUT_COORDINATOR_WARNING)
        op = ReduceOp.from_value(reduce_op)

        def one(v: Any) -> Any:
            v = jnp.asarray(v.values[0] if is_distributed(v) else v)
            if axis is None:
                return v
            return jnp.sum(v, axis=axis) if op is ReduceOp.SUM else jnp.mean(v, axis=axis)

        return jax.tree_util.tree_map(one, value, is_leaf=is_distributed)

    def gather(self, value: Any, axis: int) -> Any:
        return value

    def experimental_local_results(self, value: Any) -> tuple:
        return (value,)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Marks ``dataset`` for ``ClusterCoordinator.create_per_worker_dataset`` (TF builds nothing here either)."""
        from distribute.parameter_server.dataset import DistributedDatasetSpec

        return DistributedDatasetSpec(dataset=dataset, options=options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Marks ``dataset_fn(input_context)`` for ``create_per_worker_dataset``.

        Every worker gets ``InputContext(num_input_pipelines=1, input_pipeline_id=0)``
        as in TF: shard per worker with ``experimental_get_current_worker_index()``.
        """
        from distribute.parameter_server.dataset import DistributedDatasetSpec

        return DistributedDatasetSpec(dataset_fn=dataset_fn, options=options)

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> Any:
        return value_fn(ValueContext(0, 1))

    def _shutdown(self) -> None:
        """Stops the coordinator's threads and kills this strategy's actors."""
        coordinator = self._cluster_coordinator
        if coordinator is not None:
            coordinator._stop()
        self._finalizer()


def _shutdown(cluster: Any) -> None:
    cluster.shutdown()


def _task_counts(resolver: Any, num_workers: int | None, num_ps: int | None) -> tuple[int, int]:
    for name, value in (("num_workers", num_workers), ("num_ps", num_ps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"ParameterServerStrategy: {name} must be a positive int, got {value!r}.")
    if resolver is None:
        return num_workers or _DEFAULT_NUM_WORKERS, num_ps or _DEFAULT_NUM_PS
    spec = resolver.cluster_spec()
    jobs = spec.as_dict() if hasattr(spec, "as_dict") else dict(spec)
    if not jobs:
        raise ValueError("Cluster spec must be non-empty in `tf.distribute.cluster_resolver.ClusterResolver`.")
    allowed = ("chief", "worker", "ps", "evaluator")
    task_type = getattr(resolver, "task_type", None)
    if task_type not in (None, *allowed):
        raise ValueError(f'Unrecognized task_type: {task_type}, valid task types are: "chief", "worker", "evaluator" and "ps".')
    if any(job not in allowed for job in jobs):
        raise ValueError(
            f"Disallowed task type found in cluster spec. Allowed types are {allowed} and the cluster spec is {jobs}."
        )
    if len(jobs.get("chief", ())) > 1:
        raise ValueError("There must be at most one 'chief' job.")
    if not jobs.get("ps"):
        raise ValueError("There must be at least one ps.")
    if not jobs.get("worker"):
        raise ValueError("There must be at least one worker.")
    counts = len(jobs["worker"]), len(jobs["ps"])
    for name, given, found in (("num_workers", num_workers, counts[0]), ("num_ps", num_ps, counts[1])):
        if given is not None and given != found:
            raise ValueError(
                f"ParameterServerStrategy: {name}={given} disagrees with the cluster spec, which has {found}; "
                "pass one or the other."
            )
    return counts
