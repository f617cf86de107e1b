"""Training state kept in memory for an elastic launch (``--num-workers MIN:MAX``): commit and restore.

``commit`` copies every variable's value to host memory after a completed step
(``runtime/elastic.py`` keeps it and hands it to the launcher when this worker
stops for a lost peer or a regroup); ``restore`` puts the state the launcher
holds back into the variables of the next generation, of any size (values are
placed with the variables' current placement, as a checkpoint restore).

Under MultiWorkerMirroredStrategy every worker holds the whole replicated
state, so one survivor's commit is the full state.  A variable split over the
replicas of several workers (sharded state) is gathered at each commit
(``host_value``: a collective every worker makes at the same step), so the
commit is again the full state; that gather costs a collective per step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import distribute.checkpoint._state as _state
import distribute.runtime.elastic as _runtime

logger = logging.getLogger("distribute")


def enabled() -> bool:
    """Whether this worker runs under an elastic launch."""
    return _runtime.agent_address() is not None


def commit(objects: dict[str, Any], meta: dict, values: dict[str, Any] | None = None) -> None:
    """Keeps a copy of every variable of ``objects`` (name -> Keras object) with ``meta`` (an int ``step``).

    The copy is made on this worker's device by one compiled program, dispatched
    without waiting (the next step, which donates the variables' buffers, waits
    for it); it is read to host memory only when handed to the agent.  The
    previous step's copy is waited for here, so the commit before the newest is
    always complete (a step whose peer died never completes).  A
    variable whose value spans several workers' devices unevenly (sharded
    state) is gathered to host memory at once instead.  ``values``: more arrays
    (a step's logs), kept the same way and returned by ``restore`` by name.
    """
    names, local, dtypes = {}, [], []
    for name, obj in objects.items():
        variables = _state.variables_of(name, obj)
        names[name] = [v.path for v in variables]
        for v in variables:
            local.append(_local_value(v))
            dtypes.append(np.dtype(v.dtype).str)
    for value in (values or {}).values():
        if isinstance(value, jax.Array) and value.is_fully_replicated:
            value = value.addressable_data(0)
        local.append(value if isinstance(value, jax.Array) else np.asarray(value))
        dtypes.append(np.dtype(getattr(value, "dtype", np.float32)).str)
    on_device = [i for i, value in enumerate(local) if isinstance(value, jax.Array) and value.is_fully_addressable]
    copies = _copy_all([local[i] for i in on_device]) if on_device else []
    for i, copy in zip(on_device, copies):
        local[i] = copy
    previous = _runtime.newest()
    if previous is not None:  # the host runs at most one step ahead of the last complete commit
        jax.block_until_ready([a for a in previous[1] if isinstance(a, jax.Array)])
    _runtime.commit(dict(meta, objects=names, values=list(values or {})), local, dtypes)


def _local_value(variable: Any) -> Any:
    """This worker's whole value of ``variable``: a one-device jax.Array (replicated state) or a host copy."""
    value = variable.value
    if isinstance(value, jax.Array):
        if value.is_fully_replicated:
            return value.addressable_data(0)  # every device holds the whole value: one copy is the state
        if value.is_fully_addressable and len(value.sharding.device_set) == 1:
            return value
    return _state.host_value(variable)  # sharded state: gathered (every worker commits at the same step)


@jax.jit
def _copy_all(values: list) -> list:
    return [jnp.copy(v) for v in values]


def restore(objects: dict[str, Any]) -> tuple[dict, dict[str, np.ndarray]] | None:
    """Assigns the agent's state to ``objects``' variables; returns ``(meta, values)``, or None when it holds none.

    An optimizer not built yet is built first with the models' trainable
    variables (its slots exist once it has applied a step), as a checkpoint restore.

    Raises:
        ValueError: the held state has other objects or variables (a different model), naming the first that differs.
    """
    begin = time.monotonic()
    state = _runtime.fetch()
    if state is None:
        return None
    meta, arrays = state
    held = meta["objects"]
    if sorted(held) != sorted(objects):
        raise ValueError(f"the elastic agent holds the state of {sorted(held)} but this worker restores {sorted(objects)}; "
                         "every generation must build the same objects.")
    _build_optimizers(objects, held)
    plan, position = [], 0
    for name, obj in objects.items():
        paths = held[name]
        plan += _state.match(f"the elastic agent's state (step {meta['step']})", name, _state.variables_of(name, obj),
                             [{"path": p} for p in paths], arrays[position:position + len(paths)])
        position += len(paths)
    _state.assign([(v, np.array(a)) for v, a in plan])
    logger.warning("elastic: generation %d restored step %s from the agent's memory (%.3f s)", _runtime.generation(),
                   meta["step"], time.monotonic() - begin)
    return meta, dict(zip(meta.get("values", []), arrays[position:]))


def _build_optimizers(objects: dict[str, Any], held: dict[str, list[str]]) -> None:
    trainable = [v for obj in objects.values() if not _state.is_optimizer(obj) and not _state.is_unbuilt(obj)
                 for v in getattr(obj, "trainable_variables", [])]
    for name, obj in objects.items():
        if _state.is_optimizer(obj) and not obj.built and len(held.get(name, [])) > len(obj.variables) and trainable:
            with _state.scope_of(_state.strategy_of(trainable)), _state.outside_name_scopes():
                obj.build(trainable)


def ready() -> None:
    """Lets the agent ask this generation to regroup (see ``runtime.elastic.ready``)."""
    _runtime.ready()


def at_step_boundary() -> None:
    """Stops this worker (handing off its commit) when the agent asked the generation to regroup."""
    if _runtime.regroup_requested():
        _runtime.stop_for_regroup()


