"""Distributed fit of models whose per-example losses have more than one axis equals one device (issue 18, item 4).

A ``(rows,)`` per-row loss weight met per-timestep losses ``(rows, steps)``: ``Masking`` then
``TimeDistributed(Dense)`` (the mask reaches the loss) and ``BatchNormalization`` on rank-3 inputs raised
``Incompatible shapes for broadcasting`` in fit under a strategy, where plain Keras on one device and TF train.
7 rows, batch 4 on 2 replicas: an even step (2 | 2) and an uneven one (2 | 1).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from helpers import mirrored


def _model(kind: str) -> keras.Model:
    if kind == "masked_time_distributed":
        return keras.Sequential([keras.Input((10, 20)), keras.layers.Masking(0.0), keras.layers.TimeDistributed(keras.layers.Dense(1))])
    # synchronized: the moments over every replica's rows, as one device computes them (unsynchronized BatchNorm
    # normalizes each replica by its own rows, as in TF, which differs from one device by design)
    return keras.Sequential([keras.Input((10, 20)), keras.layers.BatchNormalization(synchronized=True), keras.layers.Dense(1)])


def _train(kind: str, strategy) -> tuple[list, list]:
    rng = np.random.default_rng(0)
    x, y = rng.random((7, 10, 20), dtype=np.float32), rng.random((7, 10, 1), dtype=np.float32)
    x[:, 7:] = 0.0  # the last 3 timesteps masked (Masking(0.0))
    keras.utils.set_random_seed(1)
    if strategy is None:
        model = _model(kind)
        model.compile(keras.optimizers.SGD(0.1), "mse")
    else:
        with strategy.scope():
            model = _model(kind)
            model.compile(keras.optimizers.SGD(0.1), "mse")
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()], history.history["loss"]


@pytest.mark.parametrize("kind", ["masked_time_distributed", "batch_norm_rank_3"])
def test_fit_with_per_timestep_losses_equals_one_device(kind):
    want_weights, want_loss = _train(kind, None)
    got_weights, got_loss = _train(kind, mirrored(2))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for got, want in zip(got_weights, want_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
