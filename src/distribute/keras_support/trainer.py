"""Keras ``fit`` / ``evaluate`` / ``predict`` over every replica of a strategy.

A model compiled inside ``strategy.scope()`` remembers the strategy.  Its
``fit``, ``evaluate`` and ``predict`` then run inside that scope (so lazily built
layers are mirrored too) with Keras' own loop, callbacks and progress bar; only
the per-step functions are replaced by SPMD programs over the strategy's mesh:

* each batch is split between the replicas (``input/splitting.py``); a partial
  batch is padded and masked, so results equal one device's exactly;
* each replica's loss is weighted so that the sum over replicas is the loss of
  the whole batch (``sum_over_batch_size``: rows weighted ``b / N``); gradients
  are summed across replicas; regularization losses are divided by the number of
  replicas; the loss tracker and compiled metrics count real rows only;
* variables stay replicated (``tracing._combine_replicas``).

Beyond TF: TF's Keras averages each replica's mean loss, so an uneven last
batch gives a slightly different answer there; here it is exact.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
from keras.src import tree

from distribute import _context
from distribute.input.splitting import split_batch
from distribute.keras_support import steps
from distribute.keras_support.data_adapter import adapt
from distribute.tracing import check_ownership

AXIS = "replica"
_EXACT_REDUCTIONS = {"sum_over_batch_size": "mean", "mean": "mean", "sum": "sum"}


def install() -> None:
    from keras.src.backend.jax.trainer import JAXTrainer
    from keras.src.trainers.trainer import Trainer

    # On the base class: Keras' load_model compares type(model).compile with Trainer.compile.
    Trainer.compile = functools.wraps(Trainer.compile)(_compile_wrapper(Trainer.compile))
    for name in ("fit", "evaluate", "predict"):
        original = getattr(JAXTrainer, name)
        setattr(JAXTrainer, name, functools.wraps(original)(_in_scope(original)))
    for kind in _KINDS:
        original = getattr(JAXTrainer, f"make_{kind}_function")
        setattr(JAXTrainer, f"make_{kind}_function", functools.wraps(original)(_routed(original, kind)))


def model_strategy(model: Any) -> Any:
    return model.__dict__.get("_distribute_strategy")


def _compile_wrapper(original):
    def compile(self, *args, **kwargs):
        strategy = _context.scope_strategy()
        if strategy is None:
            owners = {getattr(v, "_distribute_strategy", None) for v in self.weights}
            owners.discard(None)
            strategy = owners.pop() if len(owners) == 1 else None
        object.__setattr__(self, "_distribute_strategy", strategy)
        if strategy is None:
            return original(self, *args, **kwargs)
        with strategy.scope():
            return original(self, *args, **kwargs)

    return compile


def _in_scope(original):
    """fit/evaluate/predict: read distribute.data.Dataset inputs, and run in the model's strategy scope."""

    def method(self, *args, **kwargs):
        args = tuple(adapt(a) if i == 0 else a for i, a in enumerate(args))
        for name in ("x", "validation_data"):
            if name in kwargs:
                kwargs[name] = adapt(kwargs[name])
        strategy = model_strategy(self)
        if strategy is None:
            return original(self, *args, **kwargs)
        with strategy.scope():
            return original(self, *args, **kwargs)

    return method


def _routed(original, kind):
    def make_function(self, force=False):
        strategy = model_strategy(self)
        if strategy is None:
            return original(self, force)
        return _make_function(self, strategy, force, kind)

    return make_function


# -- placing batches ------------------------------------------------------------------
def _split(strategy: Any, data: Any, rows_seen: list[int]) -> tuple[Any, list[np.ndarray], np.ndarray | None]:
    """Splits one Keras batch between the replicas: ``(treedef, (replicas, rows, ...) leaves, lengths)``.

    Every replica is padded to the most rows seen so far by this function (the
    first, full batch's share), so the last, partial batch reuses the compiled step.
    """
    leaves, treedef = jax.tree_util.tree_flatten(data)
    leaves = [np.asarray(x) for x in leaves]
    rows_seen[0] = max(rows_seen[0], -(-leaves[0].shape[0] // strategy.num_replicas_in_sync))
    # Split for every replica in the job; this worker keeps its replicas' rows (lengths stay global).
    stacked, lengths = split_batch(leaves, strategy.num_replicas_in_sync, rows_seen[0])
    return treedef, [strategy.extended._local_rows(x) for x in stacked], lengths


def _check_supported(model: Any, method: str) -> None:
    from keras.src.backend.jax.trainer import JAXTrainer

    if getattr(type(model), method) is not getattr(JAXTrainer, method):
        raise NotImplementedError(
            f"{type(model).__name__} overrides {method}; distributed fit/evaluate/predict run "
            "Keras' own step on every replica. Use a custom loop with strategy.run for a custom "
            f"{method}, or drop the override."
        )


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
    """Runs Keras' ``*_function(state, iterator)`` contract with compiled SPMD steps.

    ``build_step(treedef, rows)`` returns ``step(state, leaves, valid) ->
    (result, state)`` for one replica.  Each input signature is compiled once:
    one program for full batches, one for a padded batch, and, with
    ``steps_per_execution = K > 1``, one that runs K full batches in an
    unrolled ``lax.scan`` (TF's steps_per_execution: one dispatch for K steps;
    unrolled because XLA:CPU ran convolutions inside a rolled loop 6x slower).
    """

    def __init__(self, model: Any, strategy: Any, build_step: Any, variables: list, result_spec: Any = P(), multi_step: bool = True):
        self.model, self.strategy, self.build_step = model, strategy, build_step
        self.variables, self.result_spec, self.multi_step = variables, result_spec, multi_step
        self.cache: dict = {}
        self.rows_seen = [0]

    def _compiled(self, treedef: Any, placed: list, valid: Any, steps: int) -> Any:
        key = (treedef, tuple((p.shape, p.dtype) for p in placed), valid is None, steps)
        if key not in self.cache:
            check_ownership(self.strategy, self.variables)
            rows = placed[0].shape[1 if steps == 1 else 2]
            step = self.build_step(treedef, rows)
            mesh = self.strategy.extended._mesh
            if steps == 1:
                mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=(self.result_spec, P()))
            else:
                def scanned(state, stacked):
                    def body(carry, leaves):
                        result, carry = step(carry, leaves, None)
                        return carry, result

                    state, results = lax.scan(body, state, stacked, unroll=True)
                    return jax.tree_util.tree_map(lambda r: r[-1], results), state

                mapped = jax.shard_map(scanned, mesh=mesh, in_specs=(P(), P(None, AXIS)), out_specs=(self.result_spec, P()))
            self.cache[key] = jax.jit(mapped, donate_argnums=(0,))
        return self.cache[key]

    def __call__(self, state: Any, iterator: Any) -> tuple[list, Any]:
        """Runs up to ``steps_per_execution`` steps; StopIteration when the data is exhausted.

        Returns ``[(result, lengths), ...]`` (one entry per compiled call) and the state.
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
            return self._run(state, batches, steps)
        except BaseException:
            _restore_purged(self.variables, state)
            raise

    def _run(self, state: Any, batches: list, steps: int) -> tuple[list, Any]:
        split = [_split(self.strategy, data, self.rows_seen) for data in batches]
        if self.multi_step and steps > 1 and len(split) == steps and all(lengths is None and treedef == split[0][0] for treedef, _, lengths in split):
            stacked = [_put_steps(self.strategy, np.stack([host[j] for _, host, _ in split])) for j in range(len(split[0][1]))]
            result, state = self._compiled(split[0][0], stacked, None, steps)(state, stacked)
            self.strategy.extended._step_dispatched(result)
            return [(result, None)], state
        ext = self.strategy.extended
        outputs = []
        for treedef, host, lengths in split:
            if lengths is None:
                leaves, valid = ext._put_per_replica_all(host), None
            else:
                *leaves, valid = ext._put_per_replica_all([*host, lengths.astype(np.int32)])
            result, state = self._compiled(treedef, leaves, valid, 1)(state, leaves, valid)
            self.strategy.extended._step_dispatched(result)
            outputs.append((result, lengths))
        return outputs, state


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
    sharding = NamedSharding(ext._mesh, P(None, AXIS))
    if jax.process_count() == 1:
        return jax.device_put(stacked, sharding)
    global_shape = (stacked.shape[0], len(ext._devices), *stacked.shape[2:])
    return jax.make_array_from_process_local_data(sharding, stacked, global_shape)


# Per kind: the Keras state parts of its step, the step builder, and the attribute
# Keras keeps the function in.
_KINDS = {
    "train": (("trainable", "non_trainable", "optimizer", "metrics"), steps.train_step),
    "test": (("trainable", "non_trainable", "metrics"), steps.test_step),
    "predict": (("trainable", "non_trainable"), steps.predict_step),
}


def _make_function(model, strategy, force, kind: str):
    """Builds ``model.<kind>_function(state, iterator) -> (logs or outputs, state)``."""
    attribute = f"{kind}_function"
    if getattr(model, attribute) is not None and not force:
        return getattr(model, attribute)
    _check_supported(model, f"{kind}_step")
    parts, build = _KINDS[kind]
    variables = _state_variables(model, parts)
    flat = [v for part in variables for v in part]
    if kind == "predict":
        runner = _StepRunner(model, strategy, lambda treedef, rows: build(model, strategy, variables, treedef, rows), flat, P(AXIS), multi_step=False)

        def function(state, iterator):
            outputs, state = runner(state, iterator)
            pieces = [tree.map_structure(lambda o: _real_rows(strategy.extended._to_host(o), lengths), result) for result, lengths in outputs]
            if len(pieces) == 1:
                return pieces[0], state
            return tree.map_structure(lambda *p: np.concatenate(p), *pieces), state

    else:
        runner = _StepRunner(model, strategy, lambda treedef, rows: build(model, strategy, variables, treedef, rows), flat)

        def function(state, iterator):
            outputs, state = runner(state, iterator)
            return outputs[-1][0], state

    setattr(model, attribute, function)
    return function


def _real_rows(stacked: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """``(replicas, rows, ...)`` -> the real rows, in order."""
    if lengths is None:
        return stacked.reshape((-1, *stacked.shape[2:]))
    return np.concatenate([stacked[r, : int(n)] for r, n in enumerate(lengths.tolist())])
