"""distribute.GradientTape: TF 2.21's answers (tests/parity/tf_2_21_tape.json), and equality with
compute_gradients in every kind of step (compiled full, compiled uneven, eager uneven, RNNs)."""

from __future__ import annotations

import json
import pathlib
import sys
import types

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import distribute
from helpers import mirrored

sys.path.insert(0, str(pathlib.Path(__file__).parent / "parity"))
from tape_cases import CASES  # noqa: E402

TF = json.loads((pathlib.Path(__file__).parent / "parity" / "tf_2_21_tape.json").read_text())
NS = types.SimpleNamespace(
    GT=distribute.GradientTape, var=lambda x: keras.Variable(x, dtype="float32"),
    const=lambda x: jnp.asarray(x, jnp.float32), to_int=lambda x: x.astype(jnp.int32),
    stop_gradient=jax.lax.stop_gradient, square=keras.ops.square)


def plain(x):
    if x is None:
        return None
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, distribute.DistributedValues):
        return [plain(v) for v in x.values]
    return np.asarray(x).tolist()


def assert_tree_close(actual, expected):
    if isinstance(expected, dict):
        assert set(actual) == set(expected)
        for k in expected:
            assert_tree_close(actual[k], expected[k])
    elif isinstance(expected, list) and any(isinstance(e, (list, dict)) or e is None for e in expected):
        assert isinstance(actual, list) and len(actual) == len(expected), (actual, expected)
        for a, e in zip(actual, expected):
            assert_tree_close(a, e)
    elif expected is None:
        assert actual is None
    else:
        np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tf_programs_give_tf_values(name):
    """Each program of tape_cases.py as a distribute.function, outside any strategy: TF 2.21's answer."""
    expected = TF[f"case/{name}"]
    step = distribute.function(CASES[name](NS))
    if isinstance(expected, dict) and "error" in expected:
        with pytest.raises(getattr(__builtins__, expected["error"], None) or Exception, match=expected["msg"][:40]):
            step()
        return
    assert_tree_close(plain(step()), expected)


def test_tf_programs_under_the_default_strategys_run():
    """The default strategy's run is a step function too (the same answers)."""
    for name in ("nested_second_order", "two_tapes_one_block", "stop_recording", "gradient_penalty"):
        assert_tree_close(plain(distribute.get_strategy().run(CASES[name](NS))), TF[f"case/{name}"])


# -- inside strategy.run: TF's MirroredStrategy values ---------------------------------------------
W0 = np.array([[0.5], [-0.25]], np.float32)
X = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], np.float32)
Y = np.array([[1.0], [0.0], [2.0], [1.0]], np.float32)


def _batches(strategy, *arrays, batch=4):
    return list(strategy.experimental_distribute_dataset(distribute.data.Dataset.from_tensor_slices(arrays).batch(batch)))


def test_per_replica_gradients_summed_by_the_optimizer_as_tf():
    strategy = mirrored(2)
    with strategy.scope():
        w = keras.Variable(W0)
        opt = keras.optimizers.SGD(0.1)

    @distribute.function
    def train_step(inputs):
        def step_fn(x, y):
            with distribute.GradientTape() as tape:
                loss = distribute.compute_average_loss(keras.ops.square(keras.ops.matmul(x, w) - y)[:, 0], global_batch_size=4)
            grads = tape.gradient(loss, [w])
            opt.apply_gradients(zip(grads, [w]))
            return grads[0], loss
        return strategy.run(step_fn, args=inputs)

    grads, losses = train_step(_batches(strategy, X, Y)[0])
    expected = TF["mirrored/per_replica_gradients"]
    assert_tree_close(plain(grads), expected["grads"])
    assert_tree_close(plain(losses), expected["losses"])
    np.testing.assert_allclose(w.numpy(), expected["w"], rtol=1e-6)


def test_two_tapes_over_one_block_gan_step_as_tf():
    strategy = mirrored(2)
    with strategy.scope():
        gen = keras.Variable([[0.5, -0.5]], name="gen")
        disc = keras.Variable([[1.0], [0.25]], name="disc")
        g_opt, d_opt = keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.2)
    noise = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)

    def step_fn(z, r):
        with distribute.GradientTape() as gen_tape, distribute.GradientTape() as disc_tape:
            fake = keras.ops.matmul(z, gen)
            fake_out, real_out = keras.ops.matmul(fake, disc), keras.ops.matmul(r, disc)
            g_loss = distribute.compute_average_loss(keras.ops.square(fake_out - 1.0)[:, 0], global_batch_size=4)
            d_loss = distribute.compute_average_loss((keras.ops.square(real_out - 1.0) + keras.ops.square(fake_out))[:, 0], global_batch_size=4)
        g_grads = gen_tape.gradient(g_loss, [gen])
        d_grads = disc_tape.gradient(d_loss, [disc])
        g_opt.apply_gradients(zip(g_grads, [gen]))
        d_opt.apply_gradients(zip(d_grads, [disc]))
        return g_loss, d_loss

    losses = [plain(strategy.run(step_fn, args=b)) for b in _batches(strategy, noise, X) for _ in range(2)]
    expected = TF["mirrored/gan_step"]
    assert_tree_close(losses, expected["losses"])
    np.testing.assert_allclose(gen.numpy(), expected["gen"], rtol=1e-5)
    np.testing.assert_allclose(disc.numpy(), expected["disc"], rtol=1e-5)


def test_watch_of_the_replicas_input_gives_each_replica_its_own_gradient():
    strategy = mirrored(2)
    with strategy.scope():
        w = keras.Variable(W0)

    def step_fn(x, y):
        with distribute.GradientTape() as tape:
            tape.watch(x)
            loss = keras.ops.sum(keras.ops.square(keras.ops.matmul(x, w) - y))
        return tape.gradient(loss, x)

    assert_tree_close(plain(strategy.run(step_fn, args=_batches(strategy, X, Y)[0])), TF["mirrored/watch_input_per_replica"])


# -- equal to compute_gradients in every kind of step ---------------------------------------------
def _model(kind):
    if kind == "bn":
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    return keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4), keras.layers.Dense(3)])


def _train(strategy, kind, use_tape, batches, branch=False, gather=False):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = _model(kind)
        opt = keras.optimizers.Adam(0.01)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        accuracy = keras.metrics.SparseCategoricalAccuracy()

    def loss_of(x, y):
        logits = model(x, training=True)
        loss = distribute.compute_average_loss(loss_object(y, logits))
        if branch and float(keras.ops.sum(x)) > -1e9:  # a Python branch on a value: the step runs eagerly
            loss = loss + 0.0
        return loss, logits

    def tape_step(x, y):
        with distribute.GradientTape() as tape:
            loss, logits = loss_of(x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        accuracy.update_state(y, logits)
        if gather:
            distribute.get_replica_context().all_gather(keras.ops.expand_dims(loss, 0), 0)
        return loss

    def cg_step(x, y):
        (loss, logits), grads = distribute.compute_gradients(lambda: loss_of(x, y), model.trainable_variables, has_aux=True)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        accuracy.update_state(y, logits)
        if gather:
            distribute.get_replica_context().all_gather(keras.ops.expand_dims(loss, 0), 0)
        return loss

    losses = [float(strategy.reduce("SUM", strategy.run(tape_step if use_tape else cg_step, args=b), axis=None)) for b in batches]
    return losses, [v.numpy() for v in model.weights], float(accuracy.result())


@pytest.mark.parametrize("kind", ["bn", "lstm"])
def test_tape_steps_equal_compute_gradients_steps_full_and_uneven(kind):
    """11 rows by 4 over 3 replicas: two full steps, then an uneven one (per-replica programs)."""
    strategy = mirrored(3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(11, 6) if kind == "bn" else (11, 5, 3)).astype(np.float32)
    y = rng.integers(0, 3, 11)
    batches = _batches(strategy, x, y)
    tape = _train(strategy, kind, True, batches)
    cg = _train(strategy, kind, False, batches)
    np.testing.assert_allclose(tape[0], cg[0], rtol=1e-5)
    for a, b in zip(tape[1], cg[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert tape[2] == cg[2]


def test_tape_in_an_eager_step_equals_compute_gradients():
    """An all_gather after the step: every uneven step runs eagerly on every replica (TF's eager mode)."""
    strategy = mirrored(2)
    rng = np.random.default_rng(1)
    batches = _batches(strategy, rng.normal(size=(7, 6)).astype(np.float32), rng.integers(0, 3, 7))
    tape = _train(strategy, "bn", True, batches, gather=True)
    cg = _train(strategy, "bn", False, batches, gather=True)
    np.testing.assert_allclose(tape[0], cg[0], rtol=1e-5)
    for a, b in zip(tape[1], cg[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_tape_in_a_step_with_a_python_branch_on_a_value_names_the_fix():
    strategy = mirrored(2)
    rng = np.random.default_rng(1)
    batches = _batches(strategy, rng.normal(size=(4, 6)).astype(np.float32), rng.integers(0, 3, 4))
    with pytest.warns(UserWarning, match="eagerly"), pytest.raises(NotImplementedError, match="lax.cond"):
        _train(strategy, "bn", True, batches, branch=True)


def test_collective_inside_the_tape_block_in_full_and_uneven_steps():
    """The gradient of an all-reduced loss is the all-reduce of every replica's gradient (TF), in both steps."""
    strategy = mirrored(2)
    with strategy.scope():
        w = keras.Variable([2.0])

    def step_fn(x):
        ctx = distribute.get_replica_context()
        with distribute.GradientTape() as tape:
            total = ctx.all_reduce("SUM", keras.ops.sum(x * w))
        return tape.gradient(total, w)

    xs = np.array([1.0, 2.0, 3.0], np.float32)
    steps = [plain(strategy.run(step_fn, args=(b,))) for b in _batches(strategy, xs, batch=2)]
    assert steps == TF["mirrored/all_reduce_in_block"]  # [[2], [4]], then [[6], [0]]


# -- errors ------------------------------------------------------------------------------------
def test_a_tape_outside_any_step_function_names_the_fix():
    with pytest.raises(RuntimeError, match="distribute.function"):
        with distribute.GradientTape():
            pass


def test_a_tape_inside_jax_jit_within_the_step_is_refused():
    v = keras.Variable(2.0)

    @distribute.function
    def step():
        @jax.jit
        def inner(x):
            with distribute.GradientTape() as tape:
                y = v * x
            return tape.gradient(y, v)
        return inner(3.0)

    with pytest.raises(NotImplementedError, match="JAX transformation"):
        step()


@pytest.mark.parametrize("bad", [3.0, np.ones(2, np.float32)])
def test_watch_of_a_non_array_names_the_fix(bad):
    @distribute.function
    def step():
        with distribute.GradientTape() as tape:
            tape.watch(bad)

    with pytest.raises(ValueError, match="jnp.asarray"):
        step()


def test_a_function_that_takes_another_path_when_replayed_is_a_clear_error():
    calls = []
    v = keras.Variable(1.0)

    @distribute.function
    def step():
        calls.append(1)
        with distribute.GradientTape() as tape:
            y = v * 2.0
        if len(calls) % 2:  # Python state that changes between runs
            return tape.gradient(y, v)
        return y

    with pytest.raises(RuntimeError, match="another path"):
        step()


def test_readme_using_it_loop_as_written():
    """README "Using it": the TF loop with distribute.GradientTape and @distribute.function, 2 replicas,
    an uneven last batch; it learns, and it ends at the weights of the same loop on one device."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(300, 64)).astype(np.float32)
    labels = images[:, :10].argmax(axis=1).astype(np.int32)

    def readme(strategy, per_replica=64):
        from distribute.data import Dataset

        keras.utils.set_random_seed(3)
        with strategy.scope():
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                      keras.layers.Dense(10)])
            optimizer = keras.optimizers.Adam()
            loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
            accuracy = keras.metrics.SparseCategoricalAccuracy()

        def train_step(x, y):
            with distribute.GradientTape() as tape:
                logits = model(x, training=True)
                loss = distribute.compute_average_loss(loss_object(y, logits))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))  # sums over replicas
            accuracy.update_state(y, logits)
            return loss

        @distribute.function
        def distributed_train_step(x, y):
            return strategy.reduce("SUM", strategy.run(train_step, args=(x, y)), axis=None)

        dataset = Dataset.from_tensor_slices((images, labels)).batch(per_replica * strategy.num_replicas_in_sync)
        losses = [float(distributed_train_step(x, y)) for _ in range(3)
                  for x, y in strategy.experimental_distribute_dataset(dataset)]
        return losses, [v.numpy() for v in model.weights], float(accuracy.result())

    losses, weights, acc = readme(mirrored(2))
    one_losses, one_weights, one_acc = readme(distribute.OneDeviceStrategy("/cpu:0"), per_replica=128)
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, one_losses, rtol=2e-4, atol=2e-5)
    for a, b in zip(weights, one_weights):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-5)
    assert acc == pytest.approx(one_acc, abs=1e-6)


def test_a_tape_directly_in_a_function_that_loops_over_a_dataset_is_refused_not_wrong():
    """A distribute.function that iterates a dataset runs as Python; a tape used directly in it (no
    strategy.run around the step) would replay the loop (consume the iterator again, repeat earlier steps):
    a NotImplementedError naming the fix, and the fix gives one device's values."""
    from distribute.data import Dataset

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
    data = Dataset.from_tensor_slices((np.arange(8, dtype=np.float32).reshape(4, 2), np.ones((4, 1), np.float32))).batch(2)

    def step_fn(x, y):
        with distribute.GradientTape() as tape:
            loss = keras.ops.mean((model(x) - y) ** 2)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @distribute.function
    def direct(dataset):
        return [step_fn(x, y) for x, y in dataset]

    @distribute.function
    def through_run(dataset):
        return [distribute.get_strategy().run(step_fn, args=(x, y)) for x, y in dataset]

    with pytest.raises(NotImplementedError, match=r"distribute.get_strategy\(\).run\(step_fn"):
        direct(data)
    start = [w.copy() for w in model.get_weights()]
    losses = [float(v) for v in through_run(data)]
    w, b = start
    for (x, y), loss in zip([(np.arange(4, dtype=np.float32).reshape(2, 2), 1.0), (np.arange(4, 8, dtype=np.float32).reshape(2, 2), 1.0)], losses):
        err = x @ w + b - y
        assert loss == pytest.approx(float(np.mean(err ** 2)), rel=1e-5)
        w, b = w - 0.1 * (2 * x.T @ err / len(x)), b - 0.1 * 2 * err.mean(axis=0)
    np.testing.assert_allclose(model.get_weights()[0], w, rtol=1e-5)
