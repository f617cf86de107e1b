"""Keras `fit` under MirroredStrategy: the TF guide's first example, ported.

TF original (tensorflow.org/guide/distributed_training, "Use tf.distribute.Strategy
with Keras Model.fit"):

    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(1,))])
    model.compile(loss="mse", optimizer="sgd")

The only changes: import `distribute` instead of `tf.distribute`, and (on a CPU
machine) ask XLA for several CPU devices before JAX starts.

Run: python examples/keras_fit.py [--epochs N]
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import numpy as np  # noqa: E402

import distribute  # noqa: E402  (sets KERAS_BACKEND=jax before keras loads)
import keras  # noqa: E402


def main(epochs: int = 3) -> float:
    strategy = distribute.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")

    with strategy.scope():
        model = keras.Sequential([
            keras.Input((20,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer="adam", loss="mse")

    rng = np.random.default_rng(0)
    x = rng.random((4096, 20), dtype=np.float32)
    y = (x @ rng.random((20, 1), dtype=np.float32) + 0.1).astype(np.float32)

    global_batch_size = 64 * strategy.num_replicas_in_sync
    history = model.fit(x, y, batch_size=global_batch_size, epochs=epochs, verbose=2)
    loss = model.evaluate(x, y, batch_size=global_batch_size, verbose=0)
    print(f"final loss: {loss:.5f} (first epoch {history.history['loss'][0]:.5f})")
    return loss


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    main(parser.parse_args().epochs)
