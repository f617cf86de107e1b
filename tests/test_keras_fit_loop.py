"""What distributed fit changes in Keras' per-step loop, and what it keeps.

* the last, partial batch of ``fit`` on arrays is compiled ahead (in a thread,
  while the full steps run) when it splits evenly between the replicas, and the
  results equal one device's;
* ``CallbackList`` skips a batch-end call no callback listens to; every callback
  with a batch hook still gets every step's logs, as from Keras;
* Keras' per-step state on the model (``_jax_state``) is stored untracked.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

from distribute.keras_support import model_methods, trainer
from helpers import mirrored

ROWS, BATCH = 200, 32  # 6 full batches and a partial one of 8 rows (4 per replica on 2)


def _data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=(ROWS,)).astype(np.int32)
    return x, y


def _model(strategy=None):
    def build():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    if strategy is None:
        return build()
    with strategy.scope():
        return build()


class _BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append((batch, dict(logs)))


class _OldStyleBatchEnd(keras.callbacks.Callback):
    """Overrides only on_batch_end (Keras calls it from on_train_batch_end)."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def on_batch_end(self, batch, logs=None):
        self.batches.append(batch)


def _runner(model):
    return [cell.cell_contents for cell in model.train_function.__closure__ if isinstance(cell.cell_contents, trainer._StepRunner)][0]


def test_partial_batch_compiled_ahead_and_results_equal_one_device():
    x, y = _data()
    one = _model()
    expected = one.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    model = _model(mirrored(2))
    got = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5)
    for a, b in zip(model.get_weights(), one.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    runner = _runner(model)
    shapes = {key[1][0][0]: program for key, program in runner.cache.items()}
    # The full step (2 x 16 rows) as jit, the partial one (2 x 4 rows) as the program compiled ahead.
    assert set(shapes) == {(2, 16, 6), (2, 4, 6)}
    assert isinstance(shapes[(2, 4, 6)], jax.stages.Compiled)
    assert not runner.ahead
    assert "_distribute_partial_rows" not in model.__dict__


def test_uneven_partial_batch_is_not_compiled_ahead():
    x, y = _data()
    model = _model(mirrored(3))  # 32 rows do not split over 3: the exact uneven step, as before
    model.fit(x[:199], y[:199], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert not _runner(model).ahead
    assert not any(isinstance(p, jax.stages.Compiled) for p in _runner(model).cache.values())


@pytest.mark.parametrize(
    "args, kwargs, expected",
    [
        ((np.zeros((200, 2)), None), {"batch_size": 32}, 8),
        ((np.zeros((192, 2)), None), {"batch_size": 32}, None),
        ((np.zeros((100, 2)), None), {}, 4),  # Keras' default batch_size 32
        (({"a": np.zeros((200, 2))}, None, 64), {}, 8),
        ((np.zeros((200, 2)), None), {"batch_size": 32, "validation_split": 0.25}, 22),  # floor(150) % 32
        ((np.zeros((200, 2)), None), {"batch_size": 32, "steps_per_epoch": 3}, None),
    ],
)
def test_partial_rows_follow_keras(args, kwargs, expected):
    assert model_methods._partial_rows(args, kwargs) == expected


def test_batch_hooks_get_every_step_as_from_keras():
    x, y = _data()
    plain, dist = _BatchLogs(), _BatchLogs()
    old_plain, old_dist = _OldStyleBatchEnd(), _OldStyleBatchEnd()
    one = _model()
    expected = one.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[plain, old_plain])
    model = _model(mirrored(2))
    got = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[dist, old_dist])
    assert [b for b, _ in dist.logs] == [b for b, _ in plain.logs] == list(range(7)) * 2
    assert old_dist.batches == old_plain.batches == list(range(7)) * 2
    for (_, a), (_, b) in zip(dist.logs, plain.logs):
        assert set(a) == set(b) == {"loss", "accuracy"}
        for name in a:
            assert isinstance(a[name], float)
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5)
    # History gets the epochs' values, with or without batch hooks.
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(got.history[name], expected.history[name], rtol=1e-5)


def test_no_listener_no_batch_end_call():
    calls = []

    class EpochOnly(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            calls.append(("epoch", epoch))

    model = _model(mirrored(2))
    callbacks = keras.callbacks.CallbackList([EpochOnly()], add_history=True, model=model)
    assert not model_methods._listens(callbacks.callbacks, "train")
    assert model_methods._listens([*callbacks.callbacks, _BatchLogs()], "train")
    assert model_methods._listens([_OldStyleBatchEnd()], "train")
    assert not model_methods._listens([_OldStyleBatchEnd()], "test")  # on_batch_end is a train-only alias
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[EpochOnly()])
    assert calls == [("epoch", 0), ("epoch", 1)]


def test_loop_state_is_untracked_only_on_distributed_models():
    model = _model(mirrored(2))
    state = {"trainable_variables": [np.zeros(2)]}
    model._jax_state = state
    assert model.__dict__["_jax_state"] is state  # stored as is (Keras would wrap it in a TrackedDict)
    plain = _model()
    plain._jax_state = state
    assert plain.__dict__["_jax_state"] is not state
    model.extra_layer = keras.layers.Dense(2)  # everything else is tracked as by Keras
    assert id(model.extra_layer) in model._tracker.stored_ids["layers"]
