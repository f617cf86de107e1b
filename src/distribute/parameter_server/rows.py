"""Which variables a scheduled step reads only by rows: the analysis of the step's jaxpr.

A step program (``program.py``) is traced into one jaxpr: the scheduled
function's forward pass, its gradients, metric updates, a packed closure's
worker-side updates.  A variable read by the step is a **row table** of that
step when every use of its value, followed through the computation, touches
only rows the step looks up by id along dim 0 (TF's ``embedding_lookup``):

* ``gather`` of whole rows along dim 0 (Keras ``Embedding``,
  ``keras.ops.take(v, ids, axis=0)``, ``jnp.take``, ``v[ids]``);
* elementwise arithmetic whose result is itself used that way (a packed
  closure's worker-side optimizer update of the table and its slots);
* ``scatter`` / ``scatter-add`` of whole rows at ids (the gradient of a gather is
  a scatter-add into zeros of the table's shape), elementwise arithmetic on
  such values (clipping, loss scaling), sums over them (a gradient norm), and
  the table's own gradient as a step output, pushed to its ps.

Then the step runs on ``U`` rows instead of ``N``: ``U`` is the number of ids
the step can look up (the sizes of the index arrays; the distinct ids fill the
first rows, the rest is padding), each index is replaced by its position among
the sorted distinct ids (``rows_program.py``), and a table-shaped value is held
as its ``U`` rows plus, where known, the value every other row has (its
*probe*: zeros for a gradient).  The table's gradient goes to the ps as
``(distinct ids, their summed rows)``.  The ids must not depend on a table's
values (they are computed first, by the *ids program*, to fetch the rows).

Anything else a table's value meets (a regularizer over the whole table, a
reshape, a matmul) makes it an ordinary variable of that step: read whole, as
before.  The analysis runs to a fixed point, dropping what cannot be rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.extend import core as jcore

DENSE, LAZY, ROWS = 0, 1, 2
# Eqn modes of the row program (rows_program.py interprets them).
M_DENSE, M_LAZY, M_GATHER, M_SCATTER, M_ELEMENTWISE, M_REDUCE_KEEP, M_REDUCE_ALL = range(7)

# Calls that are inlined (their body is analysed as part of the step).
_INLINED = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
            "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
            "remat": "jaxpr", "checkpoint": "jaxpr", "custom_lin": None}
ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "neg", "max", "min", "abs", "sign", "sqrt", "rsqrt", "cbrt", "exp",
    "exp2", "log", "log1p", "expm1", "tanh", "logistic", "pow", "integer_pow", "square", "sin", "cos", "tan",
    "erf", "erfc", "erf_inv", "floor", "ceil", "round", "is_finite", "convert_element_type", "select_n", "clamp",
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "copy", "copy_p", "reduce_precision", "nextafter",
    "atan2", "sinh", "cosh", "asinh", "acosh", "atanh", "asin", "acos", "atan", "stop_gradient", "real", "imag",
})
_SCATTERS = frozenset({"scatter-add", "scatter_add", "scatter"})


class Const:
    """A literal or closed-over constant in the flattened program."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


@dataclasses.dataclass
class Eqn:
    prim: Any
    params: dict
    ins: list  # var ids (int) or Const
    outs: list  # var ids


@dataclasses.dataclass
class Flat:
    """A jaxpr with every call inlined; vars are ints, ``avals[i]`` their abstract values."""

    avals: list
    invars: list
    outvars: list
    eqns: list


def flatten(closed: Any) -> Flat:
    """``closed`` (a ClosedJaxpr) with jit / custom_jvp / custom_vjp / remat calls inlined."""
    flat = Flat([], [], [], [])

    def new(aval: Any) -> int:
        flat.avals.append(aval)
        return len(flat.avals) - 1

    def inline(jaxpr: Any, consts: list, ins: list) -> list:
        env: dict = {v: Const(c) for v, c in zip(jaxpr.constvars, consts)}
        env.update(zip(jaxpr.invars, ins))

        def atom(a: Any) -> Any:
            return Const(a.val) if isinstance(a, jcore.Literal) else env[a]

        for eqn in jaxpr.eqns:
            args = [atom(a) for a in eqn.invars]
            inner = _inner(eqn)
            if inner is not None:
                outs = inline(*inner, args)
            else:
                outs = [new(v.aval) for v in eqn.outvars]
                flat.eqns.append(Eqn(eqn.primitive, dict(eqn.params), args, outs))
            for v, o in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = o
        return [atom(a) for a in jaxpr.outvars]

    flat.invars = [new(v.aval) for v in closed.jaxpr.invars]
    flat.outvars = inline(closed.jaxpr, list(closed.consts), flat.invars)
    return flat


def _inner(eqn: Any) -> tuple | None:
    key = _INLINED.get(eqn.primitive.name, "")
    inner = eqn.params.get(key) if key else None
    if isinstance(inner, jcore.ClosedJaxpr):
        return inner.jaxpr, list(inner.consts)
    if isinstance(inner, jcore.Jaxpr) and not inner.constvars:
        return inner, []
    return None


@dataclasses.dataclass
class Group:
    """Tables that share one set of looked-up ids (a table, its slots, their gradients)."""

    tables: set = dataclasses.field(default_factory=set)  # input positions
    indices: dict = dataclasses.field(default_factory=dict)  # index var id -> number of ids it holds
    seeds: set = dataclasses.field(default_factory=set)  # eqns that started rows from zeros (scatter into a broadcast)
    rows: int | None = None  # dim 0 of its tables
    reason: str = ""


@dataclasses.dataclass
class Analysis:
    """The result: row tables (input positions) by group, and how to run each eqn."""

    flat: Flat
    groups: list  # of Group (only valid ones, each with >= 1 table)
    group_of: dict  # var id -> index into groups (row values only)
    modes: list  # per eqn
    kinds: dict  # var id -> DENSE / LAZY / ROWS
    probe_known: dict  # var id -> bool (row values)
    grad_outputs: dict  # output position -> group index (row gradients pushed as rows)
    grad_tables: dict  # output position -> input position of the table it is the gradient of
    raw_ids: dict  # index var id -> the var to range-check (before jnp.take's negative-index wrap)
    dense_reasons: dict  # input position -> why it is read whole (only candidates that failed)


def analyze(flat: Flat, candidates: set, grad_outputs: dict) -> Analysis:
    """Row tables among ``candidates`` (input positions of read variables).

    ``grad_outputs``: output position -> input position of the variable whose
    gradient (to be pushed to its ps) that output is.  Iterates to a fixed point:
    a group that meets an unsupported use is dropped (its tables read whole).
    """
    excluded: set = set()
    dense_seeds: set = set()
    reasons: dict = {}
    for _ in range(64):
        state = _Pass(flat, candidates - excluded, dense_seeds, grad_outputs)
        failed = state.run()
        if not failed:
            return state.result(reasons)
        for root, reason in failed.items():
            group = state.groups[root]
            for t in group.tables:
                reasons.setdefault(t, reason)
            excluded |= group.tables
            dense_seeds |= group.seeds
    raise AssertionError("row analysis did not settle")  # pragma: no cover


class _Pass:
    def __init__(self, flat: Flat, candidates: set, dense_seeds: set, grad_outputs: dict):
        self.flat, self.candidates, self.dense_seeds, self.grad_outputs = flat, candidates, dense_seeds, grad_outputs
        self.kind: dict = {}
        self.gid: dict = {}  # var -> group id (union-find element)
        self.parent: list = []
        self.groups: dict = {}  # root -> Group
        self.probe: dict = {}
        self.taint: dict = {}  # var -> depends on a table's values
        self.modes: list = []
        self.failed: dict = {}

    # -- union-find -----------------------------------------------------------------------
    def _new_group(self) -> int:
        self.parent.append(len(self.parent))
        self.groups[len(self.parent) - 1] = Group()
        return len(self.parent) - 1

    def find(self, g: int) -> int:
        while self.parent[g] != g:
            self.parent[g] = self.parent[self.parent[g]]
            g = self.parent[g]
        return g

    def union(self, a: int, b: int) -> int:
        a, b = self.find(a), self.find(b)
        if a == b:
            return a
        ga, gb = self.groups.pop(a), self.groups.pop(b)
        self.parent[b] = a
        merged = Group(ga.tables | gb.tables, {**ga.indices, **gb.indices}, ga.seeds | gb.seeds, ga.rows or gb.rows)
        if ga.rows is not None and gb.rows is not None and ga.rows != gb.rows:
            self.fail(a, "combined with a table of another row count")
        self.groups[a] = merged
        return a

    def fail(self, g: int, reason: str) -> None:
        self.failed.setdefault(self.find(g), reason)

    # -- the pass -------------------------------------------------------------------------
    def _k(self, a: Any) -> int:
        return DENSE if isinstance(a, Const) else self.kind.get(a, DENSE)

    def _shape(self, a: Any) -> tuple:
        return tuple(getattr(a.value, "shape", ())) if isinstance(a, Const) else tuple(self.flat.avals[a].shape)

    def run(self) -> dict:
        flat = self.flat
        for pos, v in enumerate(flat.invars):
            if pos in self.candidates and len(flat.avals[v].shape) >= 1:
                g = self._new_group()
                self.groups[g].tables.add(pos)
                self.groups[g].rows = flat.avals[v].shape[0]
                self.kind[v], self.gid[v], self.probe[v], self.taint[v] = ROWS, g, False, True
        for i, eqn in enumerate(flat.eqns):
            self.modes.append(self._eqn(i, eqn))
        self._outputs()
        for root in list(self.groups):
            group = self.groups[root]
            if root not in self.failed and not group.tables:
                self.fail(root, "rows not tied to a table")
            for var in group.indices:
                if self.taint.get(var):
                    self.fail(root, "its ids depend on a table's values")
        return {self.find(root): reason for root, reason in self.failed.items()}

    def _eqn(self, i: int, eqn: Eqn) -> int:
        kinds = [self._k(a) for a in eqn.ins]
        name = eqn.prim.name
        taint = any(self.taint.get(a, False) for a in eqn.ins if not isinstance(a, Const))
        for o in eqn.outs:
            self.taint[o] = taint
        if ROWS not in kinds and LAZY not in kinds:
            if name == "broadcast_in_dim" and self._lazy_broadcast(eqn):
                self.kind[eqn.outs[0]] = LAZY
                return M_LAZY
            return M_DENSE
        if ROWS not in kinds:  # only lazy broadcasts among the table-shaped inputs
            if name in _SCATTERS and kinds[0] == LAZY and i not in self.dense_seeds and self._row_scatter(eqn):
                g = self._new_group()
                self.groups[g].seeds.add(i)
                self.groups[g].rows = self._shape(eqn.ins[0])[0]
                return self._scatter_into(eqn, g, probe=True)
            if name in ELEMENTWISE and all(k == LAZY or not self._shape(a) for k, a in zip(kinds, eqn.ins)):
                self.kind[eqn.outs[0]] = LAZY
                return M_LAZY
            return M_DENSE  # the broadcasts are materialized whole (not a table's rows)
        rows = [a for a, k in zip(eqn.ins, kinds) if k == ROWS]
        g = self.gid[rows[0]]
        for a in rows[1:]:
            g = self.union(g, self.gid[a])
        if name == "gather" and kinds[0] == ROWS and kinds[1] != ROWS and self._row_gather(eqn):
            self._index(g, eqn.ins[1])
            self.kind[eqn.outs[0]] = DENSE
            self.taint[eqn.outs[0]] = True
            return M_GATHER
        if name in _SCATTERS and kinds[0] == ROWS and ROWS not in kinds[1:] and self._row_scatter(eqn):
            return self._scatter_into(eqn, g, probe=self.probe[eqn.ins[0]])
        if name in ELEMENTWISE and len(eqn.outs) == 1:
            shape = self._shape(rows[0])
            if all(k in (ROWS, LAZY) and self._shape(a) == shape or k == DENSE and not self._shape(a)
                   for a, k in zip(eqn.ins, kinds)):
                out = eqn.outs[0]
                self.kind[out], self.gid[out] = ROWS, g
                self.probe[out] = all(self.probe.get(a, True) for a, k in zip(eqn.ins, kinds) if k == ROWS)
                return M_ELEMENTWISE
        if name == "reduce_sum" and kinds[0] == ROWS:
            out, axes = eqn.outs[0], tuple(eqn.params["axes"])
            if 0 not in axes:
                self.kind[out], self.gid[out], self.probe[out] = ROWS, g, self.probe[eqn.ins[0]]
                return M_REDUCE_KEEP
            if self.probe[eqn.ins[0]]:
                self.kind[out] = DENSE
                return M_REDUCE_ALL
            self.fail(g, "a sum over its rows")
            return M_DENSE
        self.fail(g, f"an operation on the whole table ({name})")
        return M_DENSE

    def _scatter_into(self, eqn: Eqn, g: int, probe: bool) -> int:
        self._index(g, eqn.ins[1])
        out = eqn.outs[0]
        self.kind[out], self.gid[out], self.probe[out] = ROWS, g, probe
        return M_SCATTER

    def _index(self, g: int, index: Any) -> None:
        if isinstance(index, Const):
            self.fail(g, "constant ids")
            return
        shape = self.flat.avals[index].shape
        count = 1
        for d in shape[:-1]:
            count *= int(d)
        self.groups[self.find(g)].indices[index] = count

    def _lazy_broadcast(self, eqn: Eqn) -> bool:
        shape = tuple(eqn.params["shape"])
        return len(shape) >= 1 and 0 not in tuple(eqn.params["broadcast_dimensions"]) and shape[0] > 1

    def _row_gather(self, eqn: Eqn) -> bool:
        d = eqn.params["dimension_numbers"]
        operand, indices = self._shape(eqn.ins[0]), self._shape(eqn.ins[1])
        return (tuple(d.start_index_map) == (0,) and tuple(d.collapsed_slice_dims) == (0,)
                and not tuple(d.operand_batching_dims) and tuple(eqn.params["slice_sizes"]) == (1, *operand[1:])
                and indices[-1:] == (1,))

    def _row_scatter(self, eqn: Eqn) -> bool:
        d = eqn.params["dimension_numbers"]
        operand, indices, updates = self._shape(eqn.ins[0]), self._shape(eqn.ins[1]), self._shape(eqn.ins[2])
        window = tuple(updates[k] for k in d.update_window_dims)
        return (tuple(d.inserted_window_dims) == (0,) and tuple(d.scatter_dims_to_operand_dims) == (0,)
                and not tuple(d.operand_batching_dims) and indices[-1:] == (1,) and window == operand[1:])

    def _outputs(self) -> None:
        for pos, a in enumerate(self.flat.outvars):
            if self._k(a) != ROWS:
                table = self.grad_outputs.get(pos)
                if table is not None and table in self.candidates:
                    root = self._table_root(table)
                    if root is not None:
                        self.fail(root, "its gradient is computed whole")
                continue
            g = self.gid[a]
            table = self.grad_outputs.get(pos)
            if table is None:
                self.fail(g, "a row value is a result of the step (not the table's gradient)")
                continue
            root = self._table_root(table)
            if root is None:
                self.fail(g, "the gradient of a variable read whole")
                continue
            g = self.union(g, root)
            if not self.probe[a]:
                self.fail(g, "its gradient is not zero outside the looked-up rows")

    def _table_root(self, table: int) -> int | None:
        v = self.flat.invars[table]
        return self.find(self.gid[v]) if self.kind.get(v) == ROWS else None

    def result(self, reasons: dict) -> Analysis:
        roots = sorted(self.groups)
        index = {root: k for k, root in enumerate(roots)}
        group_of = {v: index[self.find(g)] for v, g in self.gid.items()}
        grads = {pos: group_of[a] for pos, a in enumerate(self.flat.outvars) if self._k(a) == ROWS}
        groups = [self.groups[root] for root in roots]
        producer = {o: e for e in self.flat.eqns for o in e.outs}
        raw = {var: _raw_ids(producer, var) for group in groups for var in group.indices}
        grad_tables = {pos: self.grad_outputs[pos] for pos in grads}
        return Analysis(self.flat, groups, group_of, self.modes, dict(self.kind), dict(self.probe), grads,
                        grad_tables, raw, dict(reasons))


def _raw_ids(producer: dict, index: int) -> int:
    """The ids ``index`` was computed from before ``jnp.take`` wrapped negative ones (``where(i < 0, i + n, i)``).

    TF's embedding lookup rejects a negative id; checking the wrapped index would
    accept -1 as the last row.  Follows ``broadcast_in_dim``/``reshape`` back to a
    ``select_n(lt(x, 0), x, add(x, n))`` and returns ``x``; else ``index`` itself.
    """
    var = index
    while True:
        eqn = producer.get(var)
        if eqn is None:
            return index
        name = eqn.prim.name
        if name in ("broadcast_in_dim", "reshape") and not isinstance(eqn.ins[0], Const):
            var = eqn.ins[0]
            continue
        if name == "select_n" and len(eqn.ins) == 3 and not any(isinstance(a, Const) for a in eqn.ins):
            pred, keep, wrapped = (producer.get(a) for a in eqn.ins)
            x = eqn.ins[1]
            if (pred is not None and pred.prim.name == "lt" and pred.ins[0] == x and isinstance(pred.ins[1], Const)
                    and wrapped is not None and wrapped.prim.name == "add" and wrapped.ins[0] == x):
                return x
        return index
