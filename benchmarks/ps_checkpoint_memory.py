"""The coordinator's memory while it checkpoints a large partitioned table (issue 16).

A ``(rows, 32)`` float32 ``Embedding`` table in ``ParameterServerStrategy(num_ps=2,
MinSizePartitioner(256 KiB, max_shards=2))`` (two shards, one per ps), trained a
few steps with SGD (rows read and updated by the ps), then
``distribute.Checkpoint(model=...).write()`` and ``restore()``.  A thread samples
this process's resident memory (RSS) every 5 ms; reported per phase: the peak
above the RSS before the phase, in MB and in table sizes.

Usage::

    .venv/bin/python benchmarks/ps_checkpoint_memory.py --rows 3000000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

os.environ.setdefault("KERAS_BACKEND", "jax")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class _Peak:
    def __init__(self):
        self.peak, self._stop = _rss_mb(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_mb())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss_mb())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=3_000_000)
    args = parser.parse_args(argv)
    import keras
    import numpy as np

    import distribute
    from distribute.coordinator import ClusterCoordinator

    table_mb = args.rows * 32 * 4 / 2**20
    partitioner = distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)
    strategy = distribute.ParameterServerStrategy(num_workers=1, num_ps=2, variable_partitioner=partitioner)
    coordinator = ClusterCoordinator(strategy)
    phases = {}

    def phase(name, fn):
        before = _rss_mb()
        peak = _Peak()
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        top = peak.stop()
        phases[name] = {"rss_before_mb": round(before), "peak_above_mb": round(top - before),
                        "peak_above_tables": round((top - before) / table_mb, 2), "seconds": round(seconds, 2)}
        print(name, json.dumps(phases[name]), flush=True)

    state: dict = {}

    def create():
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(args.rows, 32),
                                      keras.layers.Flatten(), keras.layers.Dense(1)])
            optimizer = keras.optimizers.SGD(0.1)
        state.update(model=model, optimizer=optimizer)

    def train():
        model, optimizer = state["model"], state["optimizer"]
        ids = np.random.default_rng(0).integers(0, args.rows, size=(64, 4)).astype(np.int32)

        def step(x):
            loss, grads = distribute.compute_gradients(lambda: keras.ops.mean(model(x, training=True) ** 2),
                                                       model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        for _ in range(5):
            coordinator.schedule(step, args=(ids,))
        coordinator.join()

    directory = tempfile.mkdtemp()

    def save():
        checkpoint = distribute.Checkpoint(model=state["model"])
        state["path"] = checkpoint.write(os.path.join(directory, "ckpt"))
        checkpoint.wait_until_finished()

    def restore():
        distribute.Checkpoint(model=state["model"]).restore(state["path"])

    phase("create the model in scope (values made here)", create)
    phase("5 steps + join (the first sends the initial values)", train)
    phase("checkpoint write", save)
    phase("checkpoint restore", restore)
    print(json.dumps({"rows": args.rows, "table_mb": round(table_mb), "load": os.getloadavg()[0], "phases": phases}))
    strategy._shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
