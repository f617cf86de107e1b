"""Shared helpers for the distribute test suite: cached strategies, the TF fixture, small data."""

from __future__ import annotations

import functools
import json
import pathlib

import numpy as np

import distribute

FIXTURE_PATH = pathlib.Path(__file__).parent / "parity" / "tf_2_21.json"


@functools.lru_cache(maxsize=None)
def tf_fixture() -> dict:
    """The recorded TensorFlow 2.21 values (tests/parity/tf_2_21.json)."""
    return json.loads(FIXTURE_PATH.read_text())


@functools.lru_cache(maxsize=None)
def mirrored(num_replicas: int) -> "distribute.MirroredStrategy":
    """One MirroredStrategy over the first ``num_replicas`` CPU devices, shared by tests."""
    return distribute.MirroredStrategy([f"/cpu:{i}" for i in range(num_replicas)])


def local_lists(strategy, value) -> list:
    """experimental_local_results of ``value`` as plain Python lists."""
    return [np.asarray(v).tolist() for v in strategy.experimental_local_results(value)]


def split_rule(num_rows: int, num_replicas: int) -> list[list[int]]:
    """TF's split of a batch of row indices ``0..num_rows-1``: ceil(n/R) rows each, in order."""
    share = -(-num_rows // num_replicas) if num_rows else 0
    return [list(range(min(r * share, num_rows), min((r + 1) * share, num_rows))) for r in range(num_replicas)]


def keras_inputs() -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """x (64, 4), y (64, 1) and the initial weights of the fixture's Keras model."""
    inputs = tf_fixture()["keras_fit"]["inputs"]
    x = np.asarray(inputs["x"], np.float32)
    y = np.asarray(inputs["y"], np.float32)
    weights = [np.asarray(w, np.float32) for w in inputs["initial_weights"]]
    return x, y, weights


def build_fixture_model(weights=None):
    """Sequential([Input((4,)), Dense(3, relu), Dense(1)]) with the fixture's weights."""
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"), keras.layers.Dense(1)])
    model.set_weights(keras_inputs()[2] if weights is None else weights)
    return model


def assert_tree_close(actual, expected, *, rtol=0.0, atol=0.0) -> None:
    actual, expected = list(actual), list(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def kill_actor_and_wait(ray, handle, seconds: float = 120.0) -> None:
    """Kills a Ray actor and returns once its process is gone (TF's ``kill_task`` returns once the task is down).

    ``ray.kill`` returns at once and Ray reports the actor dead at once, while its
    process can still run (and answer a ps channel) for a fraction of a second.
    """
    import os
    import time

    pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=seconds)
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + seconds
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(f"/proc/{pid}"), f"actor process {pid} still runs {seconds} s after ray.kill"
