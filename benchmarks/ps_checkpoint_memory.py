"""The coordinator's memory while it makes, trains and checkpoints a large partitioned table (issues 16, 27).

A ``(rows, dim)`` float32 ``Embedding`` table in ``ParameterServerStrategy(num_ps=2,
MinSizePartitioner(256 KiB, max_shards=2))`` (two shards, one per ps), trained
``--steps`` steps with SGD (rows read and updated by the ps), then
``distribute.Checkpoint(model=...).write()`` and ``restore()``, then a restore into a
new cluster of ``--restore-ps`` ps (4,096 sampled rows compared with the first
cluster's).  A thread samples this process's resident memory (RSS) every 5 ms;
reported per phase: the peak above the RSS before the phase, in MB and in table
sizes; at the end each ps's and the worker's RSS (the worker's also right after the
model was made) and the mean step time of the last half of the steps.

Usage::

    .venv/bin/python benchmarks/ps_checkpoint_memory.py --rows 3000000            # 384 MB
    .venv/bin/python benchmarks/ps_checkpoint_memory.py --rows 12000000 --dim 64  # 3 GB
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


def _actor_rss(strategy, kind: str = "ps") -> list:
    """The RSS (MB) of each ``kind`` ("ps" or "workers") actor, read from /proc by the actor itself."""
    import ray

    def rss(actor):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS:"))

    return ray.get([actor.__ray_call__.remote(rss) for actor in getattr(strategy.extended._cluster, kind)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=3_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    parser.add_argument("--restore-ps", type=int, default=3,
                        help="also restore into a new cluster with this many ps and compare rows (0: skip)")
    args = parser.parse_args(argv)
    import keras
    import numpy as np

    import distribute
    from distribute.coordinator import ClusterCoordinator

    table_mb = args.rows * args.dim * 4 / 2**20
    partitioner = distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)
    strategy = distribute.ParameterServerStrategy(num_workers=1, num_ps=2, variable_partitioner=partitioner)
    coordinator = ClusterCoordinator(strategy)
    phases = {}
    start = _rss_mb()  # before the model exists: the "above resident" baseline

    def phase(name, fn):
        before = _rss_mb()
        peak = _Peak()
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        top = peak.stop()
        phases[name] = {"rss_before_mb": round(before), "peak_above_mb": round(top - before),
                        "peak_above_start_mb": round(top - start),
                        "peak_above_tables": round((top - before) / table_mb, 2), "seconds": round(seconds, 2)}
        print(name, json.dumps(phases[name]), flush=True)

    state: dict = {}

    def build():
        return keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(args.rows, args.dim),
                                 keras.layers.Flatten(), keras.layers.Dense(1)])

    def create():
        with strategy.scope():
            model = build()
            optimizer = keras.optimizers.SGD(0.1)
        state.update(model=model, optimizer=optimizer, worker_rss_after_create_mb=_actor_rss(strategy, "workers"))

    def train():
        model, optimizer = state["model"], state["optimizer"]
        ids = np.random.default_rng(0).integers(0, args.rows, size=(64, 4)).astype(np.int32)

        def step(x):
            loss, grads = distribute.compute_gradients(lambda: keras.ops.mean(model(x, training=True) ** 2),
                                                       model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        for _ in range(args.steps):
            t0 = time.perf_counter()
            coordinator.schedule(step, args=(ids,)).fetch()
            state.setdefault("step_seconds", []).append(time.perf_counter() - t0)
        coordinator.join()

    directory = args.dir or tempfile.mkdtemp()

    def save():
        checkpoint = distribute.Checkpoint(model=state["model"])
        state["path"] = checkpoint.write(os.path.join(directory, "ckpt"))
        checkpoint.wait_until_finished()

    def restore():
        distribute.Checkpoint(model=state["model"]).restore(state["path"])

    def sample_rows(on_coordinator, model):
        ids = np.random.default_rng(1).integers(0, args.rows, size=4096).astype(np.int32)
        table = model.layers[0].embeddings
        return np.asarray(on_coordinator.schedule(lambda i: keras.ops.take(table, i, axis=0), args=(ids,)).fetch())

    def restore_elsewhere():
        other = distribute.ParameterServerStrategy(
            num_workers=1, num_ps=args.restore_ps,
            variable_partitioner=distribute.experimental.partitioners.MinSizePartitioner(
                min_shard_bytes=256 << 10, max_shards=args.restore_ps))
        other_coordinator = ClusterCoordinator(other)
        with other.scope():
            model = build()
        distribute.Checkpoint(model=model).restore(state["path"])
        want = sample_rows(coordinator, state["model"])
        got = sample_rows(other_coordinator, model)
        state["restore_elsewhere"] = {"ps": args.restore_ps, "rows_compared": len(want),
                                      "equal": bool(np.array_equal(want, got)),
                                      "shards": [list(s.shape) for s in getattr(model.layers[0].embeddings, "variables", [])]}
        other._shutdown()

    phase("create the model in scope", create)
    phase(f"{args.steps} steps + join", train)
    phase("checkpoint write", save)
    phase("checkpoint restore", restore)
    if args.restore_ps:
        phase(f"checkpoint restore into {args.restore_ps} ps", restore_elsewhere)
    late = state["step_seconds"][len(state["step_seconds"]) // 2:]
    print(json.dumps({"rows": args.rows, "dim": args.dim, "table_mb": round(table_mb), "load": os.getloadavg()[0],
                      "step_ms": round(1000 * sum(late) / len(late), 1), "ps_rss_mb": _actor_rss(strategy),
                      "worker_rss_after_create_mb": state["worker_rss_after_create_mb"],
                      "worker_rss_end_mb": _actor_rss(strategy, "workers"),
                      "restore_elsewhere": state.get("restore_elsewhere"),
                      "checkpoint_directory": sorted(os.listdir(directory)),
                      "tables": sorted(os.listdir(tables)) if os.path.isdir(tables := os.path.join(state["path"], "tables")) else [],
                      "phases": phases}))
    strategy._shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
