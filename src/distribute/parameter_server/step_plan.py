"""``StepPlan``: what a worker needs to run one step program (``program.py`` makes them).

A module of its own, standard library only: a worker unpickles plans, and
``program.py`` loads Keras (seconds in a worker that never uses it, issue 27).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What a worker needs to run one step program: plain data, no user code."""

    program_id: int
    pull: dict  # ps index -> tuple of storage keys
    read: tuple  # per program variable input: ((ps, key), ...) concatenated on axis 0
    iterators: tuple  # (resource_id, number of next() calls, per element [(shape, dtype), ...])
    num_results: int
    applies: tuple  # (ps, program_id, box, owned keys, written keys, foreign (ps, key)s or output position, grad slices,
    #                  row_plan.ApplyRows or None): apply_program.programs
    deltas: tuple  # (output position, ((ps, key, start, stop), ...))
    sets: tuple
    # The programs of one function and result structure, one per element signature, share a family:
    # a worker that met another signature before runs that program itself (ClusterCoordinator sets it).
    family: int = -1
    # Per iterator input, the element structure (treedef) the program unflattens each element with:
    # an element of another structure is a new signature (TF retraces), never read with this one.
    element_treedefs: tuple = ()
    # The step's row tables (row_plan.RowPlan): read and updated by looked-up rows; None: every variable whole.
    rows: Any = None
