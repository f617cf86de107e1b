"""Keras ``fit`` / ``evaluate`` / ``predict`` over every replica of a strategy.

A model compiled inside ``strategy.scope()`` remembers the strategy.  Its
``fit``, ``evaluate`` and ``predict`` then run inside that scope (so lazily built
layers are mirrored too) with Keras' own loop, callbacks and progress bar; only
the per-step functions are replaced by SPMD programs over the strategy's mesh:

* each batch is split between the replicas (``input/splitting.py``); a full
  batch runs as one SPMD program, an uneven one (the last, partial batch) as
  the exact uneven step (``uneven.py``: every replica on its real rows), so
  results equal one device's;
* each replica's loss is its ``compute_loss`` result weighted by its share of
  the batch's rows (``replica_loss.py``: one rule, Keras' own loss and
  overrides alike), so the sum over replicas is the loss of the whole batch;
  gradients are summed across replicas; the loss tracker and compiled metrics
  count real rows only;
* variables stay replicated (``ReplicaContext._combine_all``);
* a model that overrides ``train_step`` / ``test_step`` / ``predict_step`` runs
  the override as one program over the global batch (``_WholeBatchRunner``).

Beyond TF: TF's Keras averages each replica's mean loss, so an uneven last
batch gives a slightly different answer there; here it is exact.

Per-step cost of Keras' loop, for these models only: a batch-end callback call
that no callback listens to is skipped (Keras would read every step's logs to
the host for it), the loop's state is stored on the model untracked, and the
last, partial batch of ``fit`` on arrays is compiled ahead, in a thread, when it
splits evenly between the replicas.

The Keras methods that lead here (``compile``, ``fit``, ``make_train_function``, ...)
are wrapped in ``model_methods.py``; this module builds and runs the steps.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from distribute.mesh import AXIS
from distribute import _context, collectives
from distribute import placement, spmd, uneven
from distribute._keras import JAXTrainer, copy_thread_state, tree
from distribute.engine.host import HostCollectives
from distribute.input.splitting import split_batch, split_counts
import distribute.keras_support.steps as steps
from distribute.keras_support import interrupts
from distribute.lifting import check_ownership


# -- placing batches ------------------------------------------------------------------
def _split(strategy: Any, data: Any) -> tuple[Any, list[np.ndarray], np.ndarray | None]:
    """Splits one Keras batch between the replicas: ``(treedef, leaves, counts)``.

    An even batch gives this worker's ``(local replicas, rows, ...)`` stacks and
    ``counts`` None; an uneven one gives the whole batch's leaves and every
    replica's row count (TF's layout, ``split_counts``).
    """
    leaves, treedef = jax.tree_util.tree_flatten(data)
    leaves = [np.asarray(x) for x in leaves]
    num_rows, num_replicas = leaves[0].shape[0], strategy.num_replicas_in_sync
    if num_rows % num_replicas == 0:
        stacked, _ = split_batch(leaves, num_replicas, num_rows // num_replicas)
        return treedef, [strategy.extended.replica_mesh.local_rows(x) for x in stacked], None
    return treedef, leaves, split_counts(num_rows, num_replicas)


def _overridden(model: Any, method: str) -> bool:
    return getattr(type(model), method) is not getattr(JAXTrainer, method)


def _state_variables(model, parts):
    out = []
    for part in parts:
        if part == "trainable":
            out.append(list(model.trainable_variables))
        elif part == "non_trainable":
            out.append(list(model.non_trainable_variables))
        elif part == "optimizer":
            out.append(list(model.optimizer.variables))
        else:
            out.append(list(model.metrics_variables))
    return out


class _StepRunner:
    """Runs Keras' ``*_function(state, iterator)`` contract with the strategy's engine.

    ``build_step(treedef)`` returns ``step(state, leaves) -> (result, state)`` for
    one replica.  A full batch runs as one compiled SPMD program per input
    signature; with ``steps_per_execution = K > 1``, K full batches run as one
    program, an unrolled ``lax.scan`` (TF's steps_per_execution: one dispatch
    for K steps; unrolled because XLA:CPU ran convolutions inside a rolled loop
    6x slower).  An uneven batch runs as the exact uneven step.
    """

    def __init__(self, model: Any, strategy: Any, build_step: Any, parts: list, per_replica_result: bool = False, multi_step: bool = True):
        self.model, self.strategy, self.build_step = model, strategy, build_step
        self.variables = [v for part in parts for v in part]
        self.per_replica_result, self.multi_step = per_replica_result, multi_step
        self.layout = placement.StateLayout(parts, strategy.extended.replica_mesh)  # whole, or split (sharded state)
        self.cache: dict = {}
        self.steps: dict = {}
        self.ahead: dict = {}  # key -> (done Event, [Compiled or None]): programs compiled ahead (the partial batch)
        self.considered: set = set()  # (treedef, partial rows) already compiled ahead or found not to need it

    def _step(self, treedef: Any) -> Any:
        if treedef not in self.steps:
            check_ownership(self.strategy, self.variables)
            self.steps[treedef] = self.build_step(treedef)
        return self.steps[treedef]

    def _in_context(self, step: Any) -> Any:
        """``step`` inside the SPMD program: the replica context, this replica's ``(rows, ...)`` leaves."""
        strategy = self.strategy

        def body(state, leaves):
            local = [leaf[0] for leaf in leaves]
            context = spmd.replica_context(strategy, local[0].shape[0])
            state = self.layout.replica_values(context, state)
            with _context.enter_replica(strategy, context):
                result, state = step(state, local)
            state = self.layout.program_outputs(context, state)
            if self.per_replica_result:
                result = tree.map_structure(lambda o: o[None], result)
            return result, state

        return body

    def _compiled(self, treedef: Any, placed: list, steps: int) -> Any:
        key = (treedef, tuple((p.shape, p.dtype) for p in placed), steps)
        if key not in self.cache and key in self.ahead:
            done, compiled = self.ahead.pop(key)
            done.wait()  # not Thread.join: a join interrupted by Ctrl-C marks the thread finished (CPython 3.11)
            if compiled[0] is not None:  # else: compile it here (and raise its error here, if any)
                self.cache[key] = compiled[0]
        if key not in self.cache:
            body = self._in_context(self._step(treedef))
            result_spec = P(AXIS) if self.per_replica_result else P()
            state_spec = self.layout.spec()
            if steps == 1:
                program = spmd.compile_program(self.strategy, body, (state_spec, P(AXIS)), (result_spec, state_spec), donate_argnums=(0,))
            else:
                def scanned(state, stacked):
                    def scan_body(carry, leaves):
                        result, carry = body(carry, leaves)
                        return carry, result

                    state, results = lax.scan(scan_body, state, stacked, unroll=True)
                    return jax.tree_util.tree_map(lambda r: r[-1], results), state

                program = spmd.compile_program(self.strategy, scanned, (state_spec, P(None, AXIS)), (result_spec, state_spec), donate_argnums=(0,))
            self.cache[key] = program
        return self.cache[key]

    def __call__(self, state: Any, iterator: Any) -> tuple[list, Any]:
        """Runs up to ``steps_per_execution`` steps; StopIteration when the data is exhausted.

        Returns ``[result, ...]`` (one entry per compiled call or uneven step) and the state.
        """
        steps = max(int(self.model.steps_per_execution), 1)
        batches = []
        for _ in range(steps):
            try:
                batches.append(next(iterator))
            except StopIteration:
                if not batches:
                    raise
                break
        try:
            interrupts.raise_pending()  # Ctrl-C since the last step: stop here, the state given back
            return self._run(state, batches, steps)
        except BaseException:
            _restore_purged(self.variables, state)
            raise

    def _run(self, state: Any, batches: list, steps: int) -> tuple[list, Any]:
        split = [_split(self.strategy, data) for data in batches]
        ext = self.strategy.extended
        first = split[0]
        if self.multi_step and steps > 1 and len(split) == steps and all(
                counts is None and treedef == first[0] and all(np.shape(a) == np.shape(b) for a, b in zip(host, first[1]))
                for treedef, host, counts in split):  # one scan over equal batches; a partial one among them runs alone
            stacked = [_put_steps(self.strategy, np.stack([host[j] for _, host, _ in split])) for j in range(len(split[0][1]))]
            result, state = self._compiled(split[0][0], stacked, steps)(state, stacked)
            ext.record_dispatch(result)
            return [result], state
        outputs = []
        for treedef, host, counts in split:
            if counts is None:
                leaves = ext.replica_mesh.put_per_replica_all(host)
                program = self._compiled(treedef, leaves, 1)
                announced = (treedef, self.model.__dict__.get("_distribute_partial_rows"))
                if announced[1] and announced not in self.considered:
                    self.considered.add(announced)
                    self._compile_partial_ahead(treedef, leaves, state)
                result, state = program(state, leaves)
                ext.record_dispatch(result)
                if self.per_replica_result:
                    result = tree.map_structure(lambda o: _rows_in_order(ext.replica_mesh.to_host(o)), result)
            else:
                result, state = self._run_uneven(treedef, host, counts, state)
            outputs.append(result)
        return outputs, state

    def _compile_partial_ahead(self, treedef: Any, leaves: list, state: Any) -> None:
        """Compiles the step for fit's last, partial batch in a background thread, while the epoch's full steps run.

        Only when ``fit`` on arrays announced a partial batch
        (``_distribute_partial_rows``) that splits evenly between the replicas (an
        uneven one runs the exact uneven step, compiled per replica shape).  The
        thread traces with a copy of the caller's context and Keras settings; the
        result is used only for exactly the shapes it was compiled for, and a
        failed compile is simply redone (and raises) when the batch arrives.
        """
        partial = self.model.__dict__.get("_distribute_partial_rows")
        num_replicas = self.strategy.num_replicas_in_sync
        if self.per_replica_result or not partial or partial % num_replicas or jax.process_count() > 1:
            return
        rows = partial // num_replicas
        if leaves[0].shape[1] == rows:
            return
        shapes = [jax.ShapeDtypeStruct((p.shape[0], rows, *p.shape[2:]), p.dtype, sharding=p.sharding) for p in leaves]
        key = (treedef, tuple((p.shape, p.dtype) for p in shapes), 1)
        if key in self.cache or key in self.ahead:
            return
        state_shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding, weak_type=a.aval.weak_type), state)
        body = self._in_context(self._step(treedef))
        state_spec = self.layout.spec()
        program = spmd.compile_program(self.strategy, body, (state_spec, P(AXIS)), (P(), state_spec), donate_argnums=(0,))
        out: list = [None]
        keras_state = copy_thread_state()

        done = threading.Event()

        def compile_ahead() -> None:
            try:
                keras_state.apply()
                out[0] = program.lower(state_shapes, shapes).compile()
            except Exception:  # noqa: BLE001 - compiled again, raising there, when the batch arrives
                out[0] = None
            finally:
                done.set()

        # Not a daemon: the interpreter waits for it at exit (after Ctrl-C, say) instead of ending it inside XLA's
        # compiler, which aborts the process ("terminate called ...").
        thread = threading.Thread(target=contextvars.copy_context().run, args=(compile_ahead,), name="distribute-compile-ahead")
        self.ahead[key] = (done, out)
        thread.start()

    def _run_uneven(self, treedef: Any, leaves: list, counts: np.ndarray, state: Any) -> tuple[Any, Any]:
        """The exact uneven step (``uneven.run_step``, as ``strategy.run``): every replica runs ``step`` on its own rows."""
        strategy, step = self.strategy, self._step(treedef)
        mesh = strategy.extended.replica_mesh
        first = mesh.devices.index(mesh.local_devices[0])
        starts = np.concatenate([[0], np.cumsum(counts)])
        state_leaves, state_tree = jax.tree_util.tree_flatten(state)
        # State split over the replicas (sharded state) is gathered for the step and split again after it.
        layouts = [x.sharding if isinstance(x, jax.Array) and not x.is_fully_replicated else None for x in state_leaves]
        state_leaves = [x if layout is None else strategy.extended.replica_mesh.replicate(x) for x, layout in zip(state_leaves, layouts)]
        local_state = [collectives.local_slices(x, strategy) for x in state_leaves]
        inputs = [
            [*(s[local] for s in local_state), *(jax.device_put(x[starts[first + local]: starts[first + local + 1]], device) for x in leaves)]
            for local, device in enumerate(mesh.local_devices)
        ]
        num_state = len(state_leaves)

        def function(record, *flat):
            return step(jax.tree_util.tree_unflatten(state_tree, flat[:num_state]), list(flat[num_state:]))

        results = [out for out, _ in uneven.run_step(strategy, function, inputs, counts.tolist(), ("fit", step))]
        new_state = [jax.tree_util.tree_leaves(new) for _, new in results]
        new_leaves = [collectives.replicated_from_local(strategy, list(parts)) for parts in zip(*new_state)]
        new_leaves = [x if layout is None else placement.placed(x, layout) for x, layout in zip(new_leaves, layouts)]
        state = jax.tree_util.tree_unflatten(state_tree, new_leaves)
        if self.per_replica_result:
            # Every replica's rows, in order, on every worker (as Keras' predict returns them).
            pieces = [jax.tree_util.tree_leaves(result) for result, _ in results]
            tree_def = jax.tree_util.tree_structure(results[0][0])
            host = HostCollectives(strategy, counts.tolist())
            gathered = host.gather([[np.asarray(x) for x in p] for p in pieces], 0)[0]
            return jax.tree_util.tree_unflatten(tree_def, gathered), state
        return results[0][0], state


class _WholeBatchRunner:
    """Runs an overridden ``train_step`` / ``test_step`` / ``predict_step`` as one program over the global batch.

    Keras 3's JAX trainer hands ``<kind>_step(state, data)`` the whole batch and the state's
    arrays; the user's step calls ``stateless_call``, ``jax.value_and_grad``,
    ``optimizer.stateless_apply``, ``metric.stateless_update_state`` on them (keras.io,
    "Customizing what happens in fit() with JAX"). It runs here as Keras' own ``DataParallel``
    runs it: one ``jax.jit`` program over the global batch, the batch split along its first dim
    over the replicas' devices (``P("replica")``), the state kept where the strategy stores it
    (replicated, or split: sharded state); XLA's partitioner places the collectives. The user's
    code needs none, and its results are one device's by construction: the loss is the global
    batch's, random numbers are one device's stream, metrics count every row once. A batch
    whose rows do not split evenly (fit's last) is placed whole on every replica.

    Why not the replica steps of ``steps.py``: a user's step sees its data and gradients, not
    a loss this package could weight (``replica_loss.py``), so every value it computes from the
    batch (its loss tracker, a hand-written mean) would need the replicas' totals; one program
    over the global batch needs nothing of the step.
    """

    def __init__(self, model: Any, strategy: Any, kind: str, variables: list):
        self.model, self.strategy, self.kind, self.variables = model, strategy, kind, [v for part in variables for v in part]
        self.cache: dict = {}

    def __call__(self, state: Any, iterator: Any) -> tuple[list, Any]:
        steps = max(int(self.model.steps_per_execution), 1)
        outputs = []
        try:
            interrupts.raise_pending()  # Ctrl-C since the last step: stop here, the state given back
            for index in range(steps):
                try:
                    data = next(iterator)
                except StopIteration:
                    if index == 0:
                        raise
                    break
                leaves, treedef = jax.tree_util.tree_flatten(data)
                placed = [self._place(np.asarray(x)) for x in leaves]
                result, state = self._program(treedef, placed, state)(state, placed)
                self.strategy.extended.record_dispatch(result)
                outputs.append(result)
        except BaseException:
            _restore_purged(self.variables, state)
            raise
        return outputs, state

    def _place(self, value: np.ndarray) -> jax.Array:
        mesh = self.strategy.extended.replica_mesh
        even = value.ndim > 0 and value.shape[0] % len(mesh.devices) == 0
        sharding = mesh.per_replica_sharding if even else mesh.replicated_sharding
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    def _program(self, treedef: Any, placed: list, state: Any) -> Any:
        key = (treedef, tuple((p.shape, p.dtype, p.sharding) for p in placed))
        if key not in self.cache:
            step = getattr(self.model, f"{self.kind}_step")
            state_shardings = jax.tree_util.tree_map(lambda a: a.sharding, state)

            def program(state, leaves):
                result = step(state, jax.tree_util.tree_unflatten(treedef, leaves))
                if self.kind == "predict":  # Keras' predict_step returns (outputs, non_trainable_variables)
                    return result[0], (state[0], result[1])
                return result

            replicated = self.strategy.extended.replica_mesh.replicated_sharding
            # compile(run_eagerly=True): the step runs as Python on the placed arrays, as Keras runs it.
            self.cache[key] = program if self.model.run_eagerly else jax.jit(program, donate_argnums=(0,), out_shardings=(replicated, state_shardings))
        return self.cache[key]


def _restore_purged(variables: list, state: Any) -> None:
    """Gives back the values Keras took out of the variables for the loop, after a failed step.

    Keras' fit empties the model's variables while its loop holds the state; a
    step that fails before returning would leave them empty.
    """
    values = [value for part in state for value in part]
    for variable, value in zip(variables, values):
        if getattr(variable, "_value", 1) is None and not getattr(value, "is_deleted", lambda: False)():
            variable._value = value


def _put_steps(strategy: Any, stacked: np.ndarray) -> jax.Array:
    """Places ``(steps, replicas, rows, ...)`` host data, sharded on the replica dim."""
    ext = strategy.extended
    sharding = NamedSharding(ext.replica_mesh.mesh, P(None, AXIS))
    if jax.process_count() == 1:
        return jax.device_put(stacked, sharding)
    global_shape = (stacked.shape[0], len(ext.replica_mesh.devices), *stacked.shape[2:])
    return jax.make_array_from_process_local_data(sharding, stacked, global_shape)


# Per kind: the Keras state parts of its step, the step builder, and the attribute
# Keras keeps the function in.
_KINDS = {
    "train": (("trainable", "non_trainable", "optimizer", "metrics"), steps.train_step),
    "test": (("trainable", "non_trainable", "metrics"), steps.test_step),
    "predict": (("trainable", "non_trainable"), steps.predict_step),
}


def make_function(model, strategy, force, kind: str):
    """Builds ``model.<kind>_function(state, iterator) -> (logs or outputs, state)``.

    Keras' own step runs on every replica (``steps.py``); an overridden ``<kind>_step`` runs as
    one program over the global batch (``_WholeBatchRunner``).
    """
    attribute = f"{kind}_function"
    if getattr(model, attribute) is not None and not force:
        return getattr(model, attribute)
    parts, build = _KINDS[kind]
    variables = _state_variables(model, parts)
    if _overridden(model, f"{kind}_step"):
        runner: Any = _WholeBatchRunner(model, strategy, kind, variables)
    else:
        runner = _StepRunner(model, strategy, lambda treedef: build(model, strategy, variables, treedef), variables,
                             per_replica_result=kind == "predict", multi_step=kind != "predict")
    if kind == "predict":

        def function(state, iterator):
            outputs, state = runner(state, iterator)
            if len(outputs) == 1:
                return tree.map_structure(np.asarray, outputs[0]), state
            return tree.map_structure(lambda *p: np.concatenate(p), *outputs), state

    else:

        def function(state, iterator):
            outputs, state = runner(state, iterator)
            return outputs[-1], state

    setattr(model, attribute, function)
    return function


def _rows_in_order(stacked: np.ndarray) -> np.ndarray:
    """``(replicas, rows, ...)`` -> ``(replicas * rows, ...)``, in replica order."""
    return stacked.reshape((-1, *stacked.shape[2:]))
