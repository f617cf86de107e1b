"""Keras fit under ParameterServerStrategy: examples/s with steps_per_execution K (one scheduled closure per K steps).

    python benchmarks/ps_steps_per_execution.py                 # mlp 784-64-10, batch 64, 1 worker, 1 ps, K = 1, 8
    python benchmarks/ps_steps_per_execution.py --k 1,4,8,32 --workers 2

The mlp workload of ``compare.py`` (Dense 64 relu, Dense 10, Adam, sparse
cross-entropy from logits, accuracy), on synthetic data of ``--samples`` rows
(each worker gets the arrays and builds its own repeated pipeline).  For each K:
one fit of ``1 + --epochs`` epochs of ``--steps`` steps, the first untimed
(tracing, compiling, warm-up); the figure is the median timed epoch's examples/s
(an epoch ends with ``join()``, so it counts every step's update on the ps).  A closure is
one Ray round trip (pull the weights, run, push the update), so K packs K steps
into one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


class _EpochTimer:
    """An epoch-level callback (allowed under ParameterServerStrategy) recording each epoch's seconds."""

    def __new__(cls):
        import keras

        class Timer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.seconds: list[float] = []

            def on_epoch_begin(self, epoch, logs=None):
                self._start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                self.seconds.append(time.perf_counter() - self._start)

        return Timer()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", default="1,8", help="comma list of steps_per_execution values")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=128, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs")
    args = parser.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import keras
    import numpy as np

    import distribute

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=(args.samples,)).astype(np.int32)
    strategy = distribute.ParameterServerStrategy(num_workers=args.workers, num_ps=args.ps)
    rows = []
    try:
        for k in (int(v) for v in args.k.split(",")):
            with strategy.scope():
                keras.utils.set_random_seed(0)
                model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"),
                                          keras.layers.Dense(10)])
                model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"], steps_per_execution=k,
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            timer = _EpochTimer()
            model.fit(x, y, batch_size=args.batch, epochs=1 + args.epochs, steps_per_epoch=args.steps, verbose=0,
                      callbacks=[timer])
            seconds = timer.seconds[1:]  # epoch 0 traces and compiles
            median = statistics.median(seconds)
            rows.append({"steps_per_execution": k, "examples_per_second": args.steps * args.batch / median,
                         "epoch_seconds": seconds, "closures_per_epoch": -(-args.steps // k)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        strategy._shutdown()
    base = rows[0]["examples_per_second"]
    for row in rows:
        print(f"K={row['steps_per_execution']:>3}: {row['examples_per_second']:>10,.0f} examples/s "
              f"({row['examples_per_second'] / base:.2f}x K={rows[0]['steps_per_execution']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
