"""MultiWorkerMirroredStrategy: synchronous training over every worker's devices.

Every worker runs the same program.  The cluster comes from a ClusterResolver
(TF_CONFIG by default); ``jax.distributed`` joins the workers (its coordination
service runs on the chief, or worker 0); the strategy's mesh has one axis,
``"replica"``, over all workers' devices, worker 0's first.  Collectives inside
compiled steps go over gloo on CPU (NCCL on GPU).

Input: each worker feeds only its replicas' share of every global batch.  Before
each step the workers exchange their batch sizes through the coordination
service's key-value store (a few bytes, with a timeout): a step runs while any
worker still has data, workers without data feed empty, fully masked batches,
and all of them stop together, so uneven input never hangs.  A worker that does
not answer within ``CommunicationOptions.timeout_seconds`` is named in the error;
a worker that dies is detected by the coordination service's heartbeats within
the same timeout, and every surviving worker stops with a message naming it.
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import os
import pickle
import sys
import threading
import time
from typing import Any, Iterator

import jax
import numpy as np

from distribute.strategy import Strategy, StrategyExtended

DEFAULT_TIMEOUT_SECONDS = 300.0


class CommunicationImplementation(enum.Enum):
    """Cross-worker collective implementation (tf.distribute.experimental.CommunicationImplementation).

    ``AUTO`` picks gloo on CPU and NCCL on GPU (XLA's); ``RING`` means gloo;
    ``NCCL`` is accepted and used on GPUs.
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """Options for cross-worker communication (tf.distribute.experimental.CommunicationOptions).

    Args:
        bytes_per_pack: accepted for compatibility (XLA packs collectives itself).
        timeout_seconds: the longest any cross-worker wait may take: joining the
            cluster, the per-step input agreement, and the heartbeat after which
            a silent worker counts as lost.  None: 300 seconds (TF: no timeout;
            here a lost worker must never hang the others).
        implementation: a :class:`CommunicationImplementation`.

    Raises:
        ValueError: a non-positive timeout or an unknown implementation.
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        if self.timeout_seconds is not None and not self.timeout_seconds > 0:
            raise ValueError(f"timeout_seconds={self.timeout_seconds!r} must be > 0 seconds, or None for the default.")
        if not isinstance(self.implementation, CommunicationImplementation):
            try:
                object.__setattr__(self, "implementation", CommunicationImplementation(str(self.implementation).upper()))
            except ValueError:
                raise ValueError(
                    f"implementation={self.implementation!r} is not a CommunicationImplementation; "
                    "use CommunicationImplementation.AUTO, RING or NCCL."
                ) from None

    @property
    def effective_timeout_seconds(self) -> float:
        return float(self.timeout_seconds or DEFAULT_TIMEOUT_SECONDS)


class WorkerLostError(RuntimeError):
    """A worker stopped answering within the communication timeout."""


@dataclasses.dataclass(frozen=True)
class _Cluster:
    """This job's synchronous workers, read once from a resolver."""

    num_workers: int
    worker_id: int
    is_chief: bool
    coordinator: str | None
    names: tuple[str, ...]  # per worker id: "worker 1 (127.0.0.1:1234)"


def _read_cluster(resolver: Any) -> _Cluster:
    from distribute.cluster import roles

    spec = resolver.cluster_spec()
    if not spec or roles.num_workers(spec) <= 1:
        return _Cluster(1, 0, True, None, ("worker 0",))
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type is None or task_id is None:
        raise ValueError(
            f"The cluster {spec!r} has several workers but the resolver does not say which task "
            "this process is; set TF_CONFIG's 'task' (or task_type and task_id)."
        )
    if task_type not in (roles.CHIEF, roles.WORKER):
        raise ValueError(
            f"MultiWorkerMirroredStrategy runs on 'chief' and 'worker' tasks, not {task_type!r}; "
            "an evaluator uses its own (single-worker) strategy, ps tasks ParameterServerStrategy."
        )
    names = []
    for job in (roles.CHIEF, roles.WORKER):
        if job in spec.jobs:
            for i in sorted(spec.task_indices(job)):
                names.append(f"{job} {i} ({spec.task_address(job, i)})")
    return _Cluster(
        num_workers=roles.num_workers(spec),
        worker_id=roles.worker_index(task_type, task_id, spec),
        is_chief=roles.is_chief(spec, task_type, task_id),
        coordinator=roles.coordinator_address(spec),
        names=tuple(names),
    )


# -- joining the workers -------------------------------------------------------------------
def _join(cluster: _Cluster, timeout_seconds: float) -> Any:
    """Starts jax.distributed for ``cluster`` (once per process); returns its client.

    Like ``jax.distributed.initialize`` with every wait bounded by
    ``timeout_seconds``, and a heartbeat callback that names the lost worker
    instead of aborting with a bare status.
    """
    from jax._src import distributed as jax_distributed
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    state = jax_distributed.global_state
    if state.client is not None:
        if state.num_processes != cluster.num_workers or state.process_id != cluster.worker_id:
            raise RuntimeError(
                f"jax.distributed is already initialized as process {state.process_id} of "
                f"{state.num_processes}, but the cluster says worker {cluster.worker_id} of "
                f"{cluster.num_workers}; create the strategy once, from the same cluster."
            )
        return state.client
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "MultiWorkerMirroredStrategy must be created before JAX starts its backend (before any "
            "jax.devices() call or computation), since jax.distributed must join the workers first. "
            "Create the strategy at the start of the program."
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    seconds = max(int(round(timeout_seconds)), 1)
    backstop = 2 * seconds  # jax's own heartbeat abort; the watchdog below names the worker first
    port = cluster.coordinator.rsplit(":", 1)[1]
    if cluster.worker_id == 0:
        state.service = _jax.get_distributed_runtime_service(
            f"[::]:{port}", cluster.num_workers, heartbeat_timeout=backstop, shutdown_timeout=seconds
        )
    state.num_processes = cluster.num_workers
    state.process_id = cluster.worker_id
    state.coordinator_address = cluster.coordinator
    state.client = _jax.get_distributed_runtime_client(
        cluster.coordinator,
        cluster.worker_id,
        init_timeout=seconds,
        shutdown_timeout=seconds,
        heartbeat_timeout=backstop,
        use_compression=True,
    )
    try:
        state.client.connect()
    except Exception as err:  # noqa: BLE001 - jaxlib raises its own runtime error type
        raise WorkerLostError(
            f"worker {cluster.worker_id} could not join the cluster within {seconds} s: "
            f"{_missing_text(cluster, range(cluster.num_workers))} did not all connect to the "
            f"coordinator at {cluster.coordinator} ({err}). Start every worker, or raise "
            "CommunicationOptions.timeout_seconds."
        ) from err
    state.initialize_preemption_sync_manager()
    _Watchdog(state.client, cluster, timeout_seconds).start()
    return state.client


def _missing_text(cluster: _Cluster, ids: Any) -> str:
    return ", ".join(cluster.names[i] for i in ids if i != cluster.worker_id) or "the other workers"


class _Watchdog(threading.Thread):
    """Every worker publishes a heartbeat counter; a worker whose counter stops for
    ``timeout_seconds`` is lost: this worker prints whom and exits (a blocked
    collective cannot be interrupted from Python).  A worker that exits normally
    says so first and is not counted as lost."""

    def __init__(self, client: Any, cluster: _Cluster, timeout_seconds: float):
        super().__init__(name="distribute-watchdog", daemon=True)
        self._client, self._cluster, self._timeout = client, cluster, timeout_seconds
        self._period = min(1.0, timeout_seconds / 4)
        self._stopped = threading.Event()
        atexit.register(self.stop)

    def stop(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            try:
                self._client.key_value_set(self._key(self._cluster.worker_id), "exited", allow_overwrite=True)
            except Exception:  # noqa: BLE001 - the service may be gone already
                pass

    def _key(self, worker_id: int) -> str:
        return f"distribute/alive/{worker_id}"

    def run(self) -> None:
        cluster, beat = self._cluster, 0
        others = [w for w in range(cluster.num_workers) if w != cluster.worker_id]
        last = {w: (None, time.monotonic()) for w in others}
        service_ok = time.monotonic()
        while not self._stopped.wait(self._period):
            now = time.monotonic()
            beat += 1
            try:
                self._client.key_value_set(self._key(cluster.worker_id), str(beat), allow_overwrite=True)
                values = {w: self._try_get(self._key(w)) for w in others}
                service_ok = now
            except Exception as err:  # noqa: BLE001
                if now - service_ok > self._timeout and not self._stopped.is_set():
                    self._fail([0], f"the coordination service on it does not answer ({err})")
                continue
            for w, value in values.items():
                if value == "exited":
                    last[w] = (value, now)
                elif value != last[w][0]:
                    last[w] = (value, now)
                elif now - last[w][1] > self._timeout and not self._stopped.is_set():
                    self._fail([w], f"it sent no heartbeat for {self._timeout:g} s")

    def _try_get(self, key: str) -> str | None:
        try:
            return self._client.key_value_try_get(key)
        except Exception as err:  # noqa: BLE001 - NOT_FOUND before the first beat
            if "NOT_FOUND" in str(err) or "not found" in str(err).lower():
                return None
            raise

    def _fail(self, lost: list[int], why: str) -> None:
        cluster = self._cluster
        sys.stderr.write(
            f"\nMultiWorkerMirroredStrategy on {cluster.names[cluster.worker_id]}: lost "
            f"{_missing_text(cluster, lost)}: {why} (CommunicationOptions.timeout_seconds="
            f"{self._timeout:g}); the worker died or hangs. Stopping this worker too; restart the "
            "job (BackupAndRestore resumes from the last backup).\n"
        )
        sys.stderr.flush()
        os._exit(75)


class _Exchange:
    """All-gathers a few bytes between workers through the coordination service, with a timeout."""

    def __init__(self, client: Any, cluster: _Cluster, timeout_seconds: float):
        self._client, self._cluster, self._timeout = client, cluster, timeout_seconds
        self._count = 0

    def new_channel(self) -> str:
        self._count += 1
        return f"distribute/{self._count}"

    def all_gather(self, key: str, payload: bytes, what: str) -> list[bytes]:
        cluster = self._cluster
        self._client.key_value_set_bytes(f"{key}/{cluster.worker_id}", payload)
        deadline = time.monotonic() + self._timeout
        out: list[bytes] = []
        for w in range(cluster.num_workers):
            if w == cluster.worker_id:
                out.append(payload)
                continue
            remaining_ms = max(int((deadline - time.monotonic()) * 1000), 1)
            try:
                out.append(self._client.blocking_key_value_get_bytes(f"{key}/{w}", remaining_ms))
            except Exception as err:  # noqa: BLE001 - jaxlib's runtime error
                missing = [v for v in range(w, cluster.num_workers) if v != cluster.worker_id and not self._has(f"{key}/{v}")]
                raise WorkerLostError(
                    f"{_missing_text(cluster, missing or [w])} did not reach {what} within "
                    f"{self._timeout:g} s (CommunicationOptions.timeout_seconds): the worker is lost "
                    f"or stuck. Restart the job; BackupAndRestore resumes from the last backup. ({err})"
                ) from err
        return out

    def _has(self, key: str) -> bool:
        try:
            return self._client.key_value_try_get_bytes(key) is not None
        except Exception:  # noqa: BLE001 - a missing key raises NOT_FOUND
            return False

    def delete(self, key: str) -> None:
        try:
            self._client.key_value_delete(f"{key}/{self._cluster.worker_id}")
        except Exception:  # noqa: BLE001 - cleanup only
            pass


# -- the strategy ---------------------------------------------------------------------------
class MultiWorkerExtended(StrategyExtended):
    """StrategyExtended over all workers' devices; see :class:`MultiWorkerMirroredStrategy`."""

    def __init__(self, strategy: "MultiWorkerMirroredStrategy", devices: Any):
        super().__init__(strategy, devices)
        self._cluster: _Cluster = strategy._cluster_info
        self._exchange: _Exchange | None = strategy._exchange_obj

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker writes checkpoints: the chief only (as TF)."""
        return self._cluster.is_chief

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker writes summaries: the chief only (as TF)."""
        return self._cluster.is_chief

    @property
    def experimental_between_graph(self) -> bool:
        return True

    @property
    def experimental_should_init(self) -> bool:
        return True

    def _input_pipelines(self) -> tuple[int, int]:
        return self._cluster.num_workers, self._cluster.worker_id

    def _policy(self, dataset: Any) -> Any:
        from distribute.data.options import AutoShardPolicy

        try:
            policy = dataset.options().experimental_distribute.auto_shard_policy
        except AttributeError:
            policy = AutoShardPolicy.AUTO
        if policy == AutoShardPolicy.FILE:
            raise ValueError(
                f"auto_shard_policy=FILE needs a file-based dataset with at least num_workers="
                f"{self._cluster.num_workers} files, but this dataset reads 0 files. Use "
                "AutoShardPolicy.DATA (or AUTO), or shard the files yourself and use OFF."
            )
        if policy == AutoShardPolicy.AUTO:
            return AutoShardPolicy.DATA  # as TF for a dataset that reads no files
        return policy

    def _shard_dataset(self, dataset: Any) -> Any:
        """The elements this worker reads (TF's AutoShardPolicy).

        DATA (and AUTO, as TF for non-file sources): every worker reads every
        global batch and keeps its replicas' rows of it (TF rebatches the global
        batch B to B / num_workers per worker); OFF and HINT (there is no
        shard hint to replace): every worker reads the whole dataset; FILE:
        ValueError, there are no files to split.
        """
        self._policy(dataset)
        return dataset

    def _dataset_cardinality(self, dataset: Any) -> int:
        from distribute.data.options import AutoShardPolicy

        cardinality = dataset.cardinality()
        if self._policy(dataset) == AutoShardPolicy.DATA or cardinality < 0:
            return cardinality
        return cardinality * self._cluster.num_workers

    def _dataset_batches(self, dataset: Any, rows_per_replica: int) -> Iterator[tuple[list, Any, np.ndarray | None]]:
        """Global split of each global batch; DATA keeps this worker's slice, OFF walks every worker's slice."""
        from distribute.data.options import AutoShardPolicy
        from distribute.input.splitting import split_batch

        policy = self._policy(dataset)
        num_local, me = len(self._local_devices), self._cluster.worker_id
        workers = [me] if policy == AutoShardPolicy.DATA else range(self._cluster.num_workers)
        for element in dataset:
            leaves, treedef = jax.tree_util.tree_flatten(element)
            stacked, lengths = split_batch(leaves, len(self._devices), rows_per_replica)
            for w in workers:
                part = slice(w * num_local, (w + 1) * num_local)
                local = [x[part] for x in stacked]
                counts = np.full(num_local, rows_per_replica, np.int64) if lengths is None else lengths[part]
                yield local, treedef, counts

    def _agree(self, batches: Iterator) -> Iterator[tuple[list, Any, np.ndarray | None]]:
        """Runs a step while any worker has data; workers without data feed empty, masked batches."""
        exchange, num_local = self._exchange, len(self._local_devices)
        if exchange is None:
            for stacked, treedef, counts in batches:
                rows = stacked[0].shape[1] if stacked and stacked[0].ndim > 1 else 0
                yield stacked, treedef, (None if counts is None or bool(np.all(counts == rows)) else counts)
            return
        channel = exchange.new_channel()
        template = None
        source = iter(batches)
        step = 0
        while True:
            try:
                stacked, treedef, counts = next(source)
                if counts is None:
                    counts = np.full(num_local, stacked[0].shape[1] if stacked else 0, np.int64)
                spec = (treedef, [(x.shape, x.dtype.str) for x in stacked])
                template = spec
            except StopIteration:
                stacked, counts, spec = None, np.zeros(num_local, np.int64), template
            key = f"{channel}/{step}"
            gathered = [pickle.loads(p) for p in exchange.all_gather(key, pickle.dumps((counts.tolist(), spec)), f"input step {step}")]
            if step >= 2:
                exchange.delete(f"{channel}/{step - 2}")
            step += 1
            lengths = np.asarray([n for worker_counts, _ in gathered for n in worker_counts], np.int64)
            if not lengths.any():
                return  # this step's keys stay: the others may not have read them yet
            if stacked is None:
                spec = spec or next(s for _, s in gathered if s is not None)
                treedef, shapes = spec
                stacked = [np.zeros(shape, np.dtype(dtype)) for shape, dtype in shapes]
            rows = stacked[0].shape[1] if stacked and stacked[0].ndim > 1 else 0
            yield stacked, treedef, (None if rows and bool(np.all(lengths == rows)) else lengths)

    def _to_host(self, array: Any) -> np.ndarray:
        from jax.experimental import multihost_utils

        if array.is_fully_addressable or array.is_fully_replicated:
            return np.asarray(array)
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training on every device of every worker (tf.distribute.MultiWorkerMirroredStrategy).

    Each worker (process) runs the same program and drives its local devices;
    ``num_replicas_in_sync`` = workers x local devices.  With 2 workers of 2
    devices each, replicas 0-1 live on worker 0 and 2-3 on worker 1; a global
    batch of 8 rows gives worker 0 rows 0-3 and worker 1 rows 4-7.

    Args:
        cluster_resolver: where the cluster comes from; default
            ``TFConfigClusterResolver()`` (no TF_CONFIG: one local worker, as TF).
        communication_options: a :class:`CommunicationOptions` (timeouts).

    Raises:
        ValueError: a cluster that names no task for this process, or a ps /
            evaluator task.
        RuntimeError: created after JAX started its backend, or jax.distributed
            already joined a different cluster.
        WorkerLostError: the workers did not all join within the timeout.
    """

    _extended_cls = MultiWorkerExtended

    def __init__(self, cluster_resolver: Any = None, communication_options: CommunicationOptions | None = None):
        from distribute.cluster import TFConfigClusterResolver
        from distribute.keras_support.hooks import install

        install()
        if communication_options is None:
            communication_options = CommunicationOptions()
        if not isinstance(communication_options, CommunicationOptions):
            raise ValueError(f"communication_options must be a CommunicationOptions, got {communication_options!r}.")
        resolver = cluster_resolver if cluster_resolver is not None else TFConfigClusterResolver()
        cluster = _read_cluster(resolver)
        timeout = communication_options.effective_timeout_seconds
        self._communication_options = communication_options
        self._cluster_info = cluster
        self._exchange_obj = None
        if cluster.num_workers > 1:
            self._exchange_obj = _Exchange(_join(cluster, timeout), cluster, timeout)
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        super().__init__(devices)
        self._cluster_resolver = resolver
        if cluster.num_workers > 1:
            _agree_on_seed(self._exchange_obj)

    # -- results are returned replicated, so every worker can read them -------------------------
    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        return self._replicated(super().reduce(reduce_op, value, axis))

    def gather(self, value: Any, axis: int) -> Any:
        return self._replicated(super().gather(value, axis))

    def _replicated(self, tree: Any) -> Any:
        if self._cluster_info.num_workers == 1:
            return tree
        sharding = self._extended._replicated_sharding

        def one(x: Any) -> Any:
            if isinstance(x, jax.Array) and not x.is_fully_replicated:
                return jax.jit(lambda a: a, out_shardings=sharding)(x)
            return x

        return jax.tree_util.tree_map(one, tree)

    def __repr__(self) -> str:
        c = self._cluster_info
        return (
            f"MultiWorkerMirroredStrategy(num_workers={c.num_workers}, worker_id={c.worker_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


def _agree_on_seed(exchange: _Exchange) -> None:
    """Gives every worker Keras' global seed of worker 0, unless one is set (as Keras' own multi-host init).

    Variables are initialized on every worker and must be identical there.
    """
    from keras.src.utils import rng_utils

    if rng_utils.get_random_seed() is not None:
        return
    mine = int(np.random.SeedSequence().generate_state(1)[0] % (2**31 - 1))
    seeds = exchange.all_gather(exchange.new_channel(), str(mine).encode(), "the random-seed agreement")
    rng_utils.set_random_seed(int(seeds[0].decode()))
