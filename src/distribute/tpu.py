"""TPUStrategy and TPUClusterResolver: the mirrored mechanism over TPU devices.

On a TPU host JAX lists the TPU cores as devices; TPUStrategy is a mesh with one
axis, ``"replica"``, over them, exactly as MirroredStrategy over GPUs.  On a
multi-host TPU slice, each host is one worker of the same program: JAX's TPU
runtime finds the slice itself (``jax.distributed.initialize()`` without
arguments), and the mesh spans every host's cores.

Testing hook: ``TPUStrategy._for_testing(devices)`` builds the strategy over any
devices (CPU devices in the test suite), skipping the TPU check, so its logic
runs without a TPU.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from distribute.cluster import ClusterResolver, ClusterSpec
from distribute.keras_support import patches
from distribute.mesh_strategy import MeshStrategy
from distribute.sharding import Sharding


def _tpu_devices() -> list[jax.Device]:
    try:
        return list(jax.devices("tpu"))
    except RuntimeError:
        return []


def _no_tpu_error(what: str) -> ValueError:
    try:
        platforms = sorted({d.platform for d in jax.devices()})
    except RuntimeError:  # pragma: no cover
        platforms = []
    return ValueError(
        f"{what}: no TPU found; JAX sees only {', '.join(platforms) or 'no'} devices. Run on a TPU VM "
        "(with jax[tpu] installed), or use MirroredStrategy on this machine."
    )


class TPUClusterResolver(ClusterResolver):
    """The TPU cluster this process belongs to (tf.distribute.cluster_resolver.TPUClusterResolver).

    Args:
        tpu: accepted for compatibility: ``None``, ``""`` or ``"local"`` mean
            this host's TPU; JAX's runtime discovers the slice itself.
        zone: accepted for compatibility.
        project: accepted for compatibility.

    Raises:
        ValueError: no TPU devices are visible to JAX.
    """

    def __init__(self, tpu: str | None = None, zone: str | None = None, project: str | None = None, **kwargs: Any):
        self._tpu = tpu
        self._devices = _tpu_devices()
        if not self._devices:
            raise _no_tpu_error("TPUClusterResolver")
        self._task_type, self._task_id, self._rpc_layer = "worker", jax.process_index(), None

    def cluster_spec(self) -> ClusterSpec:
        """One 'worker' task per TPU host (addresses are not needed: JAX's runtime connects them)."""
        return ClusterSpec({"worker": [f"tpu-host-{i}" for i in range(jax.process_count())]})

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        return ""

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None) -> dict:
        return {"TPU": len(jax.local_devices(backend="tpu"))}

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return tuple(self._devices)


class TPUStrategy(MeshStrategy):
    """Synchronous training on TPU cores (tf.distribute.TPUStrategy).

    Args:
        tpu_cluster_resolver: a :class:`TPUClusterResolver`; default: this host's TPU.
        experimental_device_assignment, experimental_spmd_xla_partitioning:
            accepted for compatibility (one replica per core).
        sharding: training state split over the cores
            (``distribute.experimental.Sharding``; see :class:`~distribute.MirroredStrategy`).

    Raises:
        ValueError: there is no TPU (the message says what JAX sees); an unknown ``sharding``.
    """

    def __init__(self, tpu_cluster_resolver: TPUClusterResolver | None = None, experimental_device_assignment: Any = None,
                 experimental_spmd_xla_partitioning: bool = False, *, sharding: Any = None):
        sharding = Sharding.from_value(sharding)
        resolver = tpu_cluster_resolver if tpu_cluster_resolver is not None else TPUClusterResolver()
        self._init(list(resolver.devices), resolver, sharding)

    @classmethod
    def _for_testing(cls, devices: Sequence[jax.Device], sharding: Any = None) -> "TPUStrategy":
        """Testing hook: a TPUStrategy over ``devices`` (e.g. CPU devices), without the TPU check."""
        self = cls.__new__(cls)
        self._init(list(devices), None, Sharding.from_value(sharding))
        return self

    def _init(self, devices: list[jax.Device], resolver: Any, sharding: Any = None) -> None:
        patches.install_core()
        devices = sorted(devices, key=lambda d: (d.process_index, d.id))
        MeshStrategy.__init__(self, devices, sharding=sharding)
        self._cluster_resolver = resolver

    def experimental_assign_to_logical_device(self, tensor: Any, logical_device_id: int) -> Any:
        """Model parallelism is not supported: every replica holds the whole model."""
        raise NotImplementedError("TPUStrategy here is data parallel only; experimental_assign_to_logical_device is not supported.")
