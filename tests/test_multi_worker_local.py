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
    assert strategy.extended.input_policy.input_pipelines() == (1, 0)
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


# -- TF_CONFIG changed after the strategy was created ------------------------------------------


def test_tf_config_change_after_creation_warns_at_the_next_step(monkeypatch, caplog):
    import json
    import logging

    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = MultiWorkerMirroredStrategy()
    def step():
        return strategy.run(lambda: 1.0)

    with caplog.at_level(logging.WARNING, logger="distribute"):
        step()
        assert not [r for r in caplog.records if "TF_CONFIG" in r.getMessage()]
        new = json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 1}})
        monkeypatch.setenv("TF_CONFIG", new)
        step()
        warned = [r.getMessage() for r in caplog.records if "TF_CONFIG" in r.getMessage()]
        assert len(warned) == 1
        # TF 2.21 says nothing here and trains alone; ours names TF_CONFIG and the fix.
        assert "TF_CONFIG was set after MultiWorkerMirroredStrategy was created without it (it is now " + repr(new) in warned[0]
        assert "trains this process alone (1 worker)" in warned[0]
        assert "Set TF_CONFIG before creating the strategy" in warned[0]
        step()
        step()
        assert len([r for r in caplog.records if "TF_CONFIG" in r.getMessage()]) == 1  # once per change
        monkeypatch.delenv("TF_CONFIG")
        step()
        warned = [r.getMessage() for r in caplog.records if "TF_CONFIG" in r.getMessage()]
        assert len(warned) == 2 and "it is now unset" in warned[1]
    assert strategy.num_replicas_in_sync == MultiWorkerMirroredStrategy().num_replicas_in_sync  # unchanged cluster


def test_a_strategy_for_a_cluster_after_one_without_tf_config_names_tf_config():
    """TF 2.21 raises ValueError('Collective ops are already configured.') for the second strategy (the first,
    without TF_CONFIG, configured them for one worker); here JAX's backend already runs, and the error says why."""
    from distribute.cluster import TFConfigClusterResolver

    MultiWorkerMirroredStrategy()  # without TF_CONFIG: this process alone
    resolver = TFConfigClusterResolver.from_tf_config(
        '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}')
    with pytest.raises(RuntimeError, match=r"for worker 0 \(127.0.0.1:1\) of 2 workers \(TF_CONFIG.*without TF_CONFIG \(it trains "
                       r"this process alone\).*Set TF_CONFIG before creating the first strategy"):
        MultiWorkerMirroredStrategy(cluster_resolver=resolver)


def test_tf_config_watch_reads_the_one_environment_module():
    from distribute.cluster import _env

    environ = {"TF_CONFIG": "a"}
    watch = _env.Watch("TF_CONFIG", environ)
    assert not watch.changed() and watch.first == "a"
    environ["TF_CONFIG"] = "b"
    assert watch.changed() and watch.value == "b"
    assert not watch.changed()
    del environ["TF_CONFIG"]
    assert watch.changed() and watch.value is None
