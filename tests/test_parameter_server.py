"""ParameterServerStrategy and ClusterCoordinator: TF's expected values from its coordinator tests.

Ported from tensorflow/python/distribute/coordinator/cluster_coordinator_test.py and
parameter_server_strategy_v2_test.py (values, in our words).  One Ray instance is
shared by the session; two strategies are shared by this module.
"""

from __future__ import annotations

import time

import logging

import keras
import numpy as np
import pytest

import distribute
from distribute.coordinator import ClusterCoordinator
from distribute.data import Dataset
from distribute.parameter_server.errors import CancelledError, OutOfRangeError

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def two_by_two(ray_instance):
    """2 workers, 2 ps, and its coordinator."""
    strategy = distribute.ParameterServerStrategy(num_workers=2, num_ps=2)
    yield strategy, ClusterCoordinator(strategy)
    strategy._shutdown()


@pytest.fixture(scope="module")
def one_worker(ray_instance):
    """1 worker, 2 ps: updates are applied in order, so training equals one device's.

    Variables of 128 bytes and more are split in 2 (the small linear model's are not).
    """
    partitioner = distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=128, max_shards=2)
    strategy = distribute.ParameterServerStrategy(num_workers=1, num_ps=2, variable_partitioner=partitioner)
    yield strategy, ClusterCoordinator(strategy)
    strategy._shutdown()


def test_coordinator_is_one_per_strategy_and_needs_ps(two_by_two):
    strategy, coordinator = two_by_two
    assert ClusterCoordinator(strategy) is coordinator
    with pytest.raises(ValueError, match="Only `tf.distribute.experimental.ParameterServerStrategy` is supported"):
        ClusterCoordinator(distribute.OneDeviceStrategy("/cpu:0"))
    assert distribute.experimental.ParameterServerStrategy is distribute.ParameterServerStrategy
    assert distribute.experimental.coordinator.ClusterCoordinator is ClusterCoordinator
    assert strategy.num_replicas_in_sync == 1
    assert strategy.extended.parameter_devices == ("/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0")


def test_async_schedule_and_join_totals_are_exact(two_by_two):
    # TF testAsyncScheduleAndJoin: 5 steps of v += 2 give 10, 5 more give 20; joins repeat fine.
    strategy, coordinator = two_by_two
    with strategy.scope():
        v = keras.Variable(0, dtype="int32")
    per_worker = coordinator.create_per_worker_dataset(lambda: Dataset.from_tensor_slices(np.full(10, 2, np.int32)))
    iterator = iter(per_worker)

    def worker_fn(iterator):
        x = next(iterator)
        v.assign_add(x)
        return x

    coordinator.join()
    assert int(v.numpy()) == 0
    results = [coordinator.schedule(worker_fn, args=(iterator,)) for _ in range(5)]
    coordinator.join()
    assert int(v.numpy()) == 10
    assert [int(r.fetch()) for r in results] == [2] * 5
    for _ in range(5):
        coordinator.schedule(worker_fn, args=(iterator,))
    coordinator.join()
    coordinator.join()
    assert coordinator.done()
    assert int(v.numpy()) == 20


def test_assign_is_last_writer_wins_and_metrics_are_exact(two_by_two):
    strategy, coordinator = two_by_two
    with strategy.scope():
        w = keras.Variable(-1.0)
        mean = keras.metrics.Mean()

    def set_and_count(x):
        w.assign(x)
        mean.update_state(x)

    for i in range(6):
        coordinator.schedule(set_and_count, args=(np.float32(i),))
    coordinator.join()
    assert float(w.numpy()) in {float(i) for i in range(6)}
    assert float(mean.result()) == pytest.approx(2.5)  # total 15 / count 6, whatever the order
    assert float(mean.count.numpy()) == 6.0
    mean.reset_state()  # a coordinator-side assign goes to the ps
    coordinator.schedule(set_and_count, args=(np.float32(4.0),))
    coordinator.join()
    assert float(mean.result()) == 4.0


def test_run_and_reduce_inside_schedule(two_by_two):
    # TF testRunAndReduce: v = 1, x = 3: (x + v, x - v) summed over the worker's replicas (one) = (4, 2).
    strategy, coordinator = two_by_two
    with strategy.scope():
        v = keras.Variable(1.0)

    def worker_fn(x):
        def replica_fn(x):
            return x + v, x - v

        return strategy.reduce("SUM", strategy.run(replica_fn, args=(x,)), axis=None)

    result = coordinator.schedule(worker_fn, args=(np.float32(3.0),))
    assert [float(a) for a in result.fetch()] == [4.0, 2.0]


def test_run_outside_schedule_warns_as_tf(two_by_two, caplog):
    strategy, _ = two_by_two
    with caplog.at_level(logging.WARNING, logger="distribute"):
        assert strategy.run(lambda: 3) == 3
    assert "is invoked without using `ClusterCoordinator.schedule`" in caplog.text


def test_nested_fetch_and_remote_value_rules(two_by_two):
    strategy, coordinator = two_by_two

    def f(x):
        return {"a": (x, x * 2), "b": [x + 1]}

    result = coordinator.schedule(f, args=(np.float32(1.0),))
    fetched = coordinator.fetch({"r": result, "plain": 7})
    assert fetched["plain"] == 7
    assert isinstance(fetched["r"]["a"][0], np.ndarray)
    assert [float(fetched["r"]["a"][0]), float(fetched["r"]["a"][1]), float(fetched["r"]["b"][0])] == [1.0, 2.0, 2.0]
    assert coordinator.schedule(lambda: None).fetch() is None
    with pytest.raises(ValueError, match="RemoteValue` used as an input to scheduled function is not yet supported"):
        coordinator.schedule(f, args=(result,))
    with pytest.raises(TypeError, match="must be a callable object"):
        coordinator.schedule(3)


def test_round_robin_placement_as_tf(ray_instance, two_by_two):
    # TF testVariablePlacement (3 ps): v2 -> ps0, v3 -> ps1, v4 -> ps2, v5 -> ps0; here with 2 ps.
    strategy, _ = two_by_two
    registry = strategy.extended._registry
    start = registry._count
    with strategy.scope():
        variables = [keras.Variable(float(i)) for i in range(4)]
    expected = [(start + i) % 2 for i in range(4)]
    assert [int(v.device.split("task:")[1][0]) for v in variables] == expected
    outside = keras.Variable(1.0)
    assert not hasattr(outside, "_distribute_on_assign")


def test_error_in_scheduled_function_is_raised_by_join_then_cleared(two_by_two):
    # TF testAsyncScheduleWithErrors-like: the first error is raised by join with its own type, queued
    # closures are cancelled, and training then continues.
    strategy, coordinator = two_by_two
    with strategy.scope():
        v = keras.Variable(0.0)
    short = iter(coordinator.create_per_worker_dataset(lambda: Dataset.from_tensor_slices(np.ones(1, np.float32))))

    def take(iterator):
        v.assign_add(next(iterator))

    def add_one():
        v.assign_add(1.0)

    for _ in range(3):  # two workers own one element each: a third next() fails somewhere
        coordinator.schedule(take, args=(short,))
    queued = [coordinator.schedule(add_one) for _ in range(200)]
    with pytest.raises(OutOfRangeError, match="End of sequence"):
        coordinator.join()
    cancelled = 0
    for r in queued:
        try:
            r.fetch()
        except CancelledError as err:
            assert "The corresponding function is cancelled. Please reschedule the function." in str(err)
            cancelled += 1
    coordinator.join()  # the error was cleared
    total = float(v.numpy())
    assert total == 2.0 + (len(queued) - cancelled)
    coordinator.schedule(add_one)
    coordinator.join()
    assert float(v.numpy()) == total + 1


def test_a_step_scheduled_at_once_reads_a_dataset_still_being_built(two_by_two):
    # Steps travel on the worker's channel, datasets through Ray: a step sent right after
    # create_per_worker_dataset waits for its iterator (TF: the resource is built before closures use it).
    strategy, coordinator = two_by_two

    def slow_dataset_fn():
        time.sleep(0.5)
        return Dataset.range(100).batch(10)

    iterator = iter(coordinator.create_per_worker_dataset(slow_dataset_fn))
    results = [coordinator.schedule(lambda it: keras.ops.sum(next(it)), args=(iterator,)) for _ in range(4)]
    coordinator.join()
    sums = [int(r.fetch()) for r in results]
    counts = [sums.count(45 + 100 * k) for k in range(4)]  # each worker reads its own copy from its start, in order
    assert sum(counts) == 4 and 1 <= counts[0] <= 2 and counts == sorted(counts, reverse=True), sums


def test_a_user_error_keeps_its_type_and_names_where_it_was_raised(two_by_two):
    strategy, coordinator = two_by_two

    # The only user Python a worker runs is its dataset: a generator that raises there.
    class BadRecord(ValueError):  # defined here: it travels by value
        pass

    def records():
        yield np.float32(1.0)
        raise BadRecord("record 7 is corrupt")

    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: Dataset.from_generator(records, output_signature=distribute.data.TensorSpec((), "float32"))))
    with pytest.raises(BadRecord, match="record 7 is corrupt") as info:  # from a later schedule or join (TF's rule)
        for _ in range(4):
            coordinator.schedule(lambda it: next(it), args=(iterator,))
        coordinator.join()
    assert any("(raised in worker " in note and "records" in note for note in info.value.__notes__)


def test_worker_index_inside_dataset_fn(two_by_two):
    # TF testWorkerIndexDatasetFn: each worker shards with its own index.
    strategy, coordinator = two_by_two
    with pytest.raises(RuntimeError, match="inside the dataset_fn"):
        distribute.coordinator.experimental_get_current_worker_index()

    def dataset_fn():
        index = distribute.coordinator.experimental_get_current_worker_index()
        return Dataset.range(10).shard(2, index).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def five(iterator):
        return sum(next(iterator) for _ in range(5))

    results = [coordinator.schedule(five, args=(iterator,)) for _ in range(4)]
    coordinator.join()
    sums = {int(r.fetch()) for r in results}
    assert sums <= {0 + 2 + 4 + 6 + 8, 1 + 3 + 5 + 7 + 9}, sums


def test_next_on_coordinator_is_refused(two_by_two):
    _, coordinator = two_by_two
    iterator = iter(coordinator.create_per_worker_dataset(Dataset.range(4).batch(2)))
    with pytest.raises(NotImplementedError, match="Iterating over an `AsyncDistributedIterator` is not supported"):
        next(iterator)


def _linear_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.7).astype(np.float32)
    return x, y


def _model(hidden):
    layers = [keras.layers.Dense(hidden, activation="tanh")] if hidden else []
    return keras.Sequential([keras.Input((4,)), *layers, keras.layers.Dense(1)])


def _custom_loop(strategy, coordinator, optimizer_fn, steps, hidden=0):
    """TF's parameter_server_training tutorial loop, ported by substitution."""
    x, y = _linear_data()
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = _model(hidden)
        optimizer = optimizer_fn()
        loss_metric = keras.metrics.Mean()

    def dataset_fn():
        return Dataset.from_tensor_slices((x, y)).repeat().batch(8, drop_remainder=True)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(iterator):
        def replica_fn(batch):
            bx, by = batch
            loss, grads = distribute.compute_gradients(
                lambda: keras.ops.mean((model(bx, training=True) - by) ** 2), model.trainable_variables
            )
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            loss_metric.update_state(loss)
            return loss

        return strategy.reduce("SUM", strategy.run(replica_fn, args=(next(iterator),)), axis=None)

    losses = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps)]
    coordinator.join()
    return model, optimizer, loss_metric, losses


def _one_device(optimizer_fn, steps, hidden=0):
    x, y = _linear_data()
    keras.utils.set_random_seed(1)
    model = _model(hidden)
    optimizer = optimizer_fn()
    for k in range(steps):
        bx, by = x[(k % 8) * 8 : (k % 8) * 8 + 8], y[(k % 8) * 8 : (k % 8) * 8 + 8]
        _, grads = distribute.compute_gradients(lambda: keras.ops.mean((model(bx) - by) ** 2), model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return model


@pytest.mark.parametrize("optimizer_fn", [lambda: keras.optimizers.SGD(0.05), lambda: keras.optimizers.Adam(0.05)], ids=["sgd", "adam"])
def test_custom_loop_one_worker_equals_one_device(one_worker, optimizer_fn):
    strategy, coordinator = one_worker
    model, optimizer, loss_metric, losses = _custom_loop(strategy, coordinator, optimizer_fn, 24)
    reference = _one_device(optimizer_fn, 24)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(optimizer.iterations.numpy()) == 24
    assert float(loss_metric.count.numpy()) == 24.0
    assert float(loss_metric.result()) == pytest.approx(np.mean([float(r.fetch()) for r in losses]), rel=1e-5)
    # Kernel, bias and the optimizer's slots are spread over both ps; slots sit with their variable.
    assert {v.device for v in model.weights} == set(strategy.extended.parameter_devices)
    for slot in optimizer.variables[2:]:
        assert slot.device in strategy.extended.parameter_devices


def test_custom_loop_two_workers_converges(two_by_two):
    strategy, coordinator = two_by_two
    model, optimizer, loss_metric, losses = _custom_loop(strategy, coordinator, lambda: keras.optimizers.SGD(0.05), 300)
    kernel, bias = model.get_weights()
    np.testing.assert_allclose(kernel.ravel(), [1.0, -2.0, 0.5, 3.0], atol=0.02)
    np.testing.assert_allclose(bias, [0.7], atol=0.02)
    assert int(optimizer.iterations.numpy()) == 300  # every step applied exactly once
    assert float(losses[-1].fetch()) < 1e-3


def test_partitioned_variables_are_split_over_ps_and_train_as_one_device(one_worker, ray_instance):
    # Dense(16)'s kernel (4, 16) float32 is 256 bytes: 2 shards of 2 rows ("div"), one per ps, round-robin;
    # its Adam slots are split the same way, and training equals one device.
    strategy, coordinator = one_worker
    adam = lambda: keras.optimizers.Adam(0.05)
    model, optimizer, _, _ = _custom_loop(strategy, coordinator, adam, 16, hidden=16)
    registry = strategy.extended._registry
    kernel = model.layers[0].kernel
    shards = registry.entry(kernel).shards
    assert [(s.start, s.stop) for s in shards] == [(0, 2), (2, 4)]
    assert sorted(s.ps for s in shards) == [0, 1]
    slot = next(v for v in optimizer.variables if tuple(v.shape) == (4, 16))
    assert [(s.ps, s.start) for s in registry.entry(slot).shards] == [(s.ps, s.start) for s in shards]
    stored = {}
    for part in ray_instance.get([ps.read_all.remote() for ps in strategy.extended._cluster.ps]):
        stored.update(part)
    np.testing.assert_array_equal(np.concatenate([stored[s.key] for s in shards]), kernel.numpy())
    reference = _one_device(adam, 16, hidden=16)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # A coordinator-side assign (a checkpoint restore) is split into the shards on the ps.
    kernel.assign(np.arange(64, dtype=np.float32).reshape(4, 16))
    coordinator.join()
    np.testing.assert_array_equal(kernel.numpy(), np.arange(64, dtype=np.float32).reshape(4, 16))


def test_keras_evaluate_and_predict_run_on_the_workers(one_worker):
    # tests/test_ps_keras_eval.py has the full set; here: the values of the coordinator's own copy of the model.
    strategy, _ = one_worker
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x, y = _linear_data()
    want = np.asarray(model(x, training=False))
    np.testing.assert_allclose(model.predict(x, verbose=0), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0), np.mean((want - y) ** 2), rtol=1e-5)


def test_dataset_creator_and_distributed_datasets_from_function(two_by_two):
    # TF: every worker's dataset_fn gets InputContext(num_input_pipelines=1, input_pipeline_id=0).
    strategy, coordinator = two_by_two

    def dataset_fn(input_context):
        assert (input_context.num_input_pipelines, input_context.input_pipeline_id) == (1, 0)
        return Dataset.from_tensor_slices(np.arange(6, dtype=np.float32)).repeat().batch(3)

    for source in (distribute.DatasetCreator(dataset_fn), strategy.distribute_datasets_from_function(dataset_fn)):
        iterator = iter(coordinator.create_per_worker_dataset(source))
        result = coordinator.schedule(lambda it: next(it), args=(iterator,))
        assert result.fetch().tolist() in ([0.0, 1.0, 2.0], [3.0, 4.0, 5.0])
    with pytest.raises(TypeError, match="must be a `callable`"):
        distribute.DatasetCreator(3)
    with pytest.raises(TypeError, match="should be a non-empty list"):  # TF's message (test_ps_sharded_variable.py)
        distribute.ShardedVariable([])


def test_cluster_resolver_validation_is_tfs(ray_instance):
    from distribute.cluster_resolver import ClusterSpec, SimpleClusterResolver

    with pytest.raises(ValueError, match="There must be at least one ps."):
        distribute.ParameterServerStrategy(SimpleClusterResolver(ClusterSpec({"worker": ["h:1"], "chief": ["h:0"]})))
    with pytest.raises(ValueError, match="There must be at least one worker."):
        distribute.ParameterServerStrategy(SimpleClusterResolver(ClusterSpec({"ps": ["h:1"], "chief": ["h:0"]})))


def test_a_worker_puts_back_the_elements_of_a_run_that_needs_another_program():
    # A program per element shape: elements of a shape the plan was not traced for go back to their
    # iterators, in order, and the worker answers with their signature; the run with the program of
    # that signature reads the same elements (none skipped or read twice), whichever plan came first.
    from types import SimpleNamespace

    from distribute.parameter_server.actors import Worker, _Iterator
    from distribute.parameter_server.dataset import ElementSpecChanged

    worker = Worker(0, [])
    batches = [np.arange(4), np.arange(4, 8), np.arange(8, 10), np.arange(4)]
    worker._iterators[5] = _Iterator(iter(batches))
    full, short = [((4,), "<i8")], [((2,), "<i8")]
    answer = worker._elements(SimpleNamespace(iterators=((5, 2, (full, full)),)))
    assert [x.tolist() for x in answer] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    answer = worker._elements(SimpleNamespace(iterators=((5, 2, (full, full)),)))  # [8, 9] then [0..3]
    assert isinstance(answer, ElementSpecChanged)
    ((rid, _, seen),) = answer.specs
    assert rid == 5 and [[shape for shape, _ in e] for e in seen] == [[(2,)], [(4,)]]
    answer = worker._elements(SimpleNamespace(iterators=((5, 2, (short, full)),)))  # the re-traced plan
    assert [x.tolist() for x in answer] == [[8, 9], [0, 1, 2, 3]]
    with pytest.raises(OutOfRangeError):
        worker._elements(SimpleNamespace(iterators=((5, 1, (full,)),)))


def test_a_worker_runs_the_program_it_already_has_for_a_partial_batch():
    # After the coordinator sent it the partial batch's program once, a worker switches to it by itself.
    from types import SimpleNamespace

    from distribute.parameter_server.actors import Worker, _Iterator
    from distribute.parameter_server.dataset import ElementSpecChanged

    worker = Worker(0, [])
    worker._iterators[3] = _Iterator(iter([np.arange(4), np.arange(2), np.arange(4), np.arange(2)]))
    import jax

    leaf = (jax.tree_util.tree_structure(0),)  # each element one array
    full = SimpleNamespace(program_id=1, family=9, iterators=((3, 1, ([((4,), "<i8")],)),), element_treedefs=leaf)
    short = SimpleNamespace(program_id=2, family=9, iterators=((3, 1, ([((2,), "<i8")],)),), element_treedefs=leaf)
    other = SimpleNamespace(program_id=3, family=8, iterators=full.iterators, element_treedefs=leaf)
    assert worker._plan_for_elements(full, ["full"])[1] == ["full"]
    assert isinstance(worker._plan_for_elements(full, ["full"])[2], ElementSpecChanged)  # [0, 1]: new to it
    plan, box, leaves = worker._plan_for_elements(short, ["short"])  # the coordinator's program for (2,)
    assert box == ["short"] and [x.tolist() for x in leaves] == [[0, 1]]
    assert worker._plan_for_elements(full, ["full"])[1] == ["full"]  # [0, 1, 2, 3]
    assert isinstance(worker._plan_for_elements(other, ["other"])[2], ElementSpecChanged)  # another family
    plan, box, leaves = worker._plan_for_elements(full, ["full"])  # its family has a (2,) program
    assert plan is short and box == ["short"] and [x.tolist() for x in leaves] == [[0, 1]]


def test_an_element_of_another_dtype_or_structure_gets_its_own_program(one_worker, monkeypatch):
    """TF's tf.function retraces for a new input signature: dtype and structure are part of it, as shapes are.

    A per-worker dataset whose elements change dtype (int32, float32, int32) or
    dict keys is computed in each element's own dtype and structure (never cast
    to the first one's): ``x * 3 // 2`` is integer floor division on int32 and
    float floor division on float32; each signature is traced once, and the
    worker reuses a program it already has (the third element).  Measured on
    TF 2.21 (tests/parity/record_tf_ps_input.py, the same tf.function over
    int32, float32, int32 per-worker iterators): int32 [1, 3, 4], float32
    [0.0, 2.0, 3.0], 2 traces; over {"a"} and {"b"} dicts: [1, 2], [10, 20].
    """
    from distribute.parameter_server import program

    strategy, coordinator = one_worker
    traced = []
    trace_step = program.trace_step

    def counting(strategy, fn, *args, **kwargs):
        traced.append(fn)
        return trace_step(strategy, fn, *args, **kwargs)

    monkeypatch.setattr(program, "trace_step", counting)
    batches = [np.array([1, 2, 3], np.int32), np.array([0.5, 1.5, 2.5], np.float32), np.array([4, 5, 6], np.int32)]
    iterator = iter(coordinator.create_per_worker_dataset(lambda: list(batches)))

    def scaled(it):
        return next(it) * 3 // 2

    got = [r.fetch() for r in [coordinator.schedule(scaled, args=(iterator,)) for _ in range(3)]]
    assert [g.dtype for g in got] == [np.int32, np.float32, np.int32]
    assert [g.tolist() for g in got] == [[1, 3, 4], [0.0, 2.0, 3.0], [6, 7, 9]]
    assert len(traced) == 2  # int32 and float32, each once
    # Another dict structure with the same leaves: unflattened with its own keys.
    weights = {"a": 1.0, "b": 10.0}
    elements = [{"a": np.array([1.0, 2.0], np.float32)}, {"b": np.array([1.0, 2.0], np.float32)},
                {"a": np.array([3.0, 4.0], np.float32)}]
    iterator = iter(coordinator.create_per_worker_dataset(lambda: list(elements)))

    def weighted(it):
        return sum(value * weights[key] for key, value in next(it).items())

    got = [r.fetch() for r in [coordinator.schedule(weighted, args=(iterator,)) for _ in range(3)]]
    assert [g.tolist() for g in got] == [[1.0, 2.0], [10.0, 20.0], [3.0, 4.0]]
    assert len(traced) == 4
    # Two structures inside one call cannot be one program: TF's dataset has one element_spec.
    iterator = iter(coordinator.create_per_worker_dataset(lambda: list(elements)))
    coordinator.schedule(lambda it: (weighted(it), weighted(it)), args=(iterator,))
    with pytest.raises(TypeError, match="elements of different structures from per-worker iterator"):
        coordinator.join()


def test_a_worker_runs_one_compiled_program_for_plans_of_the_same_box():
    # program.with_iterators: a new iterator's plan has its own id but the traced program's box; the
    # worker runs the program it compiled for that box, not a fresh copy (no second XLA compile).
    from types import SimpleNamespace

    import jax

    from distribute.parameter_server.actors import Worker, _Iterator

    worker = Worker(0, [])
    worker._iterators[3] = _Iterator(iter([np.arange(4)]))
    worker._iterators[4] = _Iterator(iter([np.arange(4)]))
    leaf = (jax.tree_util.tree_structure(0),)
    first = SimpleNamespace(program_id=1, family=9, iterators=((3, 1, ([((4,), "<i8")],)),), element_treedefs=leaf)
    second = SimpleNamespace(program_id=2, family=9, iterators=((4, 1, ([((4,), "<i8")],)),), element_treedefs=leaf)
    worker._programs[1] = "compiled"
    worker._keep_plan(first, ["box"])  # what load_plan does with a plan sent through Ray
    worker._keep_plan(second, ["box"])  # not deserialized again: program 2 is program 1's compiled one
    plan, _, leaves = worker._plan_for_elements(second, None)
    assert plan is second and worker._programs[2] == "compiled" and [x.tolist() for x in leaves] == [[0, 1, 2, 3]]
