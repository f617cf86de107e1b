"""TF's custom-training-loop metric and optimizer tests, ported by substitution only.

Sources: tensorflow/tensorflow tensorflow/python/distribute/custom_training_loop_metrics_test.py and
custom_training_loop_optimizer_test.py, with the later cases of their tf-keras copies
(keras-team/tf-keras tf_keras/distribute/custom_training_loop_metrics_test.py:
``test_update_keras_metrics_dynamic_shape``). Substitutions: tf.distribute -> distribute,
dataset_ops.Dataset -> distribute.data.Dataset, keras.metrics -> keras.metrics (Keras 3),
constant_op.constant / ops.convert_to_tensor -> jnp.asarray, variables.Variable -> keras.Variable,
keras.optimizer_v2.gradient_descent.SGD -> keras.optimizers.SGD, values.PerReplica ->
distribute.PerReplica, ``v.read_value()`` -> ``v.value``, ``t.numpy()`` -> ``np.asarray(t)`` (a JAX array), @def_function.function dropped.
``strategy_combinations.all_strategies`` -> the default strategy, OneDeviceStrategy, MirroredStrategy
over 1 and over 2 CPU devices; ``multidevice_strategies`` -> MirroredStrategy over 2.

The expected numbers are the tests' own assertions. TensorFlow 2.21 runs these files with Keras 3 as
``tf.keras``, where ``apply_gradients`` has no ``experimental_aggregate_gradients`` argument: TF 2.21
raises ``TypeError`` for it (recorded: tests/parity/record_tf_reports.py), and so do we; its default (aggregate) case
gives TF's [[-0.3, -0.3], [-0.3, -0.3]] (recorded on TF 2.21 + Keras 3.15 with 2 CPU devices).
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import keras
import numpy as np
import pytest
from helpers import mirrored

import distribute
from distribute.data import Dataset

# TF 2.21's answers, recorded by tests/parity/record_tf_reports.py (2 logical CPU devices)
TF = json.loads((pathlib.Path(__file__).parent / "parity" / "tf_2_21_reports.json").read_text())

ALL_STRATEGIES = ["default", "one_device", "mirrored_1", "mirrored_2"]


def make(name):
    if name == "default":
        return distribute.get_strategy()
    if name == "one_device":
        return distribute.OneDeviceStrategy("/cpu:0")
    return mirrored(int(name.rsplit("_", 1)[1]))


# -- custom_training_loop_metrics_test.py -------------------------------------------------------


@pytest.mark.parametrize("name", ALL_STRATEGIES)
def test_multiple_keras_metrics_experimental_run(name):
    distribution = make(name)
    with distribution.scope():
        loss_metric = keras.metrics.Mean("loss", dtype=np.float32)
        loss_metric_2 = keras.metrics.Mean("loss_2", dtype=np.float32)

    def train_step():
        def step_fn():
            loss = jnp.asarray(5.0, dtype=np.float32)
            loss_metric.update_state(loss)
            loss_metric_2.update_state(loss)

        distribution.run(step_fn)

    train_step()
    assert np.asarray(loss_metric.result()) == np.asarray(loss_metric_2.result())
    assert np.asarray(loss_metric.result()) == 5.0


@pytest.mark.parametrize("name", ALL_STRATEGIES)
def test_update_keras_metric_declared_in_strategy_scope(name):
    distribution = make(name)
    with distribution.scope():
        metric = keras.metrics.Mean("test_metric", dtype=np.float32)

    dataset = Dataset.range(10).batch(2)
    dataset = distribution.experimental_distribute_dataset(dataset)

    def step_fn(i):
        metric.update_state(i)

    for i in dataset:
        distribution.run(step_fn, args=(i,))

    # This should be the mean of integers 0-9 which has a sum of 45 and a count
    # of 10 resulting in mean of 4.5.
    assert np.asarray(metric.result()) == 4.5


@pytest.mark.parametrize("name", ALL_STRATEGIES)
def test_update_keras_metric_outside_strategy_scope_cross_replica(name):
    distribution = make(name)
    metric = keras.metrics.Mean("test_metric", dtype=np.float32)

    with distribution.scope():
        for i in range(10):
            metric.update_state(i)

    assert np.asarray(metric.result()) == 4.5


@pytest.mark.parametrize("name", ALL_STRATEGIES)
def test_update_keras_metrics_dynamic_shape(name):
    distribution = make(name)
    with distribution.scope():
        metric = keras.metrics.Mean("test_metric", dtype=np.float32)

    dataset = Dataset.range(10).batch(2, drop_remainder=False)

    def train_fn(dataset):
        weights = jnp.asarray([0.1, 0.1])

        def step_fn(i):
            metric.update_state(i, weights)

        for i in dataset:
            distribution.run(step_fn, args=(i,))

    train_fn(dataset)
    # every replica gets the whole (undistributed) batch: the mean is still 4.5
    assert np.asarray(metric.result()) == pytest.approx(4.5, abs=1e-6)


# -- custom_training_loop_optimizer_test.py -----------------------------------------------------


def _custom_aggregation(distribution, grads_fn):
    with distribution.scope():
        v = keras.Variable([0., 0.])
        optimizer = keras.optimizers.SGD(0.1)

    def optimize():
        grads = grads_fn()

        def step_fn(grads):
            optimizer.apply_gradients([(grads, v)])
            return v.value

        return distribution.experimental_local_results(distribution.run(step_fn, args=(grads,)))

    return [np.asarray(x).tolist() for x in optimize()]


def test_custom_aggregation_per_replica_built_outside_scope():
    """TF's PerReplica is plain data placed by the run it is given to: built outside any scope, it works."""
    got = _custom_aggregation(mirrored(2), lambda: distribute.PerReplica([
        jnp.asarray([1., 1.]), jnp.asarray([2., 2.])]))
    np.testing.assert_allclose(got, [[-0.3, -0.3], [-0.3, -0.3]], rtol=1e-6)


def test_custom_aggregation_aggregates_gradients():
    """The default (experimental_aggregate_gradients=True) case, its PerReplica built in scope."""
    distribution = mirrored(2)

    def grads():
        with distribution.scope():  # built inside the scope: placed at once
            return distribute.PerReplica([jnp.asarray([1., 1.]), jnp.asarray([2., 2.])])

    np.testing.assert_allclose(TF["custom_aggregation"]["None"], [[-0.3, -0.3], [-0.3, -0.3]], rtol=1e-6)
    np.testing.assert_allclose(_custom_aggregation(distribution, grads), [[-0.3, -0.3], [-0.3, -0.3]], rtol=1e-6)


@pytest.mark.parametrize("experimental_aggregate_gradients", [True, False])
def test_experimental_aggregate_gradients_is_not_a_keras3_argument(experimental_aggregate_gradients):
    """TF 2.21 with Keras 3 raises TypeError for the argument (recorded); so do we, on any strategy."""
    assert TF["custom_aggregation"][str(experimental_aggregate_gradients)]["error"] == "TypeError"
    distribution = mirrored(2)
    with distribution.scope():
        v = keras.Variable([0., 0.])
        optimizer = keras.optimizers.SGD(0.1)
        grads = distribute.PerReplica([jnp.asarray([1., 1.]), jnp.asarray([2., 2.])])

    def step_fn(grads):
        optimizer.apply_gradients([(grads, v)], experimental_aggregate_gradients=experimental_aggregate_gradients)

    with pytest.raises(TypeError, match="experimental_aggregate_gradients"):
        distribution.run(step_fn, args=(grads,))
    np.testing.assert_array_equal(np.asarray(v.value), [0., 0.])


@pytest.mark.parametrize("name", ["one_device", "default"])
def test_custom_aggregation_one_device(name):
    got = _custom_aggregation(make(name), lambda: jnp.asarray([1., 1.]))
    np.testing.assert_allclose(got, [[-0.1, -0.1]], rtol=1e-6)
