"""Checkpoints for custom loops and fit on orbax-checkpoint (tf.train.Checkpoint, CheckpointManager).

``Checkpoint`` groups Keras objects that hold variables under keyword names, as
``tf.train.Checkpoint(model=model, optimizer=optimizer)``; ``CheckpointManager``
keeps the last ``max_to_keep`` of them; ``latest_checkpoint`` finds the newest; ``checkpoints_iterator`` yields each new one as
it appears (a side-car evaluator's loop).
Each checkpoint is a standard orbax checkpoint directory (see ``_storage``),
committed atomically and written asynchronously; restore works at any replica
or worker count.  Variables are matched by object name and position (as TF
matches by object graph); Keras' per-process layer numbering (``dense_1``) is
ignored when names are compared.
"""

from distribute.checkpoint._storage import UnreadableCheckpointError
from distribute.checkpoint.checkpoint import Checkpoint, RestoreStatus
from distribute.checkpoint.iterator import checkpoints_iterator
from distribute.checkpoint.manager import CheckpointManager, latest_checkpoint

__all__ = ["Checkpoint", "CheckpointManager", "RestoreStatus", "UnreadableCheckpointError", "checkpoints_iterator",
           "latest_checkpoint"]
