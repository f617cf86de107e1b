"""The cross-worker runtime of synchronous multi-worker training (MultiWorkerMirroredStrategy).

``workers.MultiWorkerRuntime`` is what a strategy holds: the cluster read once
(``cluster.py``), joined through ``jax.distributed`` with bounded waits
(``join.py``; the coordination service in a process of its own, ``service.py``),
heartbeats naming a lost worker (``watchdog.py``), how a worker ends
(``exits.py``), and small exchanges of values between workers (``exchange.py``).
Nothing is imported here: the launcher reads ``service.EXIT_WORKER_LOST``
without loading JAX.
"""
