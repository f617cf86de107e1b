"""``element_spec`` of a DistributedDataset: ``PerReplicaSpec`` (TF: ``tf.distribute``'s PerReplicaSpec)."""

from __future__ import annotations

import math
from typing import Any

from distribute.data import TensorSpec
from distribute.data._structure import map_structure


class PerReplicaSpec:
    """The type of a PerReplica value: one spec per local replica (``_component_specs``)."""

    def __init__(self, *component_specs: Any) -> None:
        self._component_specs = tuple(component_specs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PerReplicaSpec) and other._component_specs == self._component_specs

    def __hash__(self) -> int:
        return hash(self._component_specs)

    def __repr__(self) -> str:
        return f"PerReplicaSpec({', '.join(repr(s) for s in self._component_specs)})"


def per_replica(spec: Any, num_local: int, num_replicas: int) -> Any:
    """Each leaf as TF gives it: the spec itself with one replica in sync, else a PerReplicaSpec over the local replicas."""
    if num_replicas == 1:
        return spec
    return map_structure(lambda s: PerReplicaSpec(*[s] * num_local), spec)


def split_global(spec: Any, batch_info: tuple[int, bool], num_replicas: int) -> Any:
    """The per-replica spec of a global batch: dim 0 is ``B / R`` when every batch is full and divides, else None.

    TF 2.21, 2 replicas, ``batch(4)``: ``(None, 3)``; ``batch(4, drop_remainder=True)``: ``(2, 3)``.
    """
    batch_size, drop = batch_info
    rows = batch_size // num_replicas if drop and batch_size % num_replicas == 0 else None

    def split(s: TensorSpec) -> TensorSpec:
        if s.shape is None or not s.shape:
            return s
        return TensorSpec((rows if num_replicas > 1 else s.shape[0], *s.shape[1:]), s.dtype)

    return map_structure(split, spec)


def rows_per_replica(batch_size: int, num_replicas: int) -> int:
    return math.ceil(batch_size / num_replicas)
