"""``@tf.function`` by substitution: distribute.function, and strategy.run reusing a program for a new
function object with the same code and closure (TF's multi_worker_with_ctl defines step_fn in train_step)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from helpers import mirrored

import distribute
from distribute.data import TensorSpec


def _programs_of(strategy, python_function) -> int:
    """Compiled programs of ``python_function``'s code in ``strategy``'s cache."""
    code = python_function.__code__
    return sum(1 for key in strategy.extended.programs if isinstance(key, tuple) and isinstance(key[0], tuple)
               and key[0][:2] == ("function", code))


def test_a_replica_function_defined_inside_the_step_compiles_once():
    strategy = mirrored(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1)
    data = distribute.data.Dataset.from_tensor_slices((np.ones((48, 4), np.float32), np.ones((48, 2), np.float32))).batch(8)
    seen = []

    def train_step(iterator):
        def step_fn(inputs):  # a new function object on every call, as in TF's tutorial
            x, y = inputs
            with distribute.GradientTape() as tape:
                loss = distribute.compute_average_loss(keras.ops.mean((model(x) - y) ** 2, axis=1))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        seen.append(step_fn)
        return strategy.reduce("SUM", strategy.run(step_fn, args=(next(iterator),)), axis=None)

    iterator = iter(strategy.experimental_distribute_dataset(data))
    losses = [float(train_step(iterator)) for _ in range(6)]
    assert len(seen) == 6
    assert _programs_of(strategy, seen[0]) == 1
    assert losses[-1] < losses[0]


def test_a_closure_over_other_objects_compiles_again():
    """A closed-over array is a constant of the program: another array, another program (as tf.function)."""
    strategy = mirrored(2)

    def make(scale):
        def fn():
            return scale * 2.0
        return fn

    a, b = make(jnp.asarray(1.0)), make(jnp.asarray(3.0))
    assert [float(v) for v in strategy.experimental_local_results(strategy.run(a))] == [2.0, 2.0]
    assert [float(v) for v in strategy.experimental_local_results(strategy.run(b))] == [6.0, 6.0]
    assert _programs_of(strategy, a) == 2


def test_function_compiles_once_per_input_signature_outside_any_strategy():
    v = keras.Variable(np.zeros(3, np.float32))
    traces = []

    @distribute.function(jit_compile=True, reduce_retracing=True, autograph=False, experimental_relax_shapes=True)
    def step(x):
        traces.append(1)
        v.assign_add(keras.ops.sum(x, axis=0))
        return keras.ops.sum(v)

    assert float(step(np.ones((2, 3), np.float32))) == 6.0
    n = len(traces)
    assert float(step(np.ones((2, 3), np.float32))) == 12.0
    assert len(traces) == n  # the same signature: the compiled program runs, Python does not
    assert float(step(np.ones((4, 3), np.float32))) == 24.0
    assert len(traces) > n  # another shape: traced again
    np.testing.assert_array_equal(v.numpy(), [8.0, 8.0, 8.0])
    assert step.python_function is not None


def test_input_signature_is_checked_as_tf():
    @distribute.function(input_signature=[TensorSpec((None, 2), np.float32)])
    def f(x):
        return keras.ops.sum(x)

    assert float(f(np.ones((3, 2), np.float32))) == 6.0
    for bad in ([np.ones((3, 3), np.float32)], [np.ones((3, 2), np.int32)], [np.ones((3, 2), np.float32), 1], []):
        with pytest.raises(TypeError, match="Binding inputs to distribute.function failed"):
            f(*bad)


def test_a_decorated_method():
    class Trainer:
        def __init__(self):
            self.w = keras.Variable(2.0)

        @distribute.function
        def step(self, x):
            return self.w * x

    t = Trainer()
    assert float(t.step(jnp.asarray(3.0))) == 6.0
    assert float(t.step(jnp.asarray(4.0))) == 8.0


def test_a_cross_replica_step_gives_the_values_of_the_python_loop():
    strategy = mirrored(2)
    data = distribute.data.Dataset.from_tensor_slices(np.arange(12, dtype=np.float32)).batch(4)

    def step(inputs):
        return strategy.reduce("SUM", strategy.run(lambda x: keras.ops.sum(x * x), args=(inputs,)), axis=None)

    compiled = distribute.function(step)
    batches = list(strategy.experimental_distribute_dataset(data))
    assert [float(compiled(b)) for b in batches] == [float(step(b)) for b in batches] == [14.0, 126.0, 366.0]

    @distribute.function
    def epoch(dataset):  # the tutorial's loop over a distributed dataset inside the function
        total = 0.0
        for inputs in dataset:
            total += step(inputs)
        return total

    assert float(epoch(strategy.experimental_distribute_dataset(data))) == 506.0


def test_jax_jit_around_distributed_values_names_distribute_function():
    strategy = mirrored(2)
    batch = next(iter(strategy.experimental_distribute_dataset(distribute.data.Dataset.range(4).batch(2))))
    with pytest.raises(ValueError, match="distribute.function"):
        jax.jit(lambda x: strategy.run(lambda y: y * 2, args=(x,)))(batch)
