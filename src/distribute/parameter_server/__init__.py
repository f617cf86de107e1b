"""ParameterServerStrategy and ClusterCoordinator on Ray (asynchronous training).

Modules, top down: ``strategy`` (the Strategy), ``coordinator`` (ClusterCoordinator),
``closures`` (queue, per-worker threads, failure handling), ``dataset`` (per-worker
datasets, DatasetCreator), ``program`` (tracing scheduled functions into exported
programs), ``registry`` (variable placement), ``cluster`` (Ray), ``nodes`` (the Ray head and nodes of a
TF_CONFIG cluster, ``distribute.Server``), ``actors`` (the
ps and worker processes: JAX and numpy only), ``partitioners``, ``values``
(RemoteValue, PerWorkerValues, ShardedVariable), ``errors``.  Ray is imported only when a strategy
is created (the ``jax-distribute[ps]`` extra).
"""
