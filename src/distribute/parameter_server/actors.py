"""The Ray actors: ``ParameterServer`` (holds variable shards, applies updates) and ``Worker``.

Neither imports Keras or user model code.  Workers run programs the coordinator
traced and serialized with ``jax.export``; the only user Python they run is a
``dataset_fn``.  Plans (which variables to pull, where each output goes) are
plain data built by ``program.py``.

A ps applies each update as it arrives (Ray runs one method of an actor at a
time, so an update is atomic): optimizer updates run the exported apply program
on the ps's *current* values and optimizer state; ``deltas`` are added (exact
totals under asynchrony); ``sets`` overwrite (last writer wins).

Every update carries the id of its closure, and a ps applies each closure's
update at most once.  A worker that dies while pushing may have reached some ps
and not others; the closure runs again elsewhere (TF's at-least-once), and the
ps that already have its update skip the repeat.  So every variable takes each
scheduled step exactly once, where TF can apply a re-run step twice to some
variables and once to others.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from distribute.parameter_server.dataset import ElementSpecChanged, element_specs
from distribute.parameter_server.errors import OutOfRangeError
from distribute.parameter_server.worker_context import worker_index_scope


# A re-run closure reaches the ps within seconds of the failure; remembering the last
# 2**16 applied closures (about 4 MB) covers that with a wide margin.
_REMEMBERED_CLOSURES = 1 << 16


def _load(cache: dict, program_id: int, box: list) -> Any:
    program = cache.get(program_id)
    if program is None:
        import jax
        import ray

        program = jax.export.deserialize(bytearray(ray.get(box[0])))
        cache[program_id] = program
    return program


def _rows(parts: list) -> Any:
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


class ParameterServer:
    """Holds variable storage keys -> arrays of one ps task (``/job:ps/replica:0/task:<j>``)."""

    def __init__(self, task_id: int) -> None:
        self._task_id = task_id
        self._values: dict[int, np.ndarray] = {}
        self._programs: dict[int, Any] = {}
        self._num_updates = 0
        self._applied: set[int] = set()
        self._applied_order: collections.deque[int] = collections.deque()

    def ping(self) -> int:
        return self._task_id

    def create(self, values: dict) -> None:
        for key, value in values.items():
            self._values[key] = np.asarray(value)

    def read(self, keys: tuple) -> list:
        return [self._values[k] for k in keys]

    def read_all(self) -> dict:
        return dict(self._values)

    def num_updates(self) -> int:
        return self._num_updates

    def update(self, closure_id: int, applies: list, deltas: list, sets: list) -> None:
        """Applies one step's updates: optimizer programs, then additive deltas, then sets.

        A second update for the same ``closure_id`` (a re-run closure) is skipped.
        """
        if closure_id in self._applied:
            return
        self._applied.add(closure_id)
        self._applied_order.append(closure_id)
        if len(self._applied_order) > _REMEMBERED_CLOSURES:
            self._applied.discard(self._applied_order.popleft())
        for program_id, box, owned, written, foreign_vals, grads in applies:
            program = _load(self._programs, program_id, box)
            owned_vals = [_rows([self._values[k] for k in keys]) for keys in owned]
            new_vals = program.call(owned_vals, list(foreign_vals), list(grads))
            for keys, value in zip(written, new_vals):
                value = np.asarray(value)
                start = 0
                for key in keys:
                    stop = start + self._values[key].shape[0] if len(keys) > 1 else None
                    self._values[key] = value if stop is None else value[start:stop]
                    start = stop or 0
        for key, delta in deltas:
            self._values[key] = np.asarray(self._values[key] + np.asarray(delta, self._values[key].dtype))
        for key, value in sets:
            self._values[key] = np.asarray(value, self._values[key].dtype)
        self._num_updates += 1


def _plan_signature(plan: Any) -> tuple:
    return tuple((rid, tuple(tuple(tuple(shape) for shape, _ in element) for element in specs)) for rid, _, specs in plan.iterators)


def _changed_signature(changed: ElementSpecChanged) -> tuple:
    return tuple((rid, tuple(tuple(tuple(shape) for shape, _ in element) for element in elements))
                 for rid, _, elements in changed.specs)


class _Iterator:
    """A worker's dataset iterator; elements a run put back come first, in their order."""

    def __init__(self, iterator: Any, first: list | tuple = ()) -> None:
        self._iterator, self._pending = iterator, collections.deque(first)

    def __next__(self) -> Any:
        if self._pending:
            return self._pending.popleft()
        return next(self._iterator)

    def put_back(self, elements: list) -> None:
        self._pending.extendleft(reversed(elements))


class Worker:
    """One worker task (``/job:worker/replica:0/task:<i>``): runs scheduled steps."""

    def __init__(self, worker_index: int, ps_handles: list) -> None:
        self._index = worker_index
        self._ps = list(ps_handles)
        self._programs: dict[int, Any] = {}
        self._iterators: dict[int, Any] = {}
        self._datasets: dict[int, Any] = {}  # built per-worker datasets: a fresh iterator per run
        self._variants: dict[tuple, tuple] = {}  # (plan family, element shapes) -> (plan, box) run before

    def ping(self) -> int:
        return self._index

    def create_iterator(self, resource_id: int, dataset_fn: Any) -> Any:
        """Builds this worker's dataset with ``dataset_fn()`` and returns its first element's spec.

        Returns ``(treedef, [(shape, dtype str), ...])``, or None for an empty dataset.  A ``dataset_fn`` with ``fresh_iterators`` (``build()``) keeps
        the dataset: each run starts a new iterator on it.
        """
        import jax

        with worker_index_scope(self._index):
            dataset = dataset_fn()
        iterator = iter(dataset)
        fresh = getattr(dataset_fn, "fresh_iterators", False)
        if fresh:
            self._datasets[resource_id] = dataset
        try:
            first = next(iterator)
        except StopIteration:
            if not fresh:
                self._iterators[resource_id] = _Iterator(iter(()))
            return None
        if not fresh:
            self._iterators[resource_id] = _Iterator(iterator, [first])
        leaves, treedef = jax.tree_util.tree_flatten(first)
        return treedef, [(tuple(np.shape(x)), np.asarray(x).dtype.str) for x in leaves]

    def element_spec(self, resource_id: int) -> Any:
        """The ``element_spec`` of a built dataset (``PerWorkerDataset.build()``): the Dataset's, else its first element's."""
        return element_specs(self._datasets[resource_id])

    def run(self, closure_id: int, plan: Any, box: list, args: list) -> list:
        """Pulls the variables ``plan`` reads, runs the step program, pushes its updates.

        ``closure_id`` identifies the scheduled call (the same on a re-run), so that
        each ps applies its update once.

        Returns the program's results as numpy arrays (copied to the coordinator).
        """
        import ray

        plan, box, iter_vals = self._plan_for_elements(plan, box)
        if isinstance(iter_vals, ElementSpecChanged):
            return iter_vals  # nothing pulled or pushed: the coordinator sends the program of this signature
        program = _load(self._programs, plan.program_id, box)
        pulls = {j: self._ps[j].read.remote(keys) for j, keys in plan.pull.items() if keys}
        pulled = {j: dict(zip(plan.pull[j], vals)) for j, vals in zip(pulls, ray.get(list(pulls.values())))}
        read_vals = [_rows([pulled[j][k] for j, k in keys]) for keys in plan.read]
        outs = program.call(read_vals, iter_vals, list(args))
        outs = [np.asarray(x) for x in outs]
        self._push(closure_id, plan, outs, pulled)
        return outs[: plan.num_results]

    def _plan_for_elements(self, plan: Any, box: list) -> tuple:
        """``(plan, box, element leaves)``: ``plan``, or the plan of its family that this worker ran before for the
        shapes of the next elements (no round trip to the coordinator); ElementSpecChanged for a new signature."""
        if plan.family >= 0:
            self._variants[(plan.family, _plan_signature(plan))] = (plan, box)
        found = self._elements(plan)
        if isinstance(found, ElementSpecChanged) and plan.family >= 0:
            variant = self._variants.get((plan.family, _changed_signature(found)))
            if variant is not None:
                plan, box = variant
                found = self._elements(plan)  # the elements put back, in their order
        return plan, box, found

    def _elements(self, plan: Any) -> list | ElementSpecChanged:
        """The leaves of the elements ``plan`` reads, or (all put back) the signature they need.

        Every element of the call is read first; if one's shapes are not those the
        program was traced for (a partial batch), all of them go back to their
        iterators, in order, and the new signature is returned: the same elements
        are read again by the run with the program traced for it (TF retraces).

        Raises:
            OutOfRangeError: an iterator is exhausted (TF's OutOfRangeError).
        """
        import jax

        read = []
        for resource_id, count, _ in plan.iterators:
            iterator = self._iterators.get(resource_id)
            if iterator is None and resource_id in self._datasets:
                iterator = _Iterator(iter(self._datasets[resource_id]))
            if iterator is None:
                raise RuntimeError(f"worker {self._index} has no iterator {resource_id}; create it with create_per_worker_dataset.")
            elements = []
            for _ in range(count):
                try:
                    elements.append(next(iterator))
                except StopIteration:
                    raise OutOfRangeError(
                        f"End of sequence: the dataset of worker {self._index} is exhausted. Schedule a fixed number "
                        "of steps over an infinite dataset (dataset.repeat()), as TF recommends."
                    ) from None
            read.append((iterator, elements))
        iter_vals, seen, changed = [], [], False
        for (resource_id, _, specs), (_, elements) in zip(plan.iterators, read):
            treedef, element_leaves = None, []
            for element, spec in zip(elements, specs):
                leaves, treedef = jax.tree_util.tree_flatten(element)
                leaves = [np.asarray(x) for x in leaves]
                element_leaves.append([(x.shape, x.dtype.str) for x in leaves])
                changed = changed or len(leaves) != len(spec) or any(x.shape != tuple(s) for x, (s, _) in zip(leaves, spec))
                iter_vals.extend(x.astype(d, copy=False) for x, (_, d) in zip(leaves, spec))
            seen.append((resource_id, treedef, element_leaves))
        if changed:
            for iterator, elements in read:
                iterator.put_back(elements)
            return ElementSpecChanged(tuple(seen))
        return iter_vals

    def _push(self, closure_id: int, plan: Any, outs: list, pulled: dict) -> None:
        import ray

        per_ps: dict[int, tuple[list, list, list]] = {}
        for j, program_id, box, owned, written, foreign, grad_slices in plan.applies:
            foreign_vals = [outs[f] if isinstance(f, int) else _rows([pulled[p][k] for p, k in f]) for f in foreign]
            grads = [_rows([outs[pos][a:b] for a, b in bounds]) if bounds else outs[pos] for pos, bounds in grad_slices]
            per_ps.setdefault(j, ([], [], []))[0].append((program_id, box, owned, written, foreign_vals, grads))
        for kind, targets in ((1, plan.deltas), (2, plan.sets)):
            for pos, shards in targets:
                value = outs[pos]
                for j, key, a, b in shards:
                    part = value if a is None else value[a:b]
                    per_ps.setdefault(j, ([], [], []))[kind].append((key, part))
        ray.get([self._ps[j].update.remote(closure_id, *lists) for j, lists in per_ps.items()])
