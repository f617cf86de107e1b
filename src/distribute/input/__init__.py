"""Distributed input: splitting datasets between replicas and workers."""

from distribute.input.distributed_dataset import DistributedDataset, DistributedIterator, Optional
from distribute.input.input_context import InputContext, InputOptions, InputReplicationMode

__all__ = [
    "DistributedDataset",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Optional",
]
