"""Sharded state: the levels of ``sharding=``, which variables are split, and the slices of a step.

ZeRO's stages behind tf.distribute's strategies (``MirroredStrategy(sharding=...)``,
``MultiWorkerMirroredStrategy``, ``TPUStrategy``):

* ``Sharding.NONE``: every variable and optimizer slot replicated (TF's behaviour);
* ``Sharding.OPTIMIZER_STATE`` (ZeRO-1): optimizer slots split over the replicas;
  gradients are reduce-scattered (each replica receives only the sum of its
  slice), each replica updates its slice of every variable and the slices are
  all-gathered. As DeepSpeed's stage 1, which sends what its stage 2 sends: an
  all-reduce then a local slice sent more and ran slower than ``NONE``;
* ``Sharding.GRADIENTS`` (ZeRO-2): also the gradients split. Inside one compiled
  step XLA holds a whole gradient only while it is reduce-scattered at either
  level, so here it runs the same step as ``OPTIMIZER_STATE`` (DeepSpeed's stage
  2 frees each gradient's other slices during the backward pass; XLA's buffer
  assignment does that for both);
* ``Sharding.FULL`` (ZeRO-3, FSDP's FULL_SHARD): the trainable variables
  themselves split too, all-gathered inside each step for the forward and
  backward passes.

A variable is split along one dim (:func:`split_dim`: the largest dim that
divides by the number of replicas); variables under ``MIN_SHARDED_ELEMENTS``
elements, or with no such dim, stay replicated, and so do non-trainable state
(BatchNormalization statistics) and SyncOnRead variables (metrics).

:class:`Slices` is the bookkeeping of one SPMD step: which full (all-gathered)
values are the gathers of which slices, so that a slice is taken back without
another collective.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Sequence

import jax.numpy as jnp
from jax import lax

from distribute.mesh import AXIS

MIN_SHARDED_ELEMENTS = 1024
"""Variables with fewer elements stay replicated (a bias of 64 floats is not worth a collective)."""


class Sharding(enum.Enum):
    """How much of the training state a synchronous strategy splits over its replicas.

    ``distribute.experimental.Sharding``; the value of the ``sharding=`` keyword of
    ``MirroredStrategy``, ``MultiWorkerMirroredStrategy`` and ``TPUStrategy``.
    The lower-case names (``"optimizer_state"``) are accepted too.
    """

    NONE = "none"
    OPTIMIZER_STATE = "optimizer_state"
    GRADIENTS = "gradients"
    FULL = "full"

    @classmethod
    def from_value(cls, value: Any) -> "Sharding":
        """``value`` as a ``Sharding``: a member, its lower-case name, or None (``NONE``).

        Raises:
            ValueError: anything else; the message lists the choices.
        """
        if value is None:
            return cls.NONE
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if value == member.value:
                    return member
        choices = ", ".join(f"distribute.experimental.Sharding.{m.name} ({m.value!r})" for m in cls)
        raise ValueError(f"sharding={value!r} is not a sharding level; use one of {choices}.")

    @property
    def splits_slots(self) -> bool:
        """Whether optimizer slots are split (every level but NONE)."""
        return self is not Sharding.NONE

    @property
    def scatters_gradients(self) -> bool:
        """Whether gradients are reduce-scattered rather than all-reduced (every level that splits slots)."""
        return self.splits_slots

    @property
    def splits_variables(self) -> bool:
        """Whether trainable variables themselves are split (FULL)."""
        return self is Sharding.FULL


def split_dim(shape: Sequence[int], num_replicas: int) -> int | None:
    """The dim a variable of ``shape`` is split along over ``num_replicas`` replicas, or None (replicated).

    The largest dim that divides by ``num_replicas`` (the first of equal ones);
    None with one replica, under ``MIN_SHARDED_ELEMENTS`` elements, or when no
    dim divides. ``(784, 64)`` over 8 replicas: dim 0; ``(10,)``: None.
    """
    shape = tuple(int(d) for d in shape)
    if num_replicas < 2 or not shape or math.prod(shape) < MIN_SHARDED_ELEMENTS:
        return None
    candidates = [d for d, size in enumerate(shape) if size >= num_replicas and size % num_replicas == 0]
    if not candidates:
        return None
    return max(candidates, key=lambda d: (shape[d], -d))


def spec_entries(dim: int, ndim: int) -> tuple:
    """The PartitionSpec entries of a value split along ``dim`` on the replica axis."""
    return tuple(AXIS if d == dim else None for d in range(ndim))


class Slices:
    """Inside one SPMD step: the full values gathered from slices, and back.

    ``gather(part, dim)`` all-gathers a replica's slice into the full value (the
    same on every replica) and remembers the pair; ``part(full, dim)`` gives
    that slice back without a collective, and slices any other full value
    locally (``dynamic_slice`` at this replica's offset). An unused gather is
    removed by the compiler.
    """

    def __init__(self) -> None:
        self._parts: dict[int, tuple[Any, Any]] = {}

    def gather(self, part: Any, dim: int) -> Any:
        full = lax.all_gather(part, AXIS, axis=dim, tiled=True, to="invarying")
        self._parts[id(full)] = (full, part)
        return full

    def part(self, full: Any, dim: int) -> Any:
        known = self._parts.get(id(full))
        if known is not None and known[0] is full:
            return known[1]
        full = jnp.asarray(full)
        size = full.shape[dim] // lax.axis_size(AXIS)
        return lax.dynamic_slice_in_dim(full, lax.axis_index(AXIS) * size, size, axis=dim)
