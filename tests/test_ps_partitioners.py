"""Partitioners and the "div" split: values recorded from TensorFlow 2.21 (/work/tfvenv), no Ray needed."""

from __future__ import annotations

import numpy as np
import pytest

from distribute.experimental import partitioners
from distribute.parameter_server.partitioners import div_split, num_partitions


@pytest.mark.parametrize(
    "partitioner, shape, dtype, expected",
    [
        (partitioners.FixedShardsPartitioner(2), [10, 3], np.float32, [2, 1]),
        (partitioners.FixedShardsPartitioner(5), [3, 3], np.float32, [3, 1]),
        (partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=2), [6, 1], np.float32, [2, 1]),
        (partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=3), [1000, 200], np.float32, [3, 1]),
        (partitioners.MaxSizePartitioner(max_shard_bytes=4), [6, 1], np.float32, [6, 1]),
        (partitioners.MaxSizePartitioner(max_shard_bytes=4, max_shards=2), [6, 1], np.float32, [2, 1]),
        (partitioners.MaxSizePartitioner(max_shard_bytes=1024), [6, 1], np.float32, [1, 1]),
        (partitioners.MaxSizePartitioner(max_shard_bytes=100), [10, 7], np.float64, [10, 1]),
    ],
)
def test_partitioners_match_tf(partitioner, shape, dtype, expected):
    assert partitioner(shape, dtype) == expected


def test_partitioner_argument_errors_are_tfs():
    with pytest.raises(ValueError, match="Argument `min_shard_bytes` must be positive. Received: 0"):
        partitioners.MinSizePartitioner(min_shard_bytes=0)
    with pytest.raises(ValueError, match="Argument `max_shard_bytes` must be positive. Received 0"):
        partitioners.MaxSizePartitioner(max_shard_bytes=0)
    with pytest.raises(ValueError, match="Cannot partition variable along axis 1 when shape is only"):
        partitioners.MinSizePartitioner()([4], np.float32, axis=1)


def test_div_split_is_tfs():
    # TF: 13 rows in 5 shards are [[0,1,2],[3,4,5],[6,7,8],[9,10],[11,12]]; 10 in 4 are 3,3,2,2.
    assert div_split(13, 5) == [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)]
    assert [b - a for a, b in div_split(10, 4)] == [3, 3, 2, 2]


def test_strategy_partition_rules_are_tfs():
    assert num_partitions(partitioners.FixedShardsPartitioner(8), [3, 2], np.float32) == 3  # capped by rows
    assert num_partitions(partitioners.FixedShardsPartitioner(8), [], np.float32) == 1  # scalars never split
    with pytest.raises(ValueError, match="must return a list/tuple whose elements are 1 besides the first element"):
        num_partitions(lambda shape, dtype: [2, 2], [4, 4], np.float32)
    with pytest.raises(ValueError, match=r"\(non-zero\), got: \[0, 1\]"):
        num_partitions(lambda shape, dtype: [0, 1], [4, 4], np.float32)
