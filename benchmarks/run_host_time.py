"""Host time of one custom-loop step: ``strategy.run`` + ``strategy.reduce`` around a compiled step, and
the first call of an uneven step (its compile), measured in this process.

    python benchmarks/run_host_time.py --replicas 2          # one JSON line
    PYTHONPATH=/tmp/base/src python benchmarks/run_host_time.py --replicas 2   # another commit's src

The step is tiny (Dense 32-16-4, SGD, per-replica batch 8), so the compiled work is
microseconds and the figure is the host's: Python around the call, placing the
batch, dispatch.  ``run_reduce_us``: median microseconds per step of ``reduce(SUM,
run(step, batch))`` over ``--steps`` steps of pre-placed batches (an iterator of
``experimental_distribute_dataset``), each step's result made ready before the next
so that no queue hides host time.  ``first_uneven_s``: seconds of the first call on
a global batch that does not divide between the replicas (the exact uneven step,
discovery and compile included).  Run base and new interleaved, several times, on
a quiet machine; compare medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.replicas}"
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax
    import keras
    import numpy as np

    import distribute
    from distribute.data import Dataset

    strategy = distribute.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
        optimizer = keras.optimizers.SGD(0.01)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def step(x, y):
        loss, grads = distribute.compute_gradients(
            lambda: distribute.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=8 * args.replicas),
            model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    rng = np.random.default_rng(0)
    batch = 8 * args.replicas
    n = batch * (args.steps + 50)
    x, y = rng.random((n, 32), dtype=np.float32), rng.integers(0, 4, n)
    batches = list(strategy.experimental_distribute_dataset(Dataset.from_tensor_slices((x, y)).batch(batch)))
    for xb, yb in batches[:50]:  # compile and warm up
        jax.block_until_ready(strategy.reduce("SUM", strategy.run(step, args=(xb, yb)), axis=None))
    times = []
    for xb, yb in batches[50:]:
        start = time.perf_counter()
        out = strategy.reduce("SUM", strategy.run(step, args=(xb, yb)), axis=None)
        times.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    uneven = list(strategy.experimental_distribute_dataset(Dataset.from_tensor_slices((x[: batch - 1], y[: batch - 1])).batch(batch)))
    start = time.perf_counter()
    jax.block_until_ready(strategy.reduce("SUM", strategy.run(step, args=uneven[0]), axis=None))
    first_uneven = time.perf_counter() - start
    print(json.dumps({"replicas": args.replicas, "run_reduce_us": round(statistics.median(times) * 1e6, 1),
                      "first_uneven_s": round(first_uneven, 3), "src": os.path.dirname(os.path.dirname(distribute.__file__)),
                      "python": sys.version.split()[0]}))


if __name__ == "__main__":
    main()
