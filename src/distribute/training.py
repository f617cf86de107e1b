"""The main job's training run: data, model, fit or custom loop, and outputs.

Used by ``python -m distribute train`` (``cli.py`` parses the flags first).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np


class JobError(Exception):
    """A problem with the job's inputs (data file, devices), reported in one line."""


# -- data ----------------------------------------------------------------------------
def load_data(path: str | None, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    """Returns ``x_train (n, features) float32 in [0, 1], y_train (n,) int32, x_test, y_test, name``.

    Without ``path``: scikit-learn's UCI handwritten digits (1,797 8x8 images),
    split 80/20 with ``seed``.  With ``path``: an ``.npz`` holding ``x_train``,
    ``y_train``, ``x_test``, ``y_test`` (Keras' ``mnist.npz`` layout).

    Raises:
        JobError: the file is missing, not an ``.npz`` or corrupt, lacks a key,
            its arrays are empty, hold NaN/inf images or non-integer, one-hot or
            negative labels, or do not fit together.
    """
    if path is None:
        try:
            from sklearn.datasets import load_digits
            from sklearn.model_selection import train_test_split
        except ImportError as err:
            raise JobError(
                f"the embedded digits need scikit-learn ({err}); install the main job's extras "
                "(pip install '.[examples]', or pip install 'jax-distribute[examples]'), or pass --data PATH.npz."
            ) from err

        digits = load_digits()
        x = (digits.data / 16.0).astype(np.float32)
        y = digits.target.astype(np.int32)
        x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
        return x_train, y_train, x_test, y_test, "UCI digits (scikit-learn)"
    arrays = _read_npz(path)
    x_train, x_test = (_flatten_images(arrays[k], k, path) for k in ("x_train", "x_test"))
    y_train, y_test = (_labels(arrays[k], k, path) for k in ("y_train", "y_test"))
    for x_key, x, y_key, y in (("x_train", x_train, "y_train", y_train), ("x_test", x_test, "y_test", y_test)):
        if len(x) != len(y):
            raise JobError(f"--data {path}: {x_key} has {len(x)} examples but {y_key} has {len(y)} labels")
    if x_train.shape[1] != x_test.shape[1]:
        raise JobError(f"--data {path}: x_train has {x_train.shape[1]} features per example but x_test has {x_test.shape[1]}")
    return x_train, y_train, x_test, y_test, Path(path).name


_NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


def _read_npz(path: str) -> dict[str, np.ndarray]:
    """The four arrays of ``path``; any failure is one ``JobError`` line naming the file."""
    prefix = f"cannot read --data {path}"
    not_npz = "not an .npz archive (expected a zip of x_train, y_train, x_test, y_test as numpy.savez writes)"
    try:
        with open(path, "rb") as file:
            magic = file.read(6)
    except OSError as err:
        raise JobError(f"{prefix}: {err.strerror or err}") from None
    if not magic:
        raise JobError(f"{prefix}: the file is empty; {not_npz}")
    if magic == b"\x93NUMPY":
        raise JobError(f"{prefix}: it is a single .npy array, {not_npz}")
    if not magic.startswith(b"PK"):
        raise JobError(f"{prefix}: {not_npz}")
    try:
        archive = np.load(path, allow_pickle=False)
    except Exception as err:  # noqa: BLE001 - a broken zip raises many kinds; all are the file's fault
        raise JobError(f"{prefix}: corrupt .npz archive ({_describe(err)})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):  # pragma: no cover - the magic check above
        raise JobError(f"{prefix}: {not_npz}")
    with archive:
        missing = [k for k in _NPZ_KEYS if k not in archive.files]
        if missing:
            raise JobError(f"{prefix}: missing arrays {missing}; expected x_train, y_train, x_test, y_test")
        arrays = {}
        for key in _NPZ_KEYS:
            try:
                arrays[key] = np.asarray(archive[key])
            except Exception as err:  # noqa: BLE001 - corrupt member, pickled objects, bad header
                raise JobError(f"{prefix}: cannot read {key} ({_describe(err)})") from None
    return arrays


def _describe(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _flatten_images(x: np.ndarray, key: str, path: str) -> np.ndarray:
    if x.ndim < 2 or not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        raise JobError(f"--data {path}: {key} must be numeric images (n, ...), got shape {x.shape} dtype {x.dtype}")
    if x.shape[0] == 0:
        raise JobError(f"--data {path}: {key} is empty (shape {x.shape}); it needs at least one example")
    if x.size == 0:
        raise JobError(f"--data {path}: {key} has no features (shape {x.shape})")
    x = x.reshape(len(x), -1)
    with np.errstate(over="ignore"):
        x = x.astype(np.float32)
    finite = np.isfinite(x)
    if not finite.all():
        bad, first = int(finite.size - finite.sum()), int(np.argmin(finite.all(axis=1)))
        raise JobError(f"--data {path}: {key} has {bad} non-finite values (NaN or inf, or too large for float32), "
                       f"the first in example {first}")
    peak = float(x.max())
    return x / peak if peak > 1.0 else x


def _labels(y: np.ndarray, key: str, path: str) -> np.ndarray:
    """``y`` as int32 class labels of shape ``(n,)``; rejects one-hot, fractional and negative labels."""
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        hint = "; one-hot labels? pass y.argmax(axis=1)" if y.ndim == 2 else ""
        raise JobError(f"--data {path}: {key} must be integer class labels of shape (n,), got shape {y.shape}{hint}")
    if np.issubdtype(y.dtype, np.floating):
        finite = np.isfinite(y)
        if not finite.all():
            raise JobError(f"--data {path}: {key} has {int(y.size - finite.sum())} non-finite labels (NaN or inf)")
        fractional = y[y != np.round(y)]
        if fractional.size:
            raise JobError(f"--data {path}: {key} must be integer class labels, got non-integral values such as {fractional[0]}")
    elif not np.issubdtype(y.dtype, np.integer):
        raise JobError(f"--data {path}: {key} must be integer class labels, got dtype {y.dtype}")
    if y.size and y.min() < 0:
        raise JobError(f"--data {path}: {key} has negative labels (smallest {y.min()}); class labels run from 0")
    if y.size and y.max() >= 2**31 - 1:
        raise JobError(f"--data {path}: {key} has a label {y.max()} too large for a class index")
    return y.astype(np.int32)


def check_labels(y_train: np.ndarray, y_test: np.ndarray, source: str) -> int:
    """The class count, ``max(y_train) + 1``; at least 2 and covering every test label.

    Raises:
        JobError: fewer than 2 classes, or test labels the training split lacks.
    """
    num_classes = int(y_train.max()) + 1
    if num_classes < 2:
        raise JobError(f"{source}: y_train has only class 0; a classifier needs at least 2 classes (labels 0..k-1, k >= 2)")
    unknown = np.unique(y_test[y_test >= num_classes])
    if unknown.size:
        shown = ", ".join(str(v) for v in unknown[:5]) + (", ..." if unknown.size > 5 else "")
        raise JobError(f"{source}: y_test has labels outside the training classes 0..{num_classes - 1}: {shown}")
    return num_classes


# -- strategy and model --------------------------------------------------------------------
def make_strategy(name: str, replicas: int | None, num_workers: int | None = None, num_ps: int | None = None) -> Any:
    import jax

    import distribute

    if name == "parameter_server":  # an embedded local Ray cluster (or RAY_ADDRESS's)
        try:
            return distribute.ParameterServerStrategy(num_workers=num_workers, num_ps=num_ps)
        except ImportError as err:
            raise JobError(str(err)) from err
    if name == "default":
        return distribute.get_strategy()
    if name == "multi_worker_mirrored":  # the cluster from TF_CONFIG (python -m distribute.launch sets it)
        return distribute.MultiWorkerMirroredStrategy()
    devices = jax.local_devices()
    if name == "one_device":
        return distribute.OneDeviceStrategy(devices[0])
    count = replicas or (len(devices) if devices[0].platform != "cpu" else 2)
    if count > len(devices):
        raise JobError(f"--replicas {count}: this machine has {len(devices)} {devices[0].platform.upper()} devices")
    return distribute.MirroredStrategy(devices[:count])


def build_model(num_features: int, num_classes: int, learning_rate: float) -> Any:
    import keras

    model = keras.Sequential(
        [
            keras.Input((num_features,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(num_classes),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
    return model


# -- training --------------------------------------------------------------------------
def train(args: argparse.Namespace) -> dict:
    """Runs the job described by the parsed flags; returns the history.

    Prints the strategy, a progress bar and a summary line per epoch, and, last,
    ``test accuracy: 0.9733``.  Writes ``model.keras``, ``history.json`` and
    ``curves.png`` to ``args.output``.

    Raises:
        JobError: unreadable or invalid data (see ``load_data``; also fewer than
            2 classes or test labels the training split lacks), too few
            devices, or an unwritable output directory.
    """
    x_train, y_train, x_test, y_test, data_name = load_data(args.data, args.seed)
    num_classes = check_labels(y_train, y_test, f"--data {args.data}" if args.data else data_name)
    import keras  # noqa: F401 - after the data checks, so a bad --data file is reported without the wait

    output = Path(args.output)
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise JobError(f"cannot create --output {args.output}: {err}") from None
    strategy = make_strategy(args.strategy, args.replicas, getattr(args, "num_workers", None), getattr(args, "num_ps", None))
    try:
        return _train(strategy, args, output, x_train, y_train, x_test, y_test, data_name, num_classes)
    finally:
        if args.strategy == "parameter_server":
            strategy._shutdown()  # the actors; the embedded Ray instance stops at exit


def _train(strategy, args, output, x_train, y_train, x_test, y_test, data_name, num_classes) -> dict:
    import keras

    keras.utils.set_random_seed(args.seed)
    if args.strategy == "parameter_server":
        ext = strategy.extended
        print(f"strategy: ParameterServerStrategy, workers: {ext.num_workers}, ps: {ext.num_ps}, "
              f"ps devices: {', '.join(ext.parameter_devices)}")
    else:
        print(f"strategy: {type(strategy).__name__.lstrip('_')}, replicas: {strategy.num_replicas_in_sync}, "
              f"devices: {', '.join(strategy.extended.worker_devices)}")
    print(f"data: {data_name}, {len(x_train)} train / {len(x_test)} test examples, {x_train.shape[1]} features, "
          f"{num_classes} classes; global batch {args.global_batch_size}, mode {args.mode}")
    with strategy.scope():
        model = build_model(x_train.shape[1], num_classes, args.learning_rate)
    if args.strategy == "parameter_server":
        from distribute.training_ps import coordinator_evaluate, ps_custom_loop, ps_fit

        run = ps_fit if args.mode == "fit" else ps_custom_loop
        history = run(strategy, model, args, x_train, y_train, x_test, y_test, _epoch_line)
        _, test_accuracy = coordinator_evaluate(model, x_test, y_test, args.global_batch_size)
    else:
        run = _fit if args.mode == "fit" else _custom_loop
        history = run(strategy, model, args, x_train, y_train, x_test, y_test)
        _, test_accuracy = model.evaluate(x_test, y_test, batch_size=args.global_batch_size, verbose=0)
    if strategy.extended.should_checkpoint:  # the chief writes; every worker prints
        _write_outputs(output, model, history, args)
        print(f"outputs: {output / 'model.keras'}, {output / 'history.json'}, {output / 'curves.png'}")
    print(f"test accuracy: {test_accuracy:.4f}")
    return history


def _epoch_line(epoch: int, epochs: int, logs: dict, examples: int, seconds: float) -> str:
    return (f"epoch {epoch}/{epochs}: loss {logs['loss']:.4f}, accuracy {logs['accuracy']:.4f}, "
            f"test loss {logs['val_loss']:.4f}, test accuracy {logs['val_accuracy']:.4f}, "
            f"{examples / max(seconds, 1e-9):,.0f} examples/s")


def _fit(strategy, model, args, x_train, y_train, x_test, y_test) -> dict:
    import keras

    class EpochSummary(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            # Training time only: the test pass in fit runs after the last batch.
            print(_epoch_line(epoch + 1, args.epochs, logs, len(x_train), self.train_seconds))

        def on_train_batch_end(self, batch, logs=None):
            self.train_seconds = time.perf_counter() - self.start

    # Keras appends its own ProgbarLogger after our callbacks, so our line would land in the
    # middle of its unfinished progress-bar line; listed first, it ends its line before ours
    # (CallbackList adds no second one when the list already holds a ProgbarLogger).
    callbacks = [keras.callbacks.ProgbarLogger(), EpochSummary()] if args.verbose else [EpochSummary()]
    result = model.fit(
        x_train, y_train, batch_size=args.global_batch_size, epochs=args.epochs,
        validation_data=(x_test, y_test), verbose=args.verbose, callbacks=callbacks,
    )
    return {k: [float(v) for v in vals] for k, vals in result.history.items()}


def _custom_loop(strategy, model, args, x_train, y_train, x_test, y_test) -> dict:
    import keras

    import distribute
    from distribute.data import Dataset

    with strategy.scope():
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        train_accuracy = keras.metrics.SparseCategoricalAccuracy()
        test_loss = keras.metrics.Mean()
        test_accuracy = keras.metrics.SparseCategoricalAccuracy()
    optimizer = model.optimizer

    def train_step(x, y):
        with distribute.GradientTape() as tape:
            logits = model(x, training=True)
            loss = distribute.compute_average_loss(loss_object(y, logits))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        train_accuracy.update_state(y, logits)
        return loss

    def test_step(x, y):
        logits = model(x, training=False)
        test_loss.update_state(loss_object(y, logits))
        test_accuracy.update_state(y, logits)

    test_dist = strategy.experimental_distribute_dataset(Dataset.from_tensor_slices((x_test, y_test)).batch(args.global_batch_size))
    train_ds = Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=args.seed).batch(args.global_batch_size)
    train_dist = strategy.experimental_distribute_dataset(train_ds)
    steps = math.ceil(len(x_train) / args.global_batch_size)
    history: dict[str, list[float]] = {"loss": [], "accuracy": [], "val_loss": [], "val_accuracy": []}
    for epoch in range(args.epochs):
        for metric in (train_accuracy, test_loss, test_accuracy):
            metric.reset_state()
        progress = None
        if args.verbose:  # the same layout as fit's: "Epoch i/n", the bar (or one line), the summary
            if args.epochs > 1:
                print(f"Epoch {epoch + 1}/{args.epochs}")
            progress = keras.utils.Progbar(steps, verbose=args.verbose, unit_name="step",
                                           stateful_metrics=["loss", "accuracy"])
        start, total, count = time.perf_counter(), 0.0, 0
        for step, (x, y) in enumerate(train_dist, start=1):
            loss = strategy.reduce("SUM", strategy.run(train_step, args=(x, y)), axis=None)
            total, count = total + float(loss), count + 1
            if progress is not None and step < steps:
                progress.update(step, [("accuracy", float(train_accuracy.result())), ("loss", total / count)], finalize=False)
        seconds = time.perf_counter() - start
        for x, y in test_dist:
            strategy.run(test_step, args=(x, y))
        logs = {"loss": total / count, "accuracy": float(train_accuracy.result()),
                "val_loss": float(test_loss.result()), "val_accuracy": float(test_accuracy.result())}
        if progress is not None:  # finished after the test pass, with its numbers, as fit's bar is
            progress.update(steps, [("accuracy", logs["accuracy"]), ("loss", logs["loss"]),
                                    ("val_accuracy", logs["val_accuracy"]), ("val_loss", logs["val_loss"])], finalize=True)
        for key, value in logs.items():
            history[key].append(value)
        print(_epoch_line(epoch + 1, args.epochs, logs, len(x_train), seconds))
    return history


# -- outputs ------------------------------------------------------------------------------
def _write_outputs(output: Path, model: Any, history: dict, args: argparse.Namespace) -> None:
    model.save(output / "model.keras")
    record = {"flags": {k: v for k, v in vars(args).items() if k != "command"}, "history": history}
    (output / "history.json").write_text(json.dumps(record, indent=2))
    plot_history(history, output / "curves.png")


def plot_history(history: dict, path: Path) -> None:
    """Writes a two-panel PNG: loss and accuracy per epoch, train and test."""
    try:
        import matplotlib
    except ImportError as err:
        raise JobError(
            f"curves.png needs matplotlib ({err}); install the main job's extras "
            "(pip install '.[examples]', or pip install 'jax-distribute[examples]')."
        ) from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = range(1, len(history["loss"]) + 1)
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for axes, key, title in ((left, "loss", "loss"), (right, "accuracy", "accuracy")):
        axes.plot(epochs, history[key], marker="o", label="train")
        if f"val_{key}" in history:
            axes.plot(epochs, history[f"val_{key}"], marker="s", label="test")
        axes.set_xlabel("epoch")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
