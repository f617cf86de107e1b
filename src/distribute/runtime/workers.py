"""MultiWorkerRuntime: the cross-worker runtime a synchronous multi-worker strategy holds."""

from __future__ import annotations

from typing import Any

from distribute.runtime.cluster import Cluster, read_cluster
from distribute.runtime.exchange import Exchange, agree_on_seed
from distribute.runtime.join import join


class MultiWorkerRuntime:
    """This worker's place in a synchronous job, and its bounded exchanges with the other workers.

    Built once per strategy (:meth:`start`): the cluster read from a resolver, and,
    with several workers, the workers joined through ``jax.distributed`` and the
    random seed agreed (worker 0's, unless one is set), as Keras' own multi-host
    initialization. Every wait is bounded by ``timeout_seconds`` and names the
    worker that did not answer (``WorkerLostError``, or exit status 75).

    Attributes:
        cluster: the job's workers (``cluster.Cluster``).
        exchange: the key-value exchange between workers (``exchange.Exchange``),
            None with one worker.
        timeout_seconds: the bound on every cross-worker wait.
    """

    def __init__(self, cluster: Cluster, exchange: Exchange | None, timeout_seconds: float):
        self.cluster, self.exchange, self.timeout_seconds = cluster, exchange, timeout_seconds

    @classmethod
    def start(cls, resolver: Any, timeout_seconds: float) -> "MultiWorkerRuntime":
        """Reads the cluster from ``resolver`` and, with several workers, joins them and agrees on the seed.

        Raises:
            ValueError: a cluster that does not name this process's task, or a non-worker task.
            RuntimeError: JAX's backend already started, or jax.distributed joined another cluster.
            WorkerLostError: the workers did not all join within the timeout (else the process
                ends with status 75, naming them).
        """
        cluster = read_cluster(resolver)
        if cluster.num_workers == 1:
            return cls(cluster, None, timeout_seconds)
        exchange = Exchange(join(cluster, timeout_seconds), cluster, timeout_seconds)
        agree_on_seed(exchange)
        return cls(cluster, exchange, timeout_seconds)

    @property
    def num_workers(self) -> int:
        return self.cluster.num_workers

    @property
    def worker_id(self) -> int:
        return self.cluster.worker_id

    @property
    def is_chief(self) -> bool:
        return self.cluster.is_chief

    def all_gather(self, payload: bytes, what: str) -> list[bytes]:
        """Every worker's ``payload``, in worker order, on a fresh channel (one worker: ``[payload]``).

        Raises:
            WorkerLostError: a worker did not send within the timeout; ``what`` names the exchange.
        """
        if self.exchange is None:
            return [payload]
        return self.exchange.all_gather(self.exchange.new_channel(), payload, what)
