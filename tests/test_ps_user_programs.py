"""ParameterServerStrategy + ClusterCoordinator as a user coming from TF's parameter_server_training tutorial.

Programs a TF user writes that stress the coordinator: many small steps with
nested results, scheduling from several threads, fetch before join, done()
polling, errors from inside a dataset, results that are not arrays, large and
sharded variables, a 50-layer Keras model through fit/evaluate/predict and a
checkpoint, a worker killed with large updates in flight, a lost ps followed by
a second strategy that restores the checkpoint, and a program interrupted and
ending with steps still scheduled.  Expected values are TF's where they can be
reasoned exactly (counters, sums), one device's for training with one worker
(the README's rule).  Every assertion is an invariant of any interleaving.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import keras
import numpy as np
import pytest

import distribute
from distribute.coordinator import ClusterCoordinator
from distribute.data import Dataset, TensorSpec
from distribute.parameter_server.errors import CancelledError, OutOfRangeError, PSUnavailableError

from helpers import kill_actor_and_wait

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def two(ray_instance):
    """2 workers, 2 ps; variables of 1 MiB and more are split in 2 row shards."""
    partitioner = distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=1 << 20, max_shards=2)
    strategy = distribute.ParameterServerStrategy(num_workers=2, num_ps=2, variable_partitioner=partitioner)
    yield strategy, ClusterCoordinator(strategy)
    strategy._shutdown()


@pytest.fixture(scope="module")
def one(ray_instance):
    """1 worker (updates in order: training equals one device's), 3 ps, variables of 1 MiB and more split in 3."""
    partitioner = distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=1 << 20, max_shards=3)
    strategy = distribute.ParameterServerStrategy(num_workers=1, num_ps=3, variable_partitioner=partitioner)
    yield strategy, ClusterCoordinator(strategy)
    strategy._shutdown()


def _counter(strategy):
    with strategy.scope():
        return keras.Variable(0, dtype="int32")


def test_many_small_steps_return_nested_structures(two):
    # TF: a scheduled tf.function returns any nest of tensors and Python constants;
    # fetch gives numpy with the same structure (dict keys sorted, None kept).
    strategy, coordinator = two
    count = _counter(strategy)

    def step():
        count.assign_add(1)
        n = count.value
        return {"n": n, "pair": (n * 2, 3), "np": np.float32(2.5), "list": [n + 1, None]}

    results = [coordinator.schedule(step) for _ in range(120)]
    last = results[-1].fetch()  # before join
    assert sorted(last) == ["list", "n", "np", "pair"] and last["list"][1] is None
    coordinator.join()
    assert int(count.numpy()) == 120
    for r in results:
        out = r.fetch()
        n = int(out["n"])
        assert 1 <= n <= 120
        assert (int(out["pair"][0]), int(out["pair"][1]), float(out["np"]), int(out["list"][0])) == (2 * n, 3, 2.5, n + 1)
        assert isinstance(out["pair"], tuple) and isinstance(out["list"], list) and out["list"][1] is None


def test_schedule_from_threads_while_the_main_thread_joins(two):
    strategy, coordinator = two
    count = _counter(strategy)
    errors = []

    def add(k):
        count.assign_add(k)
        return count.value

    def producer(k):
        try:
            for _ in range(25):
                coordinator.schedule(add, args=(np.int32(k),))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=producer, args=(k,)) for k in (1, 2, 3, 4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        coordinator.join()
    for t in threads:
        t.join(60)
    coordinator.join()
    coordinator.join()  # twice: a no-op, as TF
    assert not errors
    assert coordinator.done()
    assert int(count.numpy()) == 25 * (1 + 2 + 3 + 4)


def test_fetch_before_join_then_done_polling(two):
    # TF's tutorial: `while not coordinator.done(): time.sleep(...)`; a read after a
    # fetch sees at least the fetched closure's update (TF reads the ps).
    strategy, coordinator = two
    count = _counter(strategy)

    def step():
        count.assign_add(1)
        return count.value

    results = [coordinator.schedule(step) for _ in range(10)]
    fetched = int(results[4].fetch())
    assert int(count.numpy()) >= fetched >= 1
    deadline = time.monotonic() + 120
    while not coordinator.done():
        assert time.monotonic() < deadline, "done() stayed False for 120 s"
        time.sleep(0.01)
    assert int(count.numpy()) == 10
    assert all(1 <= int(r.fetch()) <= 10 for r in results)


def test_results_that_are_not_arrays(two):
    strategy, coordinator = two
    count = _counter(strategy)
    assert coordinator.schedule(lambda: None).fetch() is None
    five = coordinator.schedule(lambda: 5).fetch()
    assert int(five) == 5 and np.asarray(five).dtype == np.int32
    # TF turns a Python string into a tf.string tensor (fetch: b"hi"); here results are
    # arrays only, and the error names the value and the rule at schedule time.
    with pytest.raises(TypeError, match=r"returned 'hi' of type str; it may return arrays only"):
        coordinator.schedule(lambda: {"s": "hi"})
    with pytest.raises(TypeError, match=r"of type lock; it may return arrays only"):
        coordinator.schedule(lambda: threading.Lock())
    # Nothing was left half-scheduled.
    coordinator.schedule(lambda: count.assign_add(1))
    coordinator.join()
    assert int(count.numpy()) == 1


def test_an_unpicklable_dataset_fn_is_a_clear_error_and_leaves_nothing_behind(two):
    # TF traces dataset_fn on the coordinator; here it runs on every worker, so it is
    # pickled: the error names it and the fix (was Ray's message about an internal object).
    strategy, coordinator = two
    count = _counter(strategy)
    lock = threading.Lock()

    def locked_dataset_fn():
        with lock:
            return Dataset.range(4).repeat()

    per_worker = coordinator.create_per_worker_dataset(locked_dataset_fn)
    with pytest.raises(TypeError, match=r"'.*locked_dataset_fn' given to create_per_worker_dataset runs on every "
                                        r"worker, so it must be picklable.*create such objects inside the function"):
        iter(per_worker)
    coordinator.schedule(lambda: count.assign_add(1))
    coordinator.join()
    assert int(count.numpy()) == 1


def test_a_variable_made_outside_the_scope_in_a_scheduled_function_is_named(two):
    strategy, coordinator = two
    outside = keras.Variable(5.0, name="made_outside")
    with pytest.raises(ValueError, match=r"'made_outside'.*created outside any strategy.scope\(\).*"
                                         r"ClusterCoordinator.schedule\)"):
        coordinator.schedule(lambda: outside.assign_add(1.0))
    assert float(outside.numpy()) == 5.0
    coordinator.join()


def test_host_callback_in_a_scheduled_function_is_a_clear_error(two):
    # TF's tf.print runs on the worker; a jax.export program cannot carry host
    # callbacks, so jax.debug.print is refused with the fix (was jax's bare
    # "serialization of host_callbacks is not yet implemented").
    strategy, coordinator = two
    count = _counter(strategy)

    def noisy():
        jax.debug.print("count={c}", c=count.value)
        count.assign_add(1)
        return count.value

    with pytest.raises(NotImplementedError, match=r"noisy.*jax\.debug\.print.*RemoteValue\.fetch\(\)"):
        coordinator.schedule(noisy)
    coordinator.schedule(lambda: count.assign_add(1))
    coordinator.join()
    assert int(count.numpy()) == 1


def test_a_jax_jit_step_is_scheduled_as_a_tf_function_is(two):
    # The tutorial's `@tf.function def worker_fn(iterator)` ported as `@jax.jit`: schedule
    # traces the function it wraps (was jax's "Too many leaves for PyTreeDef; expected 0").
    strategy, coordinator = two
    total = _counter(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: Dataset.from_tensor_slices(np.full(4, 2, np.int32)).repeat()))

    @jax.jit
    def worker_fn(iterator):
        x = next(iterator)
        total.assign_add(x)
        return x * 10

    results = [coordinator.schedule(worker_fn, args=(iterator,)) for _ in range(5)]
    coordinator.join()
    assert int(total.numpy()) == 10
    assert [int(r.fetch()) for r in results] == [20] * 5


def test_generator_error_keeps_its_type_cancels_and_schedule_works_after(two):
    strategy, coordinator = two
    total = _counter(strategy)

    class GeneratorFailed(Exception):  # defined here, as in a user's __main__: pickled by value
        pass

    def gen():
        yield from (np.int32(i) for i in (1, 2, 3))
        raise GeneratorFailed("the generator gave up")

    def dataset_fn():
        return Dataset.from_generator(gen, output_signature=TensorSpec((), "int32"))

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(iterator):
        x = next(iterator)
        total.assign_add(x)
        return x

    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(12)]
    with pytest.raises(GeneratorFailed, match="the generator gave up"):
        coordinator.join()
    coordinator.join()  # the error was cleared
    ok, failed = [], []
    for r in results:
        try:
            ok.append(int(r.fetch()))
        except (GeneratorFailed, CancelledError) as err:
            failed.append(type(err))
    # Each worker's copy yields 1, 2, 3 once; the ps count every successful step once.
    assert len(ok) <= 6 and all(x in (1, 2, 3) for x in ok)
    assert GeneratorFailed in failed
    assert int(total.numpy()) == sum(ok)
    done = coordinator.schedule(lambda: total.assign_add(100))
    coordinator.join()
    done.fetch()
    assert int(total.numpy()) == sum(ok) + 100


def test_exhausted_dataset_is_raised_by_done_and_by_the_next_schedule(two):
    strategy, coordinator = two
    total = _counter(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: Dataset.range(2)))

    def step(iterator):
        total.assign_add(1)
        return next(iterator)

    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(6)]
    deadline = time.monotonic() + 120
    with pytest.raises(OutOfRangeError, match="exhausted"):
        while not coordinator.done():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert coordinator.done()
    # The first worker to exhaust its 2 elements stops the schedule; the other may not have read both of its own
    # (its closures are cancelled, as TF's). Each element is read once, and only the steps that got one applied.
    read = []
    for result in results:
        try:
            read.append(int(result.fetch()))
        except (OutOfRangeError, CancelledError):
            pass
    assert 2 <= len(read) <= 4 and int(total.numpy()) == len(read), (read, total.numpy())
    assert read.count(0) <= 2 and read.count(1) <= 2 and read.count(1) <= read.count(0), read


def test_large_sharded_dense_kernel_one_worker_equals_one_device(one):
    # A 2048x2048 kernel (16 MiB, TF's "div" row shards 683/683/682 on 3 ps): each step pushes 16 MiB of
    # gradients and reads 16 MiB back; Adam on the ps equals Adam on one device.
    strategy, coordinator = one
    n = 2048
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, n)).astype("float32")
    y = rng.normal(size=(32, n)).astype("float32")

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((n,)), keras.layers.Dense(n)]), keras.optimizers.Adam(1e-3)

    with strategy.scope():
        model, optimizer = build()
    # A 16 MiB kernel is made on its ps, each shard drawn on its own (TF's rule for partitioned variables,
    # docs/tf_compat.md): one device starts from the values the ps drew.
    initial = [np.asarray(v.numpy()) for v in model.weights]
    kernel = model.layers[0].kernel
    assert isinstance(kernel, distribute.ShardedVariable)
    assert [s.shape for s in kernel.variables] == [(683, n), (683, n), (682, n)]
    assert {s.device for s in kernel.variables} == set(strategy.extended.parameter_devices)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: Dataset.from_tensors((x, y)).repeat()))

    def train(model, optimizer, xb, yb):
        loss, grads = distribute.compute_gradients(lambda: keras.ops.mean((model(xb) - yb) ** 2), model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def step(iterator):
        xb, yb = next(iterator)
        return train(model, optimizer, xb, yb)

    losses = [coordinator.schedule(step, args=(iterator,)) for _ in range(3)]
    coordinator.join()
    ref_model, ref_optimizer = build()
    ref_model.set_weights(initial)
    ref_losses = [float(train(ref_model, ref_optimizer, x, y)) for _ in range(3)]
    np.testing.assert_allclose([float(r.fetch()) for r in losses], ref_losses, rtol=1e-6)
    for a, b in zip(model.weights, ref_model.weights):
        np.testing.assert_allclose(np.asarray(a.numpy()), np.asarray(b.numpy()), atol=1e-6)
    assert int(optimizer.iterations.numpy()) == 3


def test_fifty_layer_keras_model_fit_validation_evaluate_predict_checkpoint(one, tmp_path):
    strategy, _ = one
    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 8)).astype("float32")
    y = (x.sum(1) > 0).astype("int32")
    xv = rng.normal(size=(50, 8)).astype("float32")
    yv = (xv.sum(1) > 0).astype("int32")

    def build():
        keras.utils.set_random_seed(1)
        layers = [keras.layers.Dense(8, activation="tanh") for _ in range(50)]
        model = keras.Sequential([keras.Input((8,)), *layers, keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    with strategy.scope():
        model = build()
    assert len(model.weights) == 102
    history = model.fit(x, y, batch_size=32, epochs=2, steps_per_epoch=5, validation_data=(xv, yv), shuffle=False, verbose=0)
    scores = model.evaluate(xv, yv, batch_size=16, verbose=0, return_dict=True)
    predictions = model.predict(xv, batch_size=16, verbose=0)

    ref = build()
    ref_history = ref.fit(x, y, batch_size=32, epochs=2, validation_data=(xv, yv), shuffle=False, verbose=0)
    for key, values in ref_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-5, err_msg=key)
    ref_scores = ref.evaluate(xv, yv, batch_size=16, verbose=0, return_dict=True)
    for key, value in ref_scores.items():
        np.testing.assert_allclose(scores[key], value, rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(predictions, ref.predict(xv, batch_size=16, verbose=0), atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 10

    checkpoint = distribute.Checkpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    saved = [np.asarray(w.numpy()) for w in model.weights]
    model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=5, shuffle=False, verbose=0)
    checkpoint.restore(path)
    for w, s in zip(model.weights, saved):
        np.testing.assert_array_equal(np.asarray(w.numpy()), s)
    assert int(model.optimizer.iterations.numpy()) == 10
    # The restore reached the ps: the workers evaluate the restored weights.
    again = model.evaluate(xv, yv, batch_size=16, verbose=0, return_dict=True)
    for key, value in ref_scores.items():
        np.testing.assert_allclose(again[key], value, rtol=1e-5, err_msg=key)


def test_worker_killed_while_large_updates_are_in_flight(two, ray_instance):
    # 4 MiB per update (2 shards on 2 ps) from an optimizer and from assign_add; the
    # killed worker's steps re-run elsewhere, each ps applies each step once, so every
    # element counts each step exactly once (TF may count a re-run twice).
    strategy, coordinator = two
    with strategy.scope():
        w = keras.Variable(np.zeros((1024, 1024), "float32"))
        u = keras.Variable(np.zeros((1024, 1024), "float32"))
        count = keras.Variable(0, dtype="int32")
        optimizer = keras.optimizers.SGD(1.0)
    assert isinstance(w, distribute.ShardedVariable) and isinstance(u, distribute.ShardedVariable)

    def step():
        w.assign_add(keras.ops.ones((1024, 1024)))
        optimizer.apply_gradients([(keras.ops.ones((1024, 1024)), u)])
        count.assign_add(1)
        return count.value

    results = [coordinator.schedule(step) for _ in range(30)]
    results[2].fetch()
    ray_instance.kill(strategy.extended._cluster.workers[1], no_restart=False)
    coordinator.join()
    assert int(count.numpy()) == 30 and int(optimizer.iterations.numpy()) == 30
    values, trained = np.asarray(w.numpy()), np.asarray(u.numpy())
    assert values.min() == values.max() == 30.0 and trained.min() == trained.max() == -30.0
    for _ in range(5):
        coordinator.schedule(step)
    coordinator.join()
    assert int(count.numpy()) == 35 and float(np.asarray(w.numpy()).max()) == 35.0
    assert int(optimizer.iterations.numpy()) == 35 and float(np.asarray(u.numpy()).min()) == -35.0


def test_lost_ps_then_a_second_strategy_restores_the_checkpoint(ray_instance, tmp_path):
    # TF's advice for a lost ps: a new strategy, the model re-created in its scope,
    # the last checkpoint restored.  Two strategies one after the other in one process.
    def start():
        strategy = distribute.ParameterServerStrategy(num_workers=1, num_ps=1)
        with strategy.scope():
            count = keras.Variable(0, dtype="int32")
        return strategy, ClusterCoordinator(strategy), count

    strategy, coordinator, count = start()
    try:
        step = lambda: count.assign_add(1)  # noqa: E731
        old_iterator = iter(coordinator.create_per_worker_dataset(lambda: Dataset.range(3).repeat()))
        for _ in range(5):
            coordinator.schedule(step)
        coordinator.join()
        path = distribute.Checkpoint(count=count).save(str(tmp_path / "ckpt"))
        results = [coordinator.schedule(step) for _ in range(5)]
        kill_actor_and_wait(ray_instance, strategy.extended._cluster.ps[0])
        with pytest.raises(PSUnavailableError, match=r"parameter server 0 \(ps-0, /job:ps/replica:0/task:0\)"):
            coordinator.join()
        for r in results:
            try:
                r.fetch()
            except (PSUnavailableError, CancelledError):
                pass
        with pytest.raises(PSUnavailableError, match="restore the last checkpoint"):
            coordinator.schedule(step)
            coordinator.join()
    finally:
        strategy._shutdown()

    # The old coordinator refuses to schedule, at once and saying why (was: a hang).
    with pytest.raises(RuntimeError, match="was shut down .* create a new ParameterServerStrategy"):
        coordinator.schedule(step)
    strategy2, coordinator2, count2 = start()
    try:
        assert coordinator2 is not coordinator
        distribute.Checkpoint(count=count2).restore(path)
        with pytest.raises(ValueError, match="made by another ClusterCoordinator.*this coordinator's create_per_worker_dataset"):
            coordinator2.schedule(lambda it: count2.assign_add(next(it)), args=(old_iterator,))
        for _ in range(3):
            coordinator2.schedule(lambda: count2.assign_add(1))
        coordinator2.join()
        assert int(count2.numpy()) == 8
    finally:
        strategy2._shutdown()


def test_a_read_without_join_sees_the_updates_the_ps_applied(two):
    strategy, coordinator = two
    count = _counter(strategy)
    coordinator.join()
    for _ in range(5):
        coordinator.schedule(lambda: count.assign_add(1))
    shard = strategy.extended._registry.entry(count).shards[0]
    ps = strategy.extended._cluster.ps[shard.ps]
    deadline = time.monotonic() + 120
    while int(_ps_value(ps, shard.key)) != 5:
        assert time.monotonic() < deadline, "the ps never applied the 5 updates"
        time.sleep(0.02)
    assert int(count.numpy()) == 5  # TF: 5 (a read of the ps), also while closures may still be in flight
    coordinator.join()


def test_a_read_while_a_step_is_still_running_reads_the_ps(two, tmp_path):
    # A worker's second element waits until released: of 3 steps reading it, one is held on one worker (the
    # queue stays busy) while the other worker applies the counter's steps. A read on the coordinator then
    # is the ps's value, as TF's read of the ps.
    strategy, coordinator = two
    count = _counter(strategy)
    coordinator.join()
    release = tmp_path / "release"

    def held():
        yield np.float32(1)
        while not os.path.exists(release):
            time.sleep(0.01)
        for value in range(2, 10):
            yield np.float32(value)

    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: Dataset.from_generator(held, output_signature=TensorSpec((), "float32"))))
    reads = [coordinator.schedule(lambda it: next(it), args=(iterator,)) for _ in range(3)]
    for _ in range(6):
        coordinator.schedule(lambda: count.assign_add(1))
    shard = strategy.extended._registry.entry(count).shards[0]
    ps = strategy.extended._cluster.ps[shard.ps]
    deadline = time.monotonic() + 120
    while int(_ps_value(ps, shard.key)) < 5:  # at most one counter step waits behind the held one
        assert time.monotonic() < deadline, "the free worker never applied the counter's steps"
        time.sleep(0.02)
    assert coordinator._queue.busy()
    assert int(count.numpy()) == int(_ps_value(ps, shard.key))
    release.touch()
    coordinator.join()
    assert sorted(float(r.fetch()) for r in reads) in ([1.0, 1.0, 2.0], [1.0, 2.0, 3.0])  # 2 + 1 or 3 + 0 steps
    assert int(count.numpy()) == 6


def _ps_value(ps, key):
    import ray

    return np.asarray(ray.get(ps.read_all.remote(), timeout=60)[key])


_INTERRUPTED = textwrap.dedent("""
    import os, signal, sys, threading, time
    # Ctrl-C as at a terminal (a background job of a non-interactive shell inherits SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import numpy as np
    import distribute, keras
    from distribute.coordinator import ClusterCoordinator
    from distribute.data import Dataset, TensorSpec

    strategy = distribute.ParameterServerStrategy(num_workers=2, num_ps=1)
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        w = keras.Variable(np.zeros((512, 512), "float32"))

    def stuck():  # the second element never comes: the steps that read it never end
        yield np.float32(1)
        time.sleep(3600)
        yield np.float32(1)

    dataset_fn = lambda: Dataset.from_generator(stuck, output_signature=TensorSpec((), "float32"))
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(iterator):
        w.assign_add(keras.ops.ones((512, 512)) * next(iterator))
        return w.value[0, 0]

    for _ in range(50):
        coordinator.schedule(step, args=(iterator,))
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        coordinator.join()
        print("join returned", flush=True)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
    print("exiting", flush=True)
    sys.exit(0)
""")


def test_interrupted_program_exits_promptly_with_steps_still_scheduled(ray_instance, tmp_path):
    # Ctrl-C in a join that cannot finish raises KeyboardInterrupt (TF: the same), and
    # the program then ends although steps are stuck on the workers and more are queued.
    script = tmp_path / "interrupted.py"
    script.write_text(_INTERRUPTED)
    env = dict(os.environ, RAY_ADDRESS=ray_instance.get_runtime_context().gcs_address,
               PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["KeyboardInterrupt", "exiting"], proc.stdout + proc.stderr[-3000:]


def test_two_worker_fit_validation_equals_evaluate_and_predict_equals_the_final_weights(two):
    # With 2 workers training is asynchronous, but validation runs after the epoch's
    # join and evaluate/predict get each row once: val_ logs equal evaluate() on the
    # final weights, predict equals a forward pass of them on one device.
    strategy, _ = two
    rng = np.random.default_rng(3)
    x = rng.normal(size=(256, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    xv = rng.normal(size=(37, 6)).astype("float32")
    yv = (xv[:, 0] > 0).astype("int32")

    def build():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer="adam", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    with strategy.scope():
        model = build()
    history = model.fit(x, y, batch_size=16, epochs=2, steps_per_epoch=8, validation_data=(xv, yv), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 16
    scores = model.evaluate(xv, yv, batch_size=8, verbose=0, return_dict=True)
    np.testing.assert_allclose(history.history["val_loss"][-1], scores["loss"], rtol=1e-5)
    np.testing.assert_allclose(history.history["val_accuracy"][-1], scores["accuracy"], rtol=1e-6)
    local = build()
    local.set_weights([np.asarray(w.numpy()) for w in model.weights[: len(local.weights)]])
    np.testing.assert_allclose(model.predict(xv, batch_size=8, verbose=0), local.predict(xv, verbose=0), atol=1e-5)
    local_scores = local.evaluate(xv, yv, verbose=0, return_dict=True)
    np.testing.assert_allclose(scores["loss"], local_scores["loss"], rtol=1e-5)
