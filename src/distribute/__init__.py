"""distribute: TensorFlow's tf.distribute programming model on JAX.

Pick a strategy, build model, optimizer and metrics inside ``strategy.scope()``,
then train with Keras ``model.fit`` or a custom loop
(``experimental_distribute_dataset``, ``run``, ``reduce``).
"""

from distribute._backend import require_jax_backend as _require_jax_backend

_require_jax_backend()

from distribute import data  # noqa: E402
from distribute.input import InputContext, InputOptions, InputReplicationMode  # noqa: E402
from distribute.keras_support.gradients import compute_gradients  # noqa: E402
from distribute.losses import compute_average_loss, scale_regularization_loss  # noqa: E402
from distribute.mirrored import MirroredStrategy, OneDeviceStrategy  # noqa: E402
from distribute.replica import ReplicaContext  # noqa: E402
from distribute.strategy import (  # noqa: E402
    Strategy,
    StrategyExtended,
    ValueContext,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from distribute.values import DistributedValues, Mirrored, PerReplica, ReduceOp  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "DistributedValues",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Mirrored",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "Strategy",
    "StrategyExtended",
    "ValueContext",
    "compute_average_loss",
    "compute_gradients",
    "data",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "scale_regularization_loss",
]
