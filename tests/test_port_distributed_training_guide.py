"""TF guide "Distributed training with TensorFlow", its code cells ported by substitution only.

Source: tensorflow/docs site/en/guide/distributed_training.ipynb. Substitutions: tf.distribute ->
distribute, tf.data -> distribute.data, tf.keras -> keras, tf.Variable -> keras.Variable,
tf.nn.compute_average_loss / scale_regularization_loss -> distribute.*, tf.add_n -> sum,
``tf.keras.losses.Reduction.NONE`` -> ``"none"``, ``tf.GradientTape`` -> ``distribute.GradientTape``,
``@tf.function`` -> ``@distribute.function``.
``MirroredStrategy()`` is given two CPU devices; the models get fixed initial weights (``set_weights``)
so the values compare with TF 2.21's, recorded by tests/parity/record_tf_ports.py into
tests/parity/tf_2_21_ports.json. TPU and ParameterServerStrategy cells are left out (no TPU here;
ParameterServerStrategy is tested elsewhere).

Asserted: the Keras cells (fit on a dataset and on numpy, evaluate) and the custom-loop cells
(100 steps over the distributed dataset, then 10 more from ``iter``/``next``) give TF's losses and
weights; the constructor cells give TF's replica counts where the devices exist and the README's
clear errors where they do not (GPU names on a CPU machine: TF creates the strategy lazily), and
CentralStorageStrategy builds as TF's.
"""

from __future__ import annotations

import json
import pathlib

import jax
import keras
import numpy as np
import pytest
from helpers import mirrored

import distribute

TF = json.loads((pathlib.Path(__file__).parent / "parity" / "tf_2_21_ports.json").read_text())
W0 = [np.array([[0.5]], np.float32), np.array([0.0], np.float32)]


def test_constructor_cells():
    mirrored_strategy = distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=distribute.HierarchicalCopyAllReduce())
    assert mirrored_strategy.num_replicas_in_sync == TF["guide_constructors"]["hierarchical_copy"]
    communication_options = distribute.experimental.CommunicationOptions(
        implementation=distribute.experimental.CommunicationImplementation.NCCL)
    strategy = distribute.MultiWorkerMirroredStrategy(communication_options=communication_options)
    assert strategy.num_replicas_in_sync == len(strategy.extended.worker_devices)
    default_strategy = distribute.get_strategy()
    assert float(default_strategy.reduce("SUM", 1.0, axis=None)) == TF["guide_constructors"]["default_reduce"]
    with default_strategy.scope():
        assert float(keras.Variable(1.0)) == 1.0


def test_gpu_device_names_on_a_cpu_machine_are_a_clear_error():
    # TF 2.21 creates both lazily (2 and 1 replicas); here the unknown device is named at once.
    assert TF["guide_constructors"]["gpu_devices_on_cpu_machine"] == 2
    with pytest.raises(ValueError, match=r"Unknown device '/gpu:0'.*Available: /cpu:0"):
        distribute.MirroredStrategy(devices=["/gpu:0", "/gpu:1"])
    with pytest.raises(ValueError, match=r"Unknown device '/gpu:0'"):
        distribute.OneDeviceStrategy(device="/gpu:0")


def test_central_storage_strategy_cell():
    central_storage_strategy = distribute.experimental.CentralStorageStrategy()
    assert central_storage_strategy.num_replicas_in_sync == len(jax.local_devices())


def test_keras_cells_give_tf_values():
    mirrored_strategy = mirrored(2)
    with mirrored_strategy.scope():
        model = keras.Sequential([keras.layers.Dense(1, input_shape=(1,),
                                                     kernel_regularizer=keras.regularizers.L2(1e-4))])
        model.compile(loss="mse", optimizer="sgd")
    model.set_weights(W0)
    dataset = distribute.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(10)
    tf = TF["guide_keras"]
    np.testing.assert_allclose(model.fit(dataset, epochs=2, verbose=0).history["loss"], tf["fit_ds"], rtol=1e-6)
    np.testing.assert_allclose(model.evaluate(dataset, verbose=0), tf["evaluate"], rtol=1e-6)
    inputs, targets = np.ones((100, 1)), np.ones((100, 1))
    np.testing.assert_allclose(model.fit(inputs, targets, epochs=2, batch_size=10, verbose=0).history["loss"],
                               tf["fit_np"], rtol=1e-6)
    for got, want in zip(model.get_weights(), tf["weights"]):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    BATCH_SIZE_PER_REPLICA = 5
    global_batch_size = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync
    LEARNING_RATES_BY_BATCH_SIZE = {5: 0.1, 10: 0.15, 20: 0.175}
    assert LEARNING_RATES_BY_BATCH_SIZE[global_batch_size] == 0.15


def test_custom_loop_cells_give_tf_values():
    mirrored_strategy = mirrored(2)
    global_batch_size = 5 * mirrored_strategy.num_replicas_in_sync
    with mirrored_strategy.scope():
        model = keras.Sequential([keras.layers.Dense(1, input_shape=(1,),
                                                     kernel_regularizer=keras.regularizers.L2(1e-4))])
        optimizer = keras.optimizers.SGD()
    model.set_weights(W0)
    dataset = distribute.data.Dataset.from_tensors(([1.0], [1.0])).repeat(1000).batch(global_batch_size)
    dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)
    loss_object = keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")

    def compute_loss(labels, predictions):
        per_example_loss = loss_object(labels, predictions)
        loss = distribute.compute_average_loss(per_example_loss)
        model_losses = model.losses
        if model_losses:
            loss += distribute.scale_regularization_loss(sum(model_losses))  # was tf.add_n
        return loss

    def train_step(inputs):
        features, labels = inputs

        with distribute.GradientTape() as tape:
            predictions = model(features, training=True)
            loss = compute_loss(labels, predictions)

        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @distribute.function
    def distributed_train_step(dist_inputs):
        per_replica_losses = mirrored_strategy.run(train_step, args=(dist_inputs,))
        return mirrored_strategy.reduce(distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    losses = [float(distributed_train_step(dist_inputs)) for dist_inputs in dist_dataset]
    iterator = iter(dist_dataset)
    losses2 = [float(distributed_train_step(next(iterator))) for _ in range(10)]
    tf = TF["guide_custom_loop"]
    assert len(losses) == len(tf["losses"]) == 100
    np.testing.assert_allclose(losses, tf["losses"], rtol=2e-6)
    np.testing.assert_allclose(losses2, tf["losses2"], rtol=2e-6)
    for got, want in zip(model.get_weights(), tf["weights"]):
        np.testing.assert_allclose(got, want, rtol=2e-6)
