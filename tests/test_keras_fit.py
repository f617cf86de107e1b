"""Keras fit / evaluate / predict on 2, 3 and 4 replicas equal one device, on data that does not divide."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from distribute.data import Dataset
from helpers import mirrored

N, BATCH, CLASSES = 1001, 64, 3
RTOL = 1e-5


def _data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(N, 8)).astype(np.float32)
    y = (np.argmax(x[:, :3] + 0.3 * rng.normal(size=(N, 3)), axis=1)).astype(np.int32)
    xv = rng.normal(size=(203, 8)).astype(np.float32)
    yv = rng.integers(0, CLASSES, size=(203,)).astype(np.int32)
    return x, y, xv, yv


def _model():
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(CLASSES, activation="softmax")]
    )


def _compile(model):
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )


def _train(model, x, y, xv, yv, dataset_input):
    before = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    if dataset_input:
        history = model.fit(Dataset.from_tensor_slices((x, y)).batch(BATCH), epochs=1, verbose=0, validation_data=(xv, yv))
    else:
        history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, validation_data=(xv, yv))
    after = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return {
        "before": before,
        "predictions": predictions,
        "history": history.history,
        "weights": model.get_weights(),
        "after": after,
    }


@pytest.fixture(scope="module")
def reference():
    x, y, xv, yv = _data()
    model = _model()
    weights = model.get_weights()
    _compile(model)
    return weights, _train(model, x, y, xv, yv, dataset_input=False)


@pytest.mark.parametrize(
    "num_replicas, dataset_input",
    [(2, False), (3, False), (4, False), (2, True), (3, True)],
    ids=["2-arrays", "3-arrays", "4-arrays", "2-dataset", "3-dataset"],
)
def test_fit_evaluate_predict_equal_one_device(num_replicas, dataset_input, reference):
    """fit(validation_data=...) one epoch, evaluate and predict: 1001 rows, batch 64 (last batch 41 rows)."""
    weights, expected = reference
    x, y, xv, yv = _data()
    s = mirrored(num_replicas)
    with s.scope():
        model = _model()
        model.set_weights(weights)
        _compile(model)
    got = _train(model, x, y, xv, yv, dataset_input)

    for key, value in expected["before"].items():
        np.testing.assert_allclose(got["before"][key], value, rtol=RTOL, err_msg=key)
    assert got["predictions"].shape == (N, CLASSES)
    np.testing.assert_allclose(got["predictions"], expected["predictions"], rtol=RTOL, atol=1e-7)
    assert set(got["history"]) == set(expected["history"])
    for key, value in expected["history"].items():
        np.testing.assert_allclose(got["history"][key], value, rtol=RTOL, err_msg=key)
    for g, e in zip(got["weights"], expected["weights"]):
        np.testing.assert_allclose(g, e, rtol=RTOL, atol=1e-5)
    for key, value in expected["after"].items():
        np.testing.assert_allclose(got["after"][key], value, rtol=RTOL, err_msg=key)
    for variable in model.variables:
        shards = [np.asarray(sh.data) for sh in variable._value.addressable_shards]  # its copy per replica
        assert len(shards) == num_replicas
        for shard in shards[1:]:
            np.testing.assert_array_equal(shard, shards[0])


def test_predict_small_input_returns_rows_in_order():
    s = mirrored(4)
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    with s.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
        model.set_weights([np.ones((3, 1), np.float32)])
    got = model.predict(x, batch_size=4, verbose=0)
    np.testing.assert_array_equal(got[:, 0], x.sum(axis=1))


# -- each input signature of the fit step compiles once -------------------------------------------
class _CompileLog(__import__("logging").Handler):
    """Counts JAX's "Compiling ..." log lines (jax_log_compiles) whose argument shapes hold the 7-feature input batch."""

    def __init__(self):
        super().__init__()
        self.by_epoch: list = [0]

    def emit(self, record):
        import re

        message = record.getMessage()
        if message.startswith("Compiling") and re.search(r"float32\[(\d+,)?\d+,7\]", message):
            self.by_epoch[-1] += 1


@pytest.mark.parametrize("num_replicas", [0, 1, 4])
def test_fit_compiles_each_step_signature_once(num_replicas):
    """Plain Keras (0) compiles its train step once over 3 epochs; so must fit at 1 and 4 replicas. At 1 replica
    Keras kept the variables' values uncommitted (one device's arrays fit the 1-device mesh), so the step
    compiled for them, again for its own committed outputs, and again after the metrics' reset (3 in all)."""
    import logging

    import jax

    x = np.random.RandomState(0).rand(64, 7).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    log = _CompileLog()

    class Epochs(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            log.by_epoch.append(0)

    def build():
        model = keras.Sequential([keras.Input((7,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse", metrics=["mae"])
        return model

    if num_replicas:
        with mirrored(num_replicas).scope():
            model = build()
    else:
        model = build()
    logger = logging.getLogger("jax")
    logger.addHandler(log)
    try:
        with jax.log_compiles(True):
            model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[Epochs()])
    finally:
        logger.removeHandler(log)
    assert log.by_epoch == [1, 0, 0, 0]
