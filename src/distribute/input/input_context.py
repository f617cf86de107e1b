"""InputContext, InputOptions and InputReplicationMode (tf.distribute names)."""

from __future__ import annotations

import dataclasses
import enum


class InputReplicationMode(enum.Enum):
    """How ``distribute_datasets_from_function`` builds input pipelines (TF: same name).

    ``PER_WORKER``: one pipeline per worker, its elements dealt to the worker's
    replicas in turn.  ``PER_REPLICA``: one pipeline per replica.
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Options for distributed input (tf.distribute.InputOptions).

    Args:
        experimental_fetch_to_device: place batches on the replicas' devices
            (always done here; ``False`` is accepted and changes nothing).
        experimental_replication_mode: see :class:`InputReplicationMode`.
        experimental_place_dataset_on_device: accepted for compatibility.
        experimental_per_replica_buffer_size: how many batches are prepared ahead
            of the step that consumes them (default 1).
    """

    experimental_fetch_to_device: bool | None = None
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.experimental_replication_mode, InputReplicationMode):
            raise ValueError(
                f"experimental_replication_mode={self.experimental_replication_mode!r} is not an "
                "InputReplicationMode; use InputReplicationMode.PER_WORKER or PER_REPLICA."
            )
        if self.experimental_per_replica_buffer_size < 0:
            raise ValueError(
                f"experimental_per_replica_buffer_size={self.experimental_per_replica_buffer_size} "
                "must be >= 0."
            )


class InputContext:
    """What an input function needs to know to build its share of the input (TF: same name).

    Args:
        num_input_pipelines: pipelines in the job (one per worker by default).
        input_pipeline_id: this pipeline's index in ``[0, num_input_pipelines)``.
        num_replicas_in_sync: replicas taking part in each step.
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1):
        if not 0 <= input_pipeline_id < max(num_input_pipelines, 1):
            raise ValueError(
                f"input_pipeline_id={input_pipeline_id} must be in [0, num_input_pipelines="
                f"{num_input_pipelines})."
            )
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_input_pipelines(self) -> int:
        """Input pipelines in the job (one per worker by default)."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """This pipeline's index, in ``[0, num_input_pipelines)``."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas taking part in each step, across all workers."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size // num_replicas_in_sync``.

        Raises:
            ValueError: the global batch size is not divisible by the number of
                replicas (TF's message says the same).
        """
        if global_batch_size % self._num_replicas_in_sync != 0:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size} is not divisible by "
                f"`num_replicas_in_sync` {self._num_replicas_in_sync}; choose a global batch "
                f"size that is a multiple of {self._num_replicas_in_sync}."
            )
        return global_batch_size // self._num_replicas_in_sync

    def __str__(self) -> str:
        """TF's text: ``tf.distribute.InputContext(input pipeline id 1, total: 2)``."""
        return f"tf.distribute.InputContext(input pipeline id {self._input_pipeline_id}, total: {self._num_input_pipelines})"

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )
