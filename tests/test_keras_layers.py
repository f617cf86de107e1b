"""Keras features under a strategy that a plain Dense model does not exercise:
BatchNormalization on padded batches, Dropout randomness per replica, multi-output
models, loading a saved model in scope, and a failed step leaving the model usable."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import distribute
from distribute.data import Dataset
from helpers import mirrored


def test_batch_norm_statistics_leave_padding_out_in_fit():
    # 3 rows over 2 replicas: [1, 3] | [10] (+1 padding row). TF's per-replica
    # BatchNorm averages the replicas' moments: mean (2 + 10) / 2, var (1 + 0) / 2.
    strategy = mirrored(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.BatchNormalization(momentum=0.0), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.fit(np.array([[1.0], [3.0], [10.0]], np.float32), np.zeros((3, 1), np.float32), batch_size=3, epochs=1, shuffle=False, verbose=0)
    bn = model.layers[0]
    np.testing.assert_allclose(bn.moving_mean.numpy(), [6.0], rtol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), [0.5], rtol=1e-4)


def test_batch_norm_normalizes_real_rows_of_a_padded_replica_by_their_own_statistics():
    strategy = mirrored(2)
    with strategy.scope():
        bn = keras.layers.BatchNormalization(center=False, scale=False, epsilon=1e-6)
        bn.build((None, 1))
    dist = strategy.experimental_distribute_dataset(Dataset.from_tensor_slices(np.array([[1.0], [3.0], [10.0], [14.0], [7.0]], np.float32)).batch(5))

    def normalize(x):
        return bn(x, training=True)

    (x,) = list(dist)
    out = [np.asarray(v).ravel() for v in strategy.experimental_local_results(strategy.run(normalize, args=(x,)))]
    # Replica 0 gets [1, 3, 10], replica 1 gets [14, 7]: each normalized by its own rows.
    for rows, got in zip(([1.0, 3.0, 10.0], [14.0, 7.0]), out):
        rows = np.array(rows)
        np.testing.assert_allclose(got, (rows - rows.mean()) / np.sqrt(rows.var() + 1e-6), rtol=1e-4, atol=1e-5)


def test_dropout_masks_differ_between_replicas_and_steps():
    strategy = mirrored(2)
    with strategy.scope():
        dropout = keras.layers.Dropout(0.5, seed=3)
    dist = strategy.experimental_distribute_dataset(Dataset.from_tensor_slices(np.ones((64, 32), np.float32)).batch(64).repeat(2))

    def drop(x):
        return dropout(x, training=True)

    masks = [[np.asarray(v) > 0 for v in strategy.experimental_local_results(strategy.run(drop, args=(x,)))] for x in dist]
    (a0, a1), (b0, b1) = masks
    assert not np.array_equal(a0, a1)  # replicas draw their own masks, as in TF
    assert not np.array_equal(a0, b0)  # and new ones each step
    for mask in (a0, a1, b0, b1):
        assert 0.35 < mask.mean() < 0.65


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_multi_output_model_fit_and_evaluate_equal_one_device(num_replicas):
    rng = np.random.default_rng(0)
    x = rng.random((61, 4)).astype("float32")
    y1, y2 = rng.random((61, 1)).astype("float32"), rng.random((61, 1)).astype("float32")

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = keras.Model(inputs, [keras.layers.Dense(1, name="a")(inputs), keras.layers.Dense(1, name="b")(inputs)])
        model.compile(optimizer="sgd", loss=["mse", "mae"], loss_weights=[1.0, 0.5], metrics=[["mae"], ["mse"]])
        return model

    reference = build()
    initial = reference.get_weights()
    expected_history = reference.fit(x, [y1, y2], batch_size=16, epochs=2, shuffle=False, verbose=0).history
    expected = reference.evaluate(x, [y1, y2], batch_size=16, verbose=0, return_dict=True)
    with mirrored(num_replicas).scope():
        model = build()
    model.set_weights(initial)
    history = model.fit(x, [y1, y2], batch_size=16, epochs=2, shuffle=False, verbose=0).history
    got = model.evaluate(x, [y1, y2], batch_size=16, verbose=0, return_dict=True)
    assert sorted(history) == sorted(expected_history) == ["a_loss", "a_mae", "b_loss", "b_mse", "loss"]
    for key in expected_history:
        np.testing.assert_allclose(history[key], expected_history[key], rtol=1e-5)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_load_model_in_scope_can_resume_training(tmp_path):
    x = np.random.default_rng(0).random((32, 10)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, verbose=0)
    model.save(tmp_path / "m.keras")
    strategy = mirrored(2)
    with strategy.scope():
        loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.optimizer is not None
    assert all(strategy.extended.variable_created_in_scope(v) for v in loaded.weights)
    before = loaded.evaluate(x, y, verbose=0)
    loaded.fit(x, y, epochs=3, verbose=0)
    assert loaded.evaluate(x, y, verbose=0) < before


class _LossFailsToTrace(keras.Sequential):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        raise ValueError("this loss cannot be traced")


def test_a_step_that_fails_to_compile_leaves_the_model_usable():
    strategy = mirrored(2)
    with strategy.scope():
        model = _LossFailsToTrace([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 4), np.float32)
    with pytest.raises(ValueError, match="cannot be traced"):
        model.evaluate(x, np.ones((8, 1), np.float32), verbose=0)
    assert model.predict(x, verbose=0).shape == (8, 1)


def test_default_strategy_runs_a_stateful_custom_step_and_returns_plain_values():
    strategy = distribute.get_strategy()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
    x = np.random.default_rng(0).random((8, 4)).astype("float32")
    y = x[:, :1]

    def step(x, y):
        loss, grads = distribute.compute_gradients(lambda: jnp.mean((model(x) - y) ** 2), model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    first = strategy.run(step, args=(x, y))
    assert isinstance(first, jax.Array) and first.shape == ()
    second = strategy.run(step, args=(x, y))
    assert float(second) < float(first)
    assert float(strategy.reduce("SUM", second, axis=None)) == pytest.approx(float(second))


def test_typed_prng_keys_pass_through_run():
    out = mirrored(2).run(lambda key: jax.random.normal(key, (2,)), args=(jax.random.key(0),))
    parts = mirrored(2).experimental_local_results(out)
    np.testing.assert_allclose(parts[0], jax.random.normal(jax.random.key(0), (2,)))
    np.testing.assert_allclose(parts[0], parts[1])


@pytest.mark.parametrize("num_samples", [36, 37])
def test_activity_regularizer_on_partial_batches_equals_one_device(num_samples):
    rng = np.random.default_rng(0)
    x = rng.random((num_samples, 5)).astype("float32")
    y = rng.random((num_samples, 1)).astype("float32")

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((5,)),
            keras.layers.Dense(4, activity_regularizer=keras.regularizers.L2(0.1), bias_initializer="ones"),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    reference = build()
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    with mirrored(3).scope():
        model = build()
    model.set_weights(initial)
    got = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_fit_accepts_a_distributed_dataset_like_tf_keras():
    strategy = mirrored(2)
    x = np.random.default_rng(0).random((20, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    dataset = Dataset.from_tensor_slices((x, y)).batch(8)
    distributed = strategy.experimental_distribute_dataset(dataset)
    from_distributed = model.evaluate(distributed, verbose=0)
    assert from_distributed == pytest.approx(model.evaluate(x, y, batch_size=8, verbose=0), rel=1e-6)
    from_function = strategy.distribute_datasets_from_function(lambda ctx: dataset)
    with pytest.raises(ValueError, match="distribute_datasets_from_function"):
        model.fit(from_function, verbose=0)


def test_int64_values_beyond_int32_are_refused_not_corrupted():
    strategy = mirrored(2)
    small = list(strategy.experimental_distribute_dataset(Dataset.from_tensor_slices(np.array([1, 2], np.int64)).batch(2)))
    assert [np.asarray(v).tolist() for v in strategy.experimental_local_results(small[0])] == [[1], [2]]
    big = strategy.experimental_distribute_dataset(Dataset.from_tensor_slices(np.array([2**40, 3], np.int64)).batch(2))
    with pytest.raises(ValueError, match="jax_enable_x64"):
        list(big)


def test_steps_per_execution_gives_the_same_training_as_one_step_per_call():
    rng = np.random.default_rng(0)
    x = rng.random((203, 6)).astype("float32")
    y = rng.integers(0, 3, 203)

    def train(steps_per_execution, num_replicas):
        keras.utils.set_random_seed(0)
        with mirrored(num_replicas).scope():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
            model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"], steps_per_execution=steps_per_execution)
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        return history, model.get_weights()

    expected_history, expected_weights = train(1, 2)
    for steps, replicas in ((4, 2), (5, 3)):
        history, weights = train(steps, replicas)
        for key in expected_history:
            np.testing.assert_allclose(history[key], expected_history[key], rtol=1e-5)
        for a, b in zip(weights, expected_weights):
            np.testing.assert_allclose(a, b, atol=1e-6)
