"""The Ray side of a ParameterServerStrategy: connecting, creating and naming the actors, classifying failures.

* Embedded default: no ``address`` and no ``RAY_ADDRESS``: a local Ray instance
  the strategy starts itself (``nodes.start_local_head``: every listener on
  127.0.0.1, ``loopback.py``) and shuts down at exit; an already initialized Ray
  is reused (and left running).
* ``address=`` (or ``RAY_ADDRESS``): joins that Ray cluster.
* a TF_CONFIG (resolver) whose task is the ``chief``: the Ray head at the chief's
  ``host:port`` (``nodes.py``), joined by one Ray node per ps and worker task.

Actors are Ray named actors ``ps-<j>`` (class ``ParameterServer``) and
``worker-<i>`` (class ``Worker``) in a namespace of their own per strategy, so
``ray list actors`` shows which process is which.  A ps is never restarted (its
loss is surfaced, as TF); a worker is restarted by Ray without limit and never
retried by Ray: the coordinator re-queues its closures itself.  When the Ray
cluster has a custom resource ``distribute_ps_<j>`` (or ``distribute_worker_<i>``),
the actor is pinned to the node that offers it.
"""

from __future__ import annotations

import atexit
import itertools
import threading
from typing import Any

from distribute.parameter_server.actor_common import start_warm_up
from distribute.parameter_server.actors import ParameterServer, Worker
from distribute.parameter_server.errors import PSUnavailableError, ps_lost

_NAMESPACES = itertools.count()
_LOCK = threading.Lock()
_STARTED_RAY: list[bool] = []


def import_ray() -> Any:
    try:
        import ray
    except ImportError as err:  # pragma: no cover - ray is installed in the test environment
        raise ImportError(
            "ParameterServerStrategy runs on Ray, which is not installed. Install the extra: "
            "pip install 'jax-distribute[ps]'"
        ) from err
    return ray


def connect(address: str | None) -> None:
    """Initializes Ray (embedded local instance unless ``address``); reuses an initialized Ray."""
    ray = import_ray()
    with _LOCK:
        if ray.is_initialized():
            return
        if address is None:
            from distribute.parameter_server.nodes import start_local_head

            ray.init(address=start_local_head(), log_to_driver=False, configure_logging=False)
            _STARTED_RAY.append(True)
            atexit.register(_shutdown_ray)
        else:
            from distribute.parameter_server import loopback

            if loopback.is_loopback(address.removeprefix("ray://").rpartition(":")[0]):
                loopback.keep_on_loopback()  # else Ray dials 127.0.0.1 at the machine's other address (loopback.py)
            ray.init(address=address, log_to_driver=False, configure_logging=False)


def tf_config_resolver() -> Any:
    """A ``TFConfigClusterResolver`` when TF_CONFIG names a cluster with ``ps`` tasks, else None (embedded)."""
    from distribute.cluster import TFConfigClusterResolver, _env

    if not _env.tf_config_text():
        return None
    resolver = TFConfigClusterResolver()
    return resolver if resolver.cluster_spec().as_dict().get("ps") else None


def connect_for(resolver: Any, address: str | None, num_workers: int, num_ps: int) -> None:
    """Connects Ray for a strategy: ``address``/``RAY_ADDRESS``, a TF_CONFIG chief's head, or embedded.

    A resolver whose task is the ``chief`` (of a spec with a ``chief`` job) uses
    the chief's ``host:port`` as the Ray head (started there unless one listens),
    then waits for every ps and worker task's node (``nodes.Server``), so each
    actor is pinned to its task.
    """
    from distribute.cluster import _env
    import distribute.parameter_server.nodes as nodes

    if address is None:
        address = _env.read("RAY_ADDRESS")
    chief = _chief_address(resolver) if address is None else None
    if chief is None:
        connect(address)
        return
    connect(nodes.start_or_join_head(chief))
    nodes.wait_for_tasks(num_workers, num_ps)


def _chief_address(resolver: Any) -> str | None:
    if resolver is None or getattr(resolver, "task_type", None) != "chief":
        return None
    chiefs = resolver.cluster_spec().as_dict().get("chief") or []
    return chiefs[0] if chiefs else None


def _shutdown_ray() -> None:
    import ray

    if _STARTED_RAY and ray.is_initialized():
        ray.shutdown()


class Cluster:
    """The ps and worker actors of one strategy."""

    def __init__(self, num_workers: int, num_ps: int) -> None:
        ray = import_ray()
        base = ray.get_runtime_context().namespace
        self.namespace = f"{base}-ps{next(_NAMESPACES)}"
        resources = ray.cluster_resources()
        ps_cls = ray.remote(num_cpus=0, max_restarts=0)(ParameterServer)
        worker_cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(Worker)
        self.ps = [
            ps_cls.options(name=f"ps-{j}", namespace=self.namespace, **_pin(resources, f"distribute_ps_{j}")).remote(j)
            for j in range(num_ps)
        ]
        self._workers = [
            worker_cls.options(name=f"worker-{i}", namespace=self.namespace, **_pin(resources, f"distribute_worker_{i}")).remote(
                i, [self.ps_name(j) for j in range(num_ps)], self.namespace
            )
            for i in range(num_workers)
        ]
        for handle in self.ps:  # JAX loads there while the coordinator builds (workers load it themselves)
            handle.__ray_call__.remote(start_warm_up)
        self._ps_ids = {h._actor_id.hex(): j for j, h in enumerate(self.ps)}
        self.alive = True
        self.alive_workers = set(range(num_workers))
        self.recoveries = 0
        self._versions = [0] * num_ps  # per ps: the newest version the coordinator observed
        self._versions_lock = threading.Lock()
        # The ps are waited for here; the workers (loading JAX, seconds) on first use, while the coordinator builds.
        self._starting, self._starting_lock = [h.ping.remote() for h in self._workers], threading.Lock()
        ray.get([h.ping.remote() for h in self.ps], timeout=300)

    @property
    def workers(self) -> list:
        """The worker actors; the first access waits (up to 300 s) until every one has started.

        Raises:
            ray.exceptions.RayActorError: a worker failed to start (its constructor's error).
        """
        if self._starting:
            import ray

            with self._starting_lock:
                if self._starting:
                    ray.get(self._starting, timeout=300)
                    self._starting = []
        return self._workers

    def observe(self, versions: dict) -> None:
        """Records ps versions (ps index -> version) a finished closure or a coordinator write reported."""
        with self._versions_lock:
            for j, version in versions.items():
                if version > self._versions[j]:
                    self._versions[j] = version

    def seen(self) -> dict:
        """ps index -> the newest version observed: what a step sent now must read at least (actors.py)."""
        with self._versions_lock:
            return {j: v for j, v in enumerate(self._versions) if v}

    def ps_name(self, j: int) -> str:
        return f"ps-{j}"

    def ps_lost(self, j: int) -> PSUnavailableError:
        """The error that reports ps ``j`` lost (TF's ``PSUnavailableError``), with the way to recover."""
        return ps_lost(j)

    def get_from_ps(self, refs: list) -> list:
        """``ray.get(refs)`` of the coordinator's calls to ps actors; a dead ps raises ``PSUnavailableError``."""
        import ray

        try:
            return ray.get(refs)
        except Exception as error:  # noqa: BLE001 - classified; anything else re-raised as it is
            kind, cause = self.classify(error)
            if kind == "ps":
                raise self.ps_lost(cause) from error
            raise

    def classify(self, error: BaseException) -> tuple[str, Any]:
        """``("ps", j)``, ``("worker", error)`` or ``("user", original error)``.

        A dead ps is recognized first, also when it surfaces through a worker's
        call to it (a worker's failure caused by its ps is a ps failure).
        """
        from ray import exceptions as rx

        chain, seen = [error], error
        while isinstance(seen, rx.RayTaskError) and isinstance(seen.cause, BaseException) and seen.cause is not seen:
            seen = seen.cause
            chain.append(seen)
        for e in chain:
            if isinstance(e, PSUnavailableError) and getattr(e, "task_id", None) is not None:
                return "ps", e.task_id  # a worker found its ps dead
            actor_id = getattr(e, "actor_id", None)
            if isinstance(e, rx.RayActorError) and actor_id is not None:
                j = self._ps_ids.get(actor_id if isinstance(actor_id, str) else getattr(actor_id, "hex", lambda: "")())
                if j is not None:
                    return "ps", j
        if isinstance(error, rx.RayTaskError):
            return "user", chain[-1]
        if isinstance(error, (rx.RayActorError, rx.ObjectLostError, rx.OwnerDiedError)):
            return "worker", error
        return "user", error

    def shutdown(self) -> None:
        import ray

        self.alive = False
        if not ray.is_initialized():
            return
        for handle in self._workers + self.ps:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass


def _pin(resources: dict, name: str) -> dict:
    return {"resources": {name: 0.01}} if name in resources else {}
