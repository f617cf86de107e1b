"""TF tutorial "Save and load a model using a distribution strategy", ported by substitution only.

Source: tensorflow/docs site/en/tutorials/distribute/save_and_load.ipynb. Substitutions:
tf.distribute -> distribute, tf.data -> distribute.data, tf.keras -> keras, tf.cast -> astype.
MNIST (tfds) is replaced by synthetic 28x28x1 uint8 images (160 train, 40 eval; batch 32, so the
eval set ends with an uneven batch of 8), a smaller CNN, 1-2 epochs; shuffles are left out so runs
compare. ``MirroredStrategy()`` is given two CPU devices.

Asserted: the Keras API part (model.save / keras.models.load_model without a strategy, and inside
another strategy's scope) evaluates to the saved model's loss and accuracy and trains on to the
weights one device reaches from the same file; the tutorial's distributed inference
(``strategy.run`` of the loaded model over ``experimental_distribute_dataset``) gives the rows of
``predict``. The low-level ``tf.saved_model`` API has no counterpart here (README: not listed):
``distribute.saved_model`` is an AttributeError and ``model.export`` is Keras' own clear
ImportError naming TensorFlow. The caveat cells (saving a subclassed model) give Keras' own answers.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import mirrored

import distribute

BATCH_SIZE = 32


def get_data():
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (200, 28, 28, 1), dtype=np.uint8)
    labels = (images[:, :14].mean(axis=(1, 2, 3)) > 127.5).astype(np.int64) * 3 + images[:, 0, 0, 0] % 3

    def scale(image, label):
        image = image.astype(np.float32)  # was tf.cast(image, tf.float32)
        image /= 255
        return image, label

    mnist_train = distribute.data.Dataset.from_tensor_slices((images[:160], labels[:160]))
    mnist_test = distribute.data.Dataset.from_tensor_slices((images[160:], labels[160:]))
    train_dataset = mnist_train.map(scale).cache().batch(BATCH_SIZE)
    eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)
    return train_dataset, eval_dataset


def get_model(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=keras.optimizers.Adam(),
                      metrics=[keras.metrics.SparseCategoricalAccuracy()])
        return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    mirrored_strategy = mirrored(2)
    model = get_model(mirrored_strategy)
    train_dataset, eval_dataset = get_data()
    history = model.fit(train_dataset, epochs=2, verbose=0)
    keras_model_path = str(tmp_path_factory.mktemp("save") / "keras_save.keras")
    model.save(keras_model_path)
    return {"model": model, "path": keras_model_path, "history": history.history,
            "eval": model.evaluate(eval_dataset, return_dict=True, verbose=0),
            "predict": model.predict(eval_dataset, verbose=0)}


def _weights(model):
    return [np.asarray(w) for w in model.get_weights()]


def _fit_from_file(path, strategy=None):
    train_dataset, _ = get_data()
    if strategy is None:
        restored = keras.models.load_model(path)
        restored.fit(train_dataset, epochs=1, verbose=0)
    else:
        with strategy.scope():
            restored = keras.models.load_model(path)
            restored.fit(train_dataset, epochs=1, verbose=0)
    return restored


def test_fit_learns_under_mirrored(saved):
    loss = saved["history"]["loss"]
    assert len(loss) == 2 and np.isfinite(loss).all()


def test_restored_without_strategy_evaluates_as_saved(saved):
    _, eval_dataset = get_data()
    restored_keras_model = keras.models.load_model(saved["path"])
    result = restored_keras_model.evaluate(eval_dataset, return_dict=True, verbose=0)
    for key, value in saved["eval"].items():
        np.testing.assert_allclose(result[key], value, rtol=1e-6)
    np.testing.assert_allclose(restored_keras_model.predict(eval_dataset, verbose=0), saved["predict"],
                               rtol=1e-5, atol=1e-6)
    # trains on without compile (the tutorial's point): optimizer state restored, iterations go on
    assert int(restored_keras_model.optimizer.iterations) == 10
    restored_keras_model.fit(get_data()[0], epochs=1, verbose=0)
    assert int(restored_keras_model.optimizer.iterations) == 15


@pytest.mark.parametrize("another", ["one_device", "mirrored2", "mirrored3"])
def test_restored_in_another_strategy_trains_on_as_one_device(saved, another):
    strategy = {"one_device": lambda: distribute.OneDeviceStrategy("/cpu:0"),
                "mirrored2": lambda: mirrored(2), "mirrored3": lambda: mirrored(3)}[another]()
    reference = _fit_from_file(saved["path"])
    restored_keras_model_ds = _fit_from_file(saved["path"], strategy)
    assert int(restored_keras_model_ds.optimizer.iterations) == 15
    for got, want in zip(_weights(restored_keras_model_ds), _weights(reference)):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    _, eval_dataset = get_data()
    with strategy.scope():
        got = restored_keras_model_ds.evaluate(eval_dataset, return_dict=True, verbose=0)
    want = reference.evaluate(eval_dataset, return_dict=True, verbose=0)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-4)
    assert got["sparse_categorical_accuracy"] == pytest.approx(want["sparse_categorical_accuracy"])


def test_distributed_inference_of_the_loaded_model_gives_predict_rows(saved):
    # The tutorial: load inside another MirroredStrategy's scope and call the loaded function
    # per replica with strategy.run over experimental_distribute_dataset.
    _, eval_dataset = get_data()
    predict_dataset = eval_dataset.map(lambda image, label: image)
    another_strategy = mirrored(2)
    with another_strategy.scope():
        loaded = keras.models.load_model(saved["path"])
        dist_predict_dataset = another_strategy.experimental_distribute_dataset(predict_dataset)
        rows = []
        for batch in dist_predict_dataset:
            result = another_strategy.run(loaded, args=(batch,))
            rows.extend(np.asarray(r) for r in another_strategy.experimental_local_results(result))
    np.testing.assert_allclose(np.concatenate(rows), saved["predict"], rtol=1e-5, atol=1e-6)


def test_low_level_saved_model_api_has_no_counterpart(saved):
    # tf.saved_model.save / load: not provided (the README lists no SavedModel support).
    with pytest.raises(AttributeError, match="saved_model"):
        distribute.saved_model  # noqa: B018
    # Keras 3's export (SavedModel) needs TensorFlow, with Keras' own clear message.
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="tensorflow"):
            saved["model"].export("unused_export_dir")


class SubclassedModel(keras.Model):
    """Example model defined by subclassing `keras.Model`."""

    output_name = "output_layer"

    def __init__(self):
        super().__init__()
        self._dense_layer = keras.layers.Dense(5, dtype="float32", name=self.output_name)

    def call(self, inputs):
        return self._dense_layer(inputs)


def test_caveat_subclassed_model_saves_after_fit(tmp_path):
    mirrored_strategy = mirrored(2)
    with mirrored_strategy.scope():
        my_model = SubclassedModel()
    # Keras 3 (TF 2.21 too): a path without .keras/.h5 is refused before anything else
    with pytest.raises(ValueError, match="Invalid filepath extension"):
        my_model.save(str(tmp_path / "tf_save"))
    batch = 4 * mirrored_strategy.num_replicas_in_sync
    dataset = distribute.data.Dataset.from_tensors(
        (np.arange(5, dtype=np.float32), np.arange(5, dtype=np.float32))).repeat(100).batch(batch)
    with mirrored_strategy.scope():
        my_model.compile(optimizer="adam", loss="mean_squared_error")
    history = my_model.fit(dataset, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]
    my_model.save(str(tmp_path / "sub.keras"))  # the tutorial's last cell: saving works once built
    assert (tmp_path / "sub.keras").stat().st_size > 0
