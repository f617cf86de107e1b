"""Model Garden's BERT ``run_customized_training_loop`` test, ported by substitution, under MirroredStrategy(2).

Source: tensorflow/models official/legacy/bert/model_training_utils_test.py
(test_train_check_callbacks: steps_per_epoch=20, num_eval_per_epoch=4, steps_per_loop=10 (so 5),
epochs=2, eval_steps=10, a one-layer softmax model, SGD(0.1, momentum=0.9), CategoricalAccuracy, a
RecordingCallback), run through the port of model_training_utils.py in
tests/bert_training_loop_port.py: a ``range(steps)`` loop of ``strategy.run`` inside a
``distribute.function`` (TF: ``tf.range`` inside a ``tf.function``), a tape in the replica step.
Substitutions: tf.distribute -> distribute, tf.data -> distribute.data, tf_keras -> keras,
tf.cast -> numpy dtypes. Changes beyond substitution: no ``dataset.shuffle(64)`` (TF's shuffle order
comes from TF's RNG), ``np.random.seed(0)`` before the run (the test's data is np.random), fixed
initial weights, no ``model.add_metric`` (not in Keras 3), ``model.stop_training = False`` (Keras 3
sets it in compile), a temporary ``model_dir``. The test's loss ``categorical_crossentropy`` is per
example (a vector: tape.gradient sums it, so under 2 replicas the summed gradient is half one device's,
as TF); BERT's own loss functions return the mean, the ``scalar_loss`` variant, where 2 replicas
equal one device.

Expected values: TF 2.21 with the real model_training_utils (tf-models-no-deps 2.19.0) and tf_keras
under MirroredStrategy over 2 logical CPUs, recorded by tests/parity/record_tf_orbit.py bert (TF_*
below; its loss reads the probabilities through tf.identity, as Keras 3's categorical_crossentropy
does); and the same program on one device here.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import bert_training_loop_port as model_training_utils
import distribute
from helpers import mirrored

# TF 2.21, record_tf_orbit.py bert, mirrored_2: at each on_batch_end (batch, train "loss",
# eval "training_loss", eval "accuracy"); the epoch ends (epoch, train loss, eval loss, accuracy);
# training_summary; the output layer's bias at the end.
TF_BERT = {
    False: {  # the test's per-example loss
        "batch_end": [[4, 1.9255025386810303, 1.7627484798431396, 0.6499999761581421],
                      [9, 1.8918483257293701, 1.6888086795806885, 0.23749999701976776],
                      [14, 1.7170188426971436, 1.8558101654052734, 0.675000011920929],
                      [19, 1.666598916053772, 1.7279903888702393, 0.5625],
                      [24, 1.6796802282333374, 1.591837763786316, 0.32499998807907104],
                      [29, 1.8992782831192017, 1.6901471614837646, 0.675000011920929],
                      [34, 1.6009349822998047, 1.6647669076919556, 0.21250000596046448],
                      [39, 1.6013740301132202, 1.6647669076919556, 0.21250000596046448]],
        "epoch_end": [[1, 1.666598916053772, 1.7279903888702393, 0.5625],
                      [2, 1.6013740301132202, 1.6647669076919556, 0.21250000596046448],
                      [2, None, 1.5273301601409912, 0.25]],
        "summary": {"train_loss": 1.6013740301132202, "last_train_metrics": 0.4000000059604645, "eval_metrics": 0.25},
        "last_bias": [-0.04324992001056671, 0.37869685888290405, 0.012521862983703613],
    },
    True: {  # the mean loss (BERT's loss functions); TF's one-device run gives the same to 2e-7
        "batch_end": [[4, 1.8886833190917969, 1.7328437566757202, 0.612500011920929],
                      [9, 1.6453921794891357, 1.6089351177215576, 0.574999988079071],
                      [14, 1.6462246179580688, 1.8143672943115234, 0.26249998807907104],
                      [19, 1.7042419910430908, 1.7055213451385498, 0.38749998807907104],
                      [24, 1.6177778244018555, 1.5598686933517456, 0.32499998807907104],
                      [29, 1.8088645935058594, 1.678579330444336, 0.08749999850988388],
                      [34, 1.5420782566070557, 1.6587715148925781, 0.6625000238418579],
                      [39, 1.6026417016983032, 1.6587715148925781, 0.6625000238418579]],
        "epoch_end": [[1, 1.7042419910430908, 1.7055213451385498, 0.38749998807907104],
                      [2, 1.6026417016983032, 1.6587715148925781, 0.6625000238418579],
                      [2, None, 1.493151068687439, 0.25]],
        "summary": {"train_loss": 1.6026417016983032, "last_train_metrics": 0.550000011920929, "eval_metrics": 0.25},
        "last_bias": [0.12375408411026001, 0.20590552687644958, 0.018308384343981743],
    },
}


def initial_weights(shapes, seed):
    """Fixed initial weights (tests/parity/record_tf_orbit.py sets the same in TF)."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(-0.5, 0.5, size=s).astype(np.float32) for s in shapes]


def create_fake_data_input_fn(batch_size, features_shape, num_classes):
    def _dataset_fn(input_context=None):
        local_batch_size = input_context.get_per_replica_batch_size(batch_size)
        features = np.random.rand(64, *features_shape)
        labels = np.random.randint(2, size=[64, num_classes])
        dataset = distribute.data.Dataset.from_tensor_slices((features.astype(np.float32),  # was map(tf.cast)
                                                              labels.astype(np.float32)))
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        dataset = dataset.repeat()  # was dataset.shuffle(64).repeat()
        dataset = dataset.batch(local_batch_size, drop_remainder=True)
        return dataset.prefetch(buffer_size=64)
    return _dataset_fn


def create_model_fn(input_shape, num_classes, built):
    def _model_fn():
        input_layer = keras.layers.Input(shape=input_shape)
        x = keras.layers.Dense(num_classes, activation="relu")(input_layer)
        output_layer = keras.layers.Dense(num_classes, activation="softmax")(x)
        sub_model = keras.models.Model(input_layer, x, name="sub_model")
        model = keras.models.Model(input_layer, output_layer, name="model")
        model.optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
        model.stop_training = False
        model.set_weights(initial_weights([(128, 3), (3,), (3, 3), (3,)], 2))
        built["model"] = model
        return model, sub_model
    return _model_fn


def metric_fn():
    return keras.metrics.CategoricalAccuracy(name="accuracy", dtype="float32")


class RecordingCallback(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batch_begin, self.batch_end, self.epoch_begin, self.epoch_end = [], [], [], []

    def on_batch_begin(self, batch, logs=None):
        self.batch_begin.append((batch, logs))

    def on_batch_end(self, batch, logs=None):
        self.batch_end.append((batch, logs))

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_begin.append((epoch, logs))

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_end.append((epoch, logs))


def _run(strategy, scalar_loss, tmp_path):
    np.random.seed(0)
    built, callback = {}, RecordingCallback()

    def loss_fn(labels, outputs):
        loss = keras.losses.categorical_crossentropy(labels, outputs)
        return keras.ops.mean(loss) if scalar_loss else loss

    input_fn = create_fake_data_input_fn(batch_size=8, features_shape=[128], num_classes=3)
    _, summary = model_training_utils.run_customized_training_loop(
        strategy=strategy, model_fn=create_model_fn([128], 3, built), loss_fn=loss_fn,
        model_dir=str(tmp_path), steps_per_epoch=20, num_eval_per_epoch=4, steps_per_loop=10, epochs=2,
        train_input_fn=input_fn, eval_input_fn=input_fn, eval_steps=10, metric_fn=metric_fn,
        custom_callbacks=[callback], run_eagerly=False)
    return built["model"], summary, callback


def _rows(callback):
    batch_end = [[b, float(l["loss"]), float(l["training_loss"]), float(l["accuracy"])] for b, l in callback.batch_end]
    epoch_end = [[e, None if "loss" not in l else float(l["loss"]), float(l["training_loss"]), float(l["accuracy"])]
                 for e, l in callback.epoch_end]
    return batch_end, epoch_end


def _assert_rows(actual, expected, rtol):
    assert [r[0] for r in actual] == [r[0] for r in expected]
    for a, e in zip(actual, expected):
        assert (a[1] is None) == (e[1] is None)
        np.testing.assert_allclose([x for x in a[1:] if x is not None], [x for x in e[1:] if x is not None], rtol=rtol)


@pytest.mark.parametrize("scalar_loss", [False, True], ids=["per_example_loss", "mean_loss"])
def test_bert_customized_training_loop_gives_tf_values(scalar_loss, tmp_path):
    model, summary, callback = _run(mirrored(2), scalar_loss, tmp_path)
    expected = TF_BERT[scalar_loss]
    # The test's own assertions (test_train_check_callbacks).
    assert callback.epoch_begin == [(1, None), (2, None)] or callback.epoch_begin == [(1, {}), (2, {})]
    assert [e for e, _ in callback.epoch_end] == [1, 2, 2]
    assert [b for b, _ in callback.batch_begin] == [0, 5, 10, 15, 20, 25, 30, 35]
    assert [b for b, _ in callback.batch_end] == [4, 9, 14, 19, 24, 29, 34, 39]
    assert int(np.asarray(model.optimizer.iterations)) == 40
    batch_end, epoch_end = _rows(callback)
    _assert_rows(batch_end, expected["batch_end"], rtol=2e-5)
    _assert_rows(epoch_end, expected["epoch_end"], rtol=2e-5)
    np.testing.assert_allclose([summary[k] for k in ("train_loss", "last_train_metrics", "eval_metrics")],
                               [expected["summary"][k] for k in ("train_loss", "last_train_metrics", "eval_metrics")],
                               rtol=2e-5)
    np.testing.assert_allclose(model.get_weights()[-1], expected["last_bias"], rtol=1e-4, atol=1e-5)


def test_bert_loop_with_a_mean_loss_two_replicas_equal_one_device(tmp_path):
    """BERT's mean loss divided by num_replicas_in_sync, summed by the optimizer: one device's training."""
    two, two_summary, two_cb = _run(mirrored(2), True, tmp_path / "two")
    one, one_summary, one_cb = _run(distribute.get_strategy(), True, tmp_path / "one")
    for a, b in zip(_rows(two_cb), _rows(one_cb)):
        _assert_rows(a, b, rtol=2e-6)
    for key in ("train_loss", "last_train_metrics", "eval_metrics"):
        np.testing.assert_allclose(two_summary[key], one_summary[key], rtol=2e-6)
    for a, b in zip(two.get_weights(), one.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
