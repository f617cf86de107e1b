"""Row reads and row updates under ParameterServerStrategy (issue 16), with a cluster.

A variable a step reads only through row lookups (Keras ``Embedding``,
``keras.ops.take(v, ids, axis=0)``, ``v[ids]``) is read as its looked-up rows
from the ps shards that hold them, and updated by rows.  One worker applies
updates in order, so fit equals one device's Keras fit on the same batches: SGD
and Adagrad update only the looked-up rows, Adam's exact whole update runs on
the ps.  Duplicate ids sum; an id outside the table is TF's
``InvalidArgumentError`` naming the variable; a killed worker still counts
every step once; a killed ps surfaces as before.
"""

from __future__ import annotations

import re
import threading

import keras
import numpy as np
import pytest
from helpers import kill_actor_and_wait

import distribute
from distribute.coordinator import ClusterCoordinator
from distribute.data import Dataset
from distribute.parameter_server import transfer
from distribute.parameter_server.errors import InvalidArgumentError, PSUnavailableError

pytestmark = pytest.mark.multiprocess
ROWS, DIM = 300, 4


def _partitioned(num_workers):
    # The 300 x 4 table (4800 bytes) is split in 2 shards, one per ps; the small Dense layer is not.
    partitioner = distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=1024, max_shards=2)
    return distribute.ParameterServerStrategy(num_workers=num_workers, num_ps=2, variable_partitioner=partitioner)


@pytest.fixture(scope="module")
def one_worker(ray_instance):
    strategy = _partitioned(1)
    yield strategy, ClusterCoordinator(strategy)
    strategy._shutdown()


_TWO_WORKERS: list = []  # the module's 2-worker cluster, made again after the test that kills one of its ps


@pytest.fixture(scope="module")
def _two_workers_cleanup(ray_instance):
    yield
    while _TWO_WORKERS:
        _TWO_WORKERS.pop()[0]._shutdown()


@pytest.fixture
def two_workers(ray_instance, _two_workers_cleanup):
    if not _TWO_WORKERS:
        strategy = _partitioned(2)
        _TWO_WORKERS.append((strategy, ClusterCoordinator(strategy)))
    return _TWO_WORKERS[0]


def _data():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ROWS, size=(64, 3)).astype(np.int32)
    ids[:4] = [[5, 5, 5], [7, 5, 7], [0, 299, 0], [5, 1, 2]]  # duplicates in the first batches
    y = rng.normal(size=(64, 1)).astype(np.float32)
    return ids, y


def _model(optimizer, steps_per_execution=1):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(ROWS, DIM), keras.layers.Flatten(),
                              keras.layers.Dense(1)])
    opt = {"sgd": lambda: keras.optimizers.SGD(0.5), "adagrad": lambda: keras.optimizers.Adagrad(0.5),
           "adam": lambda: keras.optimizers.Adam(0.05)}[optimizer]()
    model.compile(optimizer=opt, loss="mse", metrics=["mae"], steps_per_execution=steps_per_execution)
    return model


def _row_plans(coordinator):
    return [step.plan for step in coordinator._traced.values() if step.plan.rows is not None]


# Adagrad updates the looked-up rows of the table and of its accumulator slot (3 steps per execution); Adam
# runs its exact whole update on the ps.  SGD's row update is checked value for value by
# test_duplicate_ids_sum_and_take_and_indexing_read_rows and test_a_table_larger_than_one_message, and an SGD
# Embedding fit + evaluate against one device by test_after_a_two_worker_fit_every_coordinator_read_is_the_ps_value.
@pytest.mark.parametrize("optimizer, per_execution, mode", [("adagrad", 3, "rows"), ("adam", 1, "dense")])
def test_fit_evaluate_predict_equal_one_device_with_row_reads(one_worker, optimizer, per_execution, mode):
    strategy, coordinator = one_worker
    ids, y = _data()
    with strategy.scope():
        model = _model(optimizer, per_execution)
    table = model.layers[0].embeddings
    assert isinstance(table, distribute.ShardedVariable) and len(table.variables) == 2
    history = model.fit(ids, y, batch_size=8, epochs=2, steps_per_epoch=8, shuffle=False, verbose=0)
    reference = _model(optimizer, per_execution)
    want = reference.fit(ids, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-6)
    np.testing.assert_allclose(model.evaluate(ids, y, batch_size=16, verbose=0),
                               reference.evaluate(ids, y, batch_size=16, verbose=0), rtol=1e-6)
    np.testing.assert_allclose(model.predict(ids[:20], batch_size=8, verbose=0),
                               reference.predict(ids[:20], batch_size=8, verbose=0), rtol=1e-6, atol=1e-7)
    # The train, evaluate and predict steps read the table by rows: it is not among what a worker pulls whole.
    plans = _row_plans(coordinator)
    keys = {s.key for s in strategy.extended._registry.entry(table).shards}
    mine = [p for p in plans if any(t.name == table.path for t in p.rows.tables)]
    assert len(mine) >= 3
    for plan in mine:
        assert not keys & {k for pulled in plan.pull.values() for k in pulled}
    train = [p for p in mine if p.applies]
    assert {a[7].mode for p in train for a in p.applies if a[7] is not None} == {mode}


def test_duplicate_ids_sum_and_take_and_indexing_read_rows(one_worker):
    strategy, coordinator = one_worker
    with strategy.scope():
        table = keras.Variable(np.zeros((ROWS, 2), np.float32), name="counts")
        optimizer = keras.optimizers.SGD(1.0)

    def step(ids):
        def loss():
            return keras.ops.sum(keras.ops.take(table, ids, axis=0)) + keras.ops.sum(table[ids[0]]) * 0.5
        value, grads = distribute.compute_gradients(loss, [table])
        optimizer.apply_gradients(zip(grads, [table]))
        return value

    coordinator.schedule(step, args=(np.asarray([[1, 1, 2], [299, 1, 0]], np.int32),))
    coordinator.join()
    expected = np.zeros((ROWS, 2), np.float32)
    expected[1], expected[2], expected[299], expected[0] = -3.0 - 1.0, -1.0 - 0.5, -1.0, -1.0
    np.testing.assert_array_equal(table.numpy(), expected)
    assert _row_plans(coordinator)[-1].rows.tables[0].name == table.path


@pytest.mark.parametrize("bad, where", [(ROWS, "indices[1,0] = 300"), (-1, "indices[1,0] = -1")])
def test_ids_out_of_range_are_an_error_naming_the_variable(one_worker, bad, where):
    strategy, coordinator = one_worker
    with strategy.scope():
        embedding = keras.layers.Embedding(ROWS, 2)
        embedding.build((None, 2))
    before = embedding.embeddings.numpy()

    def lookup(ids):
        return embedding(ids)

    coordinator.schedule(lookup, args=(np.asarray([[0, 1], [bad, 2]], np.int32),))
    with pytest.raises(InvalidArgumentError, match=re.escape(f"{where} is not in [0, 300)") + rf".*'{embedding.embeddings.path}'"):
        coordinator.join()
    np.testing.assert_array_equal(embedding.embeddings.numpy(), before)
    good = np.asarray([[0, 1], [3, 2]], np.int32)  # the error was cleared; the next call reads those rows
    np.testing.assert_array_equal(coordinator.schedule(lookup, args=(good,)).fetch(), before[good])


def test_a_table_larger_than_one_message(one_worker, monkeypatch):
    # Every coordinator <-> ps transfer is cut into messages of at most MAX_MESSAGE_BYTES: lowered to 512
    # bytes, each 2400-byte shard of this table travels in pieces, both ways, and nothing is lost.
    strategy, coordinator = one_worker
    monkeypatch.setattr(transfer, "MAX_MESSAGE_BYTES", 512)
    monkeypatch.setattr(transfer, "EAGER_REFRESH_BYTES", 256)
    start = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
    with strategy.scope():
        table = keras.Variable(start, name="big")
        optimizer = keras.optimizers.SGD(1.0)

    def step(ids):
        value, grads = distribute.compute_gradients(lambda: keras.ops.sum(keras.ops.take(table, ids, axis=0)), [table])
        optimizer.apply_gradients(zip(grads, [table]))

    coordinator.schedule(step, args=(np.asarray([0, 150, 299], np.int32),))
    coordinator.join()
    assert strategy.extended._registry.entry(table).stale  # larger than EAGER_REFRESH_BYTES: read when read
    expected = start.copy()
    expected[[0, 150, 299]] -= 1.0
    np.testing.assert_array_equal(table.numpy(), expected)
    stored = {}
    for part in strategy.extended._cluster.get_from_ps([ps.read_all.remote() for ps in strategy.extended._cluster.ps]):
        stored.update(part)
    shards = strategy.extended._registry.entry(table).shards
    np.testing.assert_array_equal(np.concatenate([stored[s.key] for s in shards]), expected)
    table.assign(-start)  # pushed in pieces too
    coordinator.schedule(step, args=(np.asarray([1], np.int32),))
    coordinator.join()
    expected = -start
    expected[1] -= 1.0
    np.testing.assert_array_equal(table.numpy(), expected)


def _ps_values(strategy, variables):
    """Each variable's value as its ps hold it now (read there directly)."""
    stored = {}
    cluster = strategy.extended._cluster
    for part in cluster.get_from_ps([ps.read_all.remote() for ps in cluster.ps]):
        stored.update(part)
    registry = strategy.extended._registry
    return [np.concatenate([stored[s.key] for s in registry.entry(v).shards]) if len(registry.entry(v).shards) > 1
            else stored[registry.entry(v).shards[0].key] for v in variables]


def test_after_a_two_worker_fit_every_coordinator_read_is_the_ps_value(two_workers, monkeypatch):
    # The reported fit (2 workers, SGD, validation) whose evaluate disagreed with its logs: after fit, every
    # read on the coordinator (weights, optimizer state, metrics; the table refreshed only when read) is what
    # the ps hold, and val_loss / evaluate are one device's evaluation of those weights.
    strategy, _ = two_workers
    monkeypatch.setattr(transfer, "EAGER_REFRESH_BYTES", 1024)  # the table is refreshed on read, not at join()
    ids, y = _data()
    with strategy.scope():
        model = _model("sgd")
    history = model.fit(ids, y, batch_size=8, epochs=3, steps_per_epoch=10, verbose=0, validation_data=(ids, y))
    variables = model.weights + model.optimizer.variables + [v for m in model.metrics for v in m.variables]
    assert strategy.extended._registry.entry(model.layers[0].embeddings).stale
    for got, stored in zip([np.asarray(v.numpy()) for v in variables], _ps_values(strategy, variables)):
        np.testing.assert_array_equal(got, stored)
    assert int(model.optimizer.iterations.numpy()) == 30
    reference = _model("sgd")
    reference.set_weights(model.get_weights())
    want = reference.evaluate(ids, y, batch_size=8, verbose=0)
    np.testing.assert_allclose(history.history["val_loss"][-1], want[0], rtol=1e-6)
    np.testing.assert_allclose(model.evaluate(ids, y, batch_size=8, verbose=0), want, rtol=1e-6)


def _counting(strategy, coordinator):
    with strategy.scope():
        table = keras.Variable(np.zeros((ROWS, 2), np.float32), name="counted")
        optimizer = keras.optimizers.SGD(1.0)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, ROWS, size=(400, 4)).astype(np.int32)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: Dataset.from_tensor_slices(ids).batch(2).repeat()))

    def step(iterator):
        batch = next(iterator)
        _, grads = distribute.compute_gradients(lambda: keras.ops.sum(keras.ops.take(table, batch, axis=0)), [table])
        optimizer.apply_gradients(zip(grads, [table]))

    return table, optimizer, iterator, step


def _join_within(coordinator, seconds=120):
    outcome: dict = {}

    def target():
        try:
            coordinator.join()
        except BaseException as err:  # noqa: BLE001 - reported to the test
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"join() did not return within {seconds} s"
    if "error" in outcome:
        raise outcome["error"]


def test_worker_killed_mid_training_counts_every_sparse_step_once(two_workers, ray_instance):
    # Each step looks up 8 ids and subtracts 1 from each looked-up entry (2 columns): after S steps the
    # table sums to -16 S exactly, whatever worker ran a step, however often a step was re-run.
    strategy, coordinator = two_workers
    table, optimizer, iterator, step = _counting(strategy, coordinator)
    steps = 120
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps)]
    results[10].fetch()
    assert not coordinator.done()
    ray_instance.kill(strategy.extended._cluster.workers[1], no_restart=False)
    _join_within(coordinator)
    assert float(table.numpy().sum()) == -16.0 * steps
    assert int(optimizer.iterations.numpy()) == steps


def test_ps_killed_surfaces_as_unavailable(two_workers, ray_instance):
    strategy, coordinator = two_workers
    table, _, iterator, step = _counting(strategy, coordinator)
    for _ in range(20):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    _TWO_WORKERS.clear()  # a test after this one makes the cluster again
    try:
        kill_actor_and_wait(ray_instance, strategy.extended._cluster.ps[1])
        with pytest.raises(PSUnavailableError, match="parameter server 1"):
            for _ in range(50):
                coordinator.schedule(step, args=(iterator,))
            _join_within(coordinator)
    finally:
        strategy._shutdown()
