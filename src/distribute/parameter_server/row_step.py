"""Builds a step's row tables on the coordinator: the analysis (``rows.py``), the two programs, the plan.

A variable becomes a row table of a step only when reading its rows is worth
it: it has more than twice as many rows as the step can look up (a small
table is cheaper to read whole, from the read-back of the last update).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from distribute.parameter_server import rows as rows_lib
from distribute.parameter_server import rows_program
from distribute.parameter_server.row_plan import RowGroup, RowPlan, RowTable

_WORTH = 2  # a table is read by rows when it has more than this many times the rows a step looks up


def size(group: Any) -> int:
    return int(sum(group.indices.values()))


def analyze_step(closed: Any, read_vars: list, grad_vars: dict, registry: Any) -> Any:
    """The row analysis of a traced step, or None when no read variable is worth reading by rows.

    ``grad_vars``: output position -> the read variable (index) whose gradient it is.
    """
    candidates = {k for k, v in enumerate(read_vars) if len(tuple(v.shape)) >= 1 and registry.entry(v) is not None}
    if not candidates:
        return None
    flat = rows_lib.flatten(closed)
    while candidates:
        analysis = rows_lib.analyze(flat, candidates, grad_vars)
        if not analysis.groups:
            return None
        small = {t for g in analysis.groups for t in g.tables if g.rows <= _WORTH * size(g)}
        if not small:
            return analysis
        candidates -= small
    return None


def build(fn: Any, analysis: Any, registry: Any, read_vars: list, avals: tuple, export: Any, ids: Any) -> tuple:
    """``(exported row program, RowPlan, {id(var): (table index, size)})`` of a step with row tables.

    ``avals``: the step's ``(read, element, array argument)`` abstract values;
    ``export(fn, body, *avals)`` exports; ``ids`` counts program ids.
    """
    import ray

    read_avals, iter_avals, arg_avals = avals
    flat_avals = [*read_avals, *iter_avals, *arg_avals]
    positions = sorted(t for g in analysis.groups for t in g.tables)
    group_of = {t: k for k, g in enumerate(analysis.groups) for t in g.tables}
    tables = []
    for t in positions:
        var = read_vars[t]
        entry = registry.entry(var)
        shards = tuple((s.ps, s.key, s.start or 0, s.stop if s.stop is not None else int(var.shape[0])) for s in entry.shards)
        tables.append(RowTable(read=t, group=group_of[t], name=var.path, rows=int(var.shape[0]), shards=shards,
                               tail=tuple(int(d) for d in tuple(var.shape)[1:]), dtype=np.dtype(var.dtype).str))
    sizes = [size(g) for g in analysis.groups]
    groups = tuple(
        RowGroup(size=sizes[k], rows=int(g.rows), tables=tuple(i for i, t in enumerate(tables) if t.group == k))
        for k, g in enumerate(analysis.groups)
    )
    ids_inputs = rows_program.ids_inputs(analysis)
    ids_exported = export(fn, rows_program.ids_function(analysis), *[flat_avals[p] for p in ids_inputs])
    table_set = set(positions)
    others = [a for p, a in enumerate(flat_avals) if p not in table_set]
    table_avals = [jax.ShapeDtypeStruct((sizes[group_of[t]], *tuple(read_vars[t].shape)[1:]), read_vars[t].dtype)
                   for t in positions]
    unique_avals = [jax.ShapeDtypeStruct((n,), np.int32) for n in sizes]
    row_fn = rows_program.row_function(analysis, positions, sizes)
    exported = export(fn, row_fn, others, table_avals, unique_avals)
    table_index = {t: i for i, t in enumerate(positions)}
    grads_of = analysis.grad_outputs
    plan = RowPlan(
        ids_program_id=next(ids),
        ids_box=[ray.put(ids_exported.serialize())],
        ids_inputs=tuple(ids_inputs),
        ids_groups=tuple(k for k, _ in rows_program.id_vars(analysis)),
        ids_direct=tuple(_input_position(analysis, var) for _, var in rows_program.id_vars(analysis)),
        num_read=len(read_avals),
        tables=tuple(tables),
        groups=groups,
        grads=tuple((pos, table_index[_grad_table(analysis, pos)]) for pos in sorted(grads_of)),
    )
    row_tables = {id(read_vars[t]): (table_index[t], sizes[group_of[t]]) for t in positions}
    return exported, plan, row_tables


def _input_position(analysis: Any, var: int) -> int:
    """The step input the ids ``var`` looks up with are (an element, an array argument), or -1 (computed)."""
    raw = analysis.raw_ids[var]
    invars = analysis.flat.invars
    return invars.index(raw) if raw in invars else -1


def _grad_table(analysis: Any, pos: int) -> int:
    return analysis.grad_tables[pos]
