"""distribute.Checkpoint / CheckpointManager: custom-loop checkpoints, restored at other replica counts.

The file is also the worker program of the multi-process test
(``python tests/test_checkpoint.py OUT_DIR``).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve()
LAUNCH_TIMEOUT_SECONDS = 120


# -- shared by the tests and the worker program -------------------------------------------------
def data():
    rng = np.random.default_rng(7)
    return rng.normal(size=(16, 5)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)


def build(strategy, second=None):
    import keras

    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), second or keras.layers.Dense(2)])
        optimizer = keras.optimizers.Adam(0.01)
    return model, optimizer


def train(strategy, model, optimizer, steps):
    import keras

    import distribute
    from distribute.data import Dataset

    x, y = data()
    loss_object = keras.losses.MeanSquaredError(reduction="none")
    dataset = strategy.experimental_distribute_dataset(Dataset.from_tensor_slices((x, y)).batch(16))

    def step(features, labels):
        def loss_fn():
            return distribute.compute_average_loss(loss_object(labels, model(features, training=True)))

        loss, grads = distribute.compute_gradients(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for _ in range(steps):
        for features, labels in dataset:
            strategy.run(step, args=(features, labels))


def values(*objects):
    return [np.asarray(v.value) for obj in objects for v in obj.variables]


# -- single process ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_at_four(tmp_path_factory):
    """3 Adam steps on 4 replicas, saved; then the 4-replica run's next step."""
    from helpers import mirrored

    import distribute

    strategy = mirrored(4)
    model, optimizer = build(strategy)
    train(strategy, model, optimizer, 3)
    manager = distribute.CheckpointManager(distribute.Checkpoint(model=model, optimizer=optimizer),
                                           tmp_path_factory.mktemp("ckpt4"), max_to_keep=2)
    path = manager.save()
    saved = values(model, optimizer)
    train(strategy, model, optimizer, 1)
    return path, saved, values(model)


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_restore_at_other_replica_count_and_continue(saved_at_four, num_replicas):
    from helpers import mirrored

    import distribute

    path, saved, next_step = saved_at_four
    strategy = mirrored(num_replicas)
    model, optimizer = build(strategy)
    assert not optimizer.built
    status = distribute.Checkpoint(model=model, optimizer=optimizer).restore(path)
    assert status.num_variables == len(saved) == 4 + 10  # kernels and biases; iteration, lr, 2 slots per weight
    got = values(model, optimizer)
    assert int(got[4]) == 3  # optimizer iterations
    for a, b in zip(got, saved):
        np.testing.assert_array_equal(a, b)
    for v in model.variables + optimizer.variables:
        assert v._value.sharding.is_equivalent_to(strategy.extended.replica_mesh.replicated_sharding, v._value.ndim)  # a copy per replica
    train(strategy, model, optimizer, 1)
    for a, b in zip(values(model), next_step):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_manager_keeps_max_to_keep_and_restores_latest(tmp_path):
    from helpers import mirrored

    import distribute

    strategy = mirrored(2)
    model, optimizer = build(strategy)
    checkpoint = distribute.Checkpoint(model=model, optimizer=optimizer)
    manager = distribute.CheckpointManager(checkpoint, tmp_path, max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.checkpoints == []
    paths = []
    for _ in range(3):
        train(strategy, model, optimizer, 1)
        paths.append(manager.save())
    assert [os.path.basename(p) for p in paths] == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert manager.checkpoints == paths[1:] and manager.latest_checkpoint == paths[2]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-2", "ckpt-3"]  # no temporary directories left
    assert distribute.latest_checkpoint(tmp_path) == paths[2]
    assert manager.save(checkpoint_number=10).endswith("ckpt-10")
    final = values(model, optimizer)

    # A relaunched job: a fresh manager finds the checkpoints and restores the newest.
    model2, optimizer2 = build(strategy)
    manager2 = distribute.CheckpointManager(distribute.Checkpoint(model=model2, optimizer=optimizer2), tmp_path, max_to_keep=2)
    assert manager2.restore_or_initialize() == str(tmp_path / "ckpt-10")
    for a, b in zip(values(model2, optimizer2), final):
        np.testing.assert_array_equal(a, b)
    assert manager2.save().endswith("ckpt-5")  # TF: the restored save_counter (4) + 1

    calls = []
    empty = distribute.CheckpointManager(checkpoint, tmp_path / "empty", init_fn=lambda: calls.append(1))
    assert empty.restore_or_initialize() is None and calls == [1]


def test_checkpoint_save_write_and_counter(tmp_path):
    from helpers import mirrored

    import distribute

    model, optimizer = build(mirrored(2))
    checkpoint = distribute.Checkpoint(model=model, optimizer=optimizer)
    assert checkpoint.model is model
    assert checkpoint.save(tmp_path / "run") == str(tmp_path / "run-1")
    assert checkpoint.save(tmp_path / "run") == str(tmp_path / "run-2")
    assert checkpoint.write(tmp_path / "exact") == str(tmp_path / "exact")
    restored = distribute.Checkpoint(model=build(mirrored(1))[0])
    with pytest.raises(ValueError, match=r"has no object 'net'.*Checkpoint\(model=..., optimizer=...\)"):
        distribute.Checkpoint(net=model).restore(tmp_path / "run-1")
    fresh = distribute.Checkpoint(model=model, optimizer=optimizer)
    fresh.restore(tmp_path / "run-2")
    assert fresh.save_counter == 2
    restored.restore(str(tmp_path / "exact"))  # only the objects asked for are restored
    for a, b in zip(values(restored.model), values(model)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="at least one object"):
        distribute.Checkpoint()
    with pytest.raises(ValueError, match="holds no Keras variables"):
        distribute.Checkpoint(step=3)
    with pytest.raises(TypeError, match="must be a distribute.Checkpoint"):
        distribute.CheckpointManager(model, tmp_path)
    with pytest.raises(ValueError, match="max_to_keep=0"):
        distribute.CheckpointManager(checkpoint, tmp_path, max_to_keep=0)


def test_missing_path_raises(tmp_path):
    from helpers import mirrored

    import distribute

    model, _ = build(mirrored(2))
    with pytest.raises(ValueError, match=r"no checkpoint at .*nothing.*does not exist"):
        distribute.Checkpoint(model=model).restore(tmp_path / "nothing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "_CHECKPOINT_METADATA").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable distribute checkpoint"):
        distribute.Checkpoint(model=model).restore(tmp_path / "bad")


def test_mismatch_names_the_variable_and_assigns_nothing(tmp_path):
    import keras
    from helpers import mirrored

    import distribute

    strategy = mirrored(2)
    model, optimizer = build(strategy)
    train(strategy, model, optimizer, 1)
    path = distribute.Checkpoint(model=model, optimizer=optimizer).write(tmp_path / "a")

    wider, _ = build(strategy, keras.layers.Dense(3))  # last kernel (4, 3), not (4, 2)
    before = values(wider)
    with pytest.raises(ValueError, match=r"variable '.*dense_\d+/kernel'.*shape \(4, 3\) differs from the saved shape \(4, 2\).*same model architecture"):
        distribute.Checkpoint(model=wider).restore(path)
    for a, b in zip(values(wider), before):  # the first layer matched, and still was not assigned
        np.testing.assert_array_equal(a, b)

    other, _ = build(strategy, keras.layers.LayerNormalization())  # same count, other names
    with pytest.raises(ValueError, match=r"variable '.*layer_normalization\w*/gamma'.*name differs"):
        distribute.Checkpoint(model=other).restore(path)

    extra, _ = build(strategy)
    extra.add(keras.layers.Dense(1))
    with pytest.raises(ValueError, match=r"has 6 variables here but 4 were saved"):
        distribute.Checkpoint(model=extra).restore(path)


def test_write_is_atomic(tmp_path, monkeypatch):
    """A save that dies midway leaves the previous checkpoint whole, and is never listed."""
    import orbax.checkpoint as ocp
    from helpers import mirrored

    import distribute

    model, optimizer = build(mirrored(2))
    manager = distribute.CheckpointManager(distribute.Checkpoint(model=model, optimizer=optimizer), tmp_path)
    first = manager.save()
    manager.wait_until_finished()
    saved = values(model, optimizer)

    real = ocp.StandardCheckpointHandler.async_save

    async def dying(self, directory, *args, **kwargs):
        await real(self, directory, *args, **kwargs)  # the values start to be written, then the disk fills
        raise OSError("disk full")

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", dying)
    with pytest.raises(OSError, match="disk full"):
        manager.save()
        manager.wait_until_finished()
    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", real)
    assert manager.checkpoints == [first] and distribute.latest_checkpoint(tmp_path) == first
    model2, optimizer2 = build(mirrored(2))
    distribute.Checkpoint(model=model2, optimizer=optimizer2).restore(first)
    for a, b in zip(values(model2, optimizer2), saved):
        np.testing.assert_array_equal(a, b)


# -- TF parity and orbax ---------------------------------------------------------------------------
TF = json.loads((HERE.parent / "parity" / "tf_2_21_checkpoint.json").read_text())


def _names(paths):
    return [os.path.basename(p) for p in paths]


def test_manager_numbering_and_max_to_keep_match_tf(tmp_path):
    """tf.train.CheckpointManager's values (checkpoint_management_test), recorded from TF 2.21."""
    import keras

    import distribute

    tf = TF["manager"]
    v = keras.Variable(1.0)
    manager = distribute.CheckpointManager(distribute.Checkpoint(v=v), tmp_path / "d", max_to_keep=2)
    assert manager.latest_checkpoint is tf["latest_before"] is None
    saves = []
    for i in range(3):
        v.assign(float(i + 10))
        saves.append(os.path.basename(manager.save()))
    assert saves == tf["saves"]
    assert _names(manager.checkpoints) == tf["checkpoints"]
    assert os.path.basename(manager.latest_checkpoint) == tf["latest"]
    assert os.path.basename(manager.save(checkpoint_number=10)) == tf["save_number_10"]
    assert _names(manager.checkpoints) == tf["checkpoints_after_10"]
    assert os.path.basename(distribute.latest_checkpoint(tmp_path / "d")) == tf["tf_latest_checkpoint"]

    v2 = keras.Variable(0.0)
    checkpoint2 = distribute.Checkpoint(v=v2)
    manager2 = distribute.CheckpointManager(checkpoint2, tmp_path / "d", max_to_keep=2)
    assert _names(manager2.checkpoints) == tf["fresh_checkpoints"]
    assert os.path.basename(manager2.restore_or_initialize()) == tf["restore_or_initialize"]
    assert float(v2.value) == tf["restored_value"] and checkpoint2.save_counter == tf["restored_save_counter"]
    assert os.path.basename(manager2.save()) == tf["fresh_save"]
    assert os.path.basename(manager2.latest_checkpoint) == tf["fresh_save"]  # newest save, not highest number

    keep_all = distribute.CheckpointManager(distribute.Checkpoint(v=keras.Variable(1.0)), tmp_path / "all", max_to_keep=None)
    assert [os.path.basename(keep_all.save()) for _ in range(4)] == tf["keep_all"]
    assert _names(keep_all.checkpoints) == tf["keep_all_checkpoints"]
    assert distribute.latest_checkpoint(tmp_path / "nothing") is tf["latest_of_missing_dir"] is None
    (tmp_path / "empty").mkdir()
    assert distribute.latest_checkpoint(tmp_path / "empty") is tf["latest_of_empty_dir"] is None


DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint32", "bool"]


def test_every_dtype_round_trips_exactly_and_plain_orbax_reads_it(tmp_path):
    """int64 (TF: value 7, dtype int64, recorded) and every other dtype come back with their declared dtype."""
    import keras
    import orbax.checkpoint as ocp

    import distribute

    def make(seed):
        rng = np.random.default_rng(seed)
        out = {}
        for dtype in DTYPES:
            if dtype == "bool":
                init = rng.integers(0, 2, size=(3,)).astype(bool)
            elif dtype.startswith(("int", "uint")):
                init = rng.integers(0, 100, size=(3,)).astype(dtype)
            else:
                init = rng.normal(size=(3,)).astype(np.float32)
            out[dtype] = keras.Variable(initializer=init, shape=(3,), dtype=dtype, name=dtype)
        out["step"] = keras.Variable(initializer=7 if seed == 0 else 0, shape=(), dtype="int64", name="step")
        out["empty"] = keras.Variable(initializer=np.zeros((0, 2), np.float32), shape=(0, 2), name="empty")
        return out

    saved = make(0)
    path = distribute.Checkpoint(**saved).write(tmp_path / "all")
    restored = make(1)
    distribute.Checkpoint(**restored).restore(path).assert_consumed()
    for key, variable in saved.items():
        assert restored[key].dtype == variable.dtype
        np.testing.assert_array_equal(np.asarray(restored[key].value), np.asarray(variable.value))
    assert int(restored["step"].value) == TF["int64"]["value"] and restored["step"].dtype == TF["int64"]["dtype"]

    plain = ocp.StandardCheckpointer().restore(path)
    assert {key: plain[key][0].dtype.name for key in DTYPES + ["step"]} == {key: key for key in DTYPES} | {"step": "int64"}
    assert plain["empty"] == []  # orbax stores no zero-size arrays; the record has the shape


def test_deferred_restoration_into_an_unbuilt_model(tmp_path, saved_at_four):
    """TF: restore before build; assert_consumed raises AssertionError until the model is built, then the values are there."""
    import keras
    from helpers import mirrored

    import distribute

    assert TF["deferred"]["assert_consumed_before_build"] == "AssertionError" and TF["deferred"]["equal_after_build"]
    path, saved, next_step = saved_at_four
    strategy = mirrored(2)
    with strategy.scope():
        keras.utils.set_random_seed(9)
        model = keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
        optimizer = keras.optimizers.Adam(0.01)
    status = distribute.Checkpoint(model=model, optimizer=optimizer).restore(path)
    with pytest.raises(AssertionError, match=r"\['model', 'optimizer'\] are not restored yet"):
        status.assert_consumed()
    with strategy.scope():
        model.build((None, 5))  # the model's values now, the optimizer's slots when it builds them
    for a, b in zip(values(model), saved[:4]):
        np.testing.assert_array_equal(a, b)
    train(strategy, model, optimizer, 1)
    status.assert_consumed()
    for a, b in zip(values(model), next_step):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("first_call", ["distribute.function", "strategy.run", "eager"])
def test_deferred_restoration_into_a_model_built_by_its_first_call_inside_a_step(tmp_path, saved_at_four, first_call):
    """TF's custom_training tutorial restores into a new model without a strategy and evaluates it in a
    tf.function: the model is built by its first call, inside the traced step. The restored values are
    what the step computes with (they once were lost: the restore's assign was only recorded by the trace)."""
    import keras
    from helpers import mirrored

    import distribute

    path, saved, _ = saved_at_four
    x, _ = data()
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
    distribute.Checkpoint(model=model).restore(path)
    w1, b1, w2, b2 = saved[:4]
    want = np.maximum(x @ w1 + b1, 0) @ w2 + b2
    if first_call == "distribute.function":
        got = distribute.function(lambda inputs: model(inputs))(x)
    elif first_call == "strategy.run":
        strategy = mirrored(1)
        got = strategy.experimental_local_results(strategy.run(lambda inputs: model(inputs), args=(x,)))[0]
    else:
        got = model(x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    for a, b in zip(values(model), saved[:4]):
        np.testing.assert_array_equal(a, b)


def test_save_is_asynchronous_and_bad_schemes_are_refused(tmp_path, monkeypatch):
    """save returns while the bytes are still being written; the commit (rename) happens later, in the background."""
    import threading

    import keras
    from orbax.checkpoint._src.checkpointers import async_checkpointer

    import distribute

    big = keras.Variable(np.ones((256, 1024), np.float32))
    checkpoint = distribute.Checkpoint(big=big)
    release = threading.Event()
    real = async_checkpointer._background_wait_for_commit_futures

    def held(*args, **kwargs):
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(async_checkpointer, "_background_wait_for_commit_futures", held)
    path = checkpoint.write(tmp_path / "a")
    big.assign(big.value * 2)  # training goes on; the checkpoint keeps the value at save time
    assert not os.path.exists(path) and os.listdir(tmp_path) == ["a.orbax-checkpoint-tmp"]
    release.set()
    checkpoint.wait_until_finished()
    assert os.listdir(tmp_path) == ["a"]
    other = keras.Variable(np.zeros((256, 1024), np.float32))
    distribute.Checkpoint(big=other).restore(path)
    np.testing.assert_array_equal(np.asarray(other.value), np.ones((256, 1024), np.float32))

    for bad in ("hdfs://namenode/ckpt", "ftp://host/ckpt"):
        with pytest.raises(ValueError, match=r"scheme '(hdfs|ftp)'.*local path"):
            checkpoint.write(bad)
    with pytest.raises(ValueError, match="scheme 'hdfs'"):
        distribute.CheckpointManager(checkpoint, "hdfs://namenode/ckpt")
    # gs:// works with gcsfs installed; without it (here) the error says so.
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"gs:// file system is not usable.*pip install gcsfs"):
            checkpoint.write("gs://bucket/ckpt")
    assert not (pathlib.Path.cwd() / "hdfs:").exists()


# -- multi-process ------------------------------------------------------------------------------
def _worker(out_dir: str) -> None:
    import shutil

    import distribute
    from distribute.multi_worker import CommunicationOptions

    strategy = distribute.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=30))
    me = strategy.extended.input_policy.input_pipelines()[1]
    model, optimizer = build(strategy)
    train(strategy, model, optimizer, 2)
    # TF's tutorial: the chief writes into the real directory, the others into a temporary one they delete.
    directory = pathlib.Path(out_dir, "ckpt") if strategy.extended.should_checkpoint else pathlib.Path(out_dir, "ckpt", f"workertemp_{me}")
    manager = distribute.CheckpointManager(distribute.Checkpoint(model=model, optimizer=optimizer), directory)
    path = manager.save()
    manager.wait_until_finished()
    temp_existed = directory.is_dir()
    if not strategy.extended.should_checkpoint:
        shutil.rmtree(directory)
    saved = values(model, optimizer)
    latest = distribute.latest_checkpoint(pathlib.Path(out_dir, "ckpt"))
    model2, optimizer2 = build(strategy)
    status = distribute.Checkpoint(model=model2, optimizer=optimizer2).restore(latest)
    status.assert_consumed()
    restored = values(model2, optimizer2)
    out = {"path": path, "latest": latest, "temp_existed": temp_existed,
           "equal": all(np.array_equal(a, b) for a, b in zip(restored, saved)),
           "weights": [w.tolist() for w in saved[:4]], "replicas": strategy.num_replicas_in_sync}
    pathlib.Path(out_dir, f"worker{me}.json").write_text(json.dumps(out))


@pytest.mark.multiprocess
def test_multi_worker_orbax_checkpoint_restored_by_all(tmp_path):
    import orbax.checkpoint as ocp

    from distribute.launch import launch

    env = {"KERAS_BACKEND": "jax", "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    result = launch([str(HERE), str(tmp_path)], 2, 2, env=env, timeout_seconds=LAUNCH_TIMEOUT_SECONDS, echo=False)
    assert result.returncode == 0, result.output[-6000:]
    workers = [json.loads((tmp_path / f"worker{w}.json").read_text()) for w in range(2)]
    expected = str(tmp_path / "ckpt" / "ckpt-1")
    assert [w["replicas"] for w in workers] == [4, 4]
    assert [w["path"] for w in workers] == [expected, expected]  # one checkpoint, the chief's
    assert [w["latest"] for w in workers] == [expected, expected]
    assert [w["temp_existed"] for w in workers] == [True, True]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-1"]  # the non-chief's temporary directory is gone
    assert [w["equal"] for w in workers] == [True, True]
    np.testing.assert_array_equal(np.asarray(workers[0]["weights"][0]), np.asarray(workers[1]["weights"][0]))
    stored = ocp.StandardCheckpointer().restore(expected)  # a user's own orbax code reads it
    assert sorted(stored) == ["model", "optimizer"] and len(stored["model"]) == 4
    np.testing.assert_array_equal(stored["model"][0], np.asarray(workers[0]["weights"][0], np.float32))


if __name__ == "__main__":
    _worker(sys.argv[1])
