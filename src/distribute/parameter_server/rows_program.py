"""The two programs of a step with row tables (``rows.py``): the ids program and the row program.

* The **ids program** computes, from the step's inputs (dataset elements, array
  arguments, variables read whole), every array of ids the step looks its row
  tables up with, as the ids a user wrote (before ``jnp.take`` wraps negative
  ones): the worker checks them (TF's embedding lookup rejects an id outside
  ``[0, rows)``), takes the distinct ones and fetches those rows from the ps.
* The **row program** is the step itself on those rows: a table's value is its
  ``U`` looked-up rows (``U`` = the ids the step can look up; the distinct ids,
  sorted, come first and the padding after them), every index becomes its
  position among the sorted distinct ids (``searchsorted``), every table-shaped
  value is held as its ``U`` rows plus its *probe*, the value each row not looked
  up has (zeros for a gradient; unknown for a table's own values, which are only
  ever read at the looked-up rows), and each row table's gradient comes out as
  its ``U`` rows, with its probe after all the outputs (the worker checks that it
  is zero: the ps updates only the looked-up rows).

Both are interpreters of the flattened jaxpr, traced by ``jax.jit`` and
exported like any step program, so the numbers are the same operations on the
same values as the whole-table program, on fewer rows.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from distribute.parameter_server.rows import (
    LAZY,
    M_DENSE,
    M_ELEMENTWISE,
    M_GATHER,
    M_LAZY,
    M_REDUCE_ALL,
    M_REDUCE_KEEP,
    M_SCATTER,
    ROWS,
    Analysis,
    Const,
)


def _bind(eqn: Any, args: list, params: dict | None = None) -> list:
    bind_params = eqn.prim.get_bind_params(eqn.params if params is None else params)
    out = eqn.prim.bind(*args, **bind_params)
    return list(out) if eqn.prim.multiple_results else [out]


def id_vars(an: Analysis) -> list:
    """``(group index, index var)`` of every array of ids, in the ids program's output order."""
    return [(k, var) for k, group in enumerate(an.groups) for var in sorted(group.indices)]


def ids_inputs(an: Analysis) -> list:
    """The input positions the ids program reads (the ids' backward slice)."""
    needed, inputs = _slice(an)
    return inputs


def _slice(an: Analysis) -> tuple[list, list]:
    flat = an.flat
    need = {an.raw_ids[var] for _, var in id_vars(an)}
    picked = []
    for i in range(len(flat.eqns) - 1, -1, -1):
        eqn = flat.eqns[i]
        if any(o in need for o in eqn.outs):
            picked.append(i)
            need.update(a for a in eqn.ins if not isinstance(a, Const))
    positions = [p for p, v in enumerate(flat.invars) if v in need]
    return picked[::-1], positions


def ids_function(an: Analysis) -> Any:
    """``fn(*inputs at ids_inputs(an)) -> [ids arrays]`` (each as its raw ids, see the module docstring)."""
    flat = an.flat
    eqn_ids, positions = _slice(an)
    outs = [an.raw_ids[var] for _, var in id_vars(an)]

    def fn(*inputs):
        env = dict(zip((flat.invars[p] for p in positions), inputs))

        def val(a):
            return a.value if isinstance(a, Const) else env[a]

        for i in eqn_ids:
            eqn = flat.eqns[i]
            env.update(zip(eqn.outs, _bind(eqn, [val(a) for a in eqn.ins])))
        return [val(a) for a in outs]

    return fn


class _Rows:
    __slots__ = ("rows", "probe")

    def __init__(self, rows: Any, probe: Any):
        self.rows, self.probe = rows, probe


def row_function(an: Analysis, tables: list, sizes: list) -> Any:
    """The row program: ``fn(other_inputs, table_rows, uniques) -> outputs + probes``.

    ``tables``: the input positions of the row tables, in ``table_rows`` order;
    ``sizes``: per group, its ``U``; ``uniques``: per group, ``(U,)`` int32, the
    sorted distinct ids then padding (the table's row count, past every id).
    ``other_inputs``: every other input, in input order.  Outputs: the step's,
    a row gradient as its ``(U, ...)`` rows; then each row gradient's probe.
    """
    flat = an.flat
    table_set = set(tables)
    others = [p for p in range(len(flat.invars)) if p not in table_set]
    grads = sorted(an.grad_outputs)

    def fn(other_vals, table_rows, uniques):
        env: dict = {}
        lazies: dict = {}
        lazy_cache: dict = {}
        positions: dict = {}
        for p, value in zip(others, other_vals):
            env[flat.invars[p]] = value
        for p, rows in zip(tables, table_rows):
            env[flat.invars[p]] = _Rows(rows, None)

        def dense(a):
            if isinstance(a, Const):
                return a.value
            if a in lazies:
                return at(a, None)
            return env[a]

        def at(a, size):
            """A lazy broadcast (or elementwise of them) with dim 0 of ``size`` rows (None: its own)."""
            key = (a, size)
            if key not in lazy_cache:
                eqn = lazies[a]
                if eqn.prim.name == "broadcast_in_dim":
                    params = dict(eqn.params)
                    if size is not None:
                        params["shape"] = (size, *tuple(params["shape"])[1:])
                    lazy_cache[key] = _bind(eqn, [dense(x) for x in eqn.ins], params)[0]
                else:
                    args = [at(x, size) if not isinstance(x, Const) and x in lazies else dense(x) for x in eqn.ins]
                    lazy_cache[key] = _bind(eqn, args)[0]
            return lazy_cache[key]

        def rows_of(a, group):
            """``(rows, probe)`` of a table-shaped input of a row eqn (a row value or a lazy broadcast)."""
            if not isinstance(a, Const) and a in lazies:
                return at(a, sizes[group]), at(a, 1)
            value = env[a]
            return value.rows, value.probe

        def where(group, index):
            key = (group, index)
            if key not in positions:
                ids = env[index]
                found = jnp.searchsorted(uniques[group], ids.reshape(-1), method="sort")
                positions[key] = found.reshape(ids.shape).astype(ids.dtype)
            return positions[key]

        for i, eqn in enumerate(flat.eqns):
            mode = an.modes[i]
            if mode == M_LAZY:
                lazies[eqn.outs[0]] = eqn
                continue
            if mode == M_DENSE:
                env.update(zip(eqn.outs, _bind(eqn, [dense(a) for a in eqn.ins])))
                continue
            out = eqn.outs[0]
            group = an.group_of.get(out, an.group_of.get(eqn.ins[0]))
            if mode == M_GATHER:
                env[out] = _bind(eqn, [env[eqn.ins[0]].rows, where(group, eqn.ins[1])])[0]
            elif mode == M_SCATTER:
                rows, probe = rows_of(eqn.ins[0], group)
                new = _bind(eqn, [rows, where(group, eqn.ins[1]), *[dense(a) for a in eqn.ins[2:]]])[0]
                env[out] = _Rows(new, probe)
            elif mode == M_ELEMENTWISE:
                env[out] = _elementwise(eqn, an, group, rows_of, dense)
            elif mode == M_REDUCE_KEEP:
                rows, probe = rows_of(eqn.ins[0], group)
                env[out] = _Rows(_bind(eqn, [rows])[0], None if probe is None else _bind(eqn, [probe])[0])
            elif mode == M_REDUCE_ALL:
                rows, probe = rows_of(eqn.ins[0], group)
                total, each = _bind(eqn, [rows])[0], _bind(eqn, [probe])[0]
                rest = an.groups[group].rows - sizes[group]  # rows outside the U held: each is the probe
                env[out] = total + jnp.asarray(rest, total.dtype) * each
            else:  # pragma: no cover
                raise AssertionError(mode)
        outs = []
        for pos, a in enumerate(flat.outvars):
            if pos in an.grad_outputs:
                outs.append(env[a].rows)
            else:
                outs.append(dense(a))
        return outs + [env[flat.outvars[pos]].probe for pos in grads]

    return fn


def _elementwise(eqn: Any, an: Analysis, group: int, rows_of: Any, dense: Any) -> _Rows:
    rows_args, probe_args, known = [], [], True
    for a in eqn.ins:
        kind = LAZY if isinstance(a, Const) else an.kinds.get(a)
        if not isinstance(a, Const) and kind in (ROWS, LAZY):
            rows, probe = rows_of(a, group)
            known = known and probe is not None
            rows_args.append(rows)
            probe_args.append(probe)
        else:
            value = dense(a)
            rows_args.append(value)
            probe_args.append(value)
    rows = _bind(eqn, rows_args)[0]
    return _Rows(rows, _bind(eqn, probe_args)[0] if known else None)
