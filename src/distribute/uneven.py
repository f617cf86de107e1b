"""The exact uneven step: every replica runs on exactly its real rows (``strategy.run`` and Keras ``fit``).

A step whose batch does not divide evenly between the replicas (an epoch's last,
or every step when the global batch does not divide by the replicas) cannot be
one SPMD program: the replicas' shapes differ.  Each replica gets TF's layout,
contiguous chunks of ``ceil(b / R)`` rows in replica order (3 rows over 2
replicas give 2 | 1; 1 row gives 1 | 0, an empty replica seeing shape
``(0, ...)``), and runs the replica function on exactly those rows.

:func:`run_step` is the one mechanism for both ``strategy.run``
(``uneven_step.py``) and ``fit`` (``keras_support/trainer.py``):

* compiled (``engine/per_replica.py``): each replica's function is traced once
  per replica shape, its collectives as markers, cut at them into programs
  compiled per device; the collectives are made on the host between the
  programs (numpy on one worker, one small compiled program over the mesh
  across workers).  No program ever waits on another, so nothing can deadlock.
* eager (``engine/threads.py``), where the function cannot be one program per
  replica (an ``all_gather``, whose result shape depends on the other replicas;
  a Python branch on a value): one thread per replica, as TF's eager
  MirroredStrategy, meeting at every collective.

Every worker makes the same choice (they agree once per step).  Every wait is
bounded and names the replicas and the collective.  Nothing here pads
anything: padding exists only inside ``PerReplica`` storage, where nothing can
observe it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distribute.engine import per_replica, threads
from distribute.engine.host import HostCollectives
from distribute.engine.per_replica import NeedsEager as NeedsEager  # re-exported: the callers' name
from distribute.engine.threads import ThreadedReplicaContext as ThreadedReplicaContext

_EAGER = "eager"  # cached in place of a program: this code runs eagerly per replica


def run_step(strategy: Any, function: Callable, inputs: Sequence[Sequence[Any]], rows: Sequence[int] | None,
             cache_key: Any) -> list[tuple[Any, dict]]:
    """Runs ``function(record, *inputs[r])`` on every local replica ``r``, each on exactly its rows.

    ``function`` runs in the replica's context (``distribute.get_replica_context()``)
    and returns a pytree of arrays; it may note what it learned while running
    (Python values, structures) in the dict ``record``.  Traced once per replica
    shape (replicas of one shape share the trace and its ``record``), or run
    eagerly in one thread per replica where it cannot be traced; it can tell
    which from ``context._runs_eagerly``.

    Args:
        strategy: the strategy.
        function: the replica function.
        inputs: per local replica, its flat inputs, on its device.
        rows: every replica's rows in the step (``num_replicas_in_sync``), or None.
        cache_key: what identifies ``function`` among the strategy's programs.

    Returns:
        Per local replica, ``(its result, the record)``.

    Raises:
        RuntimeError: the replicas make different collective calls, or one did not
            reach a collective within the strategy's timeout.
        TypeError: a collective under ``vmap`` / ``lax.scan`` / ``lax.cond``.
    """
    mesh = strategy.extended.replica_mesh
    first = mesh.devices.index(mesh.local_devices[0])
    global_rows = None if rows is None else int(sum(rows))
    programs = _programs(strategy, function, inputs, rows, global_rows, cache_key, first)
    rounds, error = None, None
    if programs is not None:
        try:
            per_replica.check_same_collectives(programs, first)
        except (RuntimeError, ValueError) as err:
            if jax.process_count() == 1:
                raise
            error = err  # raised after the workers met: every worker makes the same exchanges, even on an error
        else:
            rounds = per_replica.aligned_rounds(programs)
    if jax.process_count() > 1:
        rounds = _agree_across_workers(strategy, programs, rounds, error)
        programs = programs if rounds is not None else None
    if programs is not None:
        host = HostCollectives(strategy, rows, shapes_agreed=True)
        replica_ids = [_replica_id_on(first + i, d) for i, d in enumerate(mesh.local_devices)]
        outputs = per_replica.run(strategy, programs, rounds, inputs, replica_ids, host, threads.timeout_seconds(strategy))
        return [(out, p.record) for out, p in zip(outputs, programs)]

    def body(context: ThreadedReplicaContext) -> tuple[Any, dict]:
        record: dict = {}
        return function(record, *inputs[context._local]), record

    return threads.run_replicas(strategy, body, rows)


def _programs(strategy, function, inputs, rows, global_rows, cache_key, first) -> list | None:
    """Every local replica's traced program (shared by replicas of one shape), or None: run eagerly."""
    cache = strategy.extended.programs
    programs = []
    for local, args in enumerate(inputs):
        replica_rows = None if rows is None else int(rows[first + local])
        signature = (tuple((a.shape, a.dtype) for a in args), replica_rows, global_rows)
        key = ("per-replica", cache_key, signature)
        program = cache.get(key)
        if program is None:
            try:
                program = per_replica.trace(strategy, function, [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in args], replica_rows, global_rows)
            except TypeError as err:
                if "under a JAX transformation" in str(err):
                    raise
                program = _EAGER
            except Exception:  # noqa: BLE001 - what the tracer cannot take runs eagerly (and raises there, if it must)
                program = _EAGER
            cache[key] = program
        if program is _EAGER:
            return None
        programs.append(program)
    return programs


def _agree_across_workers(strategy: Any, programs: list | None, rounds: list | None,
                          error: Exception | None = None) -> list | None:
    """Every worker's choice and collectives: the rounds all workers make them in, or None (all run eagerly).

    ``error``: this worker's replicas disagree (``check_same_collectives``); it is
    raised here, after the exchange, and the other workers raise it too.

    Raises:
        RuntimeError: the workers' replicas make different collective calls.
        ValueError: an all_reduce of values with different shapes (on some worker).
    """
    if error is not None:
        local = {"error": [type(error).__name__, str(error)]}
    else:
        local = None if programs is None else {
            "collectives": [[kind, repr(params), [list(s) for s in shapes]] for kind, params, shapes in programs[0].signature()],
            "rounds": list(rounds),
        }
    gathered = strategy.extended.agree_on_shapes([local], "the collectives of an uneven step")
    every = [g[0] for g in gathered]
    failed = [(w, g["error"]) for w, g in enumerate(every) if g is not None and "error" in g]
    if failed:
        if error is not None:
            raise error
        _, (kind, message) = failed[0]
        raise (ValueError if kind == "ValueError" else RuntimeError)(message)  # the same error on every worker
    if any(g is None for g in every):
        return None
    if any(g["collectives"] != every[0]["collectives"] for g in every):
        counts = [len(g["collectives"]) for g in every]
        raise RuntimeError(
            f"The workers' replicas of an uneven step make different collective calls (collectives per worker: "
            f"{counts}; or different kinds or shapes). Every replica must make the same collective calls (all_reduce, "
            "all_gather, apply_gradients) in the same order, with values of the same shapes, whatever its number of rows."
        )
    return [max(r) for r in zip(*(g["rounds"] for g in every))]


@functools.lru_cache(maxsize=None)
def _replica_id_on(replica: int, device: Any) -> jax.Array:
    """The int32 replica id on its device, the first argument of a replica's program (made once)."""
    return jax.device_put(jnp.asarray(replica, jnp.int32), device)

