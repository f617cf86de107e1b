"""The worker actor (``/job:worker/replica:0/task:<i>``): runs scheduled steps, reads and updates its ps.

See ``actors.py`` for how ps and workers work together, ``row_plan.py`` for row reads and row updates.
"""

from __future__ import annotations

import collections
import secrets
import threading
from typing import Any

import numpy as np

from distribute.parameter_server import worker_rows
from distribute.parameter_server.actor_common import LOST, _load, load_jax, _locked, _rows, _Served
from distribute.parameter_server.channel import Connection, RemoteError
from distribute.parameter_server.dataset import ElementSpecChanged, element_specs
from distribute.parameter_server.errors import OutOfRangeError, UnavailableError, ps_lost
from distribute.parameter_server.worker_context import worker_index_scope

_PING_SECONDS = 60.0  # a ps that does not answer Ray's ping in this long is treated as lost


def _input_dtype(dtype: Any) -> str:
    """The dtype (``str``) a program input has for an element leaf of ``dtype``: JAX's (x64 off: 64 bits held in 32)."""
    import jax

    return np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(dtype))).str


def _same_dtype(dtype: Any, planned: str) -> bool:
    """Whether a leaf of ``dtype`` feeds a program input traced as ``planned`` (the coordinator's canonical dtype)."""
    return np.dtype(dtype).str == planned or _input_dtype(dtype) == planned


def _treedefs(plan: Any) -> tuple:
    """Per iterator of ``plan``, the element treedef its program reads (None: not recorded, any structure)."""
    treedefs = tuple(getattr(plan, "element_treedefs", ()) or ())
    return treedefs if len(treedefs) == len(plan.iterators) else (None,) * len(plan.iterators)


def _plan_signature(plan: Any) -> tuple:
    """What decides the program for a run's elements: per iterator, its id, element structure, shapes and dtypes."""
    return tuple(
        (rid, treedef, tuple(tuple((tuple(shape), _input_dtype(dtype)) for shape, dtype in element) for element in specs))
        for (rid, _, specs), treedef in zip(plan.iterators, _treedefs(plan))
    )


def _changed_signature(changed: ElementSpecChanged) -> tuple:
    """``_plan_signature`` of the program ``changed`` asks for (the worker's elements, as program inputs)."""
    return tuple(
        (rid, treedef, tuple(tuple((tuple(shape), _input_dtype(dtype)) for shape, dtype in element) for element in elements))
        for rid, treedef, elements in changed.specs
    )


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


class _PSHandles:
    """The ps actor handles, each looked up by name on first use when given as a name."""

    def __init__(self, handles: list, namespace: str | None) -> None:
        self._handles, self._namespace = list(handles), namespace

    def __getitem__(self, j: int) -> Any:
        handle = self._handles[j]
        if isinstance(handle, str):
            import ray

            try:
                handle = self._handles[j] = ray.get_actor(handle, namespace=self._namespace)
            except ValueError as error:  # Ray finds live named actors only: the ps died before this (restarted) worker
                raise ps_lost(j) from error  # first reached it, and is lost as if it died while reached
        return handle

    def __len__(self) -> int:
        return len(self._handles)


class Worker(_Served):
    """One worker task (``/job:worker/replica:0/task:<i>``): runs scheduled steps (``("run", *run's arguments)`` on its channel)."""

    REQUESTS = ("run",)

    def __init__(self, worker_index: int, ps_handles: list, namespace: str | None = None) -> None:
        """``ps_handles``: the ps actors, or their names in ``namespace`` (looked up on first use: a restartable
        actor whose constructor arguments are plain values restarts without Ray's object store)."""
        self._index = worker_index
        self._name = f"worker {worker_index}"
        self._ps = _PSHandles(ps_handles, namespace)
        self._programs: dict[int, Any] = {}
        self._iterators: dict[int, Any] = {}
        self._datasets: dict[int, Any] = {}  # built per-worker datasets: a fresh iterator per run
        self._variants: dict[tuple, tuple] = {}  # (plan family, element signature) -> (plan, box) run before
        self._box_programs: dict[Any, int] = {}  # a step program's box -> the id of the plan that loaded it first
        self._plans: dict[int, Any] = {}  # program id -> StepPlan, sent once by the coordinator
        self._sent: set[tuple[int, int]] = set()  # (ps, apply program id) sent to that ps
        self._read_back: dict[int, tuple[int, dict]] = {}  # ps -> (version, key -> value) from the last push
        self._channels: dict[int, Any] = {}  # ps -> channel.Connection, opened on first use
        self._addresses: dict[int, tuple] = {}  # ps -> (host, port, token) of its channel
        self._failed: int | None = None  # the id of the last closure that raised here
        self._adopted = not _reconstructed()
        self._lock = threading.Lock()  # runs (channel) and Ray methods, one at a time
        self._server: Any = None
        # The input library loads while the coordinator builds its model; a dataset_fn runs after it (_warm_up).
        self._warm = threading.Thread(target=_warm_up, name="distribute-warm-up", daemon=True)
        self._warm.start()

    def ping(self) -> int:
        return self._index

    @_locked
    def adopt(self) -> None:
        """The coordinator recovered this restarted worker: it runs closures again."""
        self._adopted = True

    @_locked
    def load_plan(self, plan: Any, box: list) -> None:
        """Keeps a ``StepPlan`` and loads its program (sent once, through Ray; runs then name its program id)."""
        self._keep_plan(plan, box)

    def _keep_plan(self, plan: Any, box: list | None) -> None:
        """Keeps ``plan``; its program is the one compiled here for the same box before (``with_iterators``: a new
        iterator of a known signature), else loaded from ``box``."""
        self._plans[plan.program_id] = plan
        known = plan.program_id if box is None else self._box_programs.setdefault(box[0], plan.program_id)
        if known != plan.program_id and known in self._programs:
            self._programs[plan.program_id] = self._programs[known]
        else:
            _load(self._programs, plan.program_id, box)

    @_locked
    def create_iterator(self, resource_id: int, dataset_fn: Any) -> Any:
        """Builds this worker's dataset with ``dataset_fn()`` and returns its first element's spec.

        Returns ``(treedef, [(shape, dtype str), ...])``, or None for an empty dataset.  A ``dataset_fn`` with ``fresh_iterators`` (``build()``) keeps
        the dataset: each run starts a new iterator on it.
        """
        import jax

        self._warm.join()
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

    @_locked
    def element_spec(self, resource_id: int) -> Any:
        """The ``element_spec`` of a built dataset (``PerWorkerDataset.build()``): the Dataset's, else its first element's."""
        return element_specs(self._datasets[resource_id])

    @_locked
    def run(self, closure_id: int, plan: Any, box: list | None, args: list, after: int | None = None,
            seen: dict | None = None) -> Any:
        """Reads the variables ``plan`` reads, runs the step program, pushes its updates.

        ``closure_id`` identifies the scheduled call (the same on a re-run), so that
        every ps applies one run of it, once (``_apply_once``).  ``plan`` is a ``StepPlan``, or the program
        id of one sent before (then ``box`` is None).  ``after`` is the id of the
        closure the coordinator sent here just before, still in flight when it sent
        this one: if that one raised here, this one does not run (returns None; the
        coordinator cancels it, or re-queues it, as if it had still been queued, as
        TF).  ``seen``: ps index -> the newest version of it the coordinator had
        observed (module docstring).

        Returns ``(results as numpy arrays, {ps: version after this push})``, None
        (skipped) or ``LOST`` (a restarted worker not yet recovered).
        """
        if not self._adopted:
            return LOST
        if isinstance(plan, int):
            plan = self._plans[plan]
        else:  # kept, with its program, even when skipped: the coordinator sends each once
            self._keep_plan(plan, box)
        if after is not None and after == self._failed:
            self._failed = closure_id  # and the one sent after it, if any, is skipped too
            return None
        try:
            return self._step(closure_id, plan, box, args, seen or {})
        except BaseException:
            self._failed = closure_id
            raise

    def _pull(self, plan: Any, seen: dict) -> dict:
        """ps -> {key: value} of what ``plan`` reads: the last push's read-back where new enough, else a read."""
        pulled, pulls = {}, {}
        for j, keys in plan.pull.items():
            kept = self._read_back.get(j)
            if kept is not None and kept[0] >= seen.get(j, 0) and all(k in kept[1] for k in keys):
                pulled[j] = kept[1]
            elif keys:
                self._read_back.pop(j, None)  # older than what this step reads now
                pulls[j] = ("read", keys)
        for j, vals in self._exchange(pulls).items():
            pulled[j] = dict(zip(plan.pull[j], vals))
        return pulled

    def _exchange(self, requests: dict) -> dict:
        """Sends each ps ``j`` its request over its channel, then collects the replies: ``{j: reply}``.

        A broken connection (the ps restarted its socket, a network fault, this
        worker's own restart) is reopened once and the request sent again: a
        read is repeatable and a repeated update is skipped by the ps (closure
        ids).  A dead ps surfaces as Ray's actor error from ``_alive`` (the
        coordinator classifies it as the ps's loss).
        """
        failed = []
        for j, request in requests.items():
            try:
                self._connection(j).send(request)
            except OSError:
                failed.append(j)
        replies = {}
        for j in requests:
            if j in failed:
                continue
            try:
                replies[j] = self._channels[j].receive()
            except RemoteError as error:
                raise error.error from None
            except OSError:
                failed.append(j)
        for j in failed:
            self._drop(j)
            self._alive(j)
            try:
                connection = self._connection(j)
                connection.send(requests[j])
                replies[j] = connection.receive()
            except RemoteError as error:
                raise error.error from None
            except OSError as error:
                self._drop(j)
                self._alive(j)
                raise UnavailableError(
                    f"worker {self._index} cannot reach ps {j} ({self._addresses[j][:2]}), which Ray reports "
                    f"alive: {error!r}. Check the network between the nodes (firewall, the node address)."
                ) from error
        return {j: replies[j] for j in requests}

    def _connection(self, j: int) -> Any:
        connection = self._channels.get(j)
        if connection is None:
            import ray

            if j not in self._addresses:
                self._addresses[j] = ray.get(self._ps[j].channel.remote())
            connection = self._channels[j] = Connection(self._addresses[j], lambda: self._alive(j))
        return connection

    def _drop(self, j: int) -> None:
        connection = self._channels.pop(j, None)
        if connection is not None:
            connection.close()

    def _alive(self, j: int) -> None:
        """Returns if Ray reports ps ``j`` alive; a dead ps raises ``PSUnavailableError`` naming it."""
        import ray

        try:
            ray.get(self._ps[j].ping.remote(), timeout=_PING_SECONDS)
        except ray.exceptions.RayActorError as error:
            raise ps_lost(j) from error

    def _step(self, closure_id: int, plan: Any, box: list | None, args: list, seen: dict) -> tuple[list, dict]:
        import jax

        plan, box, iter_vals = self._plan_for_elements(plan, box)
        if isinstance(iter_vals, ElementSpecChanged):
            return iter_vals  # nothing pulled or pushed: the coordinator sends the program of this signature
        program = _load(self._programs, plan.program_id, box)
        pulled = self._pull(plan, seen)
        read_vals = [None if keys is None else _rows([pulled[j][k] for j, k in keys]) for keys in plan.read]
        if plan.rows is None:
            outs, rows = jax.device_get(list(program(read_vals, iter_vals, list(args)))), None
        else:  # row tables: only their looked-up rows are read, and updated
            outs, rows = worker_rows.run(self, plan, program, read_vals, iter_vals, list(args))
        versions = self._push(closure_id, plan, outs, pulled, rows)
        return outs[: plan.num_results], versions

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

        Every element of the call is read first; if one's structure (treedef),
        shapes or dtypes are not those the program was traced for (a partial
        batch, an int32 batch after float32 ones, a dict with other keys), all of
        them go back to their iterators, in order, and the new signature is
        returned: the same elements are read again by the run with the program
        traced for it (TF's ``tf.function`` retraces for a new input signature).
        Dtypes compare as program inputs: a float64 leaf feeds a program traced for
        float32 when JAX holds float64 as float32 (x64 off).

        Raises:
            OutOfRangeError: an iterator is exhausted (TF's OutOfRangeError).
            TypeError: the elements one call reads from one iterator differ in
                structure (a program unflattens every element of an iterator alike).
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
        for (resource_id, _, specs), expected, (_, elements) in zip(plan.iterators, _treedefs(plan), read):
            treedefs, element_leaves = [], []
            for element, spec in zip(elements, specs):
                leaves, treedef = jax.tree_util.tree_flatten(element)
                leaves = [np.asarray(x) for x in leaves]
                treedefs.append(treedef)
                element_leaves.append([(x.shape, x.dtype.str) for x in leaves])
                changed = (changed or (expected is not None and treedef != expected) or len(leaves) != len(spec)
                           or any(x.shape != tuple(s) or not _same_dtype(x.dtype, d) for x, (s, d) in zip(leaves, spec)))
                iter_vals.extend(x.astype(d, copy=False) for x, (_, d) in zip(leaves, spec))
            if any(t != treedefs[0] for t in treedefs):
                for iterator, put in read:
                    iterator.put_back(put)
                raise TypeError(
                    f"one scheduled call read {len(treedefs)} elements of different structures from per-worker "
                    f"iterator {resource_id} on worker {self._index}: {treedefs}. The function is compiled for one "
                    "element structure per iterator and call (TF: a dataset has one element_spec); give the "
                    "dataset's elements one structure, or call next() once per scheduled call."
                )
            seen.append((resource_id, treedefs[0] if treedefs else expected, element_leaves))
        if changed:
            for iterator, elements in read:
                iterator.put_back(elements)
            return ElementSpecChanged(tuple(seen))
        return iter_vals

    def _push(self, closure_id: int, plan: Any, outs: list, pulled: dict, rows: Any = None) -> dict:
        """Sends each ps its part of the update; keeps what each returns; returns ps -> version.

        ``rows``: the step's looked-up ids (``worker_rows.RowState``) when it has row tables.
        """

        # ps -> (applies, deltas, sets, apply program boxes)
        per_ps: dict[int, tuple[list, list, list, list]] = {}
        for j, program_id, box, owned, written, foreign, grad_slices, meta in plan.applies:
            foreign_vals = [outs[f] if isinstance(f, int) else _rows([pulled[p][k] for p, k in f]) for f in foreign]
            if meta is None:
                grads, row_ids = [_rows([outs[pos][a:b] for a, b in bounds]) if bounds else outs[pos]
                                  for pos, bounds in grad_slices], None
            else:
                grads, row_ids = worker_rows.apply_rows(plan.rows, meta, j, rows, outs, grad_slices)
            lists = per_ps.setdefault(j, ([], [], [], []))
            lists[0].append((program_id, owned, written, foreign_vals, grads, row_ids))
            lists[3].append((program_id, box))
        for kind, targets in ((1, plan.deltas), (2, plan.sets)):
            for pos, shards in targets:
                value = outs[pos]
                for j, key, a, b in shards:
                    part = value if a is None else value[a:b]
                    per_ps.setdefault(j, ([], [], [], []))[kind].append((key, part))
        backs = {j: plan.pull.get(j) or None for j in per_ps}
        self._load_programs(per_ps)
        replies = self._apply_once(closure_id, per_ps, backs)
        versions = {}
        for j, (version, values) in replies.items():
            versions[j] = version
            if values is None:
                self._read_back.pop(j, None)  # older than this worker's own update
            else:
                self._read_back[j] = (version, dict(zip(backs[j], values)))
        return versions

    def _apply_once(self, closure_id: int, per_ps: dict, backs: dict) -> dict:
        """Sends each ps its part of the update so that every ps applies one attempt of the closure: ps -> reply.

        One ps decides for each closure (``closure_id`` mod the ps count).  A push
        to it alone is one ``update``.  Otherwise the other ps stage their parts,
        then the deciding ps decides (the first attempt to reach it wins, even
        against a dead worker's delayed request) and applies its own part, then
        the others commit the decided attempt: a re-run closure, on another batch,
        completes the run that was decided rather than mixing two.
        """
        if not per_ps:  # a step that updates nothing
            return {}
        decider = closure_id % len(self._ps)
        if set(per_ps) == {decider}:
            lists = per_ps[decider]
            return self._exchange({decider: ("update", closure_id, *lists[:3], backs[decider])})
        attempt = secrets.randbits(62) + 1  # not SINGLE_ATTEMPT
        others = [j for j in per_ps if j != decider]
        self._exchange({j: ("stage", closure_id, attempt, *per_ps[j][:3]) for j in others})
        lists = per_ps.get(decider, ([], [], []))
        version, values, decided = self._exchange({decider: ("decide", closure_id, attempt, *lists[:3], backs.get(decider))})[decider]
        replies = self._exchange({j: ("commit", closure_id, decided, backs[j]) for j in others})
        if decider in per_ps:
            replies[decider] = (version, values)
        return replies

    def _load_programs(self, per_ps: dict) -> None:
        """Sends each ps (through Ray, once per ps) the apply programs this push uses that it does not have."""
        import ray

        loads = {(j, program_id): box for j, lists in per_ps.items() for program_id, box in lists[3]
                 if (j, program_id) not in self._sent}
        ray.get([self._ps[j].load.remote(program_id, box) for (j, program_id), box in loads.items()])
        self._sent.update(loads)


def _reconstructed() -> bool:
    """Whether this actor is a restart (Ray's ``was_current_actor_reconstructed``); False outside an actor."""
    try:
        import ray

        if not ray.is_initialized():  # not in an actor (and never start or join a Ray cluster for asking)
            return False
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not in a Ray actor
        return False


def _warm_up() -> None:
    """Loads what a worker's first dataset and step need (``distribute.data``: grain, orbax; JAX's CPU backend), and
    lets its datasets skip the Keras adapter (a worker never gives a Dataset to Keras ``fit``; loading Keras took
    seconds of the first epoch, issue 27)."""
    import distribute.data._kind as kind

    kind.without_keras_adapter()
    load_jax()
