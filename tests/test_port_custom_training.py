"""TF tutorial "Custom training with tf.distribute.Strategy", ported by substitution only, every section.

Source: tensorflow/docs site/en/tutorials/distribute/custom_training.ipynb.
Substitutions: tf.distribute -> distribute, tf.data -> distribute.data, tf.keras -> keras,
tf.GradientTape -> distribute.GradientTape, tf.nn.compute_average_loss -> distribute.compute_average_loss,
tf.nn.scale_regularization_loss -> distribute.scale_regularization_loss, tf.add_n -> sum,
tf.train.Checkpoint -> distribute.Checkpoint, tf.train.latest_checkpoint -> distribute.latest_checkpoint,
reset_states -> reset_state (Keras 3), @tf.function -> @distribute.function. As TF writes it: the model is built
lazily by the first step (no Input layer), inside the tape, with an L2 kernel_regularizer whose losses come
through model.losses; a checkpoint every other epoch, restored into a model without a strategy (deferred
restoration: that model is built by its first call too); the iterator loop and the loop "inside a function".
Fashion-MNIST is replaced by small synthetic data of the same shape (28x28x1 float32 in [0, 1], labels 0..9),
300 train / 100 test images, so every epoch ends with a partial batch (300 = 4 x 64 + 44); the initial weights
come from keras.utils.set_random_seed before create_model, the shuffle gets a seed, so runs can be compared.
EPOCHS is 2 (TF: 10) and the iterator loop takes 3 steps (TF: 10 of its 938 batches).

What is asserted: the tutorial on 2 replicas and on OneDeviceStrategy ends at the one-device weights, losses and
metrics (within float32 rounding), also with a global batch that does not divide by the replicas (63 on 2
replicas: every step but the last of an epoch is uneven, 32 | 31 rows); the checkpoint restored into an
unreplicated model gives the accuracy the replicated model had at save time; the "other ways of iterating" loops
give the one-device values too; TF 2.21's values on 2 replicas.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
from helpers import mirrored

import distribute

N_TRAIN, N_TEST = 300, 100


def fashion_mnist_like():
    rng = np.random.default_rng(0)
    train_images = rng.integers(0, 256, (N_TRAIN, 28, 28), dtype=np.uint8)
    test_images = rng.integers(0, 256, (N_TEST, 28, 28), dtype=np.uint8)
    # labels that depend on the images, so training changes accuracy
    train_labels = (train_images[:, :14].mean(axis=(1, 2)) > 127.5).astype(np.uint8) * 5 + (train_images[:, 0, 0] % 5)
    test_labels = (test_images[:, :14].mean(axis=(1, 2)) > 127.5).astype(np.uint8) * 5 + (test_images[:, 0, 0] % 5)
    return (train_images, train_labels.astype(np.uint8)), (test_images, test_labels.astype(np.uint8))


def create_model():
    regularizer = keras.regularizers.L2(1e-5)
    model = keras.Sequential([
        keras.layers.Conv2D(32, 3, activation="relu", kernel_regularizer=regularizer),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu", kernel_regularizer=regularizer),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu", kernel_regularizer=regularizer),
        keras.layers.Dense(10, kernel_regularizer=regularizer),
    ])
    return model


def data():
    (train_images, train_labels), (test_images, test_labels) = fashion_mnist_like()
    train_images = train_images[..., None]
    test_images = test_images[..., None]
    train_images = train_images / np.float32(255)
    test_images = test_images / np.float32(255)
    return (train_images, train_labels), (test_images, test_labels)


def run_tutorial(strategy, checkpoint_dir, shuffle=True, extras=True, GLOBAL_BATCH_SIZE=64, EPOCHS=2):
    (train_images, train_labels), (test_images, test_labels) = data()
    BUFFER_SIZE = len(train_images)

    train_dataset = distribute.data.Dataset.from_tensor_slices((train_images, train_labels))
    if shuffle:
        train_dataset = train_dataset.shuffle(BUFFER_SIZE, seed=3)
    train_dataset = train_dataset.batch(GLOBAL_BATCH_SIZE)
    test_dataset = distribute.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)

    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

    with strategy.scope():
        # Set reduction to `NONE` so you can do the reduction yourself.
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            loss = distribute.compute_average_loss(per_example_loss)
            if model_losses:
                loss += distribute.scale_regularization_loss(sum(model_losses))  # was tf.add_n
            return loss

    with strategy.scope():
        test_loss = keras.metrics.Mean(name="test_loss")
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")

    # A model, an optimizer, and a checkpoint must be created under `strategy.scope`.
    with strategy.scope():
        keras.utils.set_random_seed(1)  # added: the same initial weights in every run
        model = create_model()
        optimizer = keras.optimizers.Adam(learning_rate=0.001)
        checkpoint = distribute.Checkpoint(optimizer=optimizer, model=model)

    def train_step(inputs):
        images, labels = inputs

        with distribute.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)

        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))

        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs

        predictions = model(images, training=False)
        t_loss = loss_object(labels, predictions)

        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    @distribute.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    @distribute.function
    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    history, step_losses, saved_test_accuracy = [], [], None
    for epoch in range(EPOCHS):
        # TRAIN LOOP
        total_loss = 0.0
        num_batches = 0
        for x in train_dist_dataset:
            step_loss = distributed_train_step(x)
            step_losses.append(float(step_loss))  # added: recorded
            total_loss += step_loss
            num_batches += 1
        train_loss = total_loss / num_batches

        # TEST LOOP
        for x in test_dist_dataset:
            distributed_test_step(x)

        if epoch % 2 == 0:
            checkpoint.save(checkpoint_prefix)
            saved_test_accuracy = float(test_accuracy.result())  # added: recorded

        history.append((float(train_loss), float(train_accuracy.result()), float(test_loss.result()),
                        float(test_accuracy.result()), num_batches))  # was: print(template.format(...))

        test_loss.reset_state()
        train_accuracy.reset_state()
        test_accuracy.reset_state()

    if not extras:
        return {"history": history, "step_losses": step_losses, "weights": [np.asarray(w) for w in model.get_weights()]}

    # -- Restore the latest checkpoint and test (without a strategy)
    eval_accuracy = keras.metrics.SparseCategoricalAccuracy(name="eval_accuracy")

    new_model = create_model()
    new_optimizer = keras.optimizers.Adam()

    test_dataset = distribute.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)

    @distribute.function
    def eval_step(images, labels):
        predictions = new_model(images, training=False)
        eval_accuracy(labels, predictions)

    checkpoint = distribute.Checkpoint(optimizer=new_optimizer, model=new_model)
    checkpoint.restore(distribute.latest_checkpoint(checkpoint_dir))

    for images, labels in test_dataset:
        eval_step(images, labels)
    restored_accuracy = float(eval_accuracy.result())

    # -- Alternate ways of iterating over a dataset: using iterators
    iter_losses = []
    for _ in range(EPOCHS):
        total_loss = 0.0
        num_batches = 0
        train_iter = iter(train_dist_dataset)

        for _ in range(3):  # TF: 10 (of 938 batches); this dataset has 5
            total_loss += distributed_train_step(next(train_iter))
            num_batches += 1
        average_train_loss = total_loss / num_batches

        iter_losses.append((float(average_train_loss), float(train_accuracy.result())))
        train_accuracy.reset_state()

    # -- iterating inside a function
    @distribute.function
    def distributed_train_epoch(dataset):
        total_loss = 0.0
        num_batches = 0
        for x in dataset:
            per_replica_losses = strategy.run(train_step, args=(x,))
            total_loss += strategy.reduce(distribute.ReduceOp.SUM, per_replica_losses, axis=None)
            num_batches += 1
        return total_loss / float(num_batches)  # was tf.cast(num_batches, dtype=tf.float32)

    epoch_losses = []
    for epoch in range(EPOCHS):
        train_loss = distributed_train_epoch(train_dist_dataset)
        epoch_losses.append((float(train_loss), float(train_accuracy.result())))
        train_accuracy.reset_state()

    return {
        "history": history,
        "saved_test_accuracy": saved_test_accuracy,
        "restored_accuracy": restored_accuracy,
        "iter_losses": iter_losses,
        "epoch_losses": epoch_losses,
        "weights": [np.asarray(w) for w in model.get_weights()],
        "iterations": int(optimizer.iterations.numpy()),
    }


_RESULTS = {}


def result(num_replicas, tmp_path_factory, global_batch=64):
    key = (num_replicas, global_batch)
    if key not in _RESULTS:
        strategy = distribute.OneDeviceStrategy("/cpu:0") if num_replicas == 0 else mirrored(num_replicas)
        directory = str(tmp_path_factory.mktemp(f"ckpt{num_replicas}_{global_batch}"))
        _RESULTS[key] = run_tutorial(strategy, directory, GLOBAL_BATCH_SIZE=global_batch)
    return _RESULTS[key]


def test_custom_training_one_device_runs_the_tutorial(tmp_path_factory):
    one = result(1, tmp_path_factory)
    assert [h[4] for h in one["history"]] == [5, 5]  # 300 = 4 x 64 + 44: the partial last batch is a step
    assert one["iterations"] == 2 * 5 + 2 * 3 + 2 * 5
    assert one["history"][1][0] < one["history"][0][0]  # training lowers the loss
    # the checkpoint (written after epoch 1) restored into a model without a strategy
    assert one["restored_accuracy"] == pytest.approx(one["saved_test_accuracy"], abs=1e-7)


def _assert_equal_runs(many, one):
    np.testing.assert_allclose(np.array([h[:4] for h in many["history"]]), np.array([h[:4] for h in one["history"]]),
                               rtol=2e-4, atol=2e-5)
    assert [h[4] for h in many["history"]] == [h[4] for h in one["history"]]
    for a, e in zip(many["weights"], one["weights"]):
        np.testing.assert_allclose(a, e, rtol=1e-3, atol=2e-5)
    np.testing.assert_allclose(many["iter_losses"], one["iter_losses"], rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(many["epoch_losses"], one["epoch_losses"], rtol=2e-4, atol=2e-5)
    assert many["iterations"] == one["iterations"]
    assert many["restored_accuracy"] == pytest.approx(many["saved_test_accuracy"], abs=1e-7)
    assert many["restored_accuracy"] == pytest.approx(one["restored_accuracy"], abs=1e-7)


@pytest.mark.parametrize("num_replicas", [0, 2])
def test_custom_training_equals_one_device(num_replicas, tmp_path_factory):
    _assert_equal_runs(result(num_replicas, tmp_path_factory), result(1, tmp_path_factory))


def test_custom_training_with_a_global_batch_not_divisible_by_the_replicas_equals_one_device(tmp_path_factory):
    # 63 rows on 2 replicas: 32 | 31 every step (the exact uneven step, compiled per replica shape); the last
    # batch of an epoch, 48 rows, splits evenly.
    one = result(1, tmp_path_factory, global_batch=63)
    assert [h[4] for h in one["history"]] == [5, 5]
    _assert_equal_runs(result(2, tmp_path_factory, global_batch=63), one)


# TF 2.21 running the tutorial's own code (tf.GradientTape, tf.nn.compute_average_loss, @tf.function)
# on MirroredStrategy(["/cpu:0", "/cpu:1"]) from the same initial weights and data, no shuffle
# (recorded with /work/tfvenv: the optimizer built in scope first, which TF 2.21 + Keras 3 needs).
TF_2_21 = {"epochs": [{"step_losses": [2.2984652519226074, 2.2998173236846924, 2.2944161891937256, 2.32745361328125, 2.339434862136841], "train_acc": 0.10000000149011612, "test_loss": 2.367363214492798, "test_acc": 0.07000000029802322}, {"step_losses": [2.2686126232147217, 2.2906434535980225, 2.2682299613952637, 2.278602361679077, 2.297321319580078], "train_acc": 0.14000000059604645, "test_loss": 2.3437066078186035, "test_acc": 0.07000000029802322}], "dense_bias": [-0.002916821511462331, 0.0033984112087637186, 0.00017762521747499704, -0.0016071191057562828, -0.0005128444172441959, 0.0004371916293166578, -0.0023497038055211306, 0.0012838039547204971, 0.0008364181267097592, -0.0022144264075905085], "weight_sums": [-0.9258508682250977, -0.08506686985492706, -27.268367767333984, -0.10633440315723419, -44.191162109375, -0.0491936169564724, -6.0178542137146, -0.0034674648195505142], "weight_abs_sums": [20.467967987060547, 0.11043496429920197, 761.774169921875, 0.17177128791809082, 2968.27490234375, 0.14412659406661987, 90.83367156982422, 0.015734365209937096]}


def test_custom_training_matches_tf_2_21(tmp_path):
    got = run_tutorial(mirrored(2), str(tmp_path), shuffle=False, extras=False, EPOCHS=2)
    tf_steps = [v for e in TF_2_21["epochs"] for v in e["step_losses"]]
    np.testing.assert_allclose(got["step_losses"], tf_steps, rtol=1e-4)
    for (train_loss, train_acc, test_loss, test_acc, _), e in zip(got["history"], TF_2_21["epochs"]):
        assert train_loss == pytest.approx(np.mean(e["step_losses"]), rel=1e-4)
        assert train_acc == pytest.approx(e["train_acc"], abs=1e-6)
        assert test_loss == pytest.approx(e["test_loss"], rel=1e-4)
        assert test_acc == pytest.approx(e["test_acc"], abs=1e-6)
    np.testing.assert_allclose(got["weights"][-1], TF_2_21["dense_bias"], atol=2e-6)
    np.testing.assert_allclose([float(np.sum(np.abs(w))) for w in got["weights"]], TF_2_21["weight_abs_sums"], rtol=1e-3)
