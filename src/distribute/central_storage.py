"""``distribute.experimental.CentralStorageStrategy``: variables on one parameter device, compute replicated.

TF's CentralStorageStrategy keeps each variable once, on the parameter device
(the CPU when there are several compute devices), copies it to the compute
devices for each step and applies the summed gradients there.  Its answers are
MirroredStrategy's: every replica computes on its share of the batch with the
same variable values, gradients are summed, variables with ``sum`` / ``mean``
aggregation combine the replicas' writes.  Here the step runs as
MirroredStrategy's compiled program over the compute devices (the variables
are its replicated inputs, as TF's per-step copies); a variable read in
cross-replica context (``v.value``, ``float(v)``, a checkpoint's save) and
``strategy.reduce``'s results are on the parameter device, as TF's.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from distribute.input.policy import InputPolicy
from distribute.keras_support import patches
from distribute.mesh import ReplicaMesh
from distribute.mesh_strategy import MeshExtended
from distribute.mirrored import MirroredStrategy, default_devices, resolve_devices


class _ParameterMesh(ReplicaMesh):
    """The compute devices' mesh, whose cross-replica copies live on the parameter device."""

    __slots__ = ("parameter_device",)

    def __init__(self, devices: Sequence[jax.Device], parameter_device: jax.Device):
        super().__init__(devices)
        object.__setattr__(self, "parameter_device", parameter_device)

    def local_copy(self, array: Any) -> Any:
        copy = super().local_copy(array)
        if not isinstance(copy, jax.Array) or isinstance(copy, jax.core.Tracer):
            return copy
        if copy.sharding.device_set == {self.parameter_device}:
            return copy
        return jax.device_put(copy, self.parameter_device)


class CentralStorageExtended(MeshExtended):
    """CentralStorageStrategy's ``extended``: ``parameter_devices`` is the parameter device (TF: same)."""

    def __init__(self, strategy: Any, devices: Sequence[jax.Device], parameter_device: jax.Device | None = None,
                 parameter_name: str | None = None):
        super().__init__(strategy, devices)
        self.replica_mesh = _ParameterMesh(devices, parameter_device)
        self.input_policy = InputPolicy(self.replica_mesh)
        self._parameter_name = parameter_name

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The device that holds the variables, as given (TF: ``('/cpu:0',)``)."""
        return (self._parameter_name,)


class CentralStorageStrategy(MirroredStrategy):
    """Synchronous training with variables on one device (tf.distribute.experimental.CentralStorageStrategy).

    Args:
        compute_devices: the devices the replicas run on (names or ``jax.Device``);
            default: every local GPU/TPU, else every CPU device JAX exposes.
        parameter_device: the device that holds the variables; default: the one
            compute device when there is one, else the first CPU device (TF's rule).

    Raises:
        ValueError: an unknown or duplicate device.
    """

    _extended_cls = CentralStorageExtended

    def __init__(self, compute_devices: Sequence[Any] | None = None, parameter_device: Any = None):
        patches.install_core()
        devices = default_devices() if compute_devices is None else resolve_devices(compute_devices)
        if parameter_device is None:
            parameter = devices[0] if len(devices) == 1 else jax.local_devices(backend="cpu")[0]
            name = _name(parameter)
        else:
            (parameter,) = resolve_devices([parameter_device])
            name = parameter_device if isinstance(parameter_device, str) else _name(parameter)
        self._extended = CentralStorageExtended(self, devices, parameter, name)
        self._cluster_resolver = None
        self._cross_device_ops = None

    def __repr__(self) -> str:
        return super().__repr__().replace(">", f" parameter_device={self._extended.parameter_devices[0]}>", 1)


def _name(device: jax.Device) -> str:
    return f"/job:localhost/replica:0/task:0/device:{device.platform.upper()}:{device.id}"
