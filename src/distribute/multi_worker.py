"""MultiWorkerMirroredStrategy: synchronous training over every worker's devices.

Every worker runs the same program.  The cluster comes from a ClusterResolver
(TF_CONFIG by default); ``jax.distributed`` joins the workers (its coordination
service runs in a process of its own that the chief, or worker 0, starts on its
TF_CONFIG port, so it outlives a chief that dies); the strategy's mesh has one axis,
``"replica"``, over all workers' devices, worker 0's first.  Collectives inside
compiled steps go over gloo on CPU (NCCL on GPU).

Input: each worker feeds only its replicas' share of every global batch.  Under
DATA sharding (the default for datasets that read no files) of a dataset whose
cardinality every worker knows and agrees on at the start of a pass, the pass
runs that many steps with no further exchange: every worker splits the same
global batches, so each knows every replica's rows.  Otherwise, before each step
the workers exchange their batch sizes through the coordination service's
key-value store (a few bytes, with a timeout): a step runs while any worker
still has data, workers without data give their replicas no rows (the exact
uneven step), and all of them stop together, so uneven input never hangs.  A worker that does
not answer within ``CommunicationOptions.timeout_seconds`` is named in the error;
a worker that dies (the chief included) is detected by the heartbeats this
package publishes in the coordination service within the same timeout, and
every surviving worker stops (exit status 75) with a message naming it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import pickle
from typing import Any, Iterator

import jax
import numpy as np

from distribute.runtime.cluster import Cluster
from distribute.runtime.exchange import Exchange
from distribute.runtime.exits import WorkerLostError  # noqa: F401  (raised by the strategy; public here)
from distribute.runtime.workers import MultiWorkerRuntime
from distribute.cluster import _env
from distribute.input.policy import InputPolicy
from distribute.keras_support import patches
from distribute.mesh_strategy import MeshExtended, MeshStrategy
from distribute.sharding import Sharding
from distribute.values import is_distributed

DEFAULT_TIMEOUT_SECONDS = 300.0
logger = logging.getLogger("distribute")


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


class MultiWorkerInputPolicy(InputPolicy):
    """Input across workers: sharding by ``AutoShardPolicy``, every global batch split over all
    workers' replicas, and agreement on unseeded shuffles' seeds and on end-of-data at each step."""

    def __init__(self, replica_mesh: Any, cluster: Cluster, exchange: Exchange | None):
        super().__init__(replica_mesh)
        self._cluster = cluster
        self._exchange = exchange

    def input_pipelines(self) -> tuple[int, int]:
        return self._cluster.num_workers, self._cluster.worker_id

    def shard_policy(self, dataset: Any) -> Any:
        from distribute.data.options import AutoShardPolicy

        try:
            policy = dataset.options().experimental_distribute.auto_shard_policy
        except AttributeError:
            policy = AutoShardPolicy.AUTO
        if policy == AutoShardPolicy.FILE and _reads_files(dataset):
            return AutoShardPolicy.DATA  # one worker (more are split by file in input/distributed_dataset.py)
        if policy == AutoShardPolicy.FILE:
            raise ValueError(
                f"auto_shard_policy=FILE needs a file-based dataset with at least num_workers="
                f"{self._cluster.num_workers} files, but this dataset reads 0 files. Use "
                "AutoShardPolicy.DATA (or AUTO), or shard the files yourself and use OFF."
            )
        if policy == AutoShardPolicy.AUTO:
            return AutoShardPolicy.DATA  # as TF for a dataset that reads no files
        return policy

    def agree_on_seeds(self, seeds: list[int]) -> list[int]:
        """Worker 0's ``seeds`` on every worker (the unseeded shuffles of a distributed dataset).

        Raises:
            ValueError: the workers built pipelines with different numbers of unseeded shuffles.
        """
        if self._exchange is None:
            return seeds
        payload = json.dumps([int(s) for s in seeds]).encode()
        gathered = [json.loads(p) for p in self._exchange.all_gather(self._exchange.new_channel(), payload, "the input pipeline's shuffle seeds")]
        if len({len(g) for g in gathered}) != 1:
            raise ValueError(
                f"The workers' input pipelines have different numbers of unseeded shuffles "
                f"({[len(g) for g in gathered]}); every worker must build the same pipeline. Give each shuffle a seed."
            )
        return gathered[0]

    def shard_dataset(self, dataset: Any) -> Any:
        """The elements this worker reads (TF's AutoShardPolicy).

        DATA (and AUTO, as TF for non-file sources): every worker reads every
        global batch and keeps its replicas' rows of it (TF rebatches the global
        batch B to B / num_workers per worker); OFF and HINT (there is no
        shard hint to replace): every worker reads the whole dataset; FILE:
        ValueError, there are no files to split.
        """
        self.shard_policy(dataset)
        return dataset

    def dataset_cardinality(self, dataset: Any) -> int:
        from distribute.data.options import UNKNOWN_CARDINALITY, AutoShardPolicy

        cardinality = dataset.cardinality()
        if self.shard_policy(dataset) == AutoShardPolicy.DATA or cardinality < 0:
            return cardinality
        info = getattr(dataset, "_batch_info", None)
        if info is None or not info[1]:
            return UNKNOWN_CARDINALITY  # OFF rebatches in order: a partial last batch takes fewer steps
        return cardinality * self._cluster.num_workers

    def dataset_batches(self, dataset: Any, rows_per_replica: int) -> Iterator[tuple[list, Any, np.ndarray | None]]:
        """Global split of each global batch; DATA keeps this worker's slice, OFF walks every worker's slice."""
        num_local = len(self.replica_mesh.local_devices)
        for local, treedef, lengths, part in self._split_global(dataset, rows_per_replica):
            counts = np.full(num_local, local[0].shape[1] if local and local[0].ndim > 1 else 0, np.int64) if lengths is None else lengths[part]
            yield local, treedef, counts

    def _split_global(self, dataset: Any, rows_per_replica: int) -> Iterator[tuple[list, Any, np.ndarray | None, slice]]:
        """``(this worker's stacks, treedef, every replica's rows or None, this worker's replicas)`` per batch read."""
        from distribute.data.options import AutoShardPolicy
        from distribute.input.splitting import split_batch

        policy = self.shard_policy(dataset)
        num_local, me = len(self.replica_mesh.local_devices), self._cluster.worker_id
        if policy != AutoShardPolicy.DATA:
            # OFF / HINT: every worker reads the whole dataset, rebatched in order as TF's rebatch does: each
            # global batch in consecutive steps of rows_per_replica rows per local replica, the last step of a
            # partial batch partial, none empty (range(12).batch(8), 2 workers of 1 replica: 3 steps of 4 rows).
            step_rows, local = rows_per_replica * num_local, slice(0, num_local)
            for element in dataset:
                leaves, treedef = jax.tree_util.tree_flatten(element)
                for start in range(0, int(leaves[0].shape[0]) if leaves else 0, step_rows):
                    stacked, lengths = split_batch([x[start:start + step_rows] for x in leaves], num_local, rows_per_replica)
                    yield list(stacked), treedef, lengths, local
            return
        for element in dataset:
            leaves, treedef = jax.tree_util.tree_flatten(element)
            stacked, lengths = split_batch(leaves, len(self.replica_mesh.devices), rows_per_replica)
            part = slice(me * num_local, (me + 1) * num_local)
            yield [x[part] for x in stacked], treedef, lengths, part

    def distributed_batches(self, dataset: Any, rows_per_replica: int) -> Iterator[tuple[list, Any, np.ndarray | None]]:
        """This worker's steps over a globally batched dataset, every worker taking the same number of steps.

        Under DATA sharding every worker reads every global batch and splits it
        the same way, so each knows every replica's rows at every step.  When
        the workers also agree, once at the start of the pass, that the dataset
        has the same known cardinality everywhere, the pass runs that many steps
        with no per-step exchange (the end-of-data answer is known in advance);
        otherwise (unknown cardinality, OFF sharding, or workers that disagree)
        each step's batch sizes are exchanged (``agree``).

        Raises:
            ValueError: the dataset yields a different number of batches than
                its cardinality (the other workers' steps would not match).
        """
        from distribute.data.options import AutoShardPolicy

        if self._exchange is None:
            yield from self.agree(self.dataset_batches(dataset, rows_per_replica))
            return
        cardinality = int(dataset.cardinality())
        data = self.shard_policy(dataset) == AutoShardPolicy.DATA
        plan = json.dumps([cardinality if data and cardinality >= 0 else None, rows_per_replica]).encode()
        plans = self._exchange.all_gather(self._exchange.new_channel(), plan, "the input pass's cardinality")
        if len(set(plans)) != 1 or json.loads(plans[0])[0] is None:
            yield from self.agree(self.dataset_batches(dataset, rows_per_replica))
            return
        steps = 0
        for local, treedef, lengths, _ in self._split_global(dataset, rows_per_replica):
            if steps == cardinality:
                raise ValueError(
                    f"The dataset yielded more than its cardinality() = {cardinality} batches on worker "
                    f"{self._cluster.worker_id}; the workers planned {cardinality} steps from it. Give the dataset a "
                    "correct cardinality (e.g. dataset.apply(assert_cardinality(n))), or one it cannot know."
                )
            steps += 1
            yield local, treedef, lengths
        if steps != cardinality:
            raise ValueError(
                f"The dataset yielded {steps} batches on worker {self._cluster.worker_id}, not its cardinality() = "
                f"{cardinality}; the workers planned {cardinality} steps from it. Give the dataset a correct "
                "cardinality, or one it cannot know (then the workers agree at every step)."
            )

    def agree(self, batches: Iterator) -> Iterator[tuple[list, Any, np.ndarray | None]]:
        """Runs a step while any worker has data; workers without data give their replicas no rows."""
        exchange, num_local = self._exchange, len(self.replica_mesh.local_devices)
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


class MultiWorkerExtended(MeshExtended):
    """StrategyExtended over all workers' devices; see :class:`MultiWorkerMirroredStrategy`."""

    def __init__(self, strategy: "MultiWorkerMirroredStrategy", devices: Any, runtime: MultiWorkerRuntime, sharding: Any = None):
        super().__init__(strategy, devices, sharding)
        self.runtime = runtime
        self._cluster = runtime.cluster
        self._exchange = runtime.exchange
        self.input_policy = MultiWorkerInputPolicy(self.replica_mesh, runtime.cluster, runtime.exchange)
        self._tf_config = _env.Watch(_env.TF_CONFIG)  # as the strategy read it; checked at every step

    def record_dispatch(self, outputs: Any) -> None:
        """After every step (run, fit, reduce, gather): a warning if TF_CONFIG changed since the strategy was created."""
        if self._tf_config.changed():
            self._warn_tf_config_changed()
        super().record_dispatch(outputs)

    def _warn_tf_config_changed(self) -> None:
        now = self._tf_config.value
        before = self._tf_config.first
        cluster = self._cluster
        if before is None and cluster.num_workers == 1 and now is not None:
            logger.warning(
                "TF_CONFIG was set after MultiWorkerMirroredStrategy was created without it (it is now %r): "
                "the strategy trains this process alone (1 worker) and does not read TF_CONFIG again. Set "
                "TF_CONFIG before creating the strategy (at the start of the program, or in the environment "
                "of the process: distribute's launcher and cluster tools set it for you).", now,
            )
            return
        logger.warning(
            "TF_CONFIG changed after MultiWorkerMirroredStrategy was created (it was %s, it is now %s); "
            "the strategy keeps the cluster it joined at creation (%d worker(s), this is %s). A strategy "
            "reads TF_CONFIG once: to train on another cluster, set TF_CONFIG before creating the strategy, "
            "in a new process.",
            "unset" if before is None else repr(before), "unset" if now is None else repr(now),
            cluster.num_workers, cluster.names[cluster.worker_id],
        )

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

    def agree_on_shapes(self, local: list, what: str) -> list:
        """Every worker's ``local`` (a JSON-able list of shapes and dtypes), in worker order.

        Exchanged through the coordination service, not a device collective, so
        that workers holding values of different shapes learn it before any
        collective starts (gloo aborts the process on mismatched sizes), and all
        raise the same error.
        """
        if self._exchange is None:
            return [local]
        channel = self._exchange.new_channel()
        gathered = [json.loads(p) for p in self._exchange.all_gather(channel, json.dumps(local).encode(), what)]
        previous = getattr(self, "_previous_shape_channel", None)
        if previous is not None:
            self._exchange.delete(previous)  # every worker has read it: they all wrote this round's key since
        self._previous_shape_channel = channel
        return gathered

class MultiWorkerMirroredStrategy(MeshStrategy):
    """Synchronous training on every device of every worker (tf.distribute.MultiWorkerMirroredStrategy).

    Each worker (process) runs the same program and drives its local devices;
    ``num_replicas_in_sync`` = workers x local devices.  With 2 workers of 2
    devices each, replicas 0-1 live on worker 0 and 2-3 on worker 1; a global
    batch of 8 rows gives worker 0 rows 0-3 and worker 1 rows 4-7.

    Args:
        cluster_resolver: where the cluster comes from; default: TF_CONFIG when
            set, else the tasks of the Slurm step this process runs in (as
            ``jax.distributed``), else one local worker (as TF with no TF_CONFIG).
        communication_options: a :class:`CommunicationOptions` (timeouts).
        sharding: how much training state is split over all workers' replicas:
            ``distribute.experimental.Sharding.NONE`` (default, TF's behaviour),
            ``OPTIMIZER_STATE``, ``GRADIENTS`` or ``FULL`` (or their lower-case
            names); see :class:`~distribute.MirroredStrategy`.

    Raises:
        ValueError: a cluster that names no task for this process, or a ps /
            evaluator task; an unknown ``sharding``.
        RuntimeError: created after JAX started its backend, jax.distributed
            already joined a different cluster, or (on worker 0) the coordination
            service could not listen on worker 0's port (the message names it).
        WorkerLostError: the workers did not all join within the timeout, where
            jaxlib reports it; otherwise the process ends at the timeout with
            status 75 and a message naming the workers that never joined.
    """

    _extended_cls = MultiWorkerExtended

    def __init__(self, cluster_resolver: Any = None, communication_options: CommunicationOptions | None = None, *,
                 sharding: Any = None):
        from distribute.cluster.detect import default_resolver

        sharding = Sharding.from_value(sharding)
        patches.install_multi_worker()
        if communication_options is None:
            communication_options = CommunicationOptions()
        if not isinstance(communication_options, CommunicationOptions):
            raise ValueError(f"communication_options must be a CommunicationOptions, got {communication_options!r}.")
        resolver = cluster_resolver if cluster_resolver is not None else default_resolver()
        runtime = MultiWorkerRuntime.start(resolver, communication_options.effective_timeout_seconds)
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        super().__init__(devices, runtime=runtime, sharding=sharding)
        self._communication_options = communication_options
        self._cluster_resolver = resolver

    # -- results are returned replicated, so every worker can read them -------------------------
    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        """As :meth:`MeshStrategy.reduce`; with several workers of one replica each, a host value
        (not distributed) is this worker's value, reduced across the workers.

        As TF's ``CollectiveAllReduceExtended._reduce_to`` (testReduceHostTensor): on 2 workers
        ``reduce("SUM", 1.0, axis=None)`` is 2.0, and MEAN of worker ``w``'s ``w + 1.0`` is 1.5.
        With several replicas per worker a host value is reduced as on one worker (SUM raises
        ValueError; TF's collective would wait for the missing replicas' values).
        """
        if axis is None and self._extended.runtime.num_workers > 1 and len(self._extended.worker_devices) == 1:
            value = jax.tree_util.tree_map(self._as_worker_value, value, is_leaf=is_distributed)
        return self._replicated(super().reduce(reduce_op, value, axis))

    def _as_worker_value(self, x: Any) -> Any:
        """A host value as a PerReplica of this worker's one replica (TF's _make_tensor_into_per_replica)."""
        if is_distributed(x) or getattr(x, "_distribute_strategy", None) is not None:
            return x
        value = jax.numpy.asarray(x)
        return self.experimental_distribute_values_from_function(lambda _: value)

    def gather(self, value: Any, axis: int) -> Any:
        return self._replicated(super().gather(value, axis))

    def _replicated(self, tree: Any) -> Any:
        if self._extended.runtime.num_workers == 1:
            return tree
        sharding = self._extended.replica_mesh.replicated_sharding

        def one(x: Any) -> Any:
            if isinstance(x, jax.Array) and not x.is_fully_replicated:
                # Then this worker's copy, where its variables' cross-replica reads are.
                return self._extended.replica_mesh.local_copy(jax.jit(lambda a: a, out_shardings=sharding)(x))
            return x

        return jax.tree_util.tree_map(one, tree)

    def __repr__(self) -> str:
        c = self._extended.runtime.cluster
        return (
            f"MultiWorkerMirroredStrategy(num_workers={c.num_workers}, worker_id={c.worker_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


def _reads_files(dataset: Any) -> bool:
    """Whether ``dataset`` reads files (a ``distribute.data`` file source, or a wrapped tf.data dataset)."""
    return getattr(dataset, "_files_root", None) is not None or getattr(dataset, "_tf_source", None) is not None
