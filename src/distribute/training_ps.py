"""The main job's loop under ParameterServerStrategy (``--strategy parameter_server --mode custom``).

TF's parameter_server_training tutorial loop: every worker builds its own
shuffled, repeated pipeline (``create_per_worker_dataset``); the coordinator
schedules ``steps`` train steps per epoch with ``ClusterCoordinator.schedule``,
``join()``s at the epoch end, and reads the loss and accuracy from the ps-side
metrics.  Test loss and accuracy are computed on the coordinator from the
weights pulled back by ``join()`` (exact: every test example once, TF's
"inline evaluation on the coordinator").
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def steps_per_epoch(num_examples: int, global_batch_size: int) -> tuple[int, int]:
    """``(steps, batch)``: full batches per pass over ``num_examples`` (at least one step).

    A per-worker pipeline is infinite and drops its remainder (one traced program
    per step shape), so an epoch is ``num_examples // batch`` steps of ``batch =
    min(global_batch_size, num_examples)`` examples each.
    """
    batch = min(global_batch_size, num_examples)
    return max(1, num_examples // batch), batch


def coordinator_evaluate(model: Any, x: np.ndarray, y: np.ndarray, batch_size: int) -> tuple[float, float]:
    """``(mean sparse cross-entropy from logits, accuracy)`` of ``model`` on ``x (n, features)``, ``y (n,)``.

    Runs on the coordinator with the values the last ``join()`` pulled from the ps.
    """
    logits = np.concatenate(
        [np.asarray(model(x[i : i + batch_size], training=False), np.float64) for i in range(0, len(x), batch_size)]
    )
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = float(-log_probs[np.arange(len(y)), y].mean())
    accuracy = float((logits.argmax(axis=1) == y).mean())
    return loss, accuracy


def ps_custom_loop(
    strategy: Any,
    model: Any,
    args: argparse.Namespace,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    epoch_line: Callable[[int, int, dict, int, float], str],
) -> dict:
    """Trains ``model`` (built in ``strategy.scope()``) for ``args.epochs``; returns the history.

    History keys: ``loss`` and ``accuracy`` (the ps-side metrics of the epoch's
    steps), ``val_loss`` and ``val_accuracy`` (``coordinator_evaluate`` after the
    epoch's ``join()``), one value per epoch.
    """
    import keras

    import distribute
    from distribute.coordinator import ClusterCoordinator, experimental_get_current_worker_index
    from distribute.data import Dataset

    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        train_loss = keras.metrics.Mean()
        train_accuracy = keras.metrics.SparseCategoricalAccuracy()
    optimizer = model.optimizer
    steps, batch = steps_per_epoch(len(x_train), args.global_batch_size)
    seed = args.seed

    def dataset_fn():  # runs on every worker; each shuffles with its own seed
        worker_seed = seed + experimental_get_current_worker_index()
        dataset = Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=worker_seed)
        return dataset.repeat().batch(batch, drop_remainder=True)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def train_step(iterator):
        def replica_fn(x, y):
            with distribute.GradientTape() as tape:
                logits = model(x, training=True)
                loss = distribute.compute_average_loss(loss_object(y, logits))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            train_loss.update_state(loss)
            train_accuracy.update_state(y, logits)
            return loss

        x, y = next(iterator)
        return strategy.reduce("SUM", strategy.run(replica_fn, args=(x, y)), axis=None)

    history: dict[str, list[float]] = {"loss": [], "accuracy": [], "val_loss": [], "val_accuracy": []}
    for epoch in range(args.epochs):
        train_loss.reset_state()  # pushed to the ps
        train_accuracy.reset_state()
        if args.verbose and args.epochs > 1:
            print(f"Epoch {epoch + 1}/{args.epochs}")
        start = time.perf_counter()
        for _ in range(steps):
            coordinator.schedule(train_step, args=(iterator,))
        coordinator.join()  # the metrics and weights now hold the ps values
        seconds = time.perf_counter() - start
        val_loss, val_accuracy = coordinator_evaluate(model, x_test, y_test, args.global_batch_size)
        logs = {"loss": float(train_loss.result()), "accuracy": float(train_accuracy.result()),
                "val_loss": val_loss, "val_accuracy": val_accuracy}
        if args.verbose:  # one finished bar per epoch (TF refuses per-step progress under PS)
            progress = keras.utils.Progbar(steps, verbose=args.verbose, unit_name="step")
            progress.update(steps, list(logs.items()), finalize=True)
        for key, value in logs.items():
            history[key].append(value)
        print(epoch_line(epoch + 1, args.epochs, logs, steps * batch, seconds))
    return history


def ps_fit(
    strategy: Any,
    model: Any,
    args: argparse.Namespace,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    epoch_line: Callable[[int, int, dict, int, float], str],
) -> dict:
    """Keras ``model.fit`` under the strategy: ``steps_per_epoch`` full batches per epoch; returns the history.

    ``--verbose 1`` becomes 2 (TF refuses a per-step bar under ParameterServerStrategy);
    test loss and accuracy are added to each epoch's logs by ``coordinator_evaluate``.
    """
    import keras

    steps, batch = steps_per_epoch(len(x_train), args.global_batch_size)
    verbose = min(args.verbose, 1) * 2

    class TestPass(keras.callbacks.Callback):  # epoch-level only: TF refuses batch-level callbacks here
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.start
            logs["val_loss"], logs["val_accuracy"] = coordinator_evaluate(model, x_test, y_test, args.global_batch_size)

    class EpochSummary(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            print(epoch_line(epoch + 1, args.epochs, logs, steps * batch, test_pass.seconds))

    test_pass = TestPass()
    callbacks = [test_pass, keras.callbacks.ProgbarLogger(), EpochSummary()] if verbose else [test_pass, EpochSummary()]
    result = model.fit(x_train, y_train, batch_size=batch, epochs=args.epochs, steps_per_epoch=steps,
                       shuffle=True, verbose=verbose, callbacks=callbacks)
    return {k: [float(v) for v in vals] for k, vals in result.history.items()}
