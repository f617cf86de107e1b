"""TPUStrategy: a clear error without a TPU; its logic on CPU devices through the testing hook."""

from __future__ import annotations

import numpy as np
import pytest

import distribute
from distribute.data import Dataset
from distribute.tpu import TPUClusterResolver, TPUStrategy


def test_no_tpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no TPU found"):
        TPUStrategy()
    with pytest.raises(ValueError, match="no TPU found"):
        TPUClusterResolver()


def test_exports():
    assert distribute.TPUStrategy is TPUStrategy
    assert distribute.cluster_resolver.TPUClusterResolver is TPUClusterResolver
    assert distribute.experimental.TPUStrategy is TPUStrategy


def test_for_testing_runs_like_mirrored():
    import jax

    strategy = TPUStrategy._for_testing(jax.devices("cpu")[:2])
    assert strategy.num_replicas_in_sync == 2
    dataset = strategy.experimental_distribute_dataset(Dataset.range(5).batch(4))
    totals = [float(strategy.reduce("SUM", strategy.run(lambda x: x * 2, args=(b,)), axis=0)) for b in dataset]
    assert totals == [12.0, 8.0]
    assert np.asarray(strategy.gather(strategy.run(lambda x: x + 1, args=(next(iter(dataset)),)), axis=0)).tolist() == [1, 2, 3, 4]
