"""The variables a Checkpoint holds: reading them to host, matching saved values, deferred restoration."""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from distribute import _context


def variables_of(name: str, obj: Any) -> list:
    """The Keras variables of ``obj`` in a stable order (as ``obj.variables``).

    Raises:
        ValueError: ``obj`` holds no Keras variables.
    """
    import keras

    if isinstance(obj, keras.Variable) or getattr(obj, "_distribute_logical_variable", False):
        return [obj]  # a ShardedVariable built from shards is stored as its full value
    variables = getattr(obj, "variables", None)
    if variables is None:
        raise ValueError(
            f"Checkpoint object {name}={obj!r} holds no Keras variables; pass Keras models, layers, "
            "optimizers, metrics or variables, e.g. Checkpoint(model=model, optimizer=optimizer)."
        )
    return list(variables)


def is_optimizer(obj: Any) -> bool:
    import keras

    return isinstance(obj, keras.optimizers.Optimizer)


def strategy_of(variables: list) -> Any:
    """The strategy the variables were created under, else the one whose scope is active; None: neither
    (the default strategy: one process, which writes checkpoints)."""
    for v in variables:
        strategy = getattr(v, "_distribute_strategy", None)
        if strategy is not None:
            return strategy
    return _context.scope_strategy()


def should_checkpoint(strategy: Any) -> bool:
    """Whether this process writes checkpoints for ``strategy`` (None: the default strategy, yes)."""
    return strategy is None or strategy.extended.should_checkpoint


def scope_of(strategy: Any) -> Any:
    """``strategy.scope()``, or a context that changes nothing for None (the default strategy)."""
    return contextlib.nullcontext() if strategy is None else strategy.scope()


def host_value(variable: Any) -> np.ndarray:
    """A private host copy of the variable's value, in the variable's declared dtype.

    JAX without x64 holds an ``int64`` variable as int32 (``float64`` as float32);
    the value is stored as the declared dtype, so it restores exactly and plain
    orbax reads the dtype the model declared.  A copy, since a training step may
    donate (reuse) the device buffer while a save is still being written.
    """
    value = variable.value
    if isinstance(value, jax.Array) and not (value.is_fully_addressable or value.is_fully_replicated):
        from jax.experimental import multihost_utils

        value = multihost_utils.process_allgather(value, tiled=True)
    return np.array(value, dtype=np.dtype(variable.dtype), copy=True)


def saved_value(variable: Any) -> Any:
    """What a checkpoint stores for ``variable``: ``host_value``, or for a variable split over the
    replicas (sharded state), a copy of its shards on their devices.

    Orbax writes each shard from its own device (each worker its own shards),
    so the whole value is never gathered on one device. A copy, as
    ``host_value``: a training step may donate the stored buffers while the
    save is written.
    """
    value = variable.__dict__.get("_value")
    if (isinstance(value, jax.Array) and not value.is_fully_replicated and len(value.sharding.device_set) > 1
            and np.dtype(value.dtype) == np.dtype(variable.dtype)):
        return _copy_program(value.sharding)(value)
    return host_value(variable)


@functools.lru_cache(maxsize=None)
def _copy_program(sharding: Any) -> Any:
    return jax.jit(jnp.copy, out_shardings=sharding)


def placed(variable: Any, value: np.ndarray) -> Any:
    """``value`` with ``variable``'s placement (works for shardings spanning several workers)."""
    layout = getattr(variable, "_layout", None)
    if isinstance(layout, jax.sharding.Sharding):
        return jax.make_array_from_callback(value.shape, layout, lambda index: value[index])
    return value


def normalized(path: str) -> str:
    """Drops Keras' per-process numbering: ``'sequential_1/dense_3/kernel'`` -> ``'sequential/dense/kernel'``."""
    return re.sub(r"_\d+(?=$|[/_])", "", path)


def match(path: str, name: str, variables: list, entries: list[dict], values: list[np.ndarray]) -> list[tuple[Any, np.ndarray]]:
    """Pairs ``variables`` with saved values, checking count, name, shape and dtype.

    Raises:
        ValueError: a count, name, shape or dtype that differs; nothing is assigned.
    """
    if len(variables) != len(entries):
        extra = entries[len(variables)] if len(entries) > len(variables) else None
        which = (f"saved variable '{extra['path']}' has no counterpart" if extra else
                 f"variable '{variables[len(entries)].path}' was not saved")
        raise ValueError(
            f"checkpoint {path!r}: object {name!r} has {len(variables)} variables here but "
            f"{len(entries)} were saved ({which}). Build the same model/optimizer as when saving "
            "(same layers in the same order)."
        )
    plan = []
    for variable, entry, value in zip(variables, entries, values):
        problem = None
        if normalized(variable.path) != normalized(entry["path"]):
            problem = f"its name differs from the saved variable '{entry['path']}'"
        elif tuple(value.shape) != tuple(variable.shape):
            problem = f"its shape {tuple(variable.shape)} differs from the saved shape {tuple(value.shape)}"
        elif np.dtype(value.dtype) != np.dtype(variable.dtype):
            problem = f"its dtype {variable.dtype} differs from the saved dtype {value.dtype}"
        if problem:
            raise ValueError(
                f"checkpoint {path!r}: variable '{variable.path}' of object {name!r} does not "
                f"match: {problem}. Nothing was restored. Restore into the same model "
                "architecture (layer types, sizes and order) and optimizer as when saving."
            )
        plan.append((variable, value))
    return plan


def assign(plan: list[tuple[Any, np.ndarray]]) -> None:
    """Gives each variable its restored value.

    A variable created while a step is traced (a model built by its first call inside
    ``distribute.function`` or ``strategy.run``) has no value yet: Keras defers it to its
    initializer when the trace ends. Its initializer then gives the restored value (an
    ``assign`` there would only be recorded by the trace).
    """
    for variable, value in plan:
        if hasattr(value, "parts"):  # a table its ps wrote (_tables.TableRef)
            placement = variable.__dict__.get("_distribute_placement")
            if placement is not None and placement.remote(variable):
                placement.load_parts(variable, value)  # each ps reads its own rows
                continue
            value = value.read()  # a variable held here (no strategy): the whole table, its own choice
        if getattr(variable, "_value", 0) is None and getattr(variable, "_initializer", None) is not None:
            variable._initializer = functools.partial(_restored, np.asarray(value))
        else:
            variable.assign(placed(variable, value))


def _restored(value: np.ndarray, shape: Any, dtype: Any = None) -> np.ndarray:
    """A deferred variable's initializer that gives its restored value."""
    return value.astype(dtype) if dtype is not None else value


def is_unbuilt(obj: Any) -> bool:
    """A model, layer or optimizer whose variables do not exist yet (``built`` is False)."""
    import keras

    return isinstance(obj, (keras.layers.Layer, keras.optimizers.Optimizer)) and not obj.built


def defer(obj: Any, apply: Any) -> None:
    """Calls ``apply()`` right after ``obj`` builds its variables (TF's deferred restoration).

    Wraps this one object's ``build`` (an instance attribute, as Keras itself
    wraps it); the wrapper removes itself after the first build.
    """
    build = obj.build

    @functools.wraps(build)  # Keras passes build() the shapes its signature names (Sequential: input_shape)
    def build_then_restore(*args: Any, **kwargs: Any) -> Any:
        result = build(*args, **kwargs)
        obj.build = build
        apply()
        return result

    obj.build = build_then_restore


@contextlib.contextmanager
def outside_name_scopes() -> Any:
    """Keras name scopes cleared (an optimizer built by a model's deferred restoration, inside the model's
    build, names its slots as when built on its own: ``adam/...``, not ``sequential/adam/...``)."""
    from distribute._keras import global_state

    stack = global_state.get_global_attribute("name_scope_stack")
    global_state.set_global_attribute("name_scope_stack", [])
    try:
        yield
    finally:
        global_state.set_global_attribute("name_scope_stack", stack)


def entries_by_object(record: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for entry in record["variables"]:
        out.setdefault(entry["object"], []).append(entry)
    return out
