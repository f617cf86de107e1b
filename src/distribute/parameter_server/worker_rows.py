"""A worker's step with row tables (``row_plan.RowPlan``): ids, row reads, the row program, row updates.

1. The ids program gives every array of ids the step looks up; each id must be
   in ``[0, rows)`` (TF's embedding lookup raises ``InvalidArgumentError``
   otherwise; here too, naming the variable, instead of JAX's silent fill).
2. Per group of tables, the distinct ids, sorted, padded to the group's size
   with ``rows`` (past every id).
3. One ``rows`` request per ps: for each shard, the local ids it holds.
4. The row program on those rows; each row gradient's probe (its value at rows
   not looked up) must be zero, since the ps updates only the looked-up rows.
5. The push sends each ps, per row table, the ids it holds and their gradient rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from distribute.parameter_server.actor_common import _load
from distribute.parameter_server.errors import InvalidArgumentError


@dataclasses.dataclass
class RowState:
    """One step's looked-up ids: per group ``(sorted distinct ids, count)``; per (table, ps) its slices of them."""

    uniques: list
    counts: list
    slices: dict  # (table index, ps) -> [(lo, hi), ...] positions among the group's distinct ids, shard order


def run(worker: Any, plan: Any, program: Any, read_vals: list, iter_vals: list, args: list) -> tuple[list, RowState]:
    """Runs ``plan``'s row program (``program``); returns its outputs (probes checked and dropped) and the ids."""
    import jax

    rp = plan.rows
    inputs = [*read_vals, *iter_vals, *args]
    if all(p >= 0 for p in rp.ids_direct):  # the ids are inputs (an Embedding of a batch): no program to run
        ids_outs = [inputs[p] for p in rp.ids_direct]
    else:
        ids_program = _load(worker._programs, rp.ids_program_id, rp.ids_box)
        ids_outs = jax.device_get(list(ids_program(*[inputs[p] for p in rp.ids_inputs])))
    state = _distinct(rp, ids_outs, worker._index)
    table_rows = _read(worker, rp, state)
    others = [v for v in read_vals if v is not None] + list(iter_vals) + list(args)
    padded = [_pad_ids(u, g.size, g.rows) for u, g in zip(state.uniques, rp.groups)]
    outs = jax.device_get(list(program(others, table_rows, padded)))
    if rp.grads:
        probes, outs = outs[-len(rp.grads):], outs[: -len(rp.grads)]
        for (_, t), probe in zip(rp.grads, probes):
            if np.any(np.asarray(probe) != 0):
                raise ValueError(
                    f"the gradient of '{rp.tables[t].name}' computed by a scheduled function is {np.asarray(probe).ravel()[:4]} "
                    "(not zero) at rows the step did not look up, so updating only the looked-up rows would differ from "
                    "the whole update. This is a bug in distribute's row analysis; please report it with the function."
                )
    return outs, state


def _distinct(rp: Any, ids_outs: list, worker_index: int) -> RowState:
    per_group: list[list] = [[] for _ in rp.groups]
    for group, ids in zip(rp.ids_groups, ids_outs):
        ids = np.asarray(ids)
        g = rp.groups[group]
        bad = (ids < 0) | (ids >= g.rows)
        if bad.any():
            where = np.unravel_index(int(np.argmax(bad)), ids.shape)
            names = " / ".join(f"'{rp.tables[t].name}'" for t in g.tables)
            raise InvalidArgumentError(
                f"indices[{','.join(str(int(i)) for i in where)}] = {int(ids[where])} is not in [0, {g.rows}): a row id "
                f"looked up in variable {names} ({g.rows} rows) by a function scheduled with ClusterCoordinator.schedule "
                f"on worker {worker_index}. Ids must be in [0, {g.rows}), as TF's embedding lookup requires "
                "(InvalidArgumentError there too); JAX alone would silently read NaN or clamp."
            )
        per_group[group].append(ids.reshape(-1))
    uniques = [np.unique(np.concatenate(parts)).astype(np.int32) if parts else np.zeros((0,), np.int32)
               for parts in per_group]
    slices: dict = {}
    for t, table in enumerate(rp.tables):
        u = uniques[table.group]
        for ps, _, start, stop in table.shards:
            lo, hi = int(np.searchsorted(u, start)), int(np.searchsorted(u, stop))
            slices.setdefault((t, ps), []).append((lo, hi))
    return RowState(uniques, [len(u) for u in uniques], slices)


def _pad_ids(u: np.ndarray, size: int, rows: int) -> np.ndarray:
    out = np.full((size,), rows, np.int32)
    out[: len(u)] = u
    return out


def _read(worker: Any, rp: Any, state: RowState) -> list:
    """Each table's looked-up rows, ``(size, ...)`` in the order of its group's distinct ids (zeros after them)."""
    requests: dict[int, list] = {}
    places: dict[int, list] = {}
    for t, table in enumerate(rp.tables):
        u = state.uniques[table.group]
        for (ps, key, start, _), (lo, hi) in zip(table.shards, _shard_slices(state, t, table)):
            if hi > lo:
                requests.setdefault(ps, []).append((key, u[lo:hi] - start))
                places.setdefault(ps, []).append((t, lo, hi))
    replies = worker._exchange({j: ("rows", reqs) for j, reqs in requests.items()})
    out = [np.zeros((rp.groups[t.group].size, *t.tail), t.dtype) for t in rp.tables]
    for j, parts in replies.items():
        for (t, lo, hi), rows in zip(places[j], parts):
            out[t][lo:hi] = rows
    return out


def _shard_slices(state: RowState, t: int, table: Any) -> list:
    """``(lo, hi)`` per shard of ``table`` in shard order (a ps holding several shards lists them in order)."""
    seen: dict[int, int] = {}
    out = []
    for ps, _, _, _ in table.shards:
        k = seen.get(ps, 0)
        out.append(state.slices[(t, ps)][k])
        seen[ps] = k + 1
    return out


def apply_rows(rp: Any, meta: Any, j: int, state: RowState, outs: list, grad_slices: tuple) -> tuple[list, tuple]:
    """For one apply program on ps ``j``: ``(gradients, (meta, ids per table))`` with row gradients as rows."""
    ids, picks = [], []
    for t in meta.tables:
        u = state.uniques[rp.tables[t].group]
        spans = state.slices.get((t, j), [])
        ids.append(np.concatenate([u[lo:hi] for lo, hi in spans]) if spans else u[:0])
        picks.append(spans)
    grads = []
    for (pos, bounds), r in zip(grad_slices, meta.grads):
        value = outs[pos]
        if r >= 0:
            spans = picks[r]
            grads.append(np.concatenate([value[lo:hi] for lo, hi in spans]) if spans else value[:0])
        elif bounds:
            grads.append(np.concatenate([value[a:b] for a, b in bounds]))
        else:
            grads.append(value)
    return grads, (meta, ids)
