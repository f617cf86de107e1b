"""The compiled uneven step, hundreds of times in a row, beside a busy process: it always finishes, exactly.

An uneven step runs each replica's function as programs cut at its collectives, the collectives made on
the host between them (``engine/per_replica.py``), so no program ever waits on another one.  The
programs it used to be (one per replica, each collective an ordered host callback that waited for the
other replicas' programs) deadlocked on a loaded machine (issue 19).  Here: 2 replicas, batches of 3 and 5
rows (2 | 1 and 3 | 2: four replica shapes), a collective of a constant, a collective under ``jax.jit``,
an L2 regularizer's losses through ``model.losses``, Adam; a busy-looping process beside it the whole time.
Every step's values and the final weights equal one device's.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import keras
import numpy as np

import distribute
from helpers import mirrored

STEPS = 100  # the suite's; run with 300 (and more) by hand
BUSY = "import time\nend = time.time() + 600\nwhile time.time() < end:\n    pass\n"


def _train(strategy, batches):
    traces = [0]
    with strategy.scope():
        keras.utils.set_random_seed(4)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-2)),
                                  keras.layers.Dense(1, kernel_regularizer=keras.regularizers.L2(1e-2))])
        optimizer = keras.optimizers.Adam(0.01)
        mse = keras.losses.MeanSquaredError(reduction="none")
    context = distribute.get_replica_context

    def step(x, y):
        traces[0] += 1

        def loss_fn():
            loss = distribute.compute_average_loss(mse(y, model(x, training=True)))
            return loss + distribute.scale_regularization_loss(sum(model.losses))

        loss, grads = distribute.compute_gradients(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        replicas = context().all_reduce("SUM", 1.0)  # a collective of a constant
        rows = jax.jit(lambda v: context().all_reduce("SUM", jnp.sum(jnp.ones_like(v[:, 0]))))(x)  # one under jax.jit
        return loss, replicas, rows

    losses = []
    for size, (x, y) in batches:
        loss, replicas, rows = strategy.run(step, args=(x, y))
        losses.append(float(strategy.reduce("SUM", loss, axis=None)))
        assert {float(r) for r in strategy.experimental_local_results(replicas)} == {float(strategy.num_replicas_in_sync)}
        assert {float(r) for r in strategy.experimental_local_results(rows)} == {float(size)}
    return losses, [np.asarray(w) for w in model.get_weights()], traces[0]


def _batches(strategy):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(4 * STEPS, 6)).astype(np.float32)
    y = np.tanh(x.sum(axis=1, keepdims=True)).astype(np.float32)
    sizes = [3 if i % 2 else 5 for i in range(STEPS)]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    pieces = [(x[a:b], y[a:b]) for a, b in zip(starts[:-1], starts[1:])]
    threes = strategy.experimental_distribute_dataset(distribute.data.Dataset.from_tensor_slices(tuple(np.concatenate(p) for p in zip(*pieces[1::2]))).batch(3))
    fives = strategy.experimental_distribute_dataset(distribute.data.Dataset.from_tensor_slices(tuple(np.concatenate(p) for p in zip(*pieces[0::2]))).batch(5))
    for five, three in zip(fives, threes):
        yield 5, five
        yield 3, three


def test_compiled_uneven_step_hundreds_of_times_beside_a_busy_process():
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        losses, weights, traces = _train(mirrored(2), _batches(mirrored(2)))
    finally:
        busy.kill()
        busy.wait()
    expected_losses, expected_weights, _ = _train(mirrored(1), _batches(mirrored(1)))
    assert len(losses) == STEPS
    # Compiled: traced twice for the discovery of each batch size (until its variables are known) and once per
    # replica shape, never per step.
    assert traces <= 2 * 2 + 4, traces
    np.testing.assert_allclose(losses, expected_losses, rtol=2e-5, atol=1e-6)
    for got, want in zip(weights, expected_weights):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-5)
