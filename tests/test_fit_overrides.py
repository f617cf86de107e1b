"""Keras 3's own ways of customizing fit, under a strategy: equal to one device (issue 25, items 1 and 2).

Each case trains the same model on the same data (22 rows, batch 8: the last batch has 6 rows,
split 2/2/2/0 at 4 replicas, as TF splits it: an uneven step with an empty replica) with no strategy and under MirroredStrategy at 1, 2
and 4 replicas, and compares the per-epoch losses and the final weights (and evaluate / predict).

The programs are ported from keras.io by substitution (the model in ``strategy.scope()``):
* "Customizing what happens in fit() with JAX" (guides/custom_train_step_in_jax.py): the
  ``train_step(self, state, data)`` with ``compute_loss_and_updates``, its lower-level version
  with its own ``loss_tracker`` / ``mae_metric`` and ``loss_fn``, and its ``test_step``;
* "Knowledge Distillation" (examples/vision/knowledge_distillation.py): ``Distiller`` overrides
  ``compile``, ``compute_loss`` (signature with ``allow_empty``, no ``training``) and ``call``.
The other ``compute_loss`` overrides are the issue's: a plain ``keras.ops`` mean, and
``super().compute_loss(...) + 1.0 * keras.ops.mean(keras.ops.square(y_pred))``.
"""

from __future__ import annotations

import contextlib

import distribute
import jax
import keras
import numpy as np
import pytest
from keras import ops

ROWS, BATCH, EPOCHS = 22, 8, 2
RNG = np.random.default_rng(0)
X = RNG.normal(size=(ROWS, 5)).astype("float32")
Y = RNG.normal(size=(ROWS, 1)).astype("float32")
LABELS = RNG.integers(0, 3, ROWS)
SAMPLE_WEIGHT = RNG.random(ROWS).astype("float32")


def _strategy(num_replicas: int | None, sharding=None):
    if num_replicas is None:
        return None
    kwargs = {} if sharding is None else {"sharding": sharding}
    return distribute.MirroredStrategy([f"/cpu:{i}" for i in range(num_replicas)], **kwargs)


def _scope(strategy):
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _dense_stack(inputs, units=1):
    hidden = keras.layers.Dense(4, activation="tanh", kernel_regularizer="l2", activity_regularizer="l2")(inputs)
    return keras.layers.Dense(units)(hidden)


# -- compute_loss overrides --------------------------------------------------------------------
class PlainOpsLoss(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return ops.mean(ops.square(y - y_pred))


class SuperPlusTerm(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return super().compute_loss(x, y, y_pred, sample_weight, training) + 1.0 * ops.mean(ops.square(y_pred))


class Distiller(keras.Model):  # keras.io knowledge_distillation.py, as written there
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature**2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


def _build(case: str):
    inputs = keras.Input((5,))
    if case == "distiller":
        teacher = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
        student = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
        model = Distiller(student=student, teacher=teacher)
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=[keras.metrics.SparseCategoricalAccuracy()],
                      student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.1, temperature=10)
        return model
    cls = {"plain_ops": PlainOpsLoss, "super_plus_term": SuperPlusTerm}.get(case, keras.Model)
    model = cls(inputs, _dense_stack(inputs))
    loss = {
        "reduction_sum": keras.losses.MeanSquaredError(reduction="sum"),
        "mean_with_sample_weight": keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
    }.get(case, "mse")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=["mae"])
    return model


def _train(case: str, num_replicas: int | None, sharding=None, rows: int = ROWS):
    keras.utils.set_random_seed(1)
    strategy = _strategy(num_replicas, sharding)
    with _scope(strategy):
        model = _build(case)
    x, y = X[:rows], (LABELS if case == "distiller" else Y)[:rows]
    weights = SAMPLE_WEIGHT[:rows] if case in ("super_plus_term", "reduction_sum", "mean_with_sample_weight") else None
    history = model.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    # evaluate (the test step, its uneven last batch): against one device at 4 replicas (the suite's time)
    evaluated = model.evaluate(x, y, sample_weight=weights, batch_size=BATCH, verbose=0) if num_replicas in (None, 4) else None
    return history.history, evaluated, [np.asarray(w) for w in model.get_weights()]


CASES = ["plain_ops", "super_plus_term", "distiller", "reduction_sum", "mean_with_sample_weight"]


@pytest.fixture(scope="module")
def one_device():
    return {case: _train(case, None) for case in CASES}


def _assert_equal_one_device(got, reference):
    history, evaluated, weights = got
    for key in reference[0]:
        np.testing.assert_allclose(history[key], reference[0][key], rtol=1e-5, err_msg=key)
    if evaluated is not None:
        np.testing.assert_allclose(evaluated, reference[1], rtol=1e-5)
    for got_weight, want in zip(weights, reference[2]):
        np.testing.assert_allclose(got_weight, want, rtol=1e-5, atol=1e-6)


def test_compute_loss_override_under_sharded_state_equals_one_device(one_device):
    """Slots and gradients split over 4 replicas (ZeRO-2): the loss rule is the same."""
    got = _train("super_plus_term", 4, distribute.experimental.Sharding.GRADIENTS)
    _assert_equal_one_device(got, one_device["super_plus_term"])


@pytest.mark.parametrize("case", ["plain_ops", "mean_with_sample_weight"])
def test_a_last_batch_with_empty_replicas_equals_one_device(case):
    """17 rows by 8 at 4 replicas: the last batch's one row on replica 0, replicas 1-3 empty (they still
    meet the others where the loss sums every replica's weights). The 22-row cases end 2/2/2/0."""
    _assert_equal_one_device(_train(case, 4, rows=17), _train(case, None, rows=17))


@pytest.mark.parametrize("num_replicas", [1, 2, 4])
@pytest.mark.parametrize("case", CASES)
def test_compute_loss_overrides_and_reductions_equal_one_device(one_device, case, num_replicas):
    history, evaluated, weights = _train(case, num_replicas)
    reference = one_device[case]
    for key in reference[0]:
        np.testing.assert_allclose(history[key], reference[0][key], rtol=1e-5, err_msg=key)
    if evaluated is not None:
        np.testing.assert_allclose(evaluated, reference[1], rtol=1e-5)
    for got, want in zip(weights, reference[2]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_loss_term_summed_over_rows_is_the_row_weighted_mean_of_the_replicas():
    """``keras.ops.sum`` over rows in an override is no mean: each replica's sum is weighted by its rows
    (TF's Keras divides it by the replica count instead; on even batches both give sum / replicas)."""

    class SumLoss(keras.Model):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return ops.sum(ops.square(y - y_pred))

    def model():
        inputs = keras.Input((5,))
        m = SumLoss(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
        m.compile(optimizer="sgd", loss="mse")
        return m

    with _strategy(2).scope():
        distributed = model()
    logged = distributed.evaluate(X[:8], Y[:8], batch_size=8, verbose=0)
    rows = np.square(Y[:8, 0])
    assert logged == pytest.approx(0.5 * rows[:4].sum() + 0.5 * rows[4:].sum(), rel=1e-6)


class ActivityRegularizationLayer(keras.layers.Layer):  # keras.io, "Making new layers and models via subclassing"
    def call(self, inputs):
        self.add_loss(1e-2 * ops.sum(inputs))
        return inputs


def test_an_add_loss_summed_over_the_batch_is_tfs_share_per_replica():
    """keras.io's ActivityRegularizationLayer: TF divides every replica's add_loss term by the replica count,
    so 2 replicas count 1e-2 * sum(inputs) / 2 (one device: the whole sum); documented in tf_compat.md."""
    with _strategy(2).scope():
        inputs = keras.Input((5,))
        model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(ActivityRegularizationLayer()(inputs)))
        model.compile(optimizer="sgd", loss="mse")
    logged = model.evaluate(X[:8], Y[:8], batch_size=8, verbose=0)
    assert logged == pytest.approx(np.mean(np.square(Y[:8])) + 1e-2 * X[:8].sum() / 2, rel=1e-5)


def test_masked_loss_counts_the_valid_steps_of_every_replica():
    """A mask that reaches the loss (Masking before an LSTM with return_sequences): Keras divides by the
    valid entries; the replicas hold different counts of them, and the result is still one device's."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(10, 6, 3)).astype("float32")
    for row, valid in enumerate([6, 1, 2, 6, 3, 6, 5, 1, 4, 2]):
        x[row, valid:] = 0.0
    y = rng.normal(size=(10, 6, 2)).astype("float32")

    def train(num_replicas):
        keras.utils.set_random_seed(2)
        strategy = _strategy(num_replicas)
        with _scope(strategy):
            model = keras.Sequential([keras.Input((6, 3)), keras.layers.Masking(0.0),
                                      keras.layers.LSTM(4, return_sequences=True), keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        return history.history["loss"], model.get_weights()

    want = train(None)
    for num_replicas in (4,):  # valid steps per replica's rows differ
        got = train(num_replicas)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        for a, b in zip(got[1], want[1]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# -- train_step / test_step / predict_step overrides (keras.io, custom_train_step_in_jax.py) ---
class CustomModel(keras.Model):
    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x, training=training)
        loss = self.compute_loss(x, y, y_pred)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(trainable_variables, non_trainable_variables, x, y, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable_variables)
        new_metrics_vars, logs = [], []
        for metric in self.metrics:
            this_metric_vars = metrics_variables[len(new_metrics_vars): len(new_metrics_vars) + len(metric.variables)]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
            logs = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        state = (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_vars)
        return logs, state

    def test_step(self, state, data):
        x, y = data
        trainable_variables, non_trainable_variables, metrics_variables = state
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x, training=False)
        loss = self.compute_loss(x, y, y_pred)
        new_metrics_vars, logs = [], []
        for metric in self.metrics:
            this_metric_vars = metrics_variables[len(new_metrics_vars): len(new_metrics_vars) + len(metric.variables)]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
            else:
                this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
            logs = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        return logs, (trainable_variables, non_trainable_variables, new_metrics_vars)

    def predict_step(self, state, data):
        trainable_variables, non_trainable_variables = state
        outputs, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, data[0] if isinstance(data, tuple) else data, training=False)
        return {"prediction": outputs, "doubled": 2.0 * outputs}, non_trainable_variables


class LowLevelModel(keras.Model):  # the guide's "Going lower-level": its own trackers and loss_fn
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y, training=False):
        y_pred, non_trainable_variables = self.stateless_call(trainable_variables, non_trainable_variables, x, training=training)
        loss = self.loss_fn(y, y_pred)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(trainable_variables, non_trainable_variables, x, y, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable_variables)
        loss_tracker_vars = metrics_variables[: len(self.loss_tracker.variables)]
        mae_metric_vars = metrics_variables[len(self.loss_tracker.variables):]
        loss_tracker_vars = self.loss_tracker.stateless_update_state(loss_tracker_vars, loss)
        mae_metric_vars = self.mae_metric.stateless_update_state(mae_metric_vars, y, y_pred)
        logs = {self.loss_tracker.name: self.loss_tracker.stateless_result(loss_tracker_vars),
                self.mae_metric.name: self.mae_metric.stateless_result(mae_metric_vars)}
        new_metrics_vars = loss_tracker_vars + mae_metric_vars
        state = (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_vars)
        return logs, state

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def _train_steps(cls, num_replicas, sharding=None):
    keras.utils.set_random_seed(1)
    strategy = _strategy(num_replicas, sharding)
    with _scope(strategy):
        inputs = keras.Input((5,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        hidden = keras.layers.BatchNormalization()(keras.layers.Dropout(0.3)(hidden))
        model = cls(inputs, keras.layers.Dense(1)(hidden))
        if cls is LowLevelModel:
            model.compile(optimizer="adam")
        else:
            model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    history = model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    out = {"history": history.history, "weights": [np.asarray(w) for w in model.get_weights()]}
    if cls is CustomModel:
        out["evaluate"] = model.evaluate(X, Y, batch_size=BATCH, verbose=0)
        out["predict"] = model.predict(X, batch_size=BATCH, verbose=0)
    return out


@pytest.mark.parametrize("cls", [CustomModel, LowLevelModel])
def test_jax_train_test_predict_step_overrides_equal_one_device(cls):
    want = _train_steps(cls, None)
    configs = [(1, None), (2, None), (4, distribute.experimental.Sharding.FULL)] if cls is CustomModel else [(4, None)]
    for num_replicas, sharding in configs:
        got = _train_steps(cls, num_replicas, sharding)
        for key in want["history"]:
            np.testing.assert_allclose(got["history"][key], want["history"][key], rtol=1e-5, err_msg=f"{key} at {num_replicas}")
        for a, b in zip(got["weights"], want["weights"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        if cls is CustomModel:
            np.testing.assert_allclose(got["evaluate"], want["evaluate"], rtol=1e-5)
            assert set(got["predict"]) == {"prediction", "doubled"}
            for key in got["predict"]:
                assert got["predict"][key].shape == (ROWS, 1)
                np.testing.assert_allclose(got["predict"][key], want["predict"][key], rtol=1e-5, atol=1e-6)


def test_a_keras_loss_in_strategy_run_is_scaled_for_the_sum_over_replicas():
    """Keras 3 on TF divides a mean-reduced Loss by the replica count inside strategy.run (TF 2.21: rows
    0..7 over 2 replicas give 1.75 and 15.75, SUM 17.5, the global mean); here the same on an even batch,
    and weighted by each replica's rows on an uneven one (7 rows split 4/3: means 3.5 and 77/3, weighted
    4/7 and 3/7: 2.0 and 11.0, SUM 13.0, the global mean, where TF gives 3.5/2 + 77/6 = 14.58). reduction="sum" is not scaled (TF neither)."""
    strategy = _strategy(2)

    def losses(rows, reduction="sum_over_batch_size"):
        x = np.arange(rows, dtype=np.float32).reshape(rows, 1)
        data = distribute.data.Dataset.from_tensor_slices((x, np.zeros_like(x))).batch(rows)
        inputs = next(iter(strategy.experimental_distribute_dataset(data)))
        loss = keras.losses.MeanSquaredError(reduction=reduction)
        result = strategy.run(lambda xb, yb: loss(yb, xb), args=inputs)
        return [float(v) for v in strategy.experimental_local_results(result)], float(strategy.reduce("SUM", result, axis=None))

    assert losses(8) == (pytest.approx([1.75, 15.75]), pytest.approx(17.5))
    assert losses(7) == (pytest.approx([2.0, 11.0]), pytest.approx(13.0))
    assert losses(8, "sum") == (pytest.approx([14.0, 126.0]), pytest.approx(140.0))


class TrackedLoss(keras.Model):
    """``Model.compute_loss``'s docstring pattern: a metric updated inside the override."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="tracked")

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = ops.mean(ops.square(y - y_pred))
        self.loss_tracker.update_state(loss)
        return loss

    @property
    def metrics(self):
        return [self.loss_tracker]


def test_a_metric_updated_inside_compute_loss_logs_one_devices_value():
    """22 rows by 8: the last batch (6 rows) splits 3/3 at 2 replicas, 2/2/2/0 at 4.

    Each replica's update counts by its share of the rows; an empty replica's counts nothing (its
    ``ops.mean`` of no rows is NaN, which a zero weight would keep: the metric logged NaN).
    """

    def logs(num_replicas):
        keras.utils.set_random_seed(1)
        strategy = _strategy(num_replicas)
        with _scope(strategy):
            inputs = keras.Input((5,))
            model = TrackedLoss(inputs, keras.layers.Dense(1)(inputs))
            model.compile(optimizer=keras.optimizers.SGD(0.1))
        history = model.fit(X, Y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history["tracked"]
        # evaluate's last batch at 4 replicas: 1/1/0/0 (two empty replicas share one program).
        return history, model.evaluate(X, Y, batch_size=BATCH, verbose=0), model.evaluate(X[:2], Y[:2], verbose=0)

    want = logs(None)
    assert np.isfinite(want[0]).all()
    for num_replicas in (2, 4):
        got = logs(num_replicas)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        np.testing.assert_allclose(got[1:], want[1:], rtol=1e-5)


def test_a_train_step_override_runs_eagerly_with_run_eagerly():
    """compile(run_eagerly=True): the override runs as Python (a float() of a value works), as in Keras."""
    seen = []

    class Eager(keras.Model):
        def train_step(self, state, data):
            logs, state = super().train_step(state, data)
            seen.append(float(logs["loss"]))
            return logs, state

    def run(strategy):
        keras.utils.set_random_seed(1)
        with _scope(strategy):
            inputs = keras.Input((5,))
            model = Eager(inputs, keras.layers.Dense(1)(inputs))
            model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
        seen.clear()
        model.fit(X, Y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        return list(seen)

    want = run(None)
    assert len(want) == 3
    np.testing.assert_allclose(run(_strategy(2)), want, rtol=1e-5)


def test_a_loss_object_given_as_a_metric_is_one_devices_metric():
    """compile(metrics=[keras.losses.MeanAbsoluteError()]): a metric, not a share of the loss (it was
    halved at 2 replicas when strategy.run's scaling of Keras losses reached fit's metrics)."""

    def evaluate(num_replicas):
        keras.utils.set_random_seed(0)
        with _scope(_strategy(num_replicas)):
            inputs = keras.Input((5,))
            model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
            model.compile(optimizer="sgd", loss="mse", metrics=[keras.losses.MeanAbsoluteError()])
        return model.evaluate(X, Y, batch_size=BATCH, verbose=0)

    # 2 replicas: every batch splits evenly (the last, 6 rows, 3/3). An uneven batch (4 replicas: 2/2/2/0) still
    # averages the replicas' means of such a metric, not its rows (the note of stop 24 says so).
    np.testing.assert_allclose(evaluate(2), evaluate(None), rtol=1e-5)
