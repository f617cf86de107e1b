"""ReplicaMesh: a mesh strategy's devices, its one-axis mesh, shardings and host <-> device placement.

Immutable: built once per strategy from its devices (all workers' devices for
MultiWorkerMirroredStrategy, worker 0's first).  ``AXIS`` is the mesh axis name
every SPMD program and collective uses.  A PerReplica value is one global array
``(num_replicas, ...)`` sharded on ``AXIS`` (``per_replica_sharding``); a
Mirrored value or a variable is one replicated array (``replicated_sharding``).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

AXIS = "replica"

_INT32 = np.iinfo(np.int32)


class ReplicaMesh:
    """The devices of a mesh strategy and how values are placed on them.

    Args:
        devices: every replica's device, in replica order (across workers).

    Attributes:
        devices: every replica's device; ``local_devices``: this worker's, in
            replica order; ``mesh``: ``Mesh(devices, ("replica",))``;
            ``per_replica_sharding`` (``P("replica")``), ``replicated_sharding``
            (``P()``); ``first_local_replica``: the replica id of this worker's
            first device.
    """

    __slots__ = ("devices", "local_devices", "mesh", "per_replica_sharding", "replicated_sharding", "first_local_replica")

    def __init__(self, devices: Sequence[jax.Device]):
        devices = tuple(devices)
        mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
        process = jax.process_index()
        local = tuple(d for d in devices if d.process_index == process)
        for name, value in (
            ("devices", devices),
            ("local_devices", local),
            ("mesh", mesh),
            ("per_replica_sharding", NamedSharding(mesh, P(AXIS))),
            ("replicated_sharding", NamedSharding(mesh, P())),
            ("first_local_replica", devices.index(local[0]) if local else 0),
        ):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ReplicaMesh is immutable; cannot set {name!r}")

    @property
    def num_replicas(self) -> int:
        return len(self.devices)

    def put_per_replica(self, stacked: Any) -> jax.Array:
        """Places a stacked host value as a global per-replica array.

        ``stacked`` is ``(num_local_replicas, ...)``, or ``(num_replicas, ...)``
        (every replica's row; only this worker's rows are used).

        Raises:
            ValueError: an int64 value that does not fit int32 without 64-bit mode.
        """
        check_integers_fit(stacked)
        if jax.process_count() == 1:
            return jax.device_put(stacked, self.per_replica_sharding)
        stacked = np.asarray(stacked)
        if stacked.shape[0] == len(self.devices):
            stacked = self.local_rows(stacked)
        global_shape = (len(self.devices), *stacked.shape[1:])
        return jax.make_array_from_process_local_data(self.per_replica_sharding, stacked, global_shape)

    def put_per_replica_all(self, stacked: list) -> list:
        """``put_per_replica`` of several values, in one transfer call where possible."""
        if jax.process_count() == 1:
            for value in stacked:
                check_integers_fit(value)
            return jax.device_put(list(stacked), self.per_replica_sharding)
        return [self.put_per_replica(value) for value in stacked]

    def put_replicated(self, value: Any) -> jax.Array:
        """Places a host value on every replica (a Mirrored value, a variable).

        Under several processes an array committed to this worker's devices (a
        ``reduce`` result: the same on every worker) is placed from its host copy:
        JAX does not move device buffers between hosts.
        """
        check_integers_fit(value)
        if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
            if value.sharding == self.replicated_sharding:
                return value
            if jax.process_count() > 1 and not value.sharding.device_set >= set(self.replicated_sharding.device_set):
                value = np.asarray(value)
        return jax.device_put(value, self.replicated_sharding)

    def local_copy(self, array: Any) -> Any:
        """The copy of a replicated array that a cross-replica read gives: one device's, committed there.

        TF's rule for a MirroredVariable read in cross-replica context (and for
        where ``strategy.reduce`` puts its result): the copy on the current device
        if the value lives there, else the primary copy.  Here the current device is
        ``jax.default_device`` when it is one of this worker's replicas' devices,
        else the primary device is this worker's first replica's device.  No
        transfer: the copy is the array's own buffer on that device (shapes are
        unchanged).  Anything but a fully replicated, multi-device ``jax.Array``
        (a host value, a tracer, a one-device array, a sharded array) is returned
        as it is.
        """
        if not isinstance(array, jax.Array) or isinstance(array, jax.core.Tracer) or not self.local_devices:
            return array
        if len(array.sharding.device_set) < 2 or not array.is_fully_replicated:
            return array
        device = self._read_device()
        first = array.addressable_data(0)
        if next(iter(first.devices())) == device:
            return first
        for shard in array.addressable_shards:
            if shard.device == device:
                return shard.data
        return array

    def local_copies(self, array: Any) -> tuple:
        """A replicated array's copies on this worker's devices, one per local replica, in replica order."""
        if not isinstance(array, jax.Array) or isinstance(array, jax.core.Tracer) or not array.is_fully_replicated:
            return tuple(array for _ in self.local_devices)
        by_device = {s.device: s.data for s in array.addressable_shards}
        if not all(d in by_device for d in self.local_devices):
            return tuple(array for _ in self.local_devices)
        return tuple(by_device[d] for d in self.local_devices)

    def whole_copy(self, array: Any) -> Any:
        """The whole value of an array split over the replicas, on the device of a cross-replica read.

        A gather onto one device (``local_copy``'s device); across workers, every
        worker takes part and gets its own copy. A replicated array gives
        ``local_copy``; anything but a ``jax.Array`` (a tracer, a host value) is
        returned as it is.
        """
        if not isinstance(array, jax.Array) or isinstance(array, jax.core.Tracer) or not self.local_devices:
            return array
        if array.is_fully_replicated:
            return self.local_copy(array)
        if array.is_fully_addressable:
            return jax.device_put(array, self._read_device())
        return self.local_copy(self.replicate(array))

    def replicate(self, array: Any) -> jax.Array:
        """``array`` (split over the replicas, of any worker) as one replicated array (an all-gather)."""
        return _replicate_program(self.replicated_sharding)(array)

    def _read_device(self) -> jax.Device:
        """This worker's device that cross-replica reads use: ``jax.default_device`` if ours, else the primary."""
        current = jax.config.jax_default_device
        if isinstance(current, jax.Device) and current in self.local_devices:
            return current
        return self.local_devices[0]

    def local_rows(self, stacked: Any) -> Any:
        """This worker's rows of a ``(num_replicas, ...)`` host value."""
        if len(self.local_devices) == len(self.devices):
            return stacked
        first = self.first_local_replica
        return stacked[first : first + len(self.local_devices)]

    def to_host(self, array: Any) -> np.ndarray:
        """The whole value of a (possibly multi-worker) array as numpy."""
        if not isinstance(array, jax.Array) or array.is_fully_addressable or array.is_fully_replicated:
            return np.asarray(array)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))

    def __repr__(self) -> str:
        return f"ReplicaMesh({len(self.devices)} replicas, {len(self.local_devices)} local)"


@functools.lru_cache(maxsize=None)
def _replicate_program(sharding: Any) -> Any:
    return jax.jit(lambda a: a, out_shardings=sharding)


def check_integers_fit(value: Any) -> None:
    """64-bit integers become 32-bit on devices unless jax_enable_x64 is set: refuse to lose values."""
    if not isinstance(value, np.ndarray) or value.dtype not in (np.int64, np.uint64) or not value.size:
        return
    if jax.config.jax_enable_x64:
        return
    low, high = int(value.min()), int(value.max())
    if low < _INT32.min or high > _INT32.max:
        raise ValueError(
            f"An int64 input holds values in [{low}, {high}], outside int32's range; JAX keeps "
            "integers in 32 bits unless 64-bit mode is on, so they would be corrupted. Enable it "
            "before creating arrays: jax.config.update('jax_enable_x64', True)."
        )
