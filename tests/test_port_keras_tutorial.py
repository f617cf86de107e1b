"""TF tutorial "Distributed training with Keras", ported by substitution only.

Source: tensorflow/docs site/en/tutorials/distribute/keras.ipynb. Substitutions: tf.distribute ->
distribute, tf.data -> distribute.data, tf.keras -> keras, tf.cast -> ndarray.astype. MNIST (tfds)
is replaced by synthetic 28x28x1 uint8 images (200 train, 64 eval; 200 = 128 + 72, an uneven last
batch); 4 epochs instead of 12 (the learning-rate schedule changes at epoch 3); the shuffle gets a
seed so runs compare. The TensorBoard callback is left out (README: needs TensorFlow).

Asserted: fit under 2 replicas gives the one-device history and weights; the LearningRateScheduler
sets the tutorial's rates; ModelCheckpoint writes one weights file per epoch and load_weights of
the latest gives the final weights; evaluate equals one device's; model.save then load_model
outside and inside the scope evaluate to the same loss and accuracy.
"""

from __future__ import annotations

import os
import pathlib

import keras
import numpy as np
import pytest
from helpers import mirrored

import distribute

EPOCHS = 4
BATCH_SIZE = 128  # tutorial: 64 per replica * replicas; fixed here so runs compare


def mnist_like():
    rng = np.random.default_rng(5)
    images = rng.integers(0, 256, (264, 28, 28, 1), dtype=np.uint8)
    labels = ((images[:, :14].mean(axis=(1, 2, 3)) > 127.5) * 5 + images[:, 0, 0, 0] % 5).astype(np.int64)
    train = distribute.data.Dataset.from_tensor_slices((images[:200], labels[:200]))  # was tfds.load('mnist')
    test = distribute.data.Dataset.from_tensor_slices((images[200:], labels[200:]))
    return train, test


def scale(image, label):
    image = image.astype(np.float32)  # was tf.cast(image, tf.float32)
    image /= 255
    return image, label


def decay(epoch):
    if epoch < 3:
        return 1e-3
    elif epoch >= 3 and epoch < 7:
        return 1e-4
    else:
        return 1e-5


_INIT = {}


def build(strategy):
    with strategy.scope():
        model = keras.Sequential([
            keras.layers.Input((28, 28, 1)),  # was input_shape=(28, 28, 1) (deprecated in Keras 3)
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ])
        if "w" not in _INIT:
            _INIT["w"] = [np.asarray(w) for w in model.get_weights()]
        model.set_weights(_INIT["w"])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=keras.optimizers.Adam(learning_rate=0.001),
                      metrics=["accuracy"])
    return model


def run(strategy, workdir):
    mnist_train, mnist_test = mnist_like()
    BUFFER_SIZE = 10000
    train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE, seed=0).batch(BATCH_SIZE)
    eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)
    model = build(strategy)

    checkpoint_dir = os.path.join(workdir, "training_checkpoints")
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch:04d}.weights.h5")
    learning_rates = []

    class PrintLR(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            learning_rates.append(float(model.optimizer.learning_rate.numpy()))

    callbacks = [
        keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
        keras.callbacks.LearningRateScheduler(decay),
        PrintLR(),
    ]
    history = model.fit(train_dataset, epochs=EPOCHS, callbacks=callbacks, verbose=0)
    final = [np.asarray(w) for w in model.get_weights()]

    files = sorted(p.name for p in pathlib.Path(checkpoint_dir).glob("*"))
    latest_checkpoint = max(pathlib.Path(checkpoint_dir).glob("*"))
    model.load_weights(latest_checkpoint)
    eval_loss, eval_acc = model.evaluate(eval_dataset, verbose=0)

    path = os.path.join(workdir, "my_model.keras")
    model.save(path)
    unreplicated_model = keras.models.load_model(path)
    unreplicated_model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                               optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
    un_loss, un_acc = unreplicated_model.evaluate(eval_dataset, verbose=0)

    with strategy.scope():
        replicated_model = keras.models.load_model(path)
        replicated_model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                 optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
        re_loss, re_acc = replicated_model.evaluate(eval_dataset, verbose=0)
    return {"history": history.history, "final": final, "files": files, "lrs": learning_rates,
                "loaded": [np.asarray(w) for w in model.get_weights()], "eval": (eval_loss, eval_acc),
                "unreplicated": (un_loss, un_acc), "replicated": (re_loss, re_acc),
                "unreplicated_weights": [np.asarray(w) for w in unreplicated_model.get_weights()]}


_RES = {}


def result(n, tmp_path_factory):
    if n not in _RES:
        _RES[n] = run(mirrored(n), str(tmp_path_factory.mktemp(f"keras{n}")))
    return _RES[n]


def test_keras_tutorial_callbacks_and_saving(tmp_path_factory):
    two = result(2, tmp_path_factory)
    assert two["lrs"] == pytest.approx([1e-3, 1e-3, 1e-3, 1e-4])
    assert two["history"]["learning_rate"] == pytest.approx([1e-3, 1e-3, 1e-3, 1e-4])
    assert two["files"] == [f"ckpt_{e:04d}.weights.h5" for e in range(1, EPOCHS + 1)]
    for a, e in zip(two["loaded"], two["final"]):
        np.testing.assert_array_equal(a, e)
    for a, e in zip(two["unreplicated_weights"], two["final"]):
        np.testing.assert_array_equal(a, e)
    np.testing.assert_allclose(two["unreplicated"], two["eval"], rtol=1e-5)
    np.testing.assert_allclose(two["replicated"], two["eval"], rtol=1e-5)
    assert two["history"]["loss"][-1] < two["history"]["loss"][0]


def test_keras_tutorial_equals_one_device(tmp_path_factory):
    one = result(1, tmp_path_factory)
    two = result(2, tmp_path_factory)
    np.testing.assert_allclose(two["history"]["loss"], one["history"]["loss"], rtol=1e-4)
    np.testing.assert_allclose(two["history"]["accuracy"], one["history"]["accuracy"], atol=1e-6)
    for a, e in zip(two["final"], one["final"]):
        np.testing.assert_allclose(a, e, rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(two["eval"], one["eval"], rtol=1e-4)
    np.testing.assert_allclose(two["unreplicated"], one["unreplicated"], rtol=1e-4)
