"""Keras ``Model.fit`` under ParameterServerStrategy: tf-keras' PS fit rules, with values.

One worker applies updates in order, so fit equals one device's Keras fit on the
same batches; two workers converge and count every step once.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import distribute
from distribute.data import Dataset

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def one_worker(ray_instance):
    strategy = distribute.ParameterServerStrategy(num_workers=1, num_ps=2)
    yield strategy
    strategy._shutdown()


@pytest.fixture(scope="module")
def two_workers(ray_instance):
    strategy = distribute.ParameterServerStrategy(num_workers=2, num_ps=1)
    yield strategy
    strategy._shutdown()


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.7).astype(np.float32)
    return x, y


def _compiled(optimizer="sgd"):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.05) if optimizer == "sgd" else keras.optimizers.Adam(0.05)
    model.compile(optimizer=opt, loss="mse", metrics=["mae"])
    return model


@pytest.mark.parametrize("source", ["numpy", "dataset"])
def test_fit_one_worker_equals_one_device_keras_fit(one_worker, source):
    x, y = _data()
    with one_worker.scope():
        model = _compiled("adam")
    if source == "numpy":
        history = model.fit(x, y, batch_size=8, epochs=3, steps_per_epoch=8, shuffle=False, verbose=0)
    else:
        history = model.fit(Dataset.from_tensor_slices((x, y)).repeat().batch(8), epochs=3, steps_per_epoch=8, verbose=0)
    reference = _compiled("adam")
    want = reference.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 3 * 8
    # Logs come from the ps-side metrics: the epoch's mean loss and MAE, as one device's fit reports.
    assert sorted(history.history) == ["loss", "mae"]
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(history.history["mae"], want.history["mae"], rtol=1e-5)


def test_fit_two_workers_converges_and_counts_every_step(two_workers):
    x, y = _data()
    with two_workers.scope():
        model = _compiled("sgd")
    history = model.fit(x, y, batch_size=8, epochs=4, steps_per_epoch=25, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 100
    kernel, bias = model.get_weights()
    np.testing.assert_allclose(kernel.ravel(), [1.0, -2.0, 0.5, 3.0], atol=0.05)
    np.testing.assert_allclose(bias, [0.7], atol=0.05)
    assert history.history["loss"][-1] < history.history["loss"][0] / 10
    assert len(history.history["loss"]) == 4


def test_two_workers_evaluate_and_predict_see_every_row_once(two_workers):
    # The coordinator sends each closure its own batches, so with 2 workers every row counts once (TF's
    # per-worker copies would count rows twice without pss_evaluation_shards) and predict keeps the row order.
    x, y = _data()
    with two_workers.scope():
        model = _compiled("sgd")
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"], steps_per_execution=3)
    history = model.fit(x, y, batch_size=8, epochs=2, steps_per_epoch=7, verbose=0, validation_data=(x, y))
    assert int(model.optimizer.iterations.numpy()) == 14  # closures of 3, 3 and 1 steps per epoch
    reference = _compiled("sgd")
    reference.set_weights(model.get_weights())
    want = reference.evaluate(x, y, batch_size=5, verbose=0)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=5, verbose=0), want, rtol=1e-5)
    np.testing.assert_allclose(history.history["val_loss"][-1], reference.evaluate(x, y, verbose=0)[0], rtol=1e-5)
    np.testing.assert_allclose(model.predict(x, batch_size=5, verbose=0), reference.predict(x, batch_size=5, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_fit_rules_are_tfs(two_workers):
    x, y = _data()
    with two_workers.scope():
        model = _compiled("sgd")
    with pytest.raises(ValueError, match="`steps_per_epoch`, `validation_steps`, `steps`, or `pss_evaluation_shards`"):
        model.fit(x, y, epochs=1)
    with pytest.raises(ValueError, match="^`steps_per_epoch` must be specified with `ParameterServerStrategy`.$"):
        model.fit(Dataset.from_tensor_slices((x, y)).repeat().batch(8), epochs=1)
    with pytest.raises(ValueError, match="`verbose=1` is not allowed with `ParameterServerStrategy`"):
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=1)
    creator = distribute.DatasetCreator(lambda ctx: Dataset.from_tensor_slices((x, y)).repeat().batch(8))
    with pytest.raises(ValueError, match="`steps_per_epoch`, `validation_steps`, `steps`, or `pss_evaluation_shards`"):
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0, validation_data=creator)
    with pytest.raises(ValueError, match="infinite validation Dataset .* Pass validation_steps="):
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0,
                  validation_data=Dataset.from_tensor_slices((x, y)).repeat().batch(8))
    with pytest.raises(ValueError, match="Expected `validation_freq` to be a positive int or a list"):
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0, validation_data=(x, y), validation_freq=0)

    class PerBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    with pytest.raises(ValueError, match="Batch-level `Callback`s are not supported with `ParameterServerStrategy`"):
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[PerBatch()])
    with pytest.raises(ValueError, match="Batch-level `Callback`s are not supported with `ParameterServerStrategy`"):
        model.evaluate(x, y, verbose=0, callbacks=[PerBatch()])
    with pytest.raises(ValueError, match="`verbose=1` is not allowed with `ParameterServerStrategy`"):
        model.evaluate(x, y, verbose=1)
    model.run_eagerly = True
    with pytest.raises(ValueError, match="`run_eagerly` is not supported"):
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0  # nothing ran


def test_fit_from_a_dataset_creator(one_worker):
    # TF's DatasetCreator: dataset_fn(input_context) runs on every worker (input pipeline 0 each, as TF).
    x, y = _data()
    creator = distribute.DatasetCreator(lambda ctx: Dataset.from_tensor_slices((x, y)).repeat().batch(8))
    with one_worker.scope():
        model = _compiled("sgd")
    with pytest.raises(ValueError, match="`steps_per_epoch`, `validation_steps`, `steps`, or `pss_evaluation_shards`"):
        model.fit(creator, epochs=1, verbose=0)
    # The compiled metrics are unbuilt: TF builds them from the first batch, here from the workers' element spec.
    assert not model._compile_metrics.built
    history = model.fit(creator, epochs=2, steps_per_epoch=8, verbose=0)
    assert sorted(history.history) == ["loss", "mae"]
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=8, shuffle=False, verbose=0)
    reference = _compiled("sgd")
    expected = reference.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history.history["mae"], expected.history["mae"][:2], rtol=1e-5)
    assert int(model.optimizer.iterations.numpy()) == 24


def test_fit_calls_tfs_batch_hooks_per_scheduled_closure(one_worker, tmp_path):
    """TF's PS fit: on_train_batch_begin(step) / on_train_batch_end(step + K - 1, logs) per closure of K steps.

    ``logs`` is the closure's RemoteValue (a callback declaring ``_supports_tf_logs`` may
    fetch it: the worker's logs after its steps); Keras' ModelCheckpoint with an integer
    ``save_freq`` reads them, so the save waits for that closure and writes the ps values:
    with one worker, exactly those after the closure's steps.
    """
    x, y = _data()
    calls = []

    class Hooks(keras.callbacks.Callback):
        _supports_tf_logs = True

        def on_train_batch_begin(self, batch, logs=None):
            calls.append(("begin", batch, logs))

        def on_train_batch_end(self, batch, logs=None):
            calls.append(("end", batch, sorted(logs.fetch()), isinstance(logs, dict)))

    with one_worker.scope():
        model = _compiled("sgd")
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"], steps_per_execution=3)
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "ck-{epoch}-{batch}.keras"), save_freq=3)
    model.fit(x, y, batch_size=8, epochs=2, steps_per_epoch=7, shuffle=False, verbose=0,
              callbacks=[Hooks(), checkpoint, keras.callbacks.TerminateOnNaN()])
    per_epoch = [("begin", 0, None), ("end", 2, ["loss", "mae"], False), ("begin", 3, None),
                 ("end", 5, ["loss", "mae"], False), ("begin", 6, None), ("end", 6, ["loss", "mae"], False)]
    assert calls == per_epoch * 2
    assert int(model.optimizer.iterations.numpy()) == 14
    # Keras' save_freq counting over closure ends 2, 5, 6 | 2, 5, 6: saves after batches 3 and 6 of each epoch
    # (one batch carried over the epoch boundary, as Keras counts).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck-1-3.keras", "ck-1-6.keras", "ck-2-3.keras",
                                                          "ck-2-6.keras"]
    # evaluate: on_test_batch_* per closure of the coordinator's batches (8 batches: 3, 3, 2).
    calls.clear()

    class TestHooks(keras.callbacks.Callback):
        _supports_tf_logs = True

        def on_test_batch_begin(self, batch, logs=None):
            calls.append(("begin", batch))

        def on_test_batch_end(self, batch, logs=None):
            calls.append(("end", batch, sorted(logs)))

    model.evaluate(x, y, batch_size=8, verbose=0, callbacks=[TestHooks()])
    assert calls == [("begin", 0), ("end", 2, ["loss", "mae"]), ("begin", 3), ("end", 5, ["loss", "mae"]),
                     ("begin", 6), ("end", 7, ["loss", "mae"])]
    reference = _compiled("sgd")
    reference.fit(x[:24], y[:24], batch_size=8, epochs=1, shuffle=False, verbose=0)  # the first closure's 3 steps
    saved = keras.models.load_model(tmp_path / "ck-1-3.keras")
    for got, want in zip(saved.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_batch_level_callbacks_that_tf_refuses(two_workers, tmp_path):
    x, y = _data()
    with two_workers.scope():
        model = _compiled("sgd")

    class PerTestBatch(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            pass

    with pytest.raises(ValueError, match=r"Batch-level `Callback`s are not supported .* Found unsupported callbacks"):
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[PerTestBatch()])
    for backup in (keras.callbacks.BackupAndRestore(str(tmp_path / "a"), save_freq=2),
                   distribute.BackupAndRestore(tmp_path / "b", save_freq=2)):
        with pytest.raises(NotImplementedError, match=r"save_freq=2\) under ParameterServerStrategy: TF's callback "
                           "skips its batch-level backups"):
            model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0, callbacks=[backup])
    assert int(model.optimizer.iterations.numpy()) == 0


def test_fit_from_experimental_distribute_dataset_and_bad_steps(two_workers):
    x, y = _data()
    with two_workers.scope():
        model = _compiled("sgd")
    with pytest.raises(NotImplementedError, match="steps_per_epoch=-1: .* needs a positive int"):
        model.fit(x, y, epochs=1, steps_per_epoch=-1, verbose=0)
    distributed = two_workers.experimental_distribute_dataset(Dataset.from_tensor_slices((x, y)).repeat().batch(8))
    history = model.fit(distributed, epochs=2, steps_per_epoch=5, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 10
    assert len(history.history["loss"]) == 2 and history.history["loss"][1] < history.history["loss"][0]


def test_the_keras_internals_ps_fit_relies_on_exist():
    # keras_support/ps_hooks.py's fit helpers read these Trainer internals; a Keras upgrade that drops one fails here.
    model = _compiled("sgd")
    assert callable(keras.Model._symbolic_build)
    assert isinstance(model._loss_tracker, keras.metrics.Mean) and model._loss_tracker.name == "loss"
    assert model._compile_metrics is not None and not model._compile_metrics.built
    from distribute.keras_support import ps_hooks

    x, y = _data()
    ps_hooks.build_fit_state(model, (x[:8], y[:8]))
    assert ps_hooks.fit_state_built(model)
    assert ps_hooks.unpack_x_y_sample_weight((x, y)) == (x, y, None)
    # keras_eval / the optimizer guard: evaluate's list order, the compiled loss, loss scaling, the optimizer classes.
    assert ps_hooks.metrics_in_order(model, {"mae": 2.0, "loss": 1.0}) == [1.0, 2.0]
    assert model._compile_loss is not None
    assert float(keras.optimizers.SGD(loss_scale_factor=4.0).scale_loss(2.0)) == 8.0
    assert issubclass(keras.optimizers.LossScaleOptimizer, keras.optimizers.Optimizer)
    for name in ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Ftrl", "Lion", "Lamb"):
        ps_hooks.check_optimizer(getattr(keras.optimizers, name)())  # Keras' own optimizers pass the guard


def test_main_job_without_ray_is_one_line(monkeypatch, capsys):
    """`python -m distribute train --strategy parameter_server` without the [ps] extra: one line, exit 1."""
    from distribute import cli
    from distribute.parameter_server import cluster

    def missing():
        raise ImportError("ParameterServerStrategy runs on Ray, which is not installed. Install the extra: pip install 'jax-distribute[ps]'")

    monkeypatch.setattr(cluster, "import_ray", missing)
    assert cli.main(["train", "--strategy", "parameter_server", "--epochs", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m distribute train: error: ParameterServerStrategy runs on Ray, which is not installed. Install the extra: pip install 'jax-distribute[ps]'"]


def test_a_second_fit_reuses_the_traced_programs(one_worker, monkeypatch):
    """TF keeps ``model.train_function`` and keys its iterator argument by element spec: a second fit traces nothing.

    The second fit starts a new iterator over its data (TF's new DataHandler: rows
    from the start again), ``optimizer.iterations`` and the weights continue, so
    (one worker) it equals one device's two fit calls on the same batches.
    """
    from distribute.parameter_server import program

    traced = []
    trace_step = program.trace_step

    def counting(strategy, fn, *args, **kwargs):
        traced.append(fn)
        return trace_step(strategy, fn, *args, **kwargs)

    monkeypatch.setattr(program, "trace_step", counting)
    x, y = _data()
    with one_worker.scope():
        model = _compiled("adam")
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=8, shuffle=False, verbose=0)
    first = len(traced)
    history = model.fit(x, y, batch_size=8, epochs=2, steps_per_epoch=5, shuffle=False, verbose=0)
    assert first == 1 and len(traced) == first  # the train step, once
    assert int(model.optimizer.iterations.numpy()) == 18
    reference = _compiled("adam")
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    # The second fit's iterator: rows 0-39, then 40-63 and 0-15 (its dataset repeats).
    rows = np.concatenate([np.arange(40), np.arange(40, 64), np.arange(16)])
    reference.fit(x[rows], y[rows], batch_size=8, epochs=1, shuffle=False, verbose=0)
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert len(history.history["loss"]) == 2


class _PlainLossNoTrainingArg(keras.Sequential):
    """A compute_loss override with plain ops and no ``training`` argument (keras.io's Distiller signature)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        return keras.ops.mean(keras.ops.square(y - y_pred)) + 0.1 * keras.ops.mean(keras.ops.abs(y_pred))


class _OwnTrainStep(keras.Sequential):
    def train_step(self, state, data):
        return super().train_step(state, data)


def test_compute_loss_override_runs_and_train_step_override_is_refused(one_worker):
    x, y = _data()

    def build(cls):
        keras.utils.set_random_seed(1)
        model = cls([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    with one_worker.scope():
        model = build(_PlainLossNoTrainingArg)
    history = model.fit(x, y, batch_size=8, epochs=2, steps_per_epoch=8, shuffle=False, verbose=0)
    reference = build(_PlainLossNoTrainingArg)
    want = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-5)
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

    with one_worker.scope():
        custom = build(_OwnTrainStep)
    with pytest.raises(NotImplementedError, match="overrides train_step.*compute_loss instead"):
        custom.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=8, verbose=0)
