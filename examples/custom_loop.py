"""A custom training loop under MirroredStrategy: the TF tutorial, ported.

TF original: tensorflow.org/tutorials/distribute/custom_training (Fashion-MNIST
CNN).  Here: an MLP on the UCI handwritten digits that scikit-learn ships, with
the same structure: dataset distributed with `experimental_distribute_dataset`,
a `train_step` run on every replica with `strategy.run`, losses combined with
`strategy.reduce`, and Mean / SparseCategoricalAccuracy metrics created in scope.

The TF loop as it is, but for the names: `tf.distribute` -> `distribute`,
`tf.data` -> `distribute.data`, `tf.GradientTape` -> `distribute.GradientTape`,
`tf.nn.compute_average_loss` -> `distribute.compute_average_loss`,
`@tf.function` -> `@distribute.function`.

Run: python examples/custom_loop.py [--epochs N]
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import distribute  # noqa: E402
import keras  # noqa: E402
from distribute.data import Dataset  # noqa: E402


def main(epochs: int = 5) -> float:
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32).reshape(-1, 64)
    labels = digits.target.astype(np.int32)
    train_images, test_images = images[:1500], images[1500:]
    train_labels, test_labels = labels[:1500], labels[1500:]

    strategy = distribute.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")

    batch_size_per_replica = 32
    global_batch_size = batch_size_per_replica * strategy.num_replicas_in_sync
    train_dataset = Dataset.from_tensor_slices((train_images, train_labels)).shuffle(1500, seed=0).batch(global_batch_size)
    test_dataset = Dataset.from_tensor_slices((test_images, test_labels)).batch(global_batch_size)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    with strategy.scope():
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

        def compute_loss(labels, predictions):
            per_example_loss = loss_object(labels, predictions)
            return distribute.compute_average_loss(per_example_loss)

        test_loss = keras.metrics.Mean(name="test_loss")
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")

        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ])
        optimizer = keras.optimizers.Adam(learning_rate=0.003)

    def train_step(inputs):
        images, labels = inputs

        with distribute.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions)

        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        test_loss.update_state(loss_object(labels, predictions))
        test_accuracy.update_state(labels, predictions)

    @distribute.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    @distribute.function
    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    for epoch in range(epochs):
        total_loss, num_batches = 0.0, 0
        for x in train_dist_dataset:
            total_loss += float(distributed_train_step(x))
            num_batches += 1
        for x in test_dist_dataset:
            distributed_test_step(x)
        print(
            f"Epoch {epoch + 1}, Loss: {total_loss / num_batches:.4f}, "
            f"Accuracy: {float(train_accuracy.result()) * 100:.2f}, "
            f"Test Loss: {float(test_loss.result()):.4f}, "
            f"Test Accuracy: {float(test_accuracy.result()) * 100:.2f}"
        )
        test_loss.reset_state()
        train_accuracy.reset_state()
        last_test_accuracy = float(test_accuracy.result())
        test_accuracy.reset_state()
    return last_test_accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    main(parser.parse_args().epochs)
