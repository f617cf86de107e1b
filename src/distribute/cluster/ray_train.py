"""RayTrainClusterResolver: the cluster of the Ray Train worker group this process belongs to.

Ray Train (``ray.train.v2.jax.JaxTrainer`` and the other v2 trainers) starts
one Ray actor per training worker and gives each its world rank and world size
(``ray.train.get_context()``). Ray's JAX backend joins the workers through
``jax.distributed.initialize`` only with ``use_gpu`` or ``use_tpu``; on CPU it
joins nothing. This resolver forms the cluster from what Ray Train set up: the
worker of world rank 0 picks a free port for the coordination service (on
127.0.0.1 when the whole group runs on one node, i.e. Ray Train's local world
size equals its world size; else on its node's Ray address,
``ray.util.get_node_ip_address()``), shares ``host:port`` with the other
workers through Ray Train's own ``ray.train.collective.broadcast_from_rank_zero``,
and every worker is task ``("worker", world_rank)`` of a cluster of
``world_size`` workers.

After a failure Ray Train starts a new worker group (``FailureConfig``); its
workers resolve again, so the new group gets a new coordinator port and may
have another size (``ScalingConfig(num_workers=(min, max))``).  With
``distribute.experimental.RayTrainElasticState`` in the run's callbacks, the new
group restores the training state the old one's workers held in memory
(``runtime/ray_train_elastic.py``), not the last backup.

Ray is imported only when this resolver is built, never by ``in_ray_train_worker``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import distribute.cluster.roles as roles
from distribute.cluster.cluster_spec import ClusterSpec
from distribute.cluster.ports import free_ports
from distribute.cluster.resolver import ClusterResolver, format_master_url

__all__ = ["RayTrainClusterResolver", "in_ray_train_worker", "ray_train_v1_world_size"]

LOOPBACK = "127.0.0.1"
_TRAIN_FN_UTILS = "ray.train.v2._internal.execution.train_fn_utils"  # set up by Ray Train v2 in each worker
_V1_SESSION = "ray.train._internal.session"  # Ray Train v1's (deprecated) per-worker session


def in_ray_train_worker() -> bool:
    """Whether this process runs a Ray Train (v2) training function, as a worker of its worker group.

    Reads what Ray Train set up in this process (its per-worker train function
    utilities, the check ``ray.train.get_context()`` makes) without importing
    Ray: a process that never imported Ray Train is not one of its workers.
    """
    module = sys.modules.get(_TRAIN_FN_UTILS)
    return module is not None and getattr(module, "_train_fn_utils", None) is not None


def ray_train_v1_world_size() -> int | None:
    """The world size of the Ray Train v1 session this process runs in (``RAY_TRAIN_V2_ENABLED=0``), else None.

    Ray Tune's function trials have such a session too, of one worker.
    """
    module = sys.modules.get(_V1_SESSION)
    session = getattr(module, "_session", None) if module is not None else None
    size = getattr(session, "world_size", None)
    return int(size) if size is not None else None


def _ray_train_context() -> Any:
    try:
        import ray.train
    except ImportError as err:
        raise RuntimeError(
            f"RayTrainClusterResolver needs Ray Train, which does not import here ({err}); install it: "
            "pip install 'jax-distribute[train]' (ray[train])."
        ) from None
    try:
        return ray.train.get_context()
    except RuntimeError as err:
        raise RuntimeError(
            f"RayTrainClusterResolver must be built inside a Ray Train training function "
            f"(train_loop_per_worker of ray.train.v2.jax.JaxTrainer), not here: {err}"
        ) from None


def _one_node(context: Any, world_size: int) -> bool:
    """Whether every worker of the group runs on this node (then the coordinator listens on loopback)."""
    local = getattr(context, "get_local_world_size", None)
    return local is not None and int(local()) == world_size


def _broadcast_from_rank_zero(data: Any) -> Any:
    from ray.train.collective import broadcast_from_rank_zero

    return broadcast_from_rank_zero(data)


def _node_address() -> str:
    import ray.util

    return ray.util.get_node_ip_address()


class RayTrainClusterResolver(ClusterResolver):
    """The cluster of the Ray Train worker group this process runs in (beyond TF, which has no Ray resolver).

    ``MultiWorkerMirroredStrategy()`` uses it by itself inside a Ray Train
    training function (see ``detect.default_resolver``); build it yourself to
    choose the coordinator's port.

    Example (inside ``train_loop_per_worker`` of a 2-worker ``JaxTrainer``, on
    the worker of world rank 1, with rank 0 on node 10.0.0.5)::

        resolver = RayTrainClusterResolver()
        resolver.cluster_spec()  # ClusterSpec({'worker': ['10.0.0.5:41234', 'ray-train-rank-1']})
        resolver.task_type, resolver.task_id  # ('worker', 1)

    Only worker 0's address is an address (the coordination service's, as
    ``jax.distributed`` needs): the other workers connect to it and need none.

    Args:
        port: The coordination service's port on rank 0's node; None: a free
            one, picked by rank 0 (each new worker group picks again).
        rpc_layer: The protocol used by `master()`.
        context: Beyond TF, for tests: an object with ``get_world_rank()`` and
            ``get_world_size()``; None: ``ray.train.get_context()``.
        broadcast: For tests: ``broadcast(data)`` returning rank 0's data on
            every worker; None: ``ray.train.collective.broadcast_from_rank_zero``.
        node_address: For tests: returns this node's address; None: Ray's
            address of this node (``ray.util.get_node_ip_address()``). Used
            only when the group spans several nodes; on one node (Ray Train's
            local world size equals its world size) the coordinator listens on
            127.0.0.1.

    Raises:
        RuntimeError: Outside a Ray Train training function, or without Ray Train.
        ValueError: A port outside 1-65535.
    """

    def __init__(self, port: int | None = None, rpc_layer: str | None = "grpc", *, context: Any = None,
                 broadcast: Callable[[Any], Any] | None = None, node_address: Callable[[], str] | None = None):
        if port is not None and not (isinstance(port, int) and 0 < port < 65536):
            raise ValueError(f"port={port!r} is not a TCP port; give one in 1-65535, or None for a free one.")
        context = _ray_train_context() if context is None else context
        self._rank, self._size = int(context.get_world_rank()), int(context.get_world_size())
        self._rpc_layer = rpc_layer
        self._task_type, self._task_id = roles.WORKER, self._rank
        if self._size == 1:
            self._coordinator = None
            self._spec = ClusterSpec({})
            return
        coordinator = None
        if self._rank == 0:
            host = LOOPBACK if _one_node(context, self._size) else (node_address or _node_address)()
            if port is None:
                port = free_ports(1, "" if ":" in host else host)[0]
            coordinator = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._coordinator = (broadcast or _broadcast_from_rank_zero)(coordinator)
        if not isinstance(self._coordinator, str):
            raise RuntimeError(
                f"Ray Train world rank {self._rank} of {self._size} received {self._coordinator!r} as the "
                "coordinator address from rank 0; every worker of the group must build a RayTrainClusterResolver "
                "(or MultiWorkerMirroredStrategy) at the same point of the training function."
            )
        self._spec = ClusterSpec({roles.WORKER: [self._coordinator]
                                  + [f"ray-train-rank-{i}" for i in range(1, self._size)]})

    @property
    def world_rank(self) -> int:
        """This worker's rank in the Ray Train worker group (its task_id)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Workers in the Ray Train worker group."""
        return self._size

    def cluster_spec(self) -> ClusterSpec:
        """Returns ``{'worker': [coordinator, 'ray-train-rank-1', ...]}``; empty for a group of one worker."""
        return self._spec

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """Returns the coordination service's ``rpc_layer://host:port`` (worker 0's); "" for one worker."""
        if task_type is not None and task_id is not None:
            return format_master_url(self._spec.task_address(task_type, task_id), rpc_layer or self._rpc_layer)
        if self._coordinator is None:
            return ""
        return format_master_url(self._coordinator, rpc_layer or self._rpc_layer)
