"""The exact uneven step: every replica runs on exactly its real rows.

A step whose batch does not divide evenly between the replicas (an epoch's last,
or every step when the global batch does not divide by the replicas) cannot be
one SPMD program: the replicas' shapes differ.  It runs as TensorFlow's
MirroredStrategy runs every step: one thread per local replica, each calling the
replica function on its own device with its own rows
(TF's layout: contiguous chunks of ``ceil(b / R)`` rows in replica order, so 3
rows over 2 replicas give 2 | 1, and 1 row gives 1 | 0, an empty replica seeing
shape ``(0, ...)``).  The threads meet at every collective
(:class:`ThreadedReplicaContext`): ``all_reduce``, ``all_gather``, the
optimizer's gradient sum and the final combination of assigned variables.  Made
eagerly, a collective adds up the replicas' values with one small compiled program over the
strategy's mesh, so it spans workers too (every worker's threads make the same
calls in the same order).

Collectives are differentiable (``jax.custom_vjp``: the gradient of a sum is a
sum), so a loss that all-reduces inside ``compute_gradients`` works.

On one worker, each replica's function is compiled (once per replica shape; the
replica id is an argument, so replicas of one shape share the program) and its
collectives become ordered host callbacks (``io_callback``) that meet the other
replicas' programs, each running on its own device, and add up in numpy.  Code
that cannot be compiled (an ``all_gather``, a Python branch on a value) runs
eagerly on every replica instead; all replicas of a step agree on which.  Across
workers the replicas run eagerly and a collective is one compiled program over the
mesh; there, and in eager code, a collective under ``jax.jit``, ``vmap`` or
``lax.scan`` raises TypeError.

Nothing here pads anything: padding exists only inside ``PerReplica`` storage,
where nothing can observe it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distribute import _context, collectives
from distribute.replica import ReplicaContext
from distribute.values import ReduceOp

MEETING_TIMEOUT_SECONDS = 300.0

# id(strategy.extended) -> the running uneven step's replica contexts, by local index:
# where a compiled replica program's collective callback finds the replica it runs for.
_RUNNING: dict[int, list] = {}


class NeedsEager(Exception):
    """Raised while compiling a replica's program: this code runs eagerly instead."""


class _Aborted(Exception):
    """Another replica failed; this one stops without a message of its own."""


class _Meeting:
    """Where this worker's replica threads meet at each collective.

    Every replica calls :meth:`exchange` with its value; the last to arrive
    computes ``combine(values)`` (one result per replica) and wakes the others.
    A replica that returned early (it skipped a collective the others make), a
    failure in another replica, or a wait past ``timeout_seconds`` ends the wait
    with an error instead of a hang.
    """

    def __init__(self, num_replicas: int, timeout_seconds: float):
        self._num = num_replicas
        self._timeout = timeout_seconds
        self._cond = threading.Condition()
        self._round = 0
        self._values: dict[int, Any] = {}
        self._results: dict[int, Any] = {}
        self._readers: dict[int, int] = {}
        self._finished: dict[int, int] = {}  # replica -> collectives it made before returning
        self._failed = False

    def exchange(self, replica: int, value: Any, combine: Callable[[list], list]) -> Any:
        with self._cond:
            round_ = self._round
            self._check(replica, round_)
            self._values[replica] = value
            if len(self._values) == self._num:
                values = [self._values[r] for r in range(self._num)]
                self._values = {}
                try:
                    results = combine(values)
                except BaseException:
                    self._fail()
                    raise
                self._results[round_] = results
                self._readers[round_] = self._num
                self._round += 1
                self._cond.notify_all()
            else:
                deadline = time.monotonic() + self._timeout
                while self._round == round_:
                    self._check(replica, round_)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        missing = sorted(set(range(self._num)) - set(self._values))
                        self._fail()
                        raise RuntimeError(
                            f"replica {replica} waited {self._timeout:.0f} s at collective #{round_ + 1} of an "
                            f"uneven step; local replicas {missing} never reached it. Every replica must make "
                            "the same collective calls (all_reduce, all_gather, apply_gradients) in the same "
                            "order, whatever its number of rows."
                        )
                    self._cond.wait(left)
            result = self._results[round_][replica]
            self._readers[round_] -= 1
            if not self._readers[round_]:
                del self._results[round_], self._readers[round_]
            return result

    def finished(self, replica: int, num_collectives: int) -> None:
        with self._cond:
            self._finished[replica] = num_collectives
            if self._values:
                self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._fail()

    def _fail(self) -> None:
        self._failed = True
        self._cond.notify_all()

    def _check(self, replica: int, round_: int) -> None:
        if self._failed:
            raise _Aborted()
        early = sorted(r for r, n in self._finished.items() if n <= round_)
        if early:
            self._failed = True
            self._cond.notify_all()
            raise RuntimeError(
                f"replica {replica} reached collective #{round_ + 1} of an uneven step, but replicas "
                f"{early} returned after {min(self._finished[r] for r in early)} collectives. Every replica "
                "must make the same collective calls (all_reduce, all_gather, apply_gradients) in the same "
                "order, whatever its number of rows: do not skip them for an empty replica."
            )


class ThreadedReplicaContext(ReplicaContext):
    """The replica context of one replica thread in an uneven step.

    Same API and answers as the SPMD context; collectives meet the other
    replicas' threads (and, through one compiled program over the mesh, the
    other workers' replicas).  ``replica_id_in_sync_group`` is an int32 scalar
    array, as in the SPMD program.
    """

    def __init__(self, strategy: Any, replica: int, local_index: int, meeting: _Meeting, rows: int | None, global_rows: int | None):
        super().__init__(strategy, in_program=True, rows=rows, global_rows=global_rows)
        self._replica = replica
        self._local = local_index
        self._meeting = meeting
        self._calls = 0
        self._device = strategy.extended.replica_mesh.local_devices[local_index]
        self._first = replica - local_index
        self._traced_replica_id = None
        self._callbacks = False  # collectives under a trace become host callbacks
        self._callback_error: BaseException | None = None

    _runs_eagerly = True

    @contextlib.contextmanager
    def _compiling(self) -> Iterator[None]:
        """While this replica's program is traced, its collectives are host callbacks (one worker only)."""
        previous, self._callbacks = self._callbacks, jax.process_count() == 1
        try:
            yield
        finally:
            self._callbacks = previous

    def _agree(self, compiled: bool) -> bool:
        """True when every local replica has a compiled program for this step (else all run eagerly)."""
        self._calls += 1
        return bool(self._meeting.exchange(self._local, compiled, lambda flags: [all(flags)] * len(flags)))

    @property
    def replica_id_in_sync_group(self) -> Any:
        if self._traced_replica_id is not None:
            return self._traced_replica_id
        return jnp.asarray(self._replica, jnp.int32)

    @contextlib.contextmanager
    def _tracing_replica_id(self, replica_id: Any) -> Iterator[None]:
        """While a per-replica program is traced, the replica id is its argument (replicas share it)."""
        previous, self._traced_replica_id = self._traced_replica_id, replica_id
        try:
            yield
        finally:
            self._traced_replica_id = previous

    # -- the meeting ------------------------------------------------------------------
    def _traced(self, leaves: list) -> bool:
        """True while this replica's program is traced: the collective becomes a callback of the program.

        Even of concrete values (a constant): meeting the others at trace time would
        pair this trace with their programs' collectives.
        """
        if self._callbacks:
            return True
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            raise self._under_transformation()
        return False

    def _meet_in_program(self, leaves: list, what: str, combine: Callable[[list], list], result_specs: list) -> list:
        """The collective as an ordered host callback: the executing replica meets the others there.

        ``combine`` gets every local replica's numpy values and returns one result
        list per replica, shaped as ``result_specs``.
        """
        key, first = id(self._strategy.extended), self._first

        def host(replica_id, *values):
            context = _RUNNING[key][int(replica_id) - first]
            try:
                out = context._meet([np.asarray(v) for v in values], combine, what)
            except BaseException as err:
                context._callback_error = err
                raise
            return [np.asarray(x, dtype=spec.dtype) for x, spec in zip(out, result_specs)]

        from jax.experimental import io_callback

        return list(io_callback(host, result_specs, self.replica_id_in_sync_group, *leaves, ordered=True))

    def _under_transformation(self) -> TypeError:
        return TypeError(
            "A collective (all_reduce, all_gather, or an optimizer's gradient sum) was called "
            "under a JAX transformation (jax.jit, vmap, lax.scan, lax.cond) inside an uneven step. "
            "In an uneven step (a batch that does not divide between the replicas) every replica "
            "runs on its own rows; there a collective needs concrete values (or, on one worker, a "
            "jax.jit around it): call it outside the transformation, or drop the uneven batch "
            "(batch(..., drop_remainder=True))."
        )

    def _meet(self, value: Any, combine: Callable[[list], list], what: str) -> Any:
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(value)):
            raise self._under_transformation()
        self._calls += 1
        signature = (what, jax.tree_util.tree_structure(value))

        def checked(entries: list) -> list:
            signatures = [sig for sig, _ in entries]
            if any(sig != signatures[0] for sig in signatures):
                kinds = ", ".join(f"replica {self._first + r}: {sig[0]}" for r, sig in enumerate(signatures))
                raise RuntimeError(
                    f"The replicas of an uneven step made different collective calls at collective "
                    f"#{self._calls} ({kinds}). Every replica must make the same collective calls "
                    "(all_reduce, all_gather, apply_gradients) in the same order, whatever its number of rows."
                )
            return combine([v for _, v in entries])

        return self._meeting.exchange(self._local, (signature, value), checked)

    def _sum_tree(self, tree: Any) -> Any:
        """Sum over every replica (all workers) of each leaf of ``tree``; every replica gets it."""
        strategy = self._strategy
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        leaves = [jnp.asarray(x) for x in leaves]
        if self._traced(leaves):
            specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
            return jax.tree_util.tree_unflatten(treedef, self._meet_in_program(leaves, "all_reduce", _host_sum, specs))

        def combine(per_replica: list) -> list:
            return collectives.sum_over_replicas(strategy, [list(col) for col in zip(*per_replica)])

        return jax.tree_util.tree_unflatten(treedef, self._meet(leaves, combine, "all_reduce"))

    def _sum(self, tree: Any) -> Any:
        """Differentiable sum over replicas (the gradient of a sum is a sum)."""
        return _differentiable_sum(self)(tree)

    def _everyones(self, tree: Any) -> Any:
        """Every replica's value of each (equal-shaped) leaf, on the host: ``(replicas, ...)`` each."""
        strategy = self._strategy
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        leaves = [jnp.asarray(x) for x in leaves]
        if self._traced(leaves):
            n = len(strategy.extended.replica_mesh.local_devices)
            specs = [jax.ShapeDtypeStruct((n, *x.shape), x.dtype) for x in leaves]
            return jax.tree_util.tree_unflatten(treedef, self._meet_in_program(leaves, "exchange", _host_stack, specs))

        def combine(per_replica: list) -> list:
            every = collectives.everyone(strategy, [list(col) for col in zip(*per_replica)])
            return [every] * len(per_replica)

        return jax.tree_util.tree_unflatten(treedef, self._meet(leaves, combine, "exchange"))

    def _gather_tree(self, tree: Any, axis: int) -> Any:
        """Concatenation of every replica's leaves along ``axis``, shapes may differ along it."""
        strategy = self._strategy
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        leaves = [jnp.asarray(x) for x in leaves]
        if self._traced(leaves):
            raise NeedsEager("all_gather's result shape depends on the other replicas' shapes")

        def combine(per_replica: list) -> list:
            return collectives.gather_over_replicas(strategy, [list(col) for col in zip(*per_replica)], axis)

        return jax.tree_util.tree_unflatten(treedef, self._meet(leaves, combine, "all_gather"))

    # -- public collectives ---------------------------------------------------------------
    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any = None) -> Any:
        op = ReduceOp.from_value(reduce_op)
        total = self._sum(jax.tree_util.tree_map(jnp.asarray, value))
        if op is ReduceOp.SUM:
            return total
        return jax.tree_util.tree_map(lambda t: t / self.num_replicas_in_sync, total)

    def merge_call(self, merge_fn: Callable, args: Any = (), kwargs: Any = None) -> Any:
        from distribute import merge_call

        return merge_call.threaded(self, merge_fn, args, kwargs, collectives.per_replica_from_local, NeedsEager)

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        for leaf in jax.tree_util.tree_leaves(value):
            if jnp.ndim(leaf) == 0:
                raise ValueError("all_gather needs values of rank >= 1; got a scalar. Expand its dims first.")
        return _differentiable_gather(self, axis)(jax.tree_util.tree_map(jnp.asarray, value))

    # -- what the engine and the Keras hooks use ---------------------------------------------
    def _sum_gradients(self, grads: list) -> list:
        present = [g for g in grads if g is not None]
        summed = iter(self._sum_tree(present))
        return [None if g is None else next(summed) for g in grads]

    def _prepare_for_gradients(self, values: list) -> list:
        return values

    def _combine_all(self, variables: Sequence[Any], new: Sequence[Any], old: Sequence[Any], plain: frozenset = frozenset(),
                     updates: frozenset = frozenset()) -> list:
        """Makes assigned variables identical on every replica, by their aggregation (as the SPMD path).

        ``sum``: every replica's change counts; values equal on every replica stay;
        others: ``mean`` over the replicas that had rows (an empty replica
        contributes nothing), ``only_first_replica`` replica 0's, ``none`` an
        error for trainable variables and the mean for the others (BatchNorm).
        """
        from distribute.replica import different_values_error

        if not variables:
            return []
        new = [jnp.asarray(n, dtype=o.dtype) for n, o in zip(new, old)]
        first = self._replica == 0
        # an optimizer's write of a sum variable (identical values) is not a replica's change
        summed = [v.aggregation == "sum" and id(v) not in updates for v in variables]
        # Round 1: every replica's change of the sum variables; replica 0's value of the others.
        assigned = [id(v) in plain for v in variables]
        probe = [(n if a else n - o) if is_sum else jnp.where(first, n, jnp.zeros_like(n)) for n, o, is_sum, a in zip(new, old, summed, assigned)]
        totals = self._sum_tree(probe)
        others = [i for i, is_sum in enumerate(summed) if not is_sum]
        out = [(t if a else o + t) if is_sum else t for o, t, is_sum, a in zip(old, totals, summed, assigned)]
        if not others:
            return out
        # Round 2: which values differ from replica 0's, and their mean over the replicas that had rows.
        has_rows = jnp.asarray(0.0 if self._rows == 0 else 1.0, jnp.float32)
        differs = [jnp.any(new[i] != totals[i]).astype(jnp.int32) for i in others]
        weighted = [(new[i] * has_rows.astype(new[i].dtype)) if jnp.issubdtype(new[i].dtype, jnp.inexact) else new[i] for i in others]
        num_differ, sums, count = self._sum_tree((differs, weighted, has_rows))
        count = jnp.maximum(count, 1.0)
        for i, flag, total in zip(others, num_differ, sums):
            var = variables[i]
            if not int(flag) or var.aggregation == "only_first_replica":
                continue  # replica 0's value (the others added zeros)
            if var.aggregation == "mean" or (var.aggregation == "none" and not var.trainable):
                out[i] = (total / count.astype(total.dtype)).astype(new[i].dtype)
            else:
                raise different_values_error(var)
        return out


def _host_sum(per_replica: list) -> list:
    """Each leaf summed over the local replicas (in replica order), the same for every replica."""
    totals = [np.sum(np.stack(col), axis=0, dtype=col[0].dtype) for col in zip(*per_replica)]
    return [totals] * len(per_replica)


def _host_stack(per_replica: list) -> list:
    """Every local replica's value of each leaf, stacked: ``(replicas, ...)``."""
    every = [np.stack(col) for col in zip(*per_replica)]
    return [every] * len(per_replica)


def _differentiable_sum(context: ThreadedReplicaContext) -> Callable:
    @jax.custom_vjp
    def total(tree):
        return context._sum_tree(tree)

    def fwd(tree):
        return context._sum_tree(tree), None

    def bwd(_, cotangent):
        return (context._sum_tree(cotangent),)

    total.defvjp(fwd, bwd)
    return total


def _differentiable_gather(context: ThreadedReplicaContext, axis: int) -> Callable:
    @jax.custom_vjp
    def gather(tree):
        return context._gather_tree(tree, axis)

    def fwd(tree):
        sizes = jax.tree_util.tree_map(lambda x: x.shape[axis % x.ndim], tree)
        return context._gather_tree(tree, axis), sizes

    def bwd(sizes, cotangent):
        # The gradient of a gather: this replica's slice of the sum of every replica's cotangent.
        total = context._sum_tree(cotangent)
        starts = context._gather_tree(jax.tree_util.tree_map(lambda n: jnp.asarray([n]), sizes), 0)

        def mine(t, offsets, n):
            start = int(np.sum(np.asarray(offsets)[: context._replica]))
            return jax.lax.slice_in_dim(t, start, start + n, axis=axis % t.ndim)

        return (jax.tree_util.tree_map(mine, total, starts, sizes),)

    gather.defvjp(fwd, bwd)
    return gather


# -- running the threads -------------------------------------------------------------------
def run_replicas(strategy: Any, body: Callable[[ThreadedReplicaContext], Any], rows: Sequence[int] | None) -> list:
    """Runs ``body(context)`` once per local replica, each in its own thread, and returns the results.

    ``rows``: the real rows of every replica in the job (``num_replicas_in_sync``
    counts), or None when the step has no batch.  Each thread runs in a copy of
    the caller's context, on its replica's device (``jax.default_device``), with
    Keras' thread-local settings (dtype policy) copied from the caller.

    Raises:
        The first exception a replica raised (the others stop at their next
        collective).
    """
    from distribute._keras import copy_thread_state

    ext = strategy.extended
    num_local = len(ext.replica_mesh.local_devices)
    first = ext.replica_mesh.devices.index(ext.replica_mesh.local_devices[0])
    timeout = float(getattr(ext, "_timeout_seconds", None) or MEETING_TIMEOUT_SECONDS)
    meeting = _Meeting(num_local, timeout)
    global_rows = None if rows is None else int(sum(rows))
    results: list = [None] * num_local
    errors: list = [None] * num_local
    keras_state = copy_thread_state()

    contexts = [
        ThreadedReplicaContext(strategy, first + local, local, meeting, None if rows is None else int(rows[first + local]), global_rows)
        for local in range(num_local)
    ]

    def work(local: int) -> None:
        context = contexts[local]
        try:
            keras_state.apply()
            with jax.default_device(ext.replica_mesh.local_devices[local]), _context.enter_replica(strategy, context):
                results[local] = body(context)
        except BaseException as err:  # noqa: BLE001 - re-raised by the caller's thread
            # An error in a compiled program's collective reaches here wrapped by XLA: use the original.
            err = context._callback_error or err
            errors[local] = err
            if not isinstance(err, _Aborted):
                meeting.abort()
        finally:
            meeting.finished(local, context._calls)

    key = id(ext)
    if key in _RUNNING:
        raise RuntimeError("an uneven step of this strategy is already running: strategy.run cannot be nested or called from two threads at once.")
    _RUNNING[key] = contexts
    try:
        threads = [threading.Thread(target=contextvars.copy_context().run, args=(work, i), name=f"distribute-replica-{i}", daemon=True) for i in range(num_local)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        del _RUNNING[key]
    real = [e for e in errors if e is not None and not isinstance(e, _Aborted)]
    if real:
        raise real[0]
    if any(errors):  # pragma: no cover - an abort always has a cause
        raise RuntimeError("an uneven step was aborted without an error")
    return results
