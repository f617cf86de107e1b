"""Where each variable created in a ParameterServerStrategy's scope lives.

Variables are registered at creation, in creation order.  Each gets one storage
key per shard; shards are placed round-robin, ``ps = count % num_ps`` with the
count going up per variable or shard, as TF's ``_create_variable_round_robin``.
An optimizer slot takes its model variable's placement (TF colocates slots).

Small variables (up to ``REMOTE_BYTES``: biases, dense kernels, metrics) keep a
copy on the coordinator (the Keras variable's own value): sent to the ps before
the first scheduled function that needs it, refreshed from the ps by
``ClusterCoordinator.join()``, pushed to the ps when assigned on the coordinator.
A larger one (an embedding table and its optimizer slots) is *remote*: made on
its ps at creation (from its initializer, ``initializers.py``, or sent in pieces
when the user gave an array), and the coordinator holds only :class:`OnPs`, its
shape and dtype; a read gathers it from the ps on demand and keeps nothing, an
assignment is sent in pieces and dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import numpy as np

from distribute.parameter_server.partitioners import div_split, num_partitions

# Variables larger than this live on their ps only (no coordinator copy); tests lower it.
REMOTE_BYTES = 1 << 20


def is_remote(var: Any) -> bool:
    """Whether ``var`` (a Keras variable of a ps strategy) is kept on its ps only (larger than REMOTE_BYTES)."""
    shape = tuple(var.shape)
    return bool(shape) and int(np.prod(shape, dtype=np.int64)) * np.dtype(var.dtype).itemsize > REMOTE_BYTES


class OnPs:
    """What the coordinator holds as the value of a remote variable: its shape and dtype, no data.

    Anything that converts it (``np.asarray``) gathers the value from the ps
    (``read()``), as a read of the variable does.
    """

    def __init__(self, shape: tuple, dtype: Any, read: Any):
        self.shape, self.dtype, self._read = tuple(shape), np.dtype(dtype), read
        self.ndim = len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self._read(), dtype=dtype)

    def __repr__(self) -> str:
        return f"OnPs(shape={self.shape}, dtype={self.dtype})"


@dataclasses.dataclass(frozen=True)
class Shard:
    key: int
    ps: int
    start: int | None  # rows [start, stop) of axis 0; None: the whole variable
    stop: int | None


@dataclasses.dataclass
class Entry:
    var: Any
    shards: tuple
    on_ps: bool = False
    reference: Any = None  # the variable it is colocated with (an optimizer slot's model variable), or None
    stale: bool = False  # the coordinator's copy may be older than the ps's (refreshed on the next read)
    remote: bool = False  # kept on the ps only: the coordinator holds OnPs (is_remote)


def ps_device(task: int) -> str:
    return f"/job:ps/replica:0/task:{task}/device:CPU:0"


class VariableRegistry:
    """Placement and coordinator-side copies of a strategy's variables."""

    def __init__(self, num_ps: int, partitioner: Any = None) -> None:
        self.num_ps = num_ps
        self._partitioner = partitioner
        self._entries: dict[int, Entry] = {}
        self._keys = itertools.count()
        self._count = 0  # TF's _variable_count

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, var: Any) -> Entry | None:
        return self._entries.get(id(var))

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def register(self, var: Any, colocate_with: Any = None) -> Entry:
        """Places ``var``: with ``colocate_with``'s shards when it is a registered
        variable of the same shape, else round-robin (partitioned when the
        strategy's partitioner says so)."""
        reference = self._entries.get(id(colocate_with)) if colocate_with is not None else None
        if reference is not None and tuple(colocate_with.shape) != tuple(var.shape):
            reference = None
        if reference is not None:
            shards = tuple(Shard(next(self._keys), s.ps, s.start, s.stop) for s in reference.shards)
        else:
            shape = tuple(var.shape)
            count = num_partitions(self._partitioner, shape, var.dtype) if shape else 1
            if count == 1:
                shards = (Shard(next(self._keys), self._next_ps(), None, None),)
            else:
                shards = tuple(Shard(next(self._keys), self._next_ps(), a, b) for a, b in div_split(shape[0], count))
        entry = Entry(var=var, shards=shards, reference=colocate_with if reference is not None else None,
                      remote=is_remote(var))
        self._entries[id(var)] = entry
        return entry

    def _next_ps(self) -> int:
        ps = self._count % self.num_ps
        self._count += 1
        return ps

    # -- values ---------------------------------------------------------------------------
    def pending(self) -> list[Entry]:
        return [e for e in self._entries.values() if not e.on_ps and e.var._value is not None
                and not isinstance(e.var._value, OnPs)]

    def shard_values(self, entry: Entry, value: Any) -> dict[int, dict[int, np.ndarray]]:
        """``{ps: {key: rows}}`` of one variable's value."""
        value = np.asarray(value)
        out: dict[int, dict[int, np.ndarray]] = {}
        for s in entry.shards:
            out.setdefault(s.ps, {})[s.key] = value if s.start is None else value[s.start : s.stop]
        return out

    def assemble(self, entry: Entry, values: dict[int, np.ndarray]) -> np.ndarray:
        parts = [values[s.key] for s in entry.shards]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    def set_local(self, entry: Entry, value: np.ndarray) -> None:
        """Sets the coordinator's copy without pushing it back to the ps."""
        var = entry.var
        layout = getattr(var, "_layout", None)
        var._value = jax.device_put(value, layout) if layout is not None else jax.numpy.asarray(value)
