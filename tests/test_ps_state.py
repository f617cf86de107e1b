"""Large ParameterServerStrategy variables live on their ps only (issue 27): made there, read and checkpointed there.

``registry.REMOTE_BYTES`` is lowered to 0 for this module, so every non-scalar
variable is *remote* (the coordinator holds ``OnPs``: shape and dtype, no
values) and small tables exercise the paths a 3 GB table takes.  Expected
values: Keras' own initializers on one device (an unpartitioned variable), and
the documented rule for a partitioned one (docs/tf_compat.md: each shard drawn
on its own with ``jax.random.fold_in(key, first row)``).
"""

from __future__ import annotations

import json
import shutil

import jax
import keras
import numpy as np
import orbax.checkpoint as ocp
import pytest

import distribute
from distribute.coordinator import ClusterCoordinator
from distribute.parameter_server import registry, transfer
from distribute.parameter_server.errors import PSUnavailableError
from distribute.parameter_server.registry import OnPs

MinSizePartitioner = distribute.experimental.partitioners.MinSizePartitioner


@pytest.fixture(scope="module")
def remote_everything():
    saved, registry.REMOTE_BYTES = registry.REMOTE_BYTES, 0
    yield
    registry.REMOTE_BYTES = saved


@pytest.fixture  # one per test: the checkpoint test kills one of its ps
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
    np.testing.assert_array_equal(given.variables[1].numpy(), np.full((20, 4), 3.0))  # read from that shard's ps only


def _table_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(40, 4), keras.layers.Flatten(),
                             keras.layers.Dense(1)])


def test_checkpoint_tables_are_written_by_their_ps_and_restore_to_3_ps_and_without_a_strategy(two_ps, ray_instance,
                                                                                              tmp_path, monkeypatch):
    import ray

    strategy, coordinator = two_ps
    with strategy.scope():
        model, optimizer = _table_model(1), keras.optimizers.Adam(0.1)
    ids = np.asarray([[0, 21], [5, 39]], np.int32)

    def step(x):
        _, grads = distribute.compute_gradients(lambda: keras.ops.sum(model(x) ** 2), model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    coordinator.schedule(step, args=(ids,))
    coordinator.join()
    table = model.layers[0].embeddings
    saved = [v.numpy() for v in model.weights + optimizer.variables]
    manager = distribute.CheckpointManager(distribute.Checkpoint(model=model, optimizer=optimizer), str(tmp_path),
                                           max_to_keep=1)
    first = manager.save()
    manager.wait_until_finished()
    assert isinstance(table._value, OnPs)  # the save read nothing whole on the coordinator
    # One directory: the ps wrote their tables inside the orbax checkpoint, committed by orbax's rename.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1"]
    # Each ps wrote its shard of the table (and of Adam's two slots) as zarr arrays; the record lists the rows.
    files = sorted(p.name for p in (tmp_path / "ckpt-1" / "tables").iterdir())
    assert {"model_0_part_0", "model_0_part_1", "optimizer_2_part_0", "optimizer_2_part_1"} <= set(files)
    orbax_tree = ocp.StandardCheckpointer().restore(first)  # plain orbax reads the rest, tables/ aside
    assert orbax_tree["optimizer"][0] == saved[3] == 1  # Adam's iterations, held by the coordinator

    # Restore into 3 ps (3 shards of 14, 13, 13 rows: another layout than the saved 20 + 20) ...
    three = distribute.ParameterServerStrategy(num_workers=1, num_ps=3,
                                               variable_partitioner=MinSizePartitioner(min_shard_bytes=128, max_shards=3))
    try:
        with three.scope():
            model3, optimizer3 = _table_model(2), keras.optimizers.Adam(0.1)
            optimizer3.build(model3.trainable_variables)
        assert [s.shape for s in model3.layers[0].embeddings.variables] == [(14, 4), (13, 4), (13, 4)]
        distribute.Checkpoint(model=model3, optimizer=optimizer3).restore(first)
        assert isinstance(model3.layers[0].embeddings._value, OnPs)
        np.testing.assert_array_equal(np.concatenate(_ps_values(three, model3.layers[0].embeddings)), saved[0])
        for got, want in zip([v.numpy() for v in model3.weights + optimizer3.variables], saved):
            np.testing.assert_array_equal(got, want)
    finally:
        three._shutdown()
    # ... and, from a copy of that one directory, into a model without a strategy (it holds the whole table).
    copy = tmp_path / "copy" / "ckpt-1"
    shutil.copytree(first, copy)
    plain, plain_optimizer = _table_model(3), keras.optimizers.Adam(0.1)
    plain_optimizer.build(plain.trainable_variables)
    distribute.Checkpoint(model=plain, optimizer=plain_optimizer).restore(str(copy))
    for got, want in zip([v.numpy() for v in plain.weights + plain_optimizer.variables], saved):
        np.testing.assert_array_equal(got, want)
    # A format-2 checkpoint (tables in a sibling <checkpoint>.tables-<ns>) still restores, and is deleted whole.
    (copy / "tables").rename(copy.parent / "ckpt-1.tables-7")
    metadata = json.loads((copy / "_CHECKPOINT_METADATA").read_text())
    metadata["custom_metadata"]["distribute"].update(format=2, tables="ckpt-1.tables-7")
    (copy / "_CHECKPOINT_METADATA").write_text(json.dumps(metadata))
    old_model, old_optimizer = _table_model(5), keras.optimizers.Adam(0.1)
    old_optimizer.build(old_model.trainable_variables)
    distribute.Checkpoint(model=old_model, optimizer=old_optimizer).restore(str(copy))
    for got, want in zip([v.numpy() for v in old_model.weights + old_optimizer.variables], saved):
        np.testing.assert_array_equal(got, want)
    plain_manager = distribute.CheckpointManager(distribute.Checkpoint(model=plain), str(copy.parent), max_to_keep=1)
    plain_manager.save(checkpoint_number=2)
    plain_manager.wait_until_finished()
    assert sorted(p.name for p in copy.parent.iterdir()) == ["ckpt-2"]
    shutil.rmtree(copy.parent)

    # A Keras file of the ps model: each table is written in row pieces from its ps, never gathered whole.
    def whole_read(*args):
        raise AssertionError("model.save gathered a whole table on the coordinator")

    monkeypatch.setattr(transfer, "gather", whole_read)
    model.save(str(tmp_path / "m.keras"))
    monkeypatch.undo()
    loaded = keras.models.load_model(str(tmp_path / "m.keras"), compile=False)
    for got, want in zip(loaded.get_weights(), saved):
        np.testing.assert_array_equal(got, want)

    # max_to_keep=1: the next save deletes ckpt-1, tables and all, with its directory.
    second = manager.save()
    manager.wait_until_finished()
    assert manager.checkpoints == [second] and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-2", "m.keras"]

    # A ps lost during a save: the save raises, nothing is committed (no ckpt-3, no orbax temporary directory
    # left), the previous checkpoint restores as it was.
    table.assign(np.zeros((40, 4), np.float32))
    ray.kill(strategy.extended._cluster.ps[1], no_restart=True)
    with pytest.raises(PSUnavailableError):
        manager.save()
    assert manager.latest_checkpoint == second and manager.checkpoints == [second]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-2", "m.keras"]
    fresh, fresh_optimizer = _table_model(4), keras.optimizers.Adam(0.1)
    fresh_optimizer.build(fresh.trainable_variables)
    distribute.Checkpoint(model=fresh, optimizer=fresh_optimizer).restore(manager.latest_checkpoint)
    np.testing.assert_array_equal(fresh.layers[0].embeddings.numpy(), saved[0])
    for got, want in zip([v.numpy() for v in fresh.weights + fresh_optimizer.variables], saved):
        np.testing.assert_array_equal(got, want)
