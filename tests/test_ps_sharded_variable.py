"""ShardedVariable: TF's sharded_variable_test values, and partitioned Keras variables under ParameterServerStrategy.

The first tests build ShardedVariables from shard variables (TF's constructor; no
cluster).  The others use strategies with 3 and 2 ps tasks (one worker each, so
training is in order and equals one device) sharing the session's Ray instance.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import distribute
from distribute.coordinator import ClusterCoordinator
from distribute.data import Dataset

ShardedVariable = distribute.ShardedVariable
FixedShardsPartitioner = distribute.experimental.partitioners.FixedShardsPartitioner


def _shards(*values, dtype="int32"):
    return [keras.Variable(np.asarray(v), dtype=dtype) for v in values]


# -- TF's ShardedVariableTest, built from shards --------------------------------------------------------------------
def test_sharded_variable_simple():
    v0, v1 = _shards([0], [1])
    s = ShardedVariable([v0, v1], name="s")
    assert s.variables[0] is v0 and s.variables[1] is v1
    assert s.shape == (2,) and s.dtype == v0.dtype and s.name == "s"
    assert isinstance(s, ShardedVariable)
    assert list(s) == [v0, v1]  # iterating yields the shards (TF)


def test_assign_assign_add_assign_sub_split_rows_as_tf():
    s = ShardedVariable(_shards([[0, 0]], [[1, 1], [2, 2]], [[3, 3]]))
    assert s.assign([[4, 4], [5, 5], [6, 6], [7, 7]]) is s
    assert [v.numpy().tolist() for v in s.variables] == [[[4, 4]], [[5, 5], [6, 6]], [[7, 7]]]
    s = ShardedVariable(_shards([[0, 0]], [[1, 1], [2, 2]], [[3, 3]]))
    s.assign_add([[1, 1], [1, 1], [2, 2], [2, 2]])
    assert [v.numpy().tolist() for v in s.variables] == [[[1, 1]], [[2, 2], [4, 4]], [[5, 5]]]
    s = ShardedVariable(_shards([[0, 0]], [[1, 1], [2, 2]], [[3, 3]]))
    s.assign_sub([[0, 0], [1, 1], [1, 1], [3, 3]])
    assert [v.numpy().tolist() for v in s.variables] == [[[0, 0]], [[0, 0], [1, 1]], [[0, 0]]]
    with pytest.raises(ValueError, match=r"a value of shape \(3, 2\); it has shape \(4, 2\)"):
        s.assign(np.zeros((3, 2), np.int32))


def test_convert_to_tensor_and_embedding_lookup():
    s = ShardedVariable(_shards([[0, 0]], [[1, 1], [2, 2]], [[3, 3]]))
    assert np.asarray(s).tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]
    assert keras.ops.convert_to_numpy(keras.ops.convert_to_tensor(s)).tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]
    sv = ShardedVariable(_shards([[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]], [[9.0, 10.0]], dtype="float32"))
    looked_up = keras.ops.take(sv, np.array([0, 3, 4]), axis=0)  # TF: embedding_lookup_v2(sv, [0, 3, 4])
    assert keras.ops.convert_to_numpy(looked_up).tolist() == [[1.0, 2.0], [7.0, 8.0], [9.0, 10.0]]
    assert sv[1:3].tolist() == [[3.0, 4.0], [5.0, 6.0]]


def test_validation_errors_are_tfs():
    with pytest.raises(TypeError, match="should be a non-empty list of `variables.Variable`s"):
        ShardedVariable([keras.Variable([0]), "not-a-variable"])
    with pytest.raises(ValueError, match="must have the same dtype"):
        ShardedVariable([keras.Variable([0], dtype="int64"), keras.Variable([1], dtype="int32")])
    with pytest.raises(ValueError, match="the same shapes except for the first axis"):
        ShardedVariable([keras.Variable(np.ones((5, 10))), keras.Variable(np.ones((5, 20)))])


@pytest.mark.parametrize("restore_into", [[[0, 0, 0, 0]], [[0, 0], [0, 0]], [[0]] * 4], ids=["4to1", "4to2", "4to4"])
def test_checkpoint_restores_into_another_shard_count(tmp_path, restore_into):
    # TF test_save_restore_different_partitions / test_save_restore_4_to_2_partitions.
    s = ShardedVariable(_shards([0], [1], [2], [3]), name="s")
    path = distribute.Checkpoint(s=s).write(str(tmp_path / "ckpt"))
    s2 = ShardedVariable(_shards(*restore_into), name="s")
    distribute.Checkpoint(s=s2).restore(path)
    assert np.concatenate([v.numpy() for v in s2.variables]).tolist() == [0, 1, 2, 3]
    s2.assign([5, 10, 15, 20])
    path = distribute.Checkpoint(s=s2).write(str(tmp_path / "ckpt2"))
    distribute.Checkpoint(s=s).restore(path)
    assert [v.numpy().tolist() for v in s.variables] == [[5], [10], [15], [20]]


# -- Partitioned Keras variables under ParameterServerStrategy ------------------------------------------------------
@pytest.fixture(scope="module")
def three_ps(ray_instance):
    strategy = distribute.ParameterServerStrategy(num_workers=1, num_ps=3, variable_partitioner=FixedShardsPartitioner(3))
    yield strategy, ClusterCoordinator(strategy)
    strategy._shutdown()


@pytest.fixture(scope="module")
def two_ps(ray_instance):
    strategy = distribute.ParameterServerStrategy(num_workers=1, num_ps=2, variable_partitioner=FixedShardsPartitioner(2))
    yield strategy, ClusterCoordinator(strategy)
    strategy._shutdown()


def _model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(10, 4), keras.layers.Flatten(),
                             keras.layers.Dense(1)])


def _data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 10, size=(32, 2)).astype(np.int32)
    y = (x[:, :1] * 0.3 - x[:, 1:] * 0.1).astype(np.float32)
    return x, y


def _train(strategy, coordinator, steps):
    x, y = _data()
    with strategy.scope():
        model, optimizer = _model(), keras.optimizers.Adam(0.05)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: Dataset.from_tensor_slices((x, y)).repeat().batch(8)))

    def step(iterator):
        bx, by = next(iterator)
        loss, grads = distribute.compute_gradients(lambda: keras.ops.mean((model(bx) - by) ** 2), model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    return model, optimizer


def _one_device(steps):
    x, y = _data()
    model, optimizer = _model(), keras.optimizers.Adam(0.05)
    for k in range(steps):
        bx, by = x[(k % 4) * 8 : (k % 4) * 8 + 8], y[(k % 4) * 8 : (k % 4) * 8 + 8]
        _, grads = distribute.compute_gradients(lambda: keras.ops.mean((model(bx) - by) ** 2), model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return model


def test_partitioned_embedding_and_dense_are_sharded_variables_and_train_as_one_device(three_ps):
    strategy, coordinator = three_ps
    model, optimizer = _train(strategy, coordinator, 12)
    embeddings, kernel, bias = model.layers[0].embeddings, model.layers[2].kernel, model.layers[2].bias
    for v in (embeddings, kernel):
        assert isinstance(v, ShardedVariable) and isinstance(v, keras.Variable)
    assert not isinstance(bias, ShardedVariable)  # shape (1,): min(3, 1) = 1 shard, a plain ps variable
    assert [s.shape for s in embeddings.variables] == [(4, 4), (3, 4), (3, 4)]  # TF's "div" rows
    assert [s.shape for s in kernel.variables] == [(3, 1), (3, 1), (2, 1)]
    # Round-robin per shard, as TF: the embedding takes 3 ps in turn; the kernel's shards continue the count. The
    # count is the strategy's: it starts where this module's earlier tests (in any order) left it.
    devices = [f"/job:ps/replica:0/task:{j}/device:CPU:0" for j in range(3)]
    first = devices.index(embeddings.variables[0].device)
    devices = devices[first:] + devices[:first]
    assert [s.device for s in embeddings.variables] == devices
    assert [s.device for s in kernel.variables] == devices
    assert bias.device == devices[0]
    assert [s.name for s in embeddings.variables] == [f"{embeddings.name}/part_{i}" for i in range(3)]
    # Slots are sharded like their variable.
    slots = [v for v in optimizer.variables if tuple(v.shape) == (10, 4)]
    assert slots and all([s.device for s in v.variables] == devices for v in slots)
    np.testing.assert_array_equal(np.concatenate([s.numpy() for s in embeddings.variables]), embeddings.numpy())
    for got, want in zip(model.get_weights(), _one_device(12).get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(optimizer.iterations.numpy()) == 12


def test_assign_of_the_full_value_and_of_a_shard_reach_the_ps(three_ps):
    strategy, coordinator = three_ps
    with strategy.scope():
        v = keras.Variable(np.zeros((5, 2), np.float32))
    assert isinstance(v, ShardedVariable) and [s.shape for s in v.variables] == [(2, 2), (2, 2), (1, 2)]
    v.assign(np.arange(10, dtype=np.float32).reshape(5, 2))
    read = coordinator.schedule(lambda: v + 0.0)  # a worker reads the shards from their ps
    np.testing.assert_array_equal(read.fetch(), np.arange(10).reshape(5, 2))
    v.assign_add(np.ones((5, 2), np.float32))
    v.variables[2].assign_sub([[10.0, 10.0]])
    coordinator.join()
    np.testing.assert_array_equal(coordinator.schedule(lambda: v + 0.0).fetch(),
                                  [[1, 2], [3, 4], [5, 6], [7, 8], [-1, 0]])

    def add_rows():
        v.assign_add(np.full((5, 2), 2.0, np.float32))

    for _ in range(3):
        coordinator.schedule(add_rows)
    coordinator.join()
    np.testing.assert_array_equal(v.numpy(), [[7, 8], [9, 10], [11, 12], [13, 14], [5, 6]])
    np.testing.assert_array_equal(v.variables[1].numpy(), [[11, 12], [13, 14]])


def test_checkpoint_of_3_shards_restores_into_2_shards_and_unpartitioned(three_ps, two_ps, tmp_path):
    strategy, coordinator = three_ps
    model, _ = _train(strategy, coordinator, 4)
    saved = model.get_weights()
    path = distribute.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    strategy2, coordinator2 = two_ps
    with strategy2.scope():
        model2 = _model()
    assert [s.shape for s in model2.layers[0].embeddings.variables] == [(5, 4), (5, 4)]
    distribute.Checkpoint(model=model2).restore(path)
    embeddings2 = model2.layers[0].embeddings
    on_ps = coordinator2.schedule(lambda: embeddings2 + 0.0).fetch()  # the ps hold the restored rows
    np.testing.assert_array_equal(on_ps, saved[0])
    for got, want in zip(model2.get_weights(), saved):
        np.testing.assert_array_equal(got, want)
    plain = _model()  # no strategy, no partitioner
    distribute.Checkpoint(model=plain).restore(path)
    for got, want in zip(plain.get_weights(), saved):
        np.testing.assert_array_equal(got, want)


def test_keras_fit_with_a_partitioned_embedding_equals_one_device(three_ps):
    # Model.fit under ParameterServerStrategy with sharded Embedding/Dense variables: one worker, so the
    # updates are in order and fit equals one device's fit on the same batches.
    strategy, _ = three_ps
    x, y = _data()

    def compiled():
        model = _model()
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
        return model

    with strategy.scope():
        model = compiled()
    history = model.fit(x, y, batch_size=8, epochs=2, steps_per_epoch=4, shuffle=False, verbose=0)
    assert isinstance(model.layers[0].embeddings, ShardedVariable)
    reference = compiled()
    want = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-5)
    assert int(model.optimizer.iterations.numpy()) == 8
