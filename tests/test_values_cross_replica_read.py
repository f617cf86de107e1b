"""Cross-replica reads of distributed variables beside strategy.reduce's result, as TF 2.21
(tests/parity/tf_2_21.json, section "values", ``cross_replica_read_*``).

TF: a MirroredVariable read in cross-replica context is the copy on the current device,
else the primary copy (``MirroredVariable._get_cross_replica``); a SyncOnRead variable's
read is its aggregate; ``strategy.reduce`` puts its result on the current device.  So with
2 replicas, ``v = keras.Variable(1.0)`` and ``loss = reduce(SUM, run(lambda: 2.0))`` (4.0),
``v + loss`` is 5.0.  Here both are one device's arrays, that device the first replica's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from helpers import mirrored, tf_fixture

import distribute

TF = tf_fixture()["values"]
SHAPES = {"scalar": (), "shape_3": (3,), "shape_2x2": (2, 2)}


def _local(s, value):
    return [np.asarray(x).tolist() for x in s.experimental_local_results(value)]


def _replica_id_plus_1():
    return keras.ops.cast(distribute.get_replica_context().replica_id_in_sync_group, "float32") + 1.0


@functools.lru_cache(maxsize=None)
def _made(shape_name: str):
    """2 replicas: a MirroredVariable, a SyncOnRead SUM variable and a Mean metric of ``1``s, and the reduced loss 4.0."""
    s = mirrored(2)
    init = np.ones(SHAPES[shape_name], np.float32) if SHAPES[shape_name] else 1.0
    with s.scope():
        v = keras.Variable(init)
        w = keras.Variable(init, synchronization="on_read", aggregation="sum")
        metric = keras.metrics.Mean()
    loss = s.reduce("SUM", s.run(lambda: keras.ops.convert_to_tensor(2.0)), axis=None)
    s.run(lambda: metric.update_state(_replica_id_plus_1()))  # replicas add 1 and 2: result 1.5
    return s, v, w, metric, loss


# What each case computes, in cross-replica context (``jnp.maximum(v, ...)`` itself is refused
# by JAX for any Keras variable, distributed or not: "Triggering __jax_array__() during
# abstractification is no longer supported"; ``v.value`` is the same read).
CASES = {
    "v_plus_loss": lambda s, v, w, m, loss: v + loss,
    "loss_plus_v": lambda s, v, w, m, loss: loss + v,
    "v_times_loss": lambda s, v, w, m, loss: v * loss,
    "ops_add": lambda s, v, w, m, loss: keras.ops.add(v, loss),
    "maximum": lambda s, v, w, m, loss: jnp.maximum(v.value, loss),
    "ops_maximum": lambda s, v, w, m, loss: keras.ops.maximum(v, loss),
    "numpy": lambda s, v, w, m, loss: v.numpy(),
    "convert_to_tensor_plus_loss": lambda s, v, w, m, loss: keras.ops.convert_to_tensor(v) + loss,
    "sync_on_read_plus_loss": lambda s, v, w, m, loss: w + loss,
    "metric_result_plus_loss": lambda s, v, w, m, loss: m.result() + loss,
}


@pytest.mark.parametrize("shape_name", SHAPES)
@pytest.mark.parametrize("case", CASES)
def test_cross_replica_read_beside_a_reduced_value_matches_tf(shape_name, case):
    s, v, w, metric, loss = _made(shape_name)
    expected = TF[f"cross_replica_read_{shape_name}"]
    assert float(loss) == expected["loss"] == 4.0
    got = CASES[case](s, v, w, metric, loss)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected[case], np.float32))
    assert np.asarray(got).shape == np.asarray(expected[case]).shape


@pytest.mark.parametrize("shape_name", SHAPES)
def test_reads_and_reduced_values_live_on_the_first_replicas_device_as_tf(shape_name):
    """TF: ``v.value().device``, ``loss.device`` and ``(v + loss).device`` are all the primary's (CPU:0)."""
    s, v, w, metric, loss = _made(shape_name)
    expected = TF[f"cross_replica_read_{shape_name}"]
    assert expected["value_device"] == expected["loss_device"] == expected["v_plus_loss_device"]
    primary = {s.extended.replica_mesh.local_devices[0]}
    for read in (v.value, w.value, metric.result(), loss, v + loss, keras.ops.convert_to_tensor(v)):
        assert read.devices() == primary
    # The variables themselves stay replicated on both replicas' devices.
    assert v._value.sharding.device_set == w._value.sharding.device_set == set(s.extended.replica_mesh.devices)


@pytest.mark.parametrize("shape_name", SHAPES)
@pytest.mark.parametrize("how", ["closure", "argument"])
def test_in_replica_context_a_reduced_value_mixes_per_replica_as_tf(shape_name, how):
    """The reverse direction: inside strategy.run the variable is each replica's copy, the result per replica."""
    s, v, w, metric, loss = _made(shape_name)
    expected = TF[f"cross_replica_read_{shape_name}"]["run_v_plus_loss" if how == "closure" else "run_v_plus_loss_arg"]
    out = s.run(lambda: v + loss) if how == "closure" else s.run(lambda x: v + x, args=(loss,))
    assert isinstance(out, distribute.PerReplica)
    assert _local(s, out) == expected
    assert [x.devices() for x in s.experimental_local_results(out)] == [{d} for d in s.extended.replica_mesh.local_devices]


@pytest.mark.parametrize("shape_name", SHAPES)
def test_assign_of_a_read_plus_a_reduced_value_matches_tf(shape_name):
    expected = TF[f"cross_replica_read_{shape_name}"]["assign"]
    s = mirrored(2)
    init = np.ones(SHAPES[shape_name], np.float32) if SHAPES[shape_name] else 1.0
    with s.scope():
        v = keras.Variable(init)
    loss = s.reduce("SUM", s.run(lambda: keras.ops.convert_to_tensor(2.0)), axis=None)
    v.assign(v + loss)
    np.testing.assert_array_equal(v.numpy(), np.asarray(expected["assign_v_plus_loss"], np.float32))
    with s.scope():
        v.assign_add(loss)
    np.testing.assert_array_equal(v.numpy(), np.asarray(expected["then_assign_add_loss_in_scope"], np.float32))
    # Every replica's copy holds it (the variable is still mirrored).
    assert v._value.sharding.device_set == set(s.extended.replica_mesh.devices)
    assert _local(s, v) == [np.asarray(expected["then_assign_add_loss_in_scope"]).tolist()] * 2
    # A delta on the other replica's device is moved to the read's (TF copies it implicitly).
    v.assign_add(s.experimental_local_results(v)[1])
    np.testing.assert_array_equal(v.numpy(), 2 * np.asarray(expected["then_assign_add_loss_in_scope"], np.float32))


def test_every_reduce_and_gather_result_is_on_the_read_device():
    """Small sums (summed in the step), big ones, axis reductions, MEAN and gather alike mix with a read."""
    s = mirrored(2)
    with s.scope():
        v = keras.Variable(1.0)
    small = s.run(lambda: _replica_id_plus_1())
    big = s.run(lambda: jnp.full((100,), _replica_id_plus_1()))
    primary = {s.extended.replica_mesh.local_devices[0]}
    results = {
        "sum_small": (s.reduce("SUM", small, axis=None), 3.0),
        "mean_small": (s.reduce("MEAN", small, axis=None), 1.5),
        "sum_big": (s.reduce("SUM", big, axis=None)[7], 3.0),
        "sum_axis0": (s.reduce("SUM", big, axis=0), 300.0),
        "mean_axis0": (s.reduce("MEAN", big, axis=0), 1.5),
        "gather": (s.gather(big, 0)[150], 2.0),
    }
    for name, (value, expected) in results.items():
        assert value.devices() == primary, name
        assert float(v + value) == 1.0 + expected, name


def test_local_results_of_a_mirrored_variable_are_its_copies_on_each_device():
    s = mirrored(2)
    with s.scope():
        v = keras.Variable([1.0, 2.0])
    parts = s.experimental_local_results(v)
    assert [p.devices() for p in parts] == [{d} for d in s.extended.replica_mesh.local_devices]
    assert [np.asarray(p).tolist() for p in parts] == [[1.0, 2.0], [1.0, 2.0]]
    # A Mirrored value's components likewise (TF: one component per device).
    mirrored_value = s.extended.reduce_to("SUM", s.run(lambda: jnp.ones(2)), s.run(lambda: jnp.ones(2)))
    assert [c.devices() for c in mirrored_value.values] == [{d} for d in s.extended.replica_mesh.local_devices]


def test_jax_default_device_chooses_the_copy_read_as_tf_current_device():
    """TF reads the copy on the current device when the variable has one there."""
    s = mirrored(2)
    with s.scope():
        v = keras.Variable(1.0)
    loss = s.reduce("SUM", s.run(lambda: keras.ops.convert_to_tensor(2.0)), axis=None)
    second = s.extended.replica_mesh.local_devices[1]
    with jax.default_device(second):
        assert v.value.devices() == {second}
        assert s.reduce("SUM", s.run(lambda: keras.ops.convert_to_tensor(2.0)), axis=None).devices() == {second}
    assert float(v + loss) == 5.0  # back on the primary


def test_one_device_and_plain_variables_are_unchanged():
    with mirrored(1).scope():
        one = keras.Variable(1.0)
    plain = keras.Variable(1.0)
    assert one.value is one._value and plain.value is plain._value


class _NoDeviceToDeviceTransfers(keras.callbacks.Callback):
    """Forbids device-to-device copies during each epoch's steps (Keras' reset_metrics at epoch start assigns zeros)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.guard = jax.transfer_guard_device_to_device("disallow_explicit")
        self.guard.__enter__()

    def on_epoch_end(self, epoch, logs=None):
        self.guard.__exit__(None, None, None)


def test_fit_and_run_take_the_variables_replicated_arrays_with_no_transfer():
    """The cross-replica read is not what programs take: fit's state and run's inputs are the replicated arrays.

    Steady-state steps under a device-to-device transfer guard prove that no
    variable is copied between devices per step (one device's read handed to the
    SPMD step would be refused by the compiled step or copied).
    """
    s = mirrored(2)
    with s.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
        v = keras.Variable(1.0)
    state = model._get_jax_state(trainable_variables=True, metrics_variables=True)
    assert all(a is var._value for a, var in zip(state[0] + state[1], model.trainable_variables + model.metrics_variables))
    x, y = np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32)

    def step():
        v.assign(v + 1.0)  # the same on every replica: the variable becomes 2.0, 3.0, ...

    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # compiles
    s.run(step)
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[_NoDeviceToDeviceTransfers()])
    with jax.transfer_guard_device_to_device("disallow_explicit"):
        s.run(step)
        s.run(step)
        assert float(v + s.reduce("SUM", s.run(lambda: keras.ops.convert_to_tensor(2.0)), axis=None)) == 8.0
    assert float(v) == 4.0
    assert len(history.history["loss"]) == 2
    for var in model.variables:
        assert var._value.sharding.device_set == set(s.extended.replica_mesh.devices)
