"""The uneven step's three ways to run: compiled per-replica programs cut at the collectives, eager threads, and
the old host-callback programs (from an older checkout), on TF's custom_training model.

Every step is uneven: global batch 63 on 2 replicas (32 | 31 rows), the tutorial's CNN with an L2
kernel_regularizer, Adam, an accuracy metric.  Two workloads: the tutorial's custom loop (strategy.run +
compute_gradients + reduce) and ``model.fit`` (batch_size=63).  Each measurement is a fresh subprocess:
the first step's seconds (trace + compile + run) and the median of the next steps.

    python benchmarks/uneven_paths.py --repeats 3 [--baseline-src /path/to/old/checkout/src] [--out benchmarks/results/uneven_paths]
    python benchmarks/uneven_paths.py --one compiled loop       # one measurement (prints a RESULT line)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

STEPS = 12


def measure(mode: str, workload: str) -> dict:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    import numpy as np

    import distribute

    if mode == "eager":
        from distribute import uneven

        uneven._programs = lambda *args, **kwargs: None  # every uneven step runs in the eager threads
    strategy = distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    batch = 63
    x = rng.random((batch * (STEPS + 1), 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, len(x))
    regularizer = keras.regularizers.L2(1e-5)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu", kernel_regularizer=regularizer), keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu", kernel_regularizer=regularizer), keras.layers.MaxPooling2D(),
            keras.layers.Flatten(), keras.layers.Dense(64, activation="relu", kernel_regularizer=regularizer),
            keras.layers.Dense(10, kernel_regularizer=regularizer)])
        optimizer = keras.optimizers.Adam()
    times = []
    if workload == "fit":
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])

        class Timer(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                self.start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                float(logs["loss"])
                times.append(time.perf_counter() - self.start)

        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Timer()])
    else:
        with strategy.scope():
            loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
            accuracy = keras.metrics.SparseCategoricalAccuracy()

        def train_step(inputs):
            images, labels = inputs

            def loss_fn():
                predictions = model(images, training=True)
                loss = distribute.compute_average_loss(loss_object(labels, predictions))
                return loss + distribute.scale_regularization_loss(sum(model.losses)), predictions

            (loss, predictions), grads = distribute.compute_gradients(loss_fn, model.trainable_variables, has_aux=True)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            accuracy.update_state(labels, predictions)
            return loss

        data = distribute.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        for inputs in strategy.experimental_distribute_dataset(data):
            start = time.perf_counter()
            float(strategy.reduce("SUM", strategy.run(train_step, args=(inputs,)), axis=None))
            times.append(time.perf_counter() - start)
    return {"mode": mode, "workload": workload, "first_step_seconds": times[0], "step_seconds": statistics.median(times[1:])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", nargs=2, metavar=("MODE", "WORKLOAD"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-src", help="src/ of a checkout whose uneven step uses host callbacks")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(*args.one)), flush=True)
        return
    runs = [("compiled", None), ("eager", None)] + ([("callback", args.baseline_src)] if args.baseline_src else [])
    results: list[dict] = []
    for repeat in range(args.repeats):  # interleaved, so that the machine's load hits every mode alike
        for workload in ("loop", "fit"):
            for mode, src in runs:
                env = dict(os.environ)
                if src:
                    env["PYTHONPATH"] = src
                out = subprocess.run([sys.executable, __file__, "--one", "compiled" if mode == "callback" else mode, workload],
                                     env=env, capture_output=True, text=True, timeout=1800)
                line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    print(f"{mode} {workload}: failed\n{out.stderr[-2000:]}", flush=True)
                    continue
                result = json.loads(line[7:]) | {"mode": mode, "load": os.getloadavg()[0]}
                results.append(result)
                print(json.dumps(result), flush=True)
    print("\nmedians over repeats (seconds): workload, mode, first step, later steps")
    for workload in ("loop", "fit"):
        for mode, _ in runs:
            rows = [r for r in results if r["workload"] == workload and r["mode"] == mode]
            if rows:
                print(f"{workload:5s} {mode:9s} {statistics.median(r['first_step_seconds'] for r in rows):8.2f} "
                      f"{statistics.median(r['step_seconds'] for r in rows):8.4f}")
    if args.out:
        path = pathlib.Path(args.out)
        path.mkdir(parents=True, exist_ok=True)
        (path / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
