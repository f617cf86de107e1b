"""The apply programs: one optimizer's update of the variables one ps holds, traced on the coordinator.

For each ``optimizer.apply`` of a scheduled step and each ps, the optimizer's
update of the variables (and rows of partitioned ones) that ps holds, with
their slots, is traced under a :class:`~distribute.keras_support.ps_hooks.PSApplyScope`
and exported; the ps runs it on its current values when the gradients arrive
(TF runs the apply ops on the ps).  Inputs: the ps's own values (``owned``), the
values of other ps it reads (``foreign``: the learning rate; the step counter
comes from the worker's step), the gradients.

A row table of the step (``rows.py``) gets its gradient as looked-up rows.  With
an optimizer of :data:`~distribute.parameter_server.row_plan.ROW_EXACT`, the
program is traced for ``size`` rows of the table and of its slots: the ps
gathers those rows, runs it and writes them back (``ApplyRows.mode ==
"rows"``); with any other optimizer the ps scatters the rows into a zero
gradient of its rows and runs the whole-value program (``"dense"``): the exact
update, done where the table lives.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import jax
import jax.numpy as jnp

from distribute.keras_support.ps_hooks import PSApplyScope, without_clipping
from distribute.parameter_server.row_plan import ApplyRows, row_exact

_LOG = logging.getLogger("distribute")
# Optimizers whose update is elementwise, so a ps may update the rows it holds of a
# partitioned variable on its own.
ELEMENTWISE_OPTIMIZERS = {"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "Nadam", "RMSprop", "Ftrl", "Lion", "Lamb"}


def local_shards(registry: Any, var: Any, j: int) -> tuple[list, tuple | None]:
    """The shards of ``var`` on ps ``j`` and their row bounds (None: the whole variable)."""
    shards = registry.entry(var).shards
    mine = [s for s in shards if s.ps == j]
    if len(mine) == len(shards):
        return mine, None
    return mine, tuple((s.start, s.stop) for s in mine)


def local_aval(registry: Any, var: Any, j: int, rows: int | None = None) -> Any:
    """``var``'s shape and dtype on ps ``j`` (its rows there; ``rows`` of them for a row update)."""
    mine, bounds = local_shards(registry, var, j)
    if rows is not None:
        return jax.ShapeDtypeStruct((rows, *tuple(var.shape)[1:]), var.dtype)
    if bounds is None:
        return jax.ShapeDtypeStruct(tuple(var.shape), var.dtype)
    return jax.ShapeDtypeStruct((sum(s.stop - s.start for s in mine), *var.shape[1:]), var.dtype)


def programs(registry: Any, optimizer: Any, variables: list, positions: list, step_pos: int, j: int, need: Any,
             row_tables: dict, ids: Any) -> list:
    """The apply program of ``optimizer`` for ps ``j`` (a one-element list), or [] if ``j`` holds none of ``variables``.

    ``row_tables``: ``id(var) -> (table index, size)`` of the step's row tables;
    ``ids``: a counter of program ids.  Returns ``[(j, program id, [box], owned
    keys, written keys, foreign keys or step_pos, grad slices, ApplyRows or None)]``.
    """
    subset, grad_slices = [], []
    for var, pos in zip(variables, positions):
        mine, bounds = local_shards(registry, var, j)
        if not mine:
            continue
        subset.append(var)
        grad_slices.append((pos, bounds))
        if bounds is not None and type(optimizer).__name__ not in ELEMENTWISE_OPTIMIZERS:
            raise NotImplementedError(
                f"optimizer {type(optimizer).__name__!r} updates the partitioned variable '{var.path}', whose rows "
                "live on several parameter servers; only elementwise optimizers "
                f"({', '.join(sorted(ELEMENTWISE_OPTIMIZERS))}) can update partitions separately. Use one of them, "
                "or create the strategy without a variable_partitioner."
            )
    if not subset:
        return []
    row_vars = [v for v in subset if id(v) in row_tables]
    if row_vars and all(row_exact(optimizer, v) for v in row_vars):
        try:
            return [_trace(registry, optimizer, subset, grad_slices, step_pos, j, need, row_tables, ids, rows_mode=True)]
        except Exception as error:  # noqa: BLE001 - e.g. a slot not colocated with its table: the exact whole update
            _LOG.debug("the update of %s on ps %d runs on whole rows: %r", [v.path for v in row_vars], j, error)
    return [_trace(registry, optimizer, subset, grad_slices, step_pos, j, need, row_tables, ids, rows_mode=False)]


def _trace(registry, optimizer, subset, grad_slices, step_pos, j, need, row_tables, ids, rows_mode: bool) -> tuple:
    row_vars = [v for v in subset if id(v) in row_tables]
    r_of = {id(v): r for r, v in enumerate(row_vars)}
    sizes = [row_tables[id(v)][1] for v in row_vars]

    def row_index(var):
        """``r`` of the row table ``var`` is, or whose optimizer slot it is (colocated with it); else -1."""
        if id(var) in r_of:
            return r_of[id(var)]
        entry = registry.entry(var)
        reference = None if entry is None else entry.reference
        return -1 if reference is None else r_of.get(id(reference), -1)

    def rows_of(var):
        r = row_index(var) if rows_mode else -1
        return None if r < 0 else sizes[r]

    grad_avals = [local_aval(registry, v, j, rows_of(v)) for v in subset]
    # Seed the discovery with what an update reads (the variables, their slots, the step counter
    # and learning rate), so that the first trace already sees this ps's rows of partitioned ones.
    # The step counter is always an input: the count the worker's step saw (output step_pos).
    owned: dict[int, Any] = {id(v): v for v in subset}
    foreign: dict[int, Any] = {id(optimizer._iterations): optimizer._iterations}
    for var in optimizer.variables:
        entry = registry.entry(var)
        if entry is None or var is optimizer._iterations:
            continue
        if local_shards(registry, var, j)[0]:
            owned.setdefault(id(var), var)
        elif var is getattr(optimizer, "_learning_rate", None):
            foreign[id(var)] = var
    for _ in range(6):
        owned_vars, foreign_vars = list(owned.values()), list(foreign.values())
        written_out: list = []
        missing: dict = {}
        bad_writes: list = []

        def body(owned_vals, foreign_vals, grads):
            mapping = {id(v): x for v, x in zip(owned_vars, owned_vals)}
            mapping.update({id(v): x for v, x in zip(foreign_vars, foreign_vals)})
            scope = PSApplyScope(mapping)
            shapes = {id(v): tuple(local_aval(registry, v, j, rows_of(v)).shape) for v in owned_vars}
            with without_clipping(optimizer), _shapes(owned_vars, shapes), scope:
                optimizer.apply(list(grads), subset)
            missing.update(scope.missing)
            outs = []
            for i, var in scope.written.items():
                if var is optimizer._iterations:
                    continue  # the worker's step adds 1, once per step
                if i not in owned:
                    bad_writes.append(var)
                    continue
                written_out.append(var)
                outs.append(jnp.asarray(scope.state_mapping[i], var.dtype))
            return outs

        owned_avals = [local_aval(registry, v, j, rows_of(v)) for v in owned_vars]
        foreign_avals = [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in foreign_vars]
        exported = jax.export.export(jax.jit(body))(owned_avals, foreign_avals, grad_avals)
        new = {i: v for i, v in missing.items() if i not in owned and i not in foreign}
        new.update({id(v): v for v in bad_writes if id(v) not in owned and id(v) not in foreign
                    and local_shards(registry, v, j)[0]})
        if new:
            for i, v in new.items():
                (owned if local_shards(registry, v, j)[0] else foreign)[i] = v
            continue
        if bad_writes:
            raise NotImplementedError(
                f"optimizer {type(optimizer).__name__!r} writes '{bad_writes[0].path}' while updating the variables "
                f"of ps {j}, but that variable lives on another ps; ParameterServerStrategy supports optimizers "
                "that update only a variable and its slots (and the step counter)."
            )
        import ray

        owned_keys = tuple(tuple(s.key for s in local_shards(registry, v, j)[0]) for v in owned_vars)
        written_keys = tuple(tuple(s.key for s in local_shards(registry, v, j)[0]) for v in written_out)
        foreign_keys = tuple(step_pos if v is optimizer._iterations else need(v) for v in foreign_vars)
        rows = None
        if row_vars:
            slots = {id(v) for v in optimizer.variables}
            if rows_mode and any(id(v) in slots and row_index(v) < 0 and tuple(v.shape) == tuple(t.shape)
                                 for v in owned_vars for t in row_vars):
                raise ValueError("an optimizer slot of a row table's shape is not colocated with it")
            rows = ApplyRows(
                mode="rows" if rows_mode else "dense",
                tables=tuple(row_tables[id(v)][0] for v in row_vars),
                sizes=tuple(sizes),
                starts=tuple(tuple(s.start or 0 for s in local_shards(registry, v, j)[0]) for v in row_vars),
                owned=tuple(row_index(v) if rows_mode else -1 for v in owned_vars),
                written=tuple(row_index(v) if rows_mode else -1 for v in written_out),
                grads=tuple(r_of.get(id(v), -1) for v in subset),
            )
        box = [ray.put(exported.serialize())]
        return (j, next(ids), box, owned_keys, written_keys, foreign_keys, tuple(grad_slices), rows)
    raise RuntimeError(f"tracing the update of optimizer {optimizer.name!r} for ps {j} did not settle.")  # pragma: no cover


@contextlib.contextmanager
def _shapes(variables: list, shapes: dict):
    """While an update is traced for a ps, each variable has the shape of the rows that ps updates."""
    saved = []
    for var in variables:
        shape = shapes[id(var)]
        if shape != tuple(var.shape):
            saved.append((var, var._shape))
            var._shape = shape
    try:
        yield
    finally:
        for var, shape in saved:
            var._shape = shape

