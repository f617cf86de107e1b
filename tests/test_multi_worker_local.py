"""MultiWorkerMirroredStrategy in one process (no TF_CONFIG: one local worker, as TF), options and exports."""

from __future__ import annotations

import numpy as np
import pytest

import distribute
from distribute.data import Dataset, Options
from distribute.data.options import AutoShardPolicy
from distribute.multi_worker import CommunicationImplementation, CommunicationOptions, MultiWorkerMirroredStrategy


@pytest.fixture(scope="module")
def strategy():
    return MultiWorkerMirroredStrategy()


def test_single_local_worker(strategy, monkeypatch):
    import jax

    assert strategy.num_replicas_in_sync == len(jax.devices())
    assert strategy.extended.should_checkpoint and strategy.extended.should_save_summary
    assert strategy.extended._input_pipelines() == (1, 0)
    assert strategy.cluster_resolver is not None


def test_communication_options():
    assert CommunicationOptions().effective_timeout_seconds == 300
    assert CommunicationOptions(timeout_seconds=5, implementation="ring").implementation is CommunicationImplementation.RING
    with pytest.raises(ValueError, match="timeout_seconds"):
        CommunicationOptions(timeout_seconds=0)
    with pytest.raises(ValueError, match="CommunicationImplementation"):
        CommunicationOptions(implementation="carrier pigeon")
    assert distribute.experimental.CommunicationOptions is CommunicationOptions
    assert distribute.MultiWorkerMirroredStrategy is MultiWorkerMirroredStrategy
    assert distribute.cluster_resolver.TFConfigClusterResolver is distribute.cluster.TFConfigClusterResolver


def test_file_policy_without_files_is_a_clear_error(strategy):
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.FILE
    with pytest.raises(ValueError, match="FILE"):
        strategy.experimental_distribute_dataset(Dataset.range(8).batch(8).with_options(options))


def test_partial_batches_single_worker(strategy):
    n = strategy.num_replicas_in_sync
    seen = []
    for batch in strategy.experimental_distribute_dataset(Dataset.range(2 * n + 3).batch(2 * n)):
        for part in strategy.experimental_local_results(batch):
            seen.extend(np.asarray(part).tolist())
    assert seen == list(range(2 * n + 3))


def test_a_ps_task_is_refused_even_with_one_worker():
    from distribute.cluster import TFConfigClusterResolver

    resolver = TFConfigClusterResolver.from_tf_config(
        '{"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, "task": {"type": "ps", "index": 0}}'
    )
    with pytest.raises(ValueError, match="'ps'"):
        MultiWorkerMirroredStrategy(cluster_resolver=resolver)
