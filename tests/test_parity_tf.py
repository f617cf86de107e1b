"""Parity with recorded TensorFlow 2.21 training runs: a custom loop and Keras fit (tests/parity/tf_2_21.json)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import distribute
from distribute.data import Dataset
from helpers import build_fixture_model, keras_inputs, mirrored, tf_fixture

KERAS_FIT = tf_fixture()["keras_fit"]
CUSTOM_LOOP = tf_fixture()["custom_loop"]


def _strategy(kind):
    if kind == "no_strategy":
        return None
    if kind == "one_device":
        return distribute.OneDeviceStrategy("/cpu:0")
    return mirrored(int(kind.split("_")[1]))


@pytest.mark.parametrize("kind", ["mirrored_2", "mirrored_1"])
def test_custom_loop_matches_tf(kind):
    expected = CUSTOM_LOOP[f"sgd_0.1_{kind}"]
    x, y, _ = keras_inputs()
    s = _strategy(kind)
    with s.scope():
        model = build_fixture_model()
        optimizer = keras.optimizers.SGD(0.1)
        loss_object = keras.losses.MeanSquaredError(reduction="none")

    def step(xb, yb):
        loss, grads = distribute.compute_gradients(
            lambda: distribute.compute_average_loss(loss_object(yb, model(xb, training=True)), global_batch_size=16),
            model.trainable_variables,
        )
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses, per_replica = [], []
    for xb, yb in s.experimental_distribute_dataset(Dataset.from_tensor_slices((x, y)).batch(16)):
        out = s.run(step, args=(xb, yb))
        losses.append(float(s.reduce("SUM", out, axis=None)))
        per_replica.append([float(v) for v in s.experimental_local_results(out)])
    np.testing.assert_allclose(losses, expected["step_losses"], rtol=1e-5)
    np.testing.assert_allclose(per_replica, expected["per_replica_step_losses"], rtol=1e-5)
    for got, want in zip(model.get_weights(), expected["final_weights"]):
        np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=1e-5, atol=1e-6)


KERAS_CASES = [k for k in KERAS_FIT if k != "inputs"]


@pytest.mark.parametrize("case", KERAS_CASES)
def test_keras_fit_matches_tf(case):
    expected = KERAS_FIT[case]
    opt_name, kind = case.split("_", 2)[0] + "_" + case.split("_", 2)[1], case.split("_", 2)[2]
    x, y, _ = keras_inputs()
    s = _strategy(kind)
    scope = s.scope() if s is not None else _null()
    with scope:
        model = build_fixture_model()
        optimizer = keras.optimizers.SGD(0.1) if opt_name == "sgd_0.1" else keras.optimizers.Adam(0.01)
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    predictions = model.predict(x[:5], verbose=0)

    assert (s.num_replicas_in_sync if s is not None else 1) == expected["num_replicas_in_sync"]
    assert set(history.history) == set(expected["history"])
    for key, values in expected["history"].items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5, err_msg=key)
    for got, want in zip(model.get_weights(), expected["final_weights"]):
        np.testing.assert_allclose(got, np.asarray(want, np.float32), rtol=1e-5, atol=1e-6)
    assert set(evaluation) == set(expected["evaluate"])
    for key, value in expected["evaluate"].items():
        np.testing.assert_allclose(evaluation[key], value, rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(predictions, np.asarray(expected["predict_first5"], np.float32), rtol=1e-5, atol=1e-6)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *args):
        return False
