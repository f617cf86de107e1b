"""Large ParameterServerStrategy variables live on their ps only (issue 27): made there, read and checkpointed there.

``registry.REMOTE_BYTES`` is lowered to 0 for this module, so every non-scalar
variable is *remote* (the coordinator holds ``OnPs``: shape and dtype, no
values) and small tables exercise the paths a 3 GB table takes.  Expected
values: Keras' own initializers on one device (an unpartitioned variable), and
the documented rule for a partitioned one (docs/tf_compat.md: each shard drawn
on its own with ``jax.random.fold_in(key, first row)``).
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

import distribute
from distribute.coordinator import ClusterCoordinator
from distribute.parameter_server import registry
from distribute.parameter_server.registry import OnPs

MinSizePartitioner = distribute.experimental.partitioners.MinSizePartitioner


@pytest.fixture(scope="module")
def remote_everything():
    saved, registry.REMOTE_BYTES = registry.REMOTE_BYTES, 0
    yield
    registry.REMOTE_BYTES = saved


@pytest.fixture(scope="module")
def two_ps(ray_instance, remote_everything):
    # (40, 4) float32 = 640 bytes: 2 shards of 20 rows; (4, 4) = 64 bytes: 1 shard.
    partitioner = MinSizePartitioner(min_shard_bytes=256, max_shards=2)
    strategy = distribute.ParameterServerStrategy(num_workers=1, num_ps=2, variable_partitioner=partitioner)
    yield strategy, ClusterCoordinator(strategy)
    strategy._shutdown()


def _ps_values(strategy, variable):
    """The variable's value as its ps hold it (read there directly)."""
    cluster, entry = strategy.extended._cluster, strategy.extended._registry.entry(variable)
    stored = {}
    for part in cluster.get_from_ps([ps.read_all.remote() for ps in cluster.ps]):
        stored.update(part)
    return [stored[s.key] for s in entry.shards]


def test_variables_are_made_on_their_ps_per_seed_and_layout(two_ps):
    strategy, coordinator = two_ps
    init = keras.initializers
    with strategy.scope():
        glorot = keras.Variable(init.GlorotUniform(seed=5)((4, 4)) * 0 + 0, name="unused")  # an array: sent, not made
        kernel = keras.Variable(init.GlorotUniform(seed=5), shape=(4, 4), name="kernel")
        normal = keras.Variable(init.RandomNormal(0.5, 2.0, seed=6), shape=(4, 4), name="normal")
        truncated = keras.Variable(init.TruncatedNormal(1.0, 0.1, seed=8), shape=(4, 4), name="truncated")
        table = keras.Variable(init.RandomUniform(-1.0, 1.0, seed=7), shape=(40, 4), name="table")
        he = keras.Variable(init.HeNormal(seed=9), shape=(40, 4), name="he")
        ones = keras.Variable(init.Ones(), shape=(40, 4), name="ones")
        given = keras.Variable(np.arange(160, dtype=np.float32).reshape(40, 4), name="given")
    for v in (glorot, kernel, normal, truncated, table, he, ones, given):
        assert isinstance(v._value, OnPs), v.path  # the coordinator holds shape and dtype only
    # One shard: exactly Keras' value on one device (same key, shape and JAX calls).
    for v, want in ((kernel, init.GlorotUniform(seed=5)((4, 4))), (normal, init.RandomNormal(0.5, 2.0, seed=6)((4, 4))),
                    (truncated, init.TruncatedNormal(1.0, 0.1, seed=8)((4, 4)))):
        np.testing.assert_array_equal(_ps_values(strategy, v)[0], np.asarray(want))
        np.testing.assert_array_equal(v.numpy(), np.asarray(want))  # a read gathers it from the ps
    # Two shards of 20 rows: each drawn on its own, key fold_in([seed, 0], first row), the full shape's scale.
    key = np.asarray([7, 0], np.uint32)
    want = [jax.random.uniform(jax.random.fold_in(key, start), (20, 4), "float32", -1.0, 1.0) for start in (0, 20)]
    for got, expected in zip(_ps_values(strategy, table), want):
        np.testing.assert_array_equal(got, np.asarray(expected))
    np.testing.assert_array_equal(table.numpy(), np.concatenate(want))
    stddev = np.sqrt(2.0 / 40) / 0.87962566103423978  # HeNormal: fan_in of the full (40, 4) shape
    want = [jax.random.truncated_normal(jax.random.fold_in(np.asarray([9, 0], np.uint32), start), -2.0, 2.0, (20, 4),
                                        "float32") * stddev for start in (0, 20)]
    np.testing.assert_array_equal(he.numpy(), np.concatenate(want))
    np.testing.assert_array_equal(ones.numpy(), np.ones((40, 4), np.float32))
    np.testing.assert_array_equal(given.numpy(), np.arange(160).reshape(40, 4))
    assert isinstance(given._value, OnPs)  # reads keep nothing

    # Training, coordinator assignments and shard assignments reach the ps; the coordinator still holds nothing.
    with strategy.scope():
        optimizer = keras.optimizers.Adam(0.1)

    def step(ids):
        _, grads = distribute.compute_gradients(lambda: keras.ops.sum(keras.ops.take(given, ids, axis=0)), [given])
        optimizer.apply_gradients(zip(grads, [given]))

    coordinator.schedule(step, args=(np.asarray([0, 39], np.int32),))
    coordinator.join()
    slots = [v for v in optimizer.variables if tuple(v.shape) == (40, 4)]
    assert slots and all(isinstance(v._value, OnPs) for v in slots)  # Adam's slots are made on the ps (zeros)
    expected = np.arange(160, dtype=np.float32).reshape(40, 4)
    expected[[0, 39]] -= 0.1  # Adam's first step moves each touched entry by the learning rate
    np.testing.assert_allclose(given.numpy(), expected, atol=2e-6)  # Adam: lr * m / (sqrt(v) + epsilon)
    given.assign(np.zeros((40, 4), np.float32))
    given.variables[1].assign(np.full((20, 4), 3.0, np.float32))
    assert isinstance(given._value, OnPs)
    np.testing.assert_array_equal(np.concatenate(_ps_values(strategy, given)), [[0.0] * 4] * 20 + [[3.0] * 4] * 20)
