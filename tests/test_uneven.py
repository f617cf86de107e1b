"""Exact uneven steps: every replica sees exactly its real rows, for any replica code.

TF 2.21's values (tests/parity/record_tf_uneven.py) for arbitrary functions of an
uneven batch, BatchNorm statistics with an empty replica equal to one device
(where TF is wrong), synchronized BatchNorm, and the uneven step's failure modes.
"""

from __future__ import annotations

import jax.numpy as jnp
import keras
import numpy as np
import pytest

import distribute
from distribute.data import Dataset
from helpers import local_lists, mirrored, tf_fixture


def _first_batch(strategy, values, batch):
    data = Dataset.from_tensor_slices(np.asarray(values, np.float32)).batch(batch)
    return next(iter(strategy.experimental_distribute_dataset(data)))


def _ctx():
    return distribute.get_replica_context()


CASES = {
    "mean": (lambda v: keras.ops.mean(v), {}),
    "size": (lambda v: keras.ops.size(v), {}),
    "softmax_rows": (lambda v: keras.ops.softmax(v, axis=0), {}),
    "row_sum_axis0": (lambda v: keras.ops.sum(keras.ops.stack([v, 2 * v], axis=1), axis=0), {}),
    "all_reduce_mean_of_mean": (lambda v: _ctx().all_reduce("MEAN", keras.ops.mean(v)), {}),
    "all_reduce_sum_of_sum": (lambda v: _ctx().all_reduce("SUM", keras.ops.sum(v)), {}),
    "all_gather_rows": (lambda v: _ctx().all_gather(v, 0), {}),
    "shape0": (lambda v: keras.ops.shape(v)[0], {}),
    "empty_replica_sum": (lambda v: jnp.sum(v), {"values": (3.0,), "batch": 4}),
    "empty_replica_shape": (lambda v: v.shape[0], {"values": (3.0,), "batch": 4}),
    "three_replicas_mean": (lambda v: jnp.mean(v), {"values": (1.0, 2.0, 3.0, 4.0, 5.0), "batch": 6, "n": 3}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_replica_code_sees_real_rows_as_tf(name):
    fn, options = CASES[name]
    strategy = mirrored(options.get("n", 2))
    x = _first_batch(strategy, options.get("values", (5.0, 6.0, 7.0)), options.get("batch", 4))
    got = local_lists(strategy, strategy.run(fn, args=(x,)))
    expected = tf_fixture()["uneven"][name]["eager"]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(e, np.float64), rtol=1e-6)


def test_empty_replica_sees_shape_zero_and_reduce_is_exact():
    s = mirrored(2)
    x = _first_batch(s, (3.0,), 4)
    shapes = local_lists(s, s.run(lambda v: jnp.asarray(v.shape), args=(x,)))
    assert shapes == [[1], [0]]
    assert float(s.reduce("SUM", s.run(jnp.sum, args=(x,)), axis=None)) == 3.0
    assert float(s.reduce("MEAN", x, axis=0)) == 3.0


def test_full_steps_stay_one_spmd_program_and_uneven_matches_one_device():
    s = mirrored(4)
    calls = [0]

    def fn(v):
        calls[0] += 1
        return jnp.sum(jnp.tanh(v)) / 7.0, _ctx().all_reduce("SUM", jnp.max(v, initial=-1.0))

    data = Dataset.range(11).map(lambda i: np.float32(i)).batch(4)  # 4 | 4 | 3 rows
    outs = [s.run(fn, args=(x,)) for x in s.experimental_distribute_dataset(data)]
    # Full steps: one trace; the uneven step (3 rows over 4 replicas: 1 | 1 | 1 | 0): once per replica shape.
    assert calls[0] == 1 + 2
    total = sum(float(s.reduce("SUM", o[0], axis=None)) for o in outs)
    np.testing.assert_allclose(total, np.sum(np.tanh(np.arange(11.0))) / 7.0, rtol=1e-6)
    assert local_lists(s, outs[-1][1]) == [8.0 + 9.0 + 10.0 - 1.0] * 4


def test_gradient_through_all_reduce_in_uneven_step_equals_one_device():
    s = mirrored(2)
    with s.scope():
        w = keras.Variable(np.array([1.5, -0.5], np.float32))
    x_host = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)

    def step(x):
        def loss_fn():
            total = _ctx().all_reduce("SUM", jnp.sum(x @ w.value))  # the whole batch's sum, on every replica
            return jnp.square(total) / s.num_replicas_in_sync
        loss, grads = distribute.compute_gradients(loss_fn, [w])
        return grads[0]

    x = next(iter(s.experimental_distribute_dataset(Dataset.from_tensor_slices(x_host).batch(4))))
    grads = np.sum(local_lists(s, s.run(step, args=(x,))), axis=0)  # what apply_gradients sums
    total = np.sum(x_host @ np.array([1.5, -0.5]))
    np.testing.assert_allclose(grads, 2 * total * x_host.sum(axis=0), rtol=1e-6)


def test_a_replica_that_skips_a_collective_fails_instead_of_hanging():
    s = mirrored(2)
    x = _first_batch(s, (3.0,), 4)  # [3.] | []

    def fn(v):
        if v.shape[0]:
            return _ctx().all_reduce("SUM", jnp.sum(v))
        return jnp.zeros(())

    with pytest.raises(RuntimeError, match="same collective calls"):
        s.run(fn, args=(x,))


def test_an_error_in_one_replica_is_raised_and_others_stop():
    s = mirrored(2)
    x = _first_batch(s, (5.0, 6.0, 7.0), 4)

    def fn(v):
        if v.shape[0] == 1:
            raise KeyError("replica 1 failed")
        return _ctx().all_reduce("SUM", jnp.sum(v))

    with pytest.raises(KeyError, match="replica 1 failed"):
        s.run(fn, args=(x,))
    # The strategy still works afterwards.
    assert local_lists(s, s.run(lambda v: _ctx().all_reduce("SUM", jnp.sum(v)), args=(x,))) == [18.0, 18.0]


def test_collective_under_jit_in_uneven_step_is_exact_and_under_vmap_a_clear_error():
    import jax

    s = mirrored(2)
    x = _first_batch(s, (5.0, 6.0, 7.0), 4)
    # On one worker the replica programs are compiled and a collective is a callback: jit inside works.
    got = s.run(lambda v: jax.jit(lambda u: _ctx().all_reduce("SUM", jnp.sum(u)))(v), args=(x,))
    assert local_lists(s, got) == [18.0, 18.0]
    with pytest.raises(TypeError, match="under a JAX transformation"):
        s.run(lambda v: jax.vmap(lambda u: _ctx().all_reduce("SUM", u))(v), args=(x,))


# -- BatchNorm -------------------------------------------------------------------------------
def _bn_model(synchronized=False, momentum=0.5):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((2,)),
        keras.layers.Dense(3, kernel_initializer="ones"),
        keras.layers.BatchNormalization(momentum=momentum, synchronized=synchronized),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def test_batch_norm_empty_replica_contributes_nothing_in_fit():
    x = np.arange(18, dtype=np.float32).reshape(9, 2)
    y = np.zeros((9, 1), np.float32)
    recorded = tf_fixture()["uneven"]
    with mirrored(2).scope():
        model = _bn_model()
    model.fit(x, y, batch_size=4, shuffle=False, epochs=1, verbose=0)
    bn = model.layers[1]
    # One device's value (TF's MirroredStrategy gives 21.625: its empty replica pulls it down).
    np.testing.assert_allclose(np.asarray(bn.moving_mean), recorded["batch_norm_fit_one_device"]["moving_mean"], rtol=1e-6)
    # Per-replica (unsynchronized) variances are over each replica's rows, as in TF.
    np.testing.assert_allclose(np.asarray(bn.moving_variance), recorded["batch_norm_fit_mirrored2"]["moving_variance"], rtol=1e-5)
    assert recorded["batch_norm_fit_mirrored2"]["moving_mean"][0] == 21.625
    assert np.all(np.isfinite(np.concatenate([np.ravel(w) for w in model.get_weights()])))


def test_batch_norm_empty_replica_contributes_nothing_in_custom_loop():
    x = np.arange(18, dtype=np.float32).reshape(9, 2)
    s = mirrored(2)
    with s.scope():
        model = _bn_model()

    def step(xb):
        return model(xb, training=True)

    for xb in s.experimental_distribute_dataset(Dataset.from_tensor_slices(x).batch(4)):
        s.run(step, args=(xb,))
    np.testing.assert_allclose(np.asarray(model.layers[1].moving_mean), tf_fixture()["uneven"]["batch_norm_fit_one_device"]["moving_mean"], rtol=1e-6)


@pytest.mark.parametrize("eager", [False, True])
def test_an_empty_replicas_nan_does_not_reach_a_mean_variable(eager):
    """2 rows over 4 replicas (1 | 1 | 0 | 0): the empty replicas assign the mean of no rows, NaN.

    A ``mean`` variable is the mean over the replicas with rows, one device's mean of the batch (6.0):
    an empty replica contributes nothing, where a zero weight times its NaN would still be NaN.
    Compiled per-replica programs (the two empty replicas share one) and the eager threads alike.
    """
    s = mirrored(4)
    with s.scope():
        variable = keras.Variable(0.0, trainable=False, aggregation="mean")
    x = _first_batch(s, (5.0, 7.0), 8)

    ran_eagerly = []

    def step(v):
        if eager:
            _ctx().all_gather(v, 0)  # its shape depends on the other replicas: one thread per replica
        ran_eagerly.append(bool(getattr(_ctx(), "_runs_eagerly", False)))
        variable.assign(jnp.mean(v))
        return jnp.mean(v)

    means = local_lists(s, s.run(step, args=(x,)))
    assert any(ran_eagerly) == eager  # (also traced: the variables, and the per-replica programs tried)
    assert means[:2] == [5.0, 7.0] and np.isnan(means[2:]).all()
    assert float(variable.numpy()) == float(np.mean([5.0, 7.0]))


@pytest.mark.parametrize("num_samples", [32, 34])
def test_synchronized_batch_norm_equals_one_device(num_samples):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_samples, 3)).astype("float32")
    y = rng.normal(size=(num_samples, 1)).astype("float32")

    def build(synchronized):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                  keras.layers.BatchNormalization(synchronized=synchronized, momentum=0.5), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    reference = build(False)
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    with mirrored(4).scope():
        model = build(True)
    model.set_weights(initial)
    got = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    for a, b in zip(model.get_weights(), reference.get_weights()):  # moving statistics included
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-4, atol=1e-5)
    assert model.layers[1].get_config()["synchronized"] is True


def test_replica_code_that_cannot_be_one_program_runs_per_replica_as_tf():
    # TF's testReduceAxisToCpu: a shape that depends on the replica id.
    s = mirrored(2)
    rid = lambda: _ctx().replica_id_in_sync_group  # noqa: E731
    with pytest.warns(UserWarning, match="runs eagerly on every replica"):
        value = s.run(lambda: jnp.full([int(rid()) + 1], rid()))
    assert local_lists(s, value) == [[0], [1, 1]]
    assert float(s.reduce("SUM", value, axis=0)) == 2.0
    np.testing.assert_allclose(float(s.reduce("MEAN", value, axis=0)), 2.0 / 3.0, rtol=1e-6)
    # A Python branch on a value, as TF's eager mode allows.
    x = _first_batch(s, (1.0, 2.0, 30.0, 40.0), 4)
    got = local_lists(s, s.run(lambda v: v * 2 if float(jnp.sum(v)) > 10 else v, args=(x,)))
    assert got == [[1.0, 2.0], [60.0, 80.0]]


def test_uneven_step_collective_of_a_constant_is_exact():
    # A collective of a value that does not depend on the inputs (a constant) is part of the compiled
    # replica program too: every replica counts once, in order with the others' collectives.
    s = mirrored(2)
    x = _first_batch(s, (5.0, 6.0, 7.0), 4)  # 2 | 1
    got = s.run(lambda v: (_ctx().all_reduce("SUM", 1.0), _ctx().all_reduce("SUM", jnp.sum(v))), args=(x,))
    assert local_lists(s, got[0]) == [2.0, 2.0]
    assert local_lists(s, got[1]) == [18.0, 18.0]
