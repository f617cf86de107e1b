"""MultiWorkerMirroredStrategy inside Ray Train (``ray.train.v2.jax.JaxTrainer``): the cluster from Ray's worker group.

The resolver's tests run in this process with a stand-in for Ray Train's
context. The JaxTrainer test runs a Keras fit on 2 CPU workers of the suite's
shared Ray instance, kills worker 1 (SIGKILL) in the second epoch, lets Ray
Train restart the worker group (``FailureConfig(max_failures=1)``), and checks
that the new group resumed from BackupAndRestore's backup and ended with the
weights and per-epoch losses of one device on the same global batch.
The file is also imported by the Ray Train workers (``train_loop``).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import threading
import time
import types

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve()
EPOCHS, KILL_EPOCH, KILL_BATCH, BATCH = 3, 1, 2, 8  # zero-based epoch 1 = the second; 5 steps an epoch
FIT_TIMEOUT_SECONDS = 240


# -- shared by the test and the Ray Train workers ---------------------------------------------------
def data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    return x, (x @ rng.normal(size=(5, 2))).astype(np.float32)


def build():
    import keras

    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def train_loop(config: dict) -> None:
    """Ray Train's train_loop_per_worker: the strategy takes its cluster from the worker group."""
    import distribute
    from distribute.multi_worker import CommunicationOptions

    strategy = distribute.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=20))
    import keras
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    out = pathlib.Path(config["out"])
    resolver = strategy.cluster_resolver
    with open(out / f"generations-rank{rank}.txt", "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "resolver": type(resolver).__name__,
                            "coordinator": resolver.cluster_spec().task_address("worker", 0),
                            "replicas": strategy.num_replicas_in_sync, "is_chief": resolver.is_chief}) + "\n")
    with strategy.scope():
        model = build()
    marker = out / "killed"

    class Record(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if rank == 1 and self.epoch == KILL_EPOCH and batch == KILL_BATCH and not marker.exists():
                backup = pathlib.Path(config["backup"], f"backup-{KILL_EPOCH}")  # after epoch 0: committed by a rename
                for _ in range(600):  # the chief's save is asynchronous: kill once it is on disk (a few ms here)
                    if backup.is_dir():
                        break
                    time.sleep(0.05)
                marker.write_text(str(os.getpid()))  # once: the restarted worker 1 trains on
                os.kill(os.getpid(), signal.SIGKILL)

        def on_epoch_end(self, epoch, logs=None):
            weights = [w.tolist() for w in self.model.get_weights()]
            with open(out / f"epochs-rank{rank}.txt", "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "epoch": epoch, "loss": logs["loss"], "weights": weights}) + "\n")

    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[distribute.BackupAndRestore(config["backup"]), Record()])


# -- the resolver, with a stand-in for Ray Train ----------------------------------------------------
class _Context:
    def __init__(self, rank, size, local_size=None):
        self.rank, self.size, self.local_size = rank, size, size if local_size is None else local_size

    def get_world_rank(self):
        return self.rank

    def get_world_size(self):
        return self.size

    def get_local_world_size(self):
        return self.local_size


def test_ray_train_resolver_names_every_worker_from_rank_zeros_address():
    from distribute.cluster import ClusterSpec, RayTrainClusterResolver
    from distribute.runtime.cluster import read_cluster

    shared = []

    def broadcast(data):  # rank 0's value reaches every rank, as ray.train.collective.broadcast_from_rank_zero
        if data is not None:
            shared.append(data)
        return shared[0]

    chief = RayTrainClusterResolver(port=41234, context=_Context(0, 3), broadcast=broadcast)
    other = RayTrainClusterResolver(context=_Context(2, 3), broadcast=broadcast)
    want = ClusterSpec({"worker": ["127.0.0.1:41234", "ray-train-rank-1", "ray-train-rank-2"]})  # one node: loopback
    assert chief.cluster_spec() == want and other.cluster_spec() == want
    assert (chief.task_type, chief.task_id, chief.is_chief) == ("worker", 0, True)
    assert (other.task_type, other.task_id, other.is_chief) == ("worker", 2, False)
    assert other.master() == "grpc://127.0.0.1:41234" and other.master("worker", 0) == "grpc://127.0.0.1:41234"
    cluster = read_cluster(other)
    assert (cluster.num_workers, cluster.worker_id, cluster.coordinator) == (3, 2, "127.0.0.1:41234")
    assert cluster.names[2] == "worker 2 (ray-train-rank-2)"

    shared.clear()  # a group over two nodes: rank 0's node address and a free port there
    spread = RayTrainClusterResolver(context=_Context(0, 4, local_size=2), broadcast=broadcast, node_address=lambda: "127.0.0.1")
    host, port = spread.cluster_spec().task_address("worker", 0).rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    alone = RayTrainClusterResolver(context=_Context(0, 1), broadcast=broadcast)  # a group of one: no cluster
    assert not alone.cluster_spec() and alone.master() == "" and read_cluster(alone).num_workers == 1

    with pytest.raises(ValueError, match=r"port=70000 is not a TCP port; give one in 1-65535"):
        RayTrainClusterResolver(port=70000, context=_Context(0, 2), broadcast=broadcast)
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 received None as the coordinator address.*same point"):
        RayTrainClusterResolver(context=_Context(1, 2), broadcast=lambda data: None)


def test_strategy_finds_the_ray_train_group_by_itself(monkeypatch):
    import distribute.cluster.ray_train as ray_train
    from distribute.cluster.detect import default_resolver

    assert not ray_train.in_ray_train_worker()  # the test process runs no training function
    utils = types.ModuleType(ray_train._TRAIN_FN_UTILS)
    utils._train_fn_utils = object()  # what Ray Train v2 sets up in each of its workers
    monkeypatch.setitem(sys.modules, ray_train._TRAIN_FN_UTILS, utils)
    monkeypatch.setattr(ray_train, "_ray_train_context", lambda: _Context(1, 2))
    monkeypatch.setattr(ray_train, "_broadcast_from_rank_zero", lambda data: "127.0.0.1:5555")
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 0}}))
    resolver = default_resolver()  # Ray Train's group first: its workers all inherit one TF_CONFIG
    assert isinstance(resolver, ray_train.RayTrainClusterResolver)
    assert (resolver.task_id, resolver.master()) == (1, "grpc://127.0.0.1:5555")
    monkeypatch.setattr(utils, "_train_fn_utils", None)  # Ray imported, but no training function here
    assert type(default_resolver()).__name__ == "TFConfigClusterResolver"

    v1 = types.ModuleType(ray_train._V1_SESSION)  # a worker of a Ray Train v1 job (RAY_TRAIN_V2_ENABLED=0)
    v1._session = types.SimpleNamespace(world_size=2)
    monkeypatch.setitem(sys.modules, ray_train._V1_SESSION, v1)
    with pytest.raises(NotImplementedError, match=r"Ray Train v1 job of 2 workers.*Ray Train v2.*or give the strategy a cluster_resolver"):
        default_resolver()
    v1._session.world_size = 1  # a Ray Tune trial: one worker, the strategy trains alone as TF does without TF_CONFIG
    assert type(default_resolver()).__name__ == "TFConfigClusterResolver"


def test_ray_train_resolver_outside_a_training_function_says_where_to_build_it():
    from distribute.cluster import RayTrainClusterResolver

    with pytest.raises(RuntimeError, match=r"inside a Ray Train training function \(train_loop_per_worker"):
        RayTrainClusterResolver()


# -- Ray Train ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_device():
    """Weights and loss after each epoch on one device, same global batch (what the 2 workers must compute)."""
    import keras

    model, x, y = build(), *data()
    per_epoch = []
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: per_epoch.append(
        (logs["loss"], [np.asarray(w) for w in model.get_weights()])))
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[record])
    return per_epoch


def _lines(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.multiprocess
@pytest.mark.xdist_group("ray")
def test_jax_trainer_fit_survives_a_killed_worker_with_one_devices_weights(ray_instance, tmp_path, one_device):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.jax import JaxTrainer

    out = tmp_path / "out"
    out.mkdir()
    path = os.pathsep.join([str(HERE.parents[1] / "src"), str(HERE.parent)])  # distribute, and this file for train_loop
    trainer = JaxTrainer(
        train_loop, train_loop_config={"out": str(out), "backup": str(tmp_path / "backup")},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(name="distribute-test", storage_path=str(tmp_path / "ray_results"),
                             failure_config=FailureConfig(max_failures=1),
                             worker_runtime_env={"env_vars": {"PYTHONPATH": path, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu",
                                                              "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}}))
    result: dict = {}
    fit = threading.Thread(target=lambda: result.update(value=trainer.fit()), daemon=True)
    fit.start()
    fit.join(FIT_TIMEOUT_SECONDS)
    assert not fit.is_alive(), f"JaxTrainer.fit did not end within {FIT_TIMEOUT_SECONDS} s"
    assert result["value"].error is None, result["value"].error

    assert not (tmp_path / "backup").exists()  # BackupAndRestore removes its backups when fit ends
    killed = int((out / "killed").read_text())
    for rank in range(2):
        generations = _lines(out / f"generations-rank{rank}.txt")
        assert len(generations) == 2  # the worker group, then the one Ray Train restarted after the kill
        assert {g["resolver"] for g in generations} == {"RayTrainClusterResolver"}  # found by MultiWorkerMirroredStrategy()
        assert [g["replicas"] for g in generations] == [2, 2] and [g["is_chief"] for g in generations] == [rank == 0] * 2
        first, second = (g["coordinator"] for g in generations)
        assert first.startswith("127.0.0.1:") and second.startswith("127.0.0.1:")
        epochs = _lines(out / f"epochs-rank{rank}.txt")
        # Generation 1 finished epoch 0 (backed up) and died in epoch 1; generation 2 resumed at epoch 1.
        assert [(e["pid"] == generations[0]["pid"], e["epoch"]) for e in epochs] == [(True, 0), (False, 1), (False, 2)]
        if rank == 1:
            assert generations[0]["pid"] == killed
        for e, (loss, weights) in zip(epochs, one_device):
            np.testing.assert_allclose(e["loss"], loss, rtol=1e-5)
            for got, want in zip(e["weights"], weights):
                np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-5, atol=1e-6)
