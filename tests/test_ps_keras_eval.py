"""Keras evaluate / predict, validation in fit, steps_per_execution and optimizer guards under ParameterServerStrategy.

One worker applies updates in order, so every value equals one device's Keras
(rtol 1e-5): evaluate's loss and metrics, predict's rows (in order), fit's
``val_`` logs, and fit with ``steps_per_execution=K`` (K steps per scheduled
closure) gives the weights of K=1.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import distribute
from distribute.coordinator import ClusterCoordinator
from distribute.data import Dataset

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def strategy(ray_instance):
    ps = distribute.ParameterServerStrategy(num_workers=1, num_ps=2)
    yield ps
    ps._shutdown()


def _data(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.7).astype(np.float32)
    w = rng.uniform(0.5, 2.0, size=(n,)).astype(np.float32)
    return x, y, w


def _compiled(optimizer=None, steps_per_execution=1):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    return model


def _close(got, want):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_evaluate_and_predict_equal_one_device(strategy):
    x, y, w = _data()
    with strategy.scope():
        model = _compiled(steps_per_execution=2)
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=5, verbose=0)
    reference = _compiled()
    reference.set_weights(model.get_weights())
    # numpy with a partial last batch (64 = 6 * 10 + 4) and sample weights; list and dict results.
    want = reference.evaluate(x, y, sample_weight=w, batch_size=10, verbose=0)
    np.testing.assert_allclose(model.evaluate(x, y, sample_weight=w, batch_size=10, verbose=0), want, rtol=1e-5)
    got = model.evaluate(x, y, sample_weight=w, batch_size=10, verbose=0, return_dict=True)
    assert sorted(got) == ["loss", "mae"]
    np.testing.assert_allclose([got["loss"], got["mae"]], want, rtol=1e-5)
    # steps limits the batches, as one device's evaluate.
    np.testing.assert_allclose(model.evaluate(x, y, sample_weight=w, batch_size=10, steps=3, verbose=0),
                               reference.evaluate(x, y, sample_weight=w, batch_size=10, steps=3, verbose=0), rtol=1e-5)
    # A finite Dataset of (x, y, sample_weight), read in order.
    dataset = Dataset.from_tensor_slices((x, y, w)).batch(16)
    np.testing.assert_allclose(model.evaluate(dataset, verbose=0),
                               reference.evaluate(x, y, sample_weight=w, batch_size=16, verbose=0), rtol=1e-5)
    # predict: every row, in order (7 batches, the last partial, 2 per scheduled closure).
    got = model.predict(x, batch_size=10, verbose=0)
    assert got.shape == (64, 1)
    np.testing.assert_allclose(got, reference.predict(x, batch_size=10, verbose=0), rtol=1e-5, atol=1e-6)
    got = model.predict(Dataset.from_tensor_slices(x).batch(16), verbose=0)
    np.testing.assert_allclose(got, reference.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    # Evaluation does not train: the weights and step count are unchanged.
    _close(model.get_weights(), reference.get_weights())
    assert int(model.optimizer.iterations.numpy()) == 5


def test_evaluate_and_predict_rules_are_tfs(strategy):
    x, y, _ = _data()
    with strategy.scope():
        model = _compiled()
    creator = distribute.DatasetCreator(lambda ctx: Dataset.from_tensor_slices((x, y)).repeat().batch(8))
    tf_message = "`steps_per_epoch`, `validation_steps`, `steps`, or `pss_evaluation_shards` argument must be provided"
    with pytest.raises(ValueError, match=tf_message):
        model.evaluate(creator, verbose=0)
    with pytest.raises(ValueError, match=tf_message):
        model.predict(creator, verbose=0)
    with pytest.raises(ValueError, match="infinite Dataset .* Pass steps="):
        model.evaluate(Dataset.from_tensor_slices((x, y)).repeat().batch(8), verbose=0)
    with pytest.raises(ValueError, match="Arguments not recognized"):
        model.evaluate(x, y, verbose=0, bogus=1)
    model.run_eagerly = True
    with pytest.raises(ValueError, match="`run_eagerly` is not supported"):
        model.evaluate(x, y, verbose=0)
    with pytest.raises(ValueError, match="`run_eagerly` is not supported"):
        model.predict(x, verbose=0)
    model.run_eagerly = False
    reference = _compiled()
    reference.set_weights(model.get_weights())
    # A DatasetCreator: the worker iterates its own copy for `steps` batches (TF), from the start here. The
    # compiled metrics are not built yet: TF builds them from the first batch, here from the workers' element spec.
    assert not model._compile_metrics.built
    got = model.evaluate(creator, steps=4, verbose=0)
    np.testing.assert_allclose(got, reference.evaluate(x[:32], y[:32], batch_size=8, verbose=0), rtol=1e-5)
    # predict builds a DatasetCreator's dataset on the coordinator (TF's predict runs there): rows in order.
    creator_x = distribute.DatasetCreator(lambda ctx: Dataset.from_tensor_slices(x).repeat().batch(8))
    np.testing.assert_allclose(model.predict(creator_x, steps=3, verbose=0), reference.predict(x[:24], verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_fit_validation_logs_equal_one_device(strategy):
    x, y, _ = _data()
    x_val, y_val = x[:21] * 0.5, y[:21]
    with strategy.scope():
        model = _compiled()
    history = model.fit(x, y, batch_size=8, epochs=4, steps_per_epoch=8, shuffle=False, verbose=0,
                        validation_data=(x_val, y_val), validation_batch_size=5, validation_freq=[1, 3, 4])
    reference = _compiled()
    want = reference.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
                         validation_data=(x_val, y_val), validation_batch_size=5, validation_freq=[1, 3, 4])
    assert sorted(history.history) == sorted(want.history) == ["loss", "mae", "val_loss", "val_mae"]
    for key in want.history:
        np.testing.assert_allclose(history.history[key], want.history[key], rtol=1e-5)
    assert len(history.history["val_loss"]) == 3  # epochs 1, 3 and 4
    _close(model.get_weights(), reference.get_weights())

    # validation_split takes the last rows (Keras); validation_steps batches from the first one each time (Keras 3).
    with strategy.scope():
        model = _compiled()
    history = model.fit(x, y, batch_size=8, epochs=3, steps_per_epoch=7, shuffle=False, verbose=0,
                        validation_split=0.125, validation_steps=1, validation_batch_size=3)
    reference = _compiled()
    want = reference.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                         validation_split=0.125, validation_steps=1, validation_batch_size=3)
    for key in ("loss", "val_loss", "val_mae"):
        np.testing.assert_allclose(history.history[key], want.history[key], rtol=1e-5)


def test_fit_validation_from_a_dataset_creator_continues_its_iterator(strategy):
    # tf-keras keeps the eval data handler of a DatasetCreator across epochs: epoch 1 validates on the worker's
    # batches 0-1, epoch 2 on batches 2-3 (its iterator goes on).
    x, y, _ = _data()
    creator = distribute.DatasetCreator(lambda ctx: Dataset.from_tensor_slices((x, y)).repeat().batch(8))
    weights = []

    class Weights(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            weights.append(self.model.get_weights())

    with strategy.scope():
        model = _compiled()
    with pytest.raises(ValueError, match="`steps_per_epoch`, `validation_steps`, `steps`, or `pss_evaluation_shards`"):
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0, validation_data=creator)
    history = model.fit(x, y, batch_size=8, epochs=2, steps_per_epoch=3, shuffle=False, verbose=0,
                        validation_data=creator, validation_steps=2, callbacks=[Weights()])
    reference = _compiled()
    for epoch, rows in ((0, slice(0, 16)), (1, slice(16, 32))):
        reference.set_weights(weights[epoch])
        want = reference.evaluate(x[rows], y[rows], batch_size=8, verbose=0)
        np.testing.assert_allclose([history.history["val_loss"][epoch], history.history["val_mae"][epoch]], want,
                                   rtol=1e-5)


def test_steps_per_execution_packs_steps_into_one_closure(strategy, monkeypatch):
    x, y, _ = _data()
    scheduled = []
    schedule = ClusterCoordinator.schedule
    monkeypatch.setattr(ClusterCoordinator, "schedule", lambda self, fn, args=None, kwargs=None: (
        scheduled.append(fn), schedule(self, fn, args, kwargs))[1])
    results = {}
    for per_execution in (1, 4):
        with strategy.scope():
            model = _compiled(keras.optimizers.Adam(0.05, clipnorm=1.0), steps_per_execution=per_execution)
        scheduled.clear()
        history = model.fit(x, y, batch_size=8, epochs=2, steps_per_epoch=10, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 20
        results[per_execution] = (model.get_weights(), history.history, len(scheduled))
    # 10 steps an epoch, 4 to a closure: 4 + 4 + 2, so 3 closures (3 round trips) an epoch instead of 10.
    assert results[1][2] == 20 and results[4][2] == 6
    _close(results[4][0], results[1][0])
    np.testing.assert_allclose(results[4][1]["loss"], results[1][1]["loss"], rtol=1e-5)
    # The worker's pipeline repeats the 8 batches: epoch 1 takes batches 0..7, 0, 1 and epoch 2 takes 2..7, 0..3;
    # one device fitting those 20 batches in that order gives the same weights.
    one_device = _compiled(keras.optimizers.Adam(0.05, clipnorm=1.0))
    order = [i % 8 for i in range(20)]
    xs = np.concatenate([x[8 * i : 8 * i + 8] for i in order])
    ys = np.concatenate([y[8 * i : 8 * i + 8] for i in order])
    one_device.fit(xs, ys, batch_size=8, epochs=1, shuffle=False, verbose=0)
    _close(results[4][0], one_device.get_weights())


class _Wrapper(keras.optimizers.SGD):
    """A MultiOptimizer-like wrapper: routes the update to another optimizer."""

    def __init__(self):
        super().__init__(0.1)
        self.inner = keras.optimizers.SGD(0.1)

    def apply(self, grads, trainable_variables=None):
        return self.inner.apply(grads, trainable_variables)


@pytest.mark.parametrize("make, name, fix", [
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), "LossScaleOptimizer", "loss_scale_factor="),
    (lambda: keras.optimizers.MultiOptimizer(lambda v: keras.optimizers.SGD(0.1)), "MultiOptimizer", "Use one Keras"),
    (_Wrapper, "_Wrapper", "Use one Keras optimizer"),
    (lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), "SGD", "Drop gradient_accumulation_steps"),
])
def test_optimizers_the_ps_cannot_apply_raise(strategy, make, name, fix):
    x, y, _ = _data()
    with strategy.scope():
        model = _compiled(make())
    with pytest.raises(NotImplementedError, match=rf"optimizer '{name}'.*{fix}"):
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)
    assert int(np.asarray(model.optimizer._iterations)) == 0
    # A custom loop hits the same check when the step is first traced (at schedule).
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        model.build((None, 4))

    def step(xb, yb):
        loss, grads = distribute.compute_gradients(lambda: model.compute_loss(x=xb, y=yb, y_pred=model(xb)),
                                                   model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    with pytest.raises(NotImplementedError, match=rf"optimizer '{name}'"):
        coordinator.schedule(step, args=(x[:8], y[:8]))


def test_loss_scale_factor_is_unscaled_as_one_device(strategy):
    x, y, _ = _data()
    with strategy.scope():
        model = _compiled(keras.optimizers.SGD(0.05, loss_scale_factor=128.0))
    history = model.fit(x, y, batch_size=8, epochs=2, steps_per_epoch=8, shuffle=False, verbose=0)
    reference = _compiled(keras.optimizers.SGD(0.05, loss_scale_factor=128.0))
    want = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    _close(model.get_weights(), reference.get_weights())
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-5)


def test_predict_calls_tfs_batch_hooks_per_scheduled_closure(strategy):
    """tf-keras' predict loop: on_predict_batch_begin(step), on_predict_batch_end(step + increment, {"outputs": ...}).

    45 rows in batches of 10 (the 5th partial), 3 steps per execution: TF's
    DataHandler runs steps 0-2 and 3-4 (the partial batch inside the last
    execution), and the end hook's ``outputs`` are that execution's rows.  A
    callback with predict batch hooks is accepted (TF's predict runs outside the
    PS scope, so its CallbackList does not refuse it).
    """
    x, _, _ = _data(45)
    with strategy.scope():
        model = _compiled(steps_per_execution=3)
    calls = []

    class Hooks(keras.callbacks.Callback):
        def on_predict_batch_begin(self, batch, logs=None):
            calls.append(("begin", batch, logs))

        def on_predict_batch_end(self, batch, logs=None):
            calls.append(("end", batch, sorted(logs), np.asarray(logs["outputs"])))

    got = model.predict(x, batch_size=10, verbose=0, callbacks=[Hooks()])
    assert [call[:3] for call in calls] == [("begin", 0, None), ("end", 2, ["outputs"]), ("begin", 3, None),
                                            ("end", 4, ["outputs"])]
    want = np.asarray(model(x, training=False))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(calls[1][3], want[:30], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(calls[3][3], want[30:], rtol=1e-5, atol=1e-6)
    # One step per execution: a pair of hooks per batch, the last one partial.
    with strategy.scope():
        model.compile(optimizer=model.optimizer, loss="mse", steps_per_execution=1)
    calls.clear()
    model.predict(Dataset.from_tensor_slices(x).batch(20), verbose=0, callbacks=[Hooks()])
    assert [call[:2] for call in calls] == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1), ("begin", 2),
                                            ("end", 2)]
    assert [call[3].shape for call in calls if call[0] == "end"] == [(20, 1), (20, 1), (5, 1)]
