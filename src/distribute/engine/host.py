"""The collectives of an uneven step, made on the host between the replicas' programs.

Each takes one list of numpy values per local replica (the same leaves on every
replica) and returns one list per local replica.  On one worker the values are
combined in numpy, in replica order; across workers through one small compiled
program over the strategy's mesh (``collectives.py``), every worker making the
same calls in the same order.  No replica's program is running while they run:
nothing here ever waits on a program that waits on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from distribute import collectives
from distribute.replica import different_values_error


@dataclasses.dataclass(frozen=True)
class VariableSpec:
    """How one assigned variable is made identical on every replica (``combine``).

    ``summed``: a ``sum`` variable written by the replica (not by an optimizer):
    every replica's change counts (or, after a plain ``assign``, every replica's
    value); otherwise the value stays when equal on every replica, else
    ``aggregation`` decides (``mean`` over the replicas with rows,
    ``only_first_replica``, ``none``: an error for a trainable variable).
    """

    path: str
    aggregation: str
    trainable: bool
    summed: bool
    assigned: bool


def variable_specs(variables: Sequence[Any], plain: frozenset, updates: frozenset) -> tuple:
    """The :class:`VariableSpec` of each variable; ``plain`` / ``updates``: ids (see ``ReplicaContext._combine_all``)."""
    return tuple(
        VariableSpec(str(v.path), str(v.aggregation), bool(v.trainable), v.aggregation == "sum" and id(v) not in updates, id(v) in plain)
        for v in variables
    )


class HostCollectives:
    """The collectives of one uneven step over this worker's replicas (and, with several, every worker's).

    Args:
        strategy: the strategy.
        rows: every replica's rows in the step (``num_replicas_in_sync`` counts), or None.
        shapes_agreed: the workers already agreed on every collective's shapes
            (the compiled step): across workers, a sum exchanges no shapes first.
    """

    def __init__(self, strategy: Any, rows: Sequence[int] | None, shapes_agreed: bool = False):
        mesh = strategy.extended.replica_mesh
        self.strategy = strategy
        self.num_local = len(mesh.local_devices)
        self.first = mesh.devices.index(mesh.local_devices[0])
        self.rows = None if rows is None else [int(n) for n in rows]
        self.multi_worker = jax.process_count() > 1
        self.shapes_agreed = shapes_agreed

    # -- the collectives ------------------------------------------------------------------
    def sum(self, per_replica: list[list]) -> list[list]:
        """Each leaf summed over every replica; every replica gets the sums.

        Raises:
            ValueError: the replicas' values of a leaf differ in shape or dtype.
        """
        if not per_replica[0]:
            return [[] for _ in per_replica]
        columns = [list(col) for col in zip(*per_replica)]
        if self.multi_worker:
            out = collectives.sum_over_replicas(self.strategy, columns, check=not self.shapes_agreed)
            return [[np.asarray(x) for x in values] for values in out]
        for col in columns:
            _check_same(col, "all_reduce")
        totals = [np.sum(np.stack(col), axis=0, dtype=col[0].dtype) for col in columns]
        return [totals] * len(per_replica)

    def stack(self, per_replica: list[list]) -> list[list]:
        """Every replica's (equal-shaped) value of each leaf: ``(num_replicas_in_sync, ...)`` each."""
        columns = [list(col) for col in zip(*per_replica)]
        if self.multi_worker:
            every = collectives.everyone(self.strategy, columns)
        else:
            every = [np.stack(col) for col in columns]
        return [every] * len(per_replica)

    def gather(self, per_replica: list[list], axis: int) -> list[list]:
        """Each leaf concatenated over every replica along ``axis`` (sizes may differ along it)."""
        columns = [list(col) for col in zip(*per_replica)]
        if self.multi_worker:
            out = collectives.gather_over_replicas(self.strategy, columns, axis)
            return [[np.asarray(x) for x in values] for values in out]
        gathered = []
        for col in columns:
            ranks, dtypes = {np.ndim(v) for v in col}, {np.asarray(v).dtype for v in col}
            shapes = [np.shape(v) for v in col]
            if len(ranks) > 1 or len(dtypes) > 1:
                raise ValueError(
                    f"all_gather got values of shapes {sorted(set(shapes))} (dtypes {sorted(map(str, dtypes))}) on "
                    "different replicas: their ranks and dtypes must be equal; only the gathered axis may differ."
                )
            ax = axis % len(shapes[0])
            others = {s[:ax] + s[ax + 1:] for s in shapes}
            if len(others) > 1:
                raise ValueError(
                    f"all_gather along axis {axis} got values whose other dims differ between replicas "
                    f"({sorted(others)}); only the gathered axis may differ."
                )
            gathered.append(np.concatenate(col, axis=ax))
        return [gathered] * len(per_replica)

    def combine(self, specs: Sequence[VariableSpec], new: list[list], old: list[list]) -> list[list]:
        """Makes assigned variables identical on every replica, by their aggregation (as the SPMD program).

        ``new[r]`` / ``old[r]``: local replica ``r``'s values of the variables
        (``old`` has the variables' dtypes).  Round 1 adds every replica's change
        of the ``sum`` variables and hands everyone replica 0's value of the
        others; round 2 (only where some value differs from replica 0's) averages
        over the replicas that had rows (an empty replica contributes nothing).

        Raises:
            ValueError: a variable whose aggregation cannot combine different
                values (``none``, trainable) differs between replicas.
        """
        if not specs:
            return [[] for _ in new]
        new = [[np.asarray(n, dtype=np.asarray(o).dtype) for n, o in zip(ns, os)] for ns, os in zip(new, old)]
        old = [[np.asarray(o) for o in os] for os in old]
        if not self.multi_worker:
            return self._combine_here(specs, new, old)
        probes = []
        for local, (ns, os) in enumerate(zip(new, old)):
            first = self.first + local == 0
            probes.append([
                (n if s.assigned else n - o) if s.summed else (n if first else np.zeros_like(n))
                for n, o, s in zip(ns, os, specs)
            ])
        totals = self.sum(probes)
        out = [
            [(t if s.assigned else o + t) if s.summed else t for o, t, s in zip(os, ts, specs)]
            for os, ts in zip(old, totals)
        ]
        others = [i for i, s in enumerate(specs) if not s.summed]
        if not others:
            return out
        payload = []
        for local, ns in enumerate(new):
            rows = None if self.rows is None else self.rows[self.first + local]
            has_rows = np.float32(0.0 if rows == 0 else 1.0)
            differs = [np.int32(np.any(ns[i] != totals[local][i])) for i in others]
            weighted = [_unless_empty(ns[i], bool(has_rows)) for i in others]
            payload.append([*differs, *weighted, has_rows])
        sums = self.sum(payload)
        for local, summed in enumerate(sums):
            num_differ, totals_2, count = summed[: len(others)], summed[len(others): 2 * len(others)], summed[-1]
            count = np.maximum(count, np.float32(1.0))
            for i, flag, total in zip(others, num_differ, totals_2):
                spec = specs[i]
                if not int(flag) or spec.aggregation == "only_first_replica":
                    continue  # replica 0's value (the others added zeros)
                if spec.aggregation == "mean" or (spec.aggregation == "none" and not spec.trainable):
                    out[local][i] = (total / count.astype(total.dtype)).astype(new[local][i].dtype)
                else:
                    raise different_values_error(spec)
        return out


    def _combine_here(self, specs: Sequence[VariableSpec], new: list[list], old: list[list]) -> list[list]:
        """``combine`` on one worker, where every replica's values are at hand: the same answers, fewer arrays."""
        has_rows = [self.rows is None or self.rows[self.first + local] != 0 for local in range(len(new))]
        combined = []
        for i, spec in enumerate(specs):
            values = [ns[i] for ns in new]
            if spec.summed:
                changes = values if spec.assigned else [n - os[i] for n, os in zip(values, old)]
                total = np.sum(np.stack(changes), axis=0, dtype=values[0].dtype)
                combined.append([total if spec.assigned else os[i] + total for os in old])
                continue
            value = values[0]  # replica 0's, where every replica has it
            if spec.aggregation != "only_first_replica" and any(not np.array_equal(v, value) for v in values[1:]):
                if not (spec.aggregation == "mean" or (spec.aggregation == "none" and not spec.trainable)):
                    raise different_values_error(spec)
                # The mean over the replicas that had rows (an empty replica contributes nothing).
                weighted = [_unless_empty(v, rows) for v, rows in zip(values, has_rows)]
                total = np.sum(np.stack(weighted), axis=0, dtype=value.dtype)
                count = np.maximum(np.float32(sum(has_rows)), np.float32(1.0))
                value = (total / count.astype(total.dtype)).astype(value.dtype)
            combined.append([value] * len(new))
        return [list(per_replica) for per_replica in zip(*combined)]


def _unless_empty(value: np.ndarray, has_rows: bool) -> np.ndarray:
    """``value``, or zeros for an empty replica: it contributes nothing (its value of zero rows is often NaN,
    and ``NaN * 0`` would still be NaN)."""
    return value if has_rows else np.zeros_like(value)


def _check_same(values: list, what: str) -> None:
    shapes = {np.shape(v) for v in values}
    dtypes = {str(np.asarray(v).dtype) for v in values}
    if len(shapes) > 1 or len(dtypes) > 1:
        raise ValueError(
            f"{what} got values of shapes {sorted(shapes)} (dtypes {sorted(dtypes)}) on different replicas; every "
            "replica must pass a value of the same shape and dtype (reduce the batch dim first, e.g. "
            "with a sum over axis 0)."
        )
