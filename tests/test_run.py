"""strategy.run: compilation caching, pure-JAX pytrees, mirrored variables, gradients and metrics vs one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import distribute
from distribute.data import Dataset
from helpers import local_lists, mirrored


# -- compilation ------------------------------------------------------------------------------
def test_run_traces_once_per_input_signature():
    s = mirrored(2)
    traces = [0]

    def fn(x):
        traces[0] += 1
        return x * 2.0 + 1.0

    dataset = Dataset.range(403).map(lambda i: np.float32(i)).batch(4)  # 100 full steps + [400,401,402]
    dist = s.experimental_distribute_dataset(dataset)
    counts, results = [], []
    for x in dist:
        results.append(np.asarray(s.gather(s.run(fn, args=(x,)), axis=0)))
        counts.append(traces[0])
    assert len(counts) == 101
    assert 1 <= counts[0] <= 2
    assert counts[99] == counts[0], "no retrace across 100 steps with the same shapes"
    # The uneven last batch (rows 2 | 1) traces fn once per distinct replica shape, on its real rows.
    assert counts[100] - counts[99] == 2
    np.testing.assert_array_equal(np.concatenate(results), np.arange(403, dtype=np.float32) * 2.0 + 1.0)
    before = traces[0]
    for x in dist:  # a second epoch reuses both programs
        s.run(fn, args=(x,))
    assert traces[0] == before  # both the full and the uneven step's programs are reused


def test_run_traces_stateful_keras_step_once_across_steps():
    s = mirrored(2)
    with s.scope():
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
        optimizer = keras.optimizers.SGD(0.01)
    traces = [0]

    def step(x):
        traces[0] += 1
        loss, grads = distribute.compute_gradients(
            lambda: distribute.compute_average_loss(jnp.sum(layer(x) ** 2, axis=-1)), layer.trainable_variables
        )
        optimizer.apply_gradients(zip(grads, layer.trainable_variables))
        return loss

    data = np.ones((8 * 30 + 3, 3), np.float32)
    counts = []
    for epoch in range(2):
        for x in s.experimental_distribute_dataset(Dataset.from_tensor_slices(data).batch(8)):
            s.run(step, args=(x,))
            counts.append(traces[0])
    steps = 31
    assert counts[0] <= 2
    assert counts[steps - 2] == counts[0]
    assert counts[steps - 1] - counts[steps - 2] == 2  # the uneven step (rows 2 | 1): once per replica shape
    assert counts[-1] == counts[steps - 1], "the second epoch traces nothing"
    assert int(optimizer.iterations.value) == 2 * steps


# -- pure JAX ---------------------------------------------------------------------------------
def test_pure_jax_pytree_in_and_out():
    s = mirrored(2)
    a = s.experimental_distribute_values_from_function(
        lambda ctx: np.full((2, 3), ctx.replica_id_in_sync_group + 1.0, np.float32)
    )
    b = np.arange(3, dtype=np.float32)

    def fn(inputs):
        total = inputs["a"] + inputs["b"]
        return total, jnp.sum(total), distribute.get_replica_context().all_reduce("SUM", jnp.sum(inputs["a"]))

    total, local_sum, global_sum = s.run(fn, args=({"a": a, "b": b},))
    assert local_lists(s, total) == [[[1.0, 2.0, 3.0]] * 2, [[2.0, 3.0, 4.0]] * 2]
    assert local_lists(s, local_sum) == [12.0, 18.0]
    assert local_lists(s, global_sum) == [18.0, 18.0]
    assert np.asarray(s.gather(total, axis=0)).shape == (4, 3)


def test_run_with_python_constants_and_kwargs():
    s = mirrored(2)
    x = s.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
    out = s.run(lambda v, scale, offset=0.0: v * scale + offset, args=(x, 3.0), kwargs={"offset": 1.0})
    assert local_lists(s, out) == [1.0, 4.0]
    out = s.run(lambda v, scale, offset=0.0: v * scale + offset, args=[x, 2.0])
    assert local_lists(s, out) == [0.0, 2.0]


# -- mirrored variables -------------------------------------------------------------------------
def _assert_mirrored(variable, strategy):
    value = variable._value  # the storage: a copy per replica (a cross-replica read is one device's, as TF)
    devices = set(strategy.extended.replica_mesh.devices)
    assert value.sharding.device_set == devices
    assert value.sharding.is_fully_replicated
    shards = [np.asarray(sh.data) for sh in value.addressable_shards]
    assert len(shards) == len(devices)
    for shard in shards[1:]:
        np.testing.assert_array_equal(shard, shards[0])


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])


def _data(n=37, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = rng.normal(size=(n, 3)).astype(np.float32)
    return x, y


def _single_device_loop(weights, make_optimizer, x, y, batch):
    model = _mlp()
    model.set_weights(weights)
    optimizer = make_optimizer()
    losses = []
    for start in range(0, len(x), batch):
        xb, yb = x[start : start + batch], y[start : start + batch]
        loss, grads = distribute.compute_gradients(
            lambda: distribute.compute_average_loss(jnp.mean((model(xb, training=True) - yb) ** 2, axis=-1)),
            model.trainable_variables,
        )
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return model.get_weights(), losses


def _distributed_loop(strategy, weights, make_optimizer, x, y, batch):
    with strategy.scope():
        model = _mlp()
        model.set_weights(weights)
        optimizer = make_optimizer()

    def step(xb, yb):
        loss, grads = distribute.compute_gradients(
            lambda: distribute.compute_average_loss(jnp.mean((model(xb, training=True) - yb) ** 2, axis=-1)),
            model.trainable_variables,
        )
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = []
    for xb, yb in strategy.experimental_distribute_dataset(Dataset.from_tensor_slices((x, y)).batch(batch)):
        losses.append(float(strategy.reduce("SUM", strategy.run(step, args=(xb, yb)), axis=None)))
    return model, optimizer, losses


@pytest.fixture(scope="module")
def initial_weights():
    return _mlp().get_weights()


@pytest.mark.parametrize("num_replicas", [2, 4])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_custom_loop_equals_single_device(num_replicas, opt, initial_weights):
    make = (lambda: keras.optimizers.SGD(0.1)) if opt == "sgd" else (lambda: keras.optimizers.Adam(0.01))
    x, y = _data()  # 37 rows, batch 16: the last batch (5 rows) is padded on every replica count
    expected_weights, expected_losses = _single_device_loop(initial_weights, make, x, y, 16)
    s = mirrored(num_replicas)
    model, optimizer, losses = _distributed_loop(s, initial_weights, make, x, y, 16)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(model.get_weights(), expected_weights):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    for variable in list(model.variables) + list(optimizer.variables):
        _assert_mirrored(variable, s)
    assert int(optimizer.iterations.value) == 3


def test_variables_created_in_scope_are_mirrored():
    s = mirrored(4)
    with s.scope():
        layer = keras.layers.Dense(5)
        layer.build((None, 3))
        optimizer = keras.optimizers.Adam()
        optimizer.build(layer.trainable_variables)
        metric = keras.metrics.Mean()
    for variable in list(layer.variables) + list(optimizer.variables) + list(metric.variables):
        _assert_mirrored(variable, s)
        assert s.extended.variable_created_in_scope(variable)
    outside = keras.layers.Dense(2)
    outside.build((None, 3))
    assert not s.extended.variable_created_in_scope(outside.kernel)


# -- metrics -------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_replicas", [2, 3, 4])
def test_metrics_updated_in_run_aggregate_real_examples_only(num_replicas):
    rng = np.random.default_rng(num_replicas)
    n, batch = 23, 8  # last batch 7 rows: padded on every replica count here
    logits = rng.normal(size=(n, 4)).astype(np.float32)
    labels = rng.integers(0, 4, size=(n,)).astype(np.int32)
    values = rng.normal(size=(n,)).astype(np.float32)

    ref_mean, ref_acc = keras.metrics.Mean(), keras.metrics.SparseCategoricalAccuracy()
    ref_mean.update_state(values)
    ref_acc.update_state(labels, logits)

    s = mirrored(num_replicas)
    with s.scope():
        mean, acc = keras.metrics.Mean(), keras.metrics.SparseCategoricalAccuracy()

    def step(v, label, logit):
        mean.update_state(v)
        acc.update_state(label, logit)
        return v

    dist = s.experimental_distribute_dataset(Dataset.from_tensor_slices((values, labels, logits)).batch(batch))
    for v, label, logit in dist:
        s.run(step, args=(v, label, logit))
    np.testing.assert_allclose(float(mean.result()), float(ref_mean.result()), rtol=1e-6)
    np.testing.assert_allclose(float(acc.result()), float(ref_acc.result()), rtol=1e-6)
    assert float(mean.count.value) == n
    for variable in list(mean.variables) + list(acc.variables):
        _assert_mirrored(variable, s)


def test_many_queued_steps_on_cpu_devices_do_not_deadlock(tmp_path):
    # XLA:CPU could wait for ever in an all-reduce rendezvous when hundreds of
    # collective steps were queued on virtual devices; the strategy bounds them.
    script = tmp_path / "many_steps.py"
    script.write_text(
        "import os\n"
        "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'\n"
        "import numpy as np, distribute, keras\n"
        "strategy = distribute.MirroredStrategy()\n"
        "with strategy.scope():\n"
        "    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation='relu'), keras.layers.Dense(10)])\n"
        "    model.compile(optimizer='adam', loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n"
        "x = np.random.default_rng(0).random((40000, 784), dtype=np.float32)\n"
        "y = np.random.default_rng(1).integers(0, 10, 40000)\n"
        "model.fit(x, y, batch_size=128, epochs=2, verbose=0)\n"
        "assert len(strategy.extended._in_flight) <= 2\n"
        "print('done')\n"
    )
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("done")


def test_small_outputs_reduce_without_a_second_program_and_agree_with_the_general_path():
    strategy = mirrored(2)
    values = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))

    def step(v):
        return {"loss": v * 2.0, "flag": v > 1.0, "key": jax.random.key(0), "big": jnp.full((100,), v)}

    out = strategy.run(step, args=(values,))
    assert out["loss"]._sum is not None and out["big"]._sum is None and out["flag"]._sum is None
    assert float(strategy.reduce("SUM", out["loss"], axis=None)) == 6.0
    assert float(strategy.reduce("MEAN", out["loss"], axis=None)) == 3.0
    general = distribute.PerReplica._from_array(strategy, out["loss"]._array)  # no fused sum
    assert float(strategy.reduce("SUM", general, axis=None)) == 6.0
    np.testing.assert_allclose(strategy.reduce("SUM", out["big"], axis=None), np.full((100,), 3.0))


def test_reducing_a_steps_own_sum_queues_no_program():
    # The in-flight bound counts programs; strategy.reduce(SUM, step output) only reads the
    # sum the step's program made, so it must not take a step's place in the queue.
    strategy = mirrored(2)
    values = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))
    out = strategy.run(lambda v: v * 2.0, args=(values,))
    in_flight = strategy.extended._in_flight
    queued, last = len(in_flight), in_flight[-1]
    total = strategy.reduce("SUM", out, axis=None)
    assert float(total) == 6.0
    assert len(in_flight) == queued and in_flight[-1] is last
    mean = strategy.reduce("MEAN", out, axis=None)  # divides: a program of its own, counted
    assert float(mean) == 3.0 and in_flight[-1][0] is mean
    general = distribute.PerReplica._from_array(strategy, out._array)  # no fused sum: reduced by a program
    total = strategy.reduce("SUM", general, axis=None)
    assert float(total) == 6.0 and in_flight[-1][0] is total
