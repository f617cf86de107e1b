"""The plain-data plan of a step's row tables (``rows.py``) and how each ps applies their updates.

Workers and ps get this with the step's ``StepPlan`` (``program.py``): which
read variables are row tables, where their shards live, how many ids each
group of tables can look up (``size``, the padded row count the programs are
compiled for), and per apply program on a ps whether it updates looked-up rows
only (``ApplyRows.mode == "rows"``: an optimizer whose update leaves a row with
a zero gradient unchanged, see :data:`ROW_EXACT`) or makes the gradient whole on
the ps first (``"dense"``: the exact update of every row, done where the table
lives; only the looked-up rows travel).
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Optimizers whose update of a row with a zero gradient leaves that row and its
# slots exactly unchanged, so updating only the looked-up rows equals the whole
# update (with momentum 0, no weight decay, no EMA, no constraint on the table):
#   SGD:     v -= lr * g
#   Adagrad: acc += g**2; v -= lr * g / sqrt(acc + eps)
# Every other Keras optimizer changes rows without a gradient (SGD with momentum and
# RMSprop: their velocity decays; Adam, AdamW, Adamax, Nadam, Lion, Lamb: their
# moments decay; Adadelta: its accumulators decay; Ftrl: it recomputes the variable
# from its `linear` slot, which turns a row never updated into 0 and depends on the
# learning rate at each step; weight decay: every row shrinks): for those the ps
# applies the exact whole-table update to the rows it holds.
ROW_EXACT = ("SGD", "Adagrad")


def row_exact(optimizer: Any, var: Any) -> bool:
    """Whether ``optimizer``'s update of ``var`` may touch only the rows with a gradient (see :data:`ROW_EXACT`)."""
    import keras

    kind = type(optimizer)
    if kind is keras.optimizers.SGD:
        exact = not optimizer.momentum
    elif kind is keras.optimizers.Adagrad:
        exact = True
    else:
        return False
    return (exact and not optimizer.weight_decay and not optimizer.use_ema
            and getattr(var, "constraint", None) is None)


@dataclasses.dataclass(frozen=True)
class RowTable:
    read: int  # position among the step's read variables
    group: int
    name: str  # the variable's path (errors name it)
    rows: int  # dim 0
    shards: tuple  # ((ps, key, start, stop), ...) in row order
    tail: tuple  # the shape after dim 0
    dtype: str


@dataclasses.dataclass(frozen=True)
class RowGroup:
    size: int  # the ids the step can look up: the row programs hold this many rows
    rows: int  # the tables' dim 0
    tables: tuple  # indices into RowPlan.tables


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """What a worker needs to run a step with row tables (``rows_program.py``)."""

    ids_program_id: int
    ids_box: list
    ids_inputs: tuple  # positions in the step's inputs (read variables, then elements, then array args)
    ids_groups: tuple  # per ids-program output: its group
    ids_direct: tuple  # per ids-program output: the input position it is, or -1; all inputs: the program is skipped
    num_read: int
    tables: tuple  # RowTable, in the row program's input order
    groups: tuple  # RowGroup
    grads: tuple  # per probe output, in order: (output position, table index)


@dataclasses.dataclass(frozen=True)
class ApplyRows:
    """The row tables of one apply program on one ps (``r`` indexes ``tables``).

    ``mode``: "rows" (the program is compiled for ``sizes[r]`` looked-up rows of
    each row variable; the ps gathers them, runs it, writes them back) or
    "dense" (the ps scatters the gradient's rows into zeros of its rows and
    runs the whole-value program).
    """

    mode: str
    tables: tuple  # per r: index into RowPlan.tables
    sizes: tuple  # per r: the padded row count
    starts: tuple  # per r: the first row of each of its shards on this ps, in key order
    owned: tuple  # per owned variable: r, or -1 (whole)
    written: tuple  # per written variable: r, or -1
    grads: tuple  # per gradient: r, or -1 (a whole gradient)


def local_rows(ids: Any, start: int, length: int) -> Any:
    """The positions within a shard ``[start, start + length)`` of the sorted ``ids`` it holds."""
    import numpy as np

    lo, hi = np.searchsorted(ids, start), np.searchsorted(ids, start + length)
    return ids[lo:hi] - start
