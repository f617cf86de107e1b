"""TF's coordinator tests, ported by substitution: expected values from TF 2.21's own test files.

Sources: tensorflow/python/distribute/coordinator/cluster_coordinator_test.py
(ClusterCoordinatorTest, ErrorReportingTest, StrategyIntegrationTest) and
parameter_server_strategy_v2_test.py (ParameterServerStrategyV2Test, ClusterTypeNameTest).
TF's clusters (5 workers / 2 ps, 1 worker / 1 ps) are one embedded cluster of 2 workers
and 1 ps here; TF's expected values do not depend on the counts.  ``tf.function``s are
plain functions; ``tf.Variable`` is ``keras.Variable`` created in the scope.  Cases on
TF private APIs (closure queues, tags, per-worker resources, variable caching) are not
ported.  Failures are strict xfails naming what differs from TF.
"""

from __future__ import annotations

import logging
import os

import keras
import numpy as np
import pytest

import distribute
from distribute.data import Dataset
from distribute.parameter_server.errors import CancelledError, OutOfRangeError

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def cluster(ray_instance):
    strategy = distribute.ParameterServerStrategy(num_workers=2, num_ps=1)
    coordinator = distribute.coordinator.ClusterCoordinator(strategy)
    yield strategy, coordinator
    strategy._shutdown()


# -- ClusterCoordinatorTest -------------------------------------------------------------------------
def test_fn_return_nested_values(cluster):
    _, coordinator = cluster
    x = np.int32(1)

    def f():
        return x + 1, (x + 2, x + 3), [x + 4], {"v": x}

    got = coordinator.schedule(f)
    want = 2, (3, 4), [5], {"v": 1}
    assert got.fetch() == want
    assert coordinator.fetch(got) == want


def test_input_function(cluster):
    strategy, coordinator = cluster

    def input_fn():
        return Dataset.range(1, 2)

    with strategy.scope():
        v = keras.Variable(0, dtype="int32")

    def worker_fn(iterator):
        x = next(iterator)
        v.assign_add(x)
        return x

    distributed_dataset = coordinator.create_per_worker_dataset(input_fn)
    result = coordinator.fetch(coordinator.schedule(worker_fn, args=(iter(distributed_dataset),)))
    assert result == 1  # TF compares with (1,): a scalar
    result = coordinator.fetch(coordinator.schedule(worker_fn, args=(iter(distributed_dataset),)))
    assert result == 1
    coordinator.join()
    assert int(v.numpy()) == 2


def test_variable_read_after_fetch_without_join_is_the_ps_value(cluster):
    # TF testBasicVariableAssignment: v1 += 0.1, v2 -= 0.2, fetch, then read v1 and v2 (no join).
    strategy, coordinator = cluster
    with strategy.scope():
        v1 = keras.Variable(0.0)
        v2 = keras.Variable(1.0)

    def worker_fn():
        v1.assign_add(0.1)
        v2.assign_sub(0.2)
        return v1.value / v2.value

    results = coordinator.schedule(worker_fn)
    np.testing.assert_allclose(coordinator.fetch(results), 0.1 / 0.8, rtol=1e-6)
    try:
        np.testing.assert_allclose(float(v1.numpy()), 0.1, atol=1e-6)
        np.testing.assert_allclose(float(v2.numpy()), 0.8, atol=1e-6)
    finally:
        coordinator.join()


@pytest.mark.parametrize("use_input_fn", [True, False])
def test_input_function_with_map(cluster, use_input_fn):
    _, coordinator = cluster

    def input_fn():
        return Dataset.range(0, 10).map(lambda x: x + 10)

    source = input_fn if use_input_fn else input_fn()
    distributed_dataset = coordinator.create_per_worker_dataset(source)
    result = coordinator.schedule(lambda iterator: next(iterator), args=(iter(distributed_dataset),))
    assert result.fetch() == 10  # TF: (10,); its tracing count (1) has no meaning here: map runs on the workers


def test_input_function_create_variables(cluster):
    _, coordinator = cluster

    def input_fn():
        v = keras.Variable(0.0)
        return Dataset.from_tensors(np.float32(v.numpy()))

    with pytest.raises(ValueError, match=r"^Creating variables in `dataset_fn` is not allowed\.$"):
        per_worker = coordinator.create_per_worker_dataset(input_fn)
        coordinator.schedule(lambda iterator: next(iterator), args=(iter(per_worker),)).fetch()


def _per_worker_sequences(coordinator, iterator, rounds=20, steps=10):
    """Elements pulled by each worker, keyed by the worker's pid (recorded by the dataset's map)."""
    seqs: dict[int, list[int]] = {}
    for _ in range(rounds):
        results = [coordinator.schedule(lambda it: next(it), args=(iterator,)) for _ in range(steps)]
        coordinator.join()
        for r in results:
            pid, x = r.fetch()
            seqs.setdefault(int(pid[0]), []).append(int(x[0]))
        if len(seqs) == 2 and min(len(s) for s in seqs.values()) >= 8:
            return list(seqs.values())
    pytest.fail(f"after {rounds * steps} steps, only these workers pulled elements: {sorted(seqs)}")


def _assert_shuffled_differently(a, b):
    # Same order on both workers: the shorter pull is a prefix of the other's, so a subset of it.
    short, long = sorted((a, b), key=len)
    assert not set(short) <= set(long), (a, b)


def test_datasets_shuffled_differently_from_an_input_fn(cluster):
    # TF testDatasetsShuffledDifferently(use_input_fn=True).
    strategy, coordinator = cluster

    def input_fn():
        dataset = Dataset.range(0, 100).shuffle(100).map(lambda x: (np.int64(os.getpid()), x)).batch(1)
        return dataset

    _assert_shuffled_differently(*_per_worker_sequences(coordinator, iter(coordinator.create_per_worker_dataset(input_fn))))


def test_datasets_shuffled_differently_from_a_dataset(cluster):
    strategy, coordinator = cluster
    dataset = Dataset.range(0, 100).shuffle(100).map(lambda x: (np.int64(os.getpid()), x)).batch(1)
    distributed = strategy.experimental_distribute_dataset(dataset)
    _assert_shuffled_differently(*_per_worker_sequences(coordinator, iter(coordinator.create_per_worker_dataset(distributed))))


def test_datasets_shuffled_differently_from_an_input_fn_closing_over_a_dataset(cluster):
    # The Dataset built on the coordinator and returned by input_fn on each worker: TF gives each
    # worker's unseeded shuffle its own seed there too.
    _, coordinator = cluster
    dataset = Dataset.range(0, 100).shuffle(100).map(lambda x: (np.int64(os.getpid()), x)).batch(1)
    _assert_shuffled_differently(*_per_worker_sequences(coordinator, iter(coordinator.create_per_worker_dataset(lambda: dataset))))


def test_a_seeded_shuffle_is_the_same_on_every_worker(cluster):
    # shuffle(seed=...) keeps its order everywhere (tf.data: a fixed seed gives a fixed order).
    _, coordinator = cluster
    dataset = Dataset.range(0, 100).shuffle(100, seed=7).map(lambda x: (np.int64(os.getpid()), x)).batch(1)
    a, b = _per_worker_sequences(coordinator, iter(coordinator.create_per_worker_dataset(dataset)))
    want = [int(x[0]) for _, x in Dataset.range(0, 100).shuffle(100, seed=7).map(lambda x: (0, x)).batch(1)]
    assert a == want[: len(a)] and b == want[: len(b)]


def test_disallow_remote_value_as_input(cluster):
    _, coordinator = cluster
    remote_v = coordinator.schedule(lambda: np.float32(1.0))
    with pytest.raises(ValueError):
        coordinator.schedule(lambda x: x + 1.0, args=(remote_v,))
    coordinator.join()


def test_pass_dataset_to_create_per_worker_dataset(cluster):
    _, coordinator = cluster
    per_worker_dataset = coordinator.create_per_worker_dataset(Dataset.range(1, 11).batch(4))
    result = coordinator.schedule(lambda iterator: next(iterator), args=(iter(per_worker_dataset),))
    np.testing.assert_array_equal(result.fetch(), [1, 2, 3, 4])


def test_multiple_datasets(cluster):
    _, coordinator = cluster
    per_worker_iterator1 = iter(coordinator.create_per_worker_dataset(lambda: Dataset.range(0, 5)))
    per_worker_iterator2 = iter(coordinator.create_per_worker_dataset(lambda: Dataset.range(5, 10)))

    def worker_fn(iterator1, iterator2):
        return next(iterator1) + next(iterator2)

    result = coordinator.schedule(worker_fn, args=(per_worker_iterator1, per_worker_iterator2))
    assert result.fetch() == 5
    per_worker_iterator3 = iter(coordinator.create_per_worker_dataset(lambda: Dataset.range(0, 5)))
    result = coordinator.schedule(worker_fn, args=(per_worker_iterator3, per_worker_iterator2))
    assert result.fetch() >= 5


def test_repeated_iterator_creation(cluster):
    _, coordinator = cluster
    per_worker_dataset1 = coordinator.create_per_worker_dataset(lambda: Dataset.range(1, 100))
    per_worker_dataset2 = coordinator.create_per_worker_dataset(lambda: Dataset.range(1, 100))

    def worker_fn(iterator1, iterator2):
        return next(iterator1) + next(iterator2)

    for _ in range(3):  # TF: 10 rounds
        per_worker_iterator1 = iter(per_worker_dataset1)
        per_worker_iterator2 = iter(per_worker_dataset2)
        result = coordinator.schedule(worker_fn, args=(per_worker_iterator1, per_worker_iterator2))
        for _ in range(10):
            coordinator.schedule(worker_fn, args=(per_worker_iterator1, per_worker_iterator2))
        coordinator.join()
        assert result.fetch() >= 2


def test_worker_index_dataset_fn_iterating_to_the_end(cluster):
    # TF testWorkerIndexDatasetFn: range(10) sharded by worker index; train_fn sums the whole shard (TF
    # turns the loop into a graph loop). Here a scheduled function is compiled for a fixed number of
    # elements: the loop is a clear TypeError (it used to trace for ever), README differences table.
    strategy, coordinator = cluster
    num_workers = strategy.extended.num_workers  # not the strategy itself: see the xfail below

    def dataset_fn():
        worker_index = distribute.coordinator.experimental_get_current_worker_index()
        return Dataset.range(10).shard(num_shards=num_workers, index=worker_index)

    def train_fn(iterator):
        total = 0
        for i, batch in enumerate(iterator):
            if i > 50:
                raise AssertionError("for-loop over a per-worker iterator did not end after 50 elements")
            total += batch
        return total

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    with pytest.raises(TypeError, match=r"next\(iterator\) a fixed number of times"):
        coordinator.schedule(train_fn, args=(iterator,))
    coordinator.join()


def _two_worker_prefixes(cycle, num_calls):
    """Every multiset two workers can give when each reads ``cycle`` over and over from the start."""
    def prefix(n):
        return [cycle[k % len(cycle)] for k in range(n)]
    return [sorted(prefix(n) + prefix(num_calls - n)) for n in range(num_calls + 1)]


def test_partial_batches_in_a_repeated_dataset(cluster):
    # TF 2.21 runs it (each worker's sums are 6, 22, 17 in turn): a program per element shape.
    strategy, coordinator = cluster
    with strategy.scope():
        total = keras.Variable(0, dtype="int32")

    def step(it):
        batch_sum = keras.ops.sum(next(it))
        total.assign_add(batch_sum)
        return batch_sum

    iterator = iter(coordinator.create_per_worker_dataset(lambda: Dataset.range(10).batch(4).repeat()))
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(8)]
    coordinator.join()  # 8 steps on 2 workers: one of them reaches its 2-row batch
    sums = sorted(int(r.fetch()) for r in results)
    assert sums in _two_worker_prefixes([0 + 1 + 2 + 3, 4 + 5 + 6 + 7, 8 + 9], 8)  # no batch skipped or read twice
    assert 17 in sums
    assert int(total.numpy()) == sum(sums)  # each step's update applied once


def test_partial_batch_inside_packed_steps(cluster):
    # Measured on TF 2.21 (tests/parity/record_tf_ps_input.py): two next() per call over
    # range(10).batch(4).repeat() give each worker [6, 22], [17, 6], [22, 17] in turn.
    _, coordinator = cluster
    iterator = iter(coordinator.create_per_worker_dataset(lambda: Dataset.range(10).batch(4).repeat()))

    def two(it):
        return keras.ops.sum(next(it)), keras.ops.sum(next(it))

    results = [coordinator.schedule(two, args=(iterator,)) for _ in range(6)]
    coordinator.join()
    pairs = sorted(tuple(int(x) for x in r.fetch()) for r in results)
    assert pairs in _two_worker_prefixes([(6, 22), (17, 6), (22, 17)], 6)


def test_input_context_inside_per_worker_dataset_fn(cluster):
    # Measured on TF 2.21: distribute_datasets_from_function inside a per_worker_dataset_fn gives
    # every worker InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1).
    strategy, coordinator = cluster

    def dataset_fn(ctx):
        return Dataset.from_tensors(np.array([ctx.num_input_pipelines, ctx.input_pipeline_id,
                                              ctx.num_replicas_in_sync], np.int32)).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(lambda: strategy.distribute_datasets_from_function(dataset_fn)))
    results = [coordinator.schedule(lambda it: next(it), args=(iterator,)) for _ in range(6)]
    coordinator.join()
    assert {tuple(int(v) for v in r.fetch()) for r in results} == {(1, 0, 1)}


def test_strategy_pickles_to_its_worker_stand_in(cluster):
    import pickle

    from distribute.parameter_server.dataset import WorkerStrategy

    strategy, _ = cluster
    on_worker = pickle.loads(pickle.dumps(strategy))
    assert isinstance(on_worker, WorkerStrategy) and on_worker.num_replicas_in_sync == 1
    dataset = Dataset.range(3)
    assert on_worker.experimental_distribute_dataset(dataset) is dataset
    with pytest.raises(AttributeError, match="not available inside a dataset_fn on a worker"):
        on_worker.run(lambda: None)


def test_per_worker_dataset_element_spec_of_a_partial_batch(cluster):
    # Measured on TF 2.21: TensorSpec(shape=(None,), dtype=tf.int64) for range(10).batch(4).
    _, coordinator = cluster
    per_worker = coordinator.create_per_worker_dataset(lambda: Dataset.range(10).batch(4))
    spec = per_worker.element_spec
    assert spec == Dataset.range(10).batch(4).element_spec
    assert spec.shape == (None,) and spec.dtype == np.int64
    empty = coordinator.create_per_worker_dataset(lambda: Dataset.range(0).batch(4))
    assert empty.element_spec == spec  # known without an element, as tf.data's
    with pytest.raises(ValueError, match="per-worker dataset is empty"):
        coordinator.schedule(lambda it: next(it), args=(iter(empty),))


def test_per_worker_dataset_build(cluster):
    _, coordinator = cluster
    per_worker_dataset = coordinator.create_per_worker_dataset(Dataset.from_tensor_slices(np.array([1, 2], np.int32)))
    per_worker_dataset = per_worker_dataset.build()
    results = [coordinator.schedule(lambda dataset: next(iter(dataset)), args=(per_worker_dataset,)) for _ in range(4)]
    coordinator.join()
    assert [int(r.fetch()) for r in results] == [1, 1, 1, 1]  # measured on TF 2.21: a fresh iterator per call


# -- ErrorReportingTest (the runtime error is an exhausted iterator: JAX programs have no assert op) ----
def _error_setup(strategy, coordinator):
    with strategy.scope():
        iteration = keras.Variable(0.0)

    def normal_function():
        iteration.assign_add(1.0)
        return keras.ops.mean(keras.ops.ones((2, 10)) @ keras.ops.ones((10, 2)))

    # One element per worker and two next() per call: every call fails (an empty dataset is refused
    # by schedule itself, which needs the element's shape).
    one = iter(coordinator.create_per_worker_dataset(lambda: Dataset.range(1)))

    def error_function(iterator):
        iteration.assign_add((next(iterator) + next(iterator)).astype("float32"))
        return iteration.value

    return iteration, normal_function, lambda: coordinator.schedule(error_function, args=(one,))


def test_join_raise_error(cluster):
    strategy, coordinator = cluster
    _, normal, schedule_error = _error_setup(strategy, coordinator)
    for _ in range(3):
        coordinator.schedule(normal)
    schedule_error()
    with pytest.raises(OutOfRangeError):
        coordinator.join()


def test_schedule_raise_error(cluster):
    strategy, coordinator = cluster
    _, normal, schedule_error = _error_setup(strategy, coordinator)
    for _ in range(3):
        coordinator.schedule(normal)
    schedule_error()
    with pytest.raises(OutOfRangeError):
        for _ in range(100_000):  # TF: while True
            coordinator.schedule(normal)
        coordinator.join()
    coordinator.join()


def test_schedule_raise_error_with_multiple_failure(cluster):
    strategy, coordinator = cluster
    _, _, schedule_error = _error_setup(strategy, coordinator)
    with pytest.raises(OutOfRangeError):
        for _ in range(100_000):
            schedule_error()
        coordinator.join()
    coordinator.join()  # only the first error is raised, the others are dropped


def test_error_will_be_cleared_and_cancellation(cluster):
    strategy, coordinator = cluster
    iteration, normal, schedule_error = _error_setup(strategy, coordinator)
    schedule_error()
    with pytest.raises(OutOfRangeError):
        coordinator.join()
    for _ in range(3):
        coordinator.schedule(normal)
    schedule_error()
    queued = [coordinator.schedule(normal) for _ in range(50)]
    with pytest.raises(OutOfRangeError):
        coordinator.join()
    for r in queued:  # each either ran or was cancelled (TF testCancellation)
        try:
            assert float(r.fetch()) == 10.0  # mean(ones((2, 10)) @ ones((10, 2)))
        except CancelledError as err:
            assert "The corresponding function is cancelled. Please reschedule the function." in str(err)
    for _ in range(3):
        coordinator.schedule(normal)
    coordinator.join()
    assert coordinator.done()


def test_resource_can_still_be_used_after_cancellation(cluster):
    strategy, coordinator = cluster
    _, _, schedule_error = _error_setup(strategy, coordinator)
    per_worker_iterator = iter(coordinator.create_per_worker_dataset(lambda: Dataset.range(0, 5)))
    coordinator.schedule(lambda iterator: next(iterator), args=(per_worker_iterator,))
    schedule_error()
    with pytest.raises(OutOfRangeError):
        coordinator.join()
    result = coordinator.schedule(lambda iterator: next(iterator), args=(per_worker_iterator,))
    coordinator.join()
    assert 0 <= int(result.fetch()) < 5


# -- StrategyIntegrationTest ------------------------------------------------------------------------
def test_run_not_used_with_cluster_coordinator_schedule(cluster, caplog):
    strategy, coordinator = cluster
    with strategy.scope():
        v = keras.Variable(1, dtype="int32")

        def replica_fn(input_tensor):
            return input_tensor + v, input_tensor - v

        def worker_fn(iterator):
            return strategy.run(replica_fn, args=(next(iterator),))

    per_worker_dataset = coordinator.create_per_worker_dataset(lambda: Dataset.range(1, 3))
    with caplog.at_level(logging.WARNING):
        strategy.run(replica_fn, args=(np.int32(1),))
    assert "invoked without using `ClusterCoordinator.schedule`" in caplog.text
    rv = coordinator.schedule(worker_fn, args=(iter(per_worker_dataset),))
    assert strategy.experimental_local_results(rv.fetch()) == ((2, 0),)


def test_reduce_not_used_with_cluster_coordinator(cluster, caplog):
    strategy, _ = cluster
    with caplog.at_level(logging.WARNING):
        strategy.reduce("SUM", None, axis=None)
    assert "invoked without using `ClusterCoordinator.schedule`" in caplog.text


def test_run_and_reduce_with_assign_add(cluster):
    strategy, coordinator = cluster
    contexts = []
    assert not distribute.in_cross_replica_context()
    with strategy.scope():
        assert distribute.in_cross_replica_context()
        v = keras.Variable(1.0)
        v1 = keras.Variable(0.0, aggregation="only_first_replica")
        expected_result = (4.0 * strategy.num_replicas_in_sync, 2.0 * strategy.num_replicas_in_sync)

        def worker_fn(input_tensor):
            def replica_fn(input_tensor):
                contexts.append(distribute.in_cross_replica_context())
                v1.assign_add(input_tensor)
                return input_tensor + v, input_tensor - v

            run_result = strategy.run(replica_fn, args=(input_tensor,))
            return strategy.reduce("SUM", run_result, axis=None)

        result = coordinator.schedule(worker_fn, args=(np.float32(3.0),))
        assert isinstance(result, distribute.coordinator.RemoteValue)
        assert result.fetch() == expected_result
    result = coordinator.schedule(worker_fn, args=(np.float32(3.0),))
    assert result.fetch() == expected_result
    coordinator.join()  # TF reads v1 without join (see the xfail above)
    assert float(v1.numpy()) == 6.0
    assert contexts and not any(contexts)


def test_variable_aggregation(cluster):
    strategy, coordinator = cluster
    with strategy.scope():
        v = keras.Variable(1.0, aggregation="sum")

        def worker_fn():
            def replica_fn():
                value = keras.ops.cast(distribute.get_replica_context().replica_id_in_sync_group + 1, v.dtype)
                v.assign(value)

            strategy.run(replica_fn)

        coordinator.schedule(worker_fn)
        coordinator.join()
    assert float(v.numpy()) == sum(i + 1 for i in range(strategy.num_replicas_in_sync))


@pytest.mark.parametrize("from_function", [True, False])
def test_pass_distributed_dataset_to_create_per_worker_dataset(cluster, from_function):
    strategy, coordinator = cluster
    if from_function:
        distributed_dataset = strategy.distribute_datasets_from_function(lambda _: Dataset.range(1, 11).batch(4))
    else:
        distributed_dataset = strategy.experimental_distribute_dataset(Dataset.range(1, 11).batch(4))

    def worker_fn(iterator):
        return strategy.experimental_local_results(next(iterator))

    per_worker_dataset = coordinator.create_per_worker_dataset(distributed_dataset)
    result = coordinator.schedule(worker_fn, args=(iter(per_worker_dataset),)).fetch()
    expected_result = np.split(np.arange(1.0, 5.0), strategy.num_replicas_in_sync)
    assert len(result) == 1
    np.testing.assert_array_equal(result[0], expected_result[0])


@pytest.mark.parametrize("from_function", [True, False])
def test_distributed_dataset_inside_per_worker_dataset_fn(cluster, from_function):
    strategy, coordinator = cluster
    if from_function:

        def per_worker_dataset_fn():
            return strategy.distribute_datasets_from_function(lambda _: Dataset.range(1, 11).batch(4))
    else:

        def per_worker_dataset_fn():
            return strategy.experimental_distribute_dataset(Dataset.range(1, 11).batch(4))

    def worker_fn(iterator):
        return strategy.experimental_local_results(next(iterator))

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    result = coordinator.schedule(worker_fn, args=(iter(per_worker_dataset),)).fetch()
    np.testing.assert_array_equal(result[0], [1, 2, 3, 4])


def test_distribute_datasets_from_function_gets_an_input_context(cluster):
    strategy, coordinator = cluster

    def input_worker_device_fn(input_context):
        assert input_context is not None
        return Dataset.range(1, 11).batch(1)

    distributed_dataset = coordinator.create_per_worker_dataset(
        strategy.distribute_datasets_from_function(input_worker_device_fn))
    result = coordinator.schedule(lambda it: strategy.experimental_local_results(next(it)),
                                  args=(iter(distributed_dataset),)).fetch()
    assert [list(r) for r in result] == [[1 + i] for i in range(strategy.num_replicas_in_sync)]


def test_async_schedule_with_distributed_dataset(cluster):
    strategy, coordinator = cluster
    dataset = Dataset.from_tensor_slices(np.array([2.0], np.float32)).repeat().batch(strategy.num_replicas_in_sync)
    with strategy.scope():
        v = keras.Variable(np.zeros(1, np.float32))

    def worker_fn(iterator):
        x = next(iterator)
        v.assign_add(strategy.reduce("MEAN", x, axis=None))

    iterator = iter(coordinator.create_per_worker_dataset(strategy.experimental_distribute_dataset(dataset)))
    coordinator.join()  # joining without any scheduling doesn't hang
    np.testing.assert_array_equal(v.numpy(), [0])
    for _ in range(5):
        coordinator.schedule(worker_fn, args=(iterator,))
    coordinator.join()
    np.testing.assert_array_equal(strategy.experimental_local_results(v.numpy()), [[10]])
    for _ in range(5):
        coordinator.schedule(worker_fn, args=(iterator,))
    coordinator.join()
    coordinator.join()
    coordinator.join()
    assert coordinator.done()
    np.testing.assert_array_equal(strategy.experimental_local_results(v.numpy()), [[20]])


def test_per_worker_distribute_datasets_element_spec(cluster):
    strategy, coordinator = cluster
    dataset = Dataset.from_tensor_slices(np.array([1, 2], np.int32))
    per_worker = coordinator.create_per_worker_dataset(
        strategy.distribute_datasets_from_function(lambda _: Dataset.from_tensor_slices(np.array([1, 2], np.int32))))
    assert per_worker.element_spec == dataset.element_spec


# -- ParameterServerStrategyV2Test -------------------------------------------------------------------
def test_distribute_dataset_used_directly(cluster):
    strategy, _ = cluster
    dataset = Dataset.range(3)
    with pytest.raises(ValueError):
        iter(strategy.experimental_distribute_dataset(dataset))
    with pytest.raises(ValueError):
        iter(strategy.distribute_datasets_from_function(lambda _: dataset))


def test_variable_with_aggregation_assigned_by_run_on_the_coordinator(cluster, caplog):
    # TF testBasicVariableWithAggregation (run without a coordinator): the assignment reaches the ps.
    strategy, coordinator = cluster
    with strategy.scope():
        v = keras.Variable(np.zeros(8, np.float32), aggregation="sum")

    def replica_fn():
        replica_id = distribute.get_replica_context().replica_id_in_sync_group
        val = keras.ops.reshape(keras.ops.cast(replica_id + 10, v.dtype), [1])
        v.assign(keras.ops.concatenate([val, keras.ops.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])], 0))

    with caplog.at_level(logging.WARNING):
        strategy.run(replica_fn)
    expected_result = np.arange(8.0) * strategy.num_replicas_in_sync
    expected_result[0] += sum(i + 10 for i in range(strategy.num_replicas_in_sync))
    np.testing.assert_array_equal(v.numpy(), expected_result)
    on_worker = coordinator.schedule(lambda: v.value + 0.0).fetch()
    np.testing.assert_array_equal(on_worker, expected_result)


class _Resolver(distribute.cluster_resolver.SimpleClusterResolver):
    pass


def _spec(**jobs):
    return distribute.cluster_resolver.ClusterSpec({k: [f"localhost:{2000 + i}" for i in range(n)] for k, n in jobs.items()})


def test_cluster_type_names_are_tfs():
    # TF ClusterTypeNameTest: validation happens before any cluster is joined.
    spec = _spec(worker=1, ps=1, chief=1, some_arbitrary_name=1)
    with pytest.raises(ValueError, match="Disallowed task type found in"):
        distribute.ParameterServerStrategy(_Resolver(spec, rpc_layer="grpc"))
    with pytest.raises(ValueError, match="There must be at most one 'chief' job."):
        distribute.ParameterServerStrategy(_Resolver(_spec(worker=1, ps=1, chief=3), rpc_layer="grpc",
                                                     task_type="chief", task_id=1))
    with pytest.raises(ValueError, match="There must be at least one worker."):
        distribute.ParameterServerStrategy(_Resolver(_spec(ps=1, chief=1), rpc_layer="grpc", task_type="ps", task_id=0))
    with pytest.raises(ValueError, match="There must be at least one ps."):
        distribute.ParameterServerStrategy(_Resolver(_spec(worker=1, chief=1), rpc_layer="grpc",
                                                     task_type="worker", task_id=0))


def test_arbitrary_current_task_type(ray_instance):
    resolver = _Resolver(_spec(worker=1, ps=1, chief=1), rpc_layer="grpc", task_type="foobar")
    strategy = None
    try:
        with pytest.raises(ValueError, match="Unrecognized task_type: foobar"):
            strategy = distribute.ParameterServerStrategy(resolver)
    finally:
        if strategy is not None:
            strategy._shutdown()
