"""fit vs Keras DataParallel in ONE process, alternating epochs (robust to the load drifting on a shared machine).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=src python benchmarks/fit_ab.py --replicas 2 --rounds 8

Two models of the mlp workload (784-64 relu - 10, Adam 1e-3, ``metrics=["accuracy"]``)
on the same data as ``compare.py --config user`` (60,000 x 784, ``shuffle=True``,
per-replica batch 64, so a partial last batch): one compiled in a
``MirroredStrategy``'s scope (``distribute``), one under
``keras.distribution.DataParallel`` (the distribution is set only while that
model fits).  After one warm-up epoch each, ``--rounds`` rounds each run one epoch
of every system in a rotating order; every epoch ends by waiting for the weights.
Prints per system the median epoch seconds (min-max), examples/s, and the ratio of
medians, plus the median of the per-round ratios (the pairwise one: both epochs of
a round ran within about a second of each other), and the CPU seconds of the
process per epoch (``time.process_time``: every thread, XLA's included), which
a loaded machine inflates much less than wall time.  ``--out`` writes results.md/json.

``--override`` adds a third system: the same model as a ``keras.Model`` subclass whose
``train_step`` is keras.io's JAX one ("Customizing what happens in fit() with JAX":
``stateless_call``, ``jax.value_and_grad``, ``optimizer.stateless_apply``), compiled in the
strategy's scope; it runs as one program over the global batch (``trainer._WholeBatchRunner``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--samples", type=int, default=60_000)
    p.add_argument("--out", default=None)
    p.add_argument("--override", action="store_true", help="also time a train_step override under the strategy")
    args = p.parse_args(argv)

    import jax
    import keras
    import numpy as np

    import distribute

    rng = np.random.default_rng(0)
    x = rng.random((args.samples, 784), dtype=np.float32)
    y = rng.integers(0, 10, size=(args.samples,), dtype=np.int32)
    devices = jax.devices()[: args.replicas]
    global_batch = 64 * args.replicas

    class CustomModel(keras.Model):
        def train_step(self, state, data):
            trainable, non_trainable, optimizer_variables, metrics_variables = state
            x, y = data

            def loss_fn(trainable):
                y_pred, new_non_trainable = self.stateless_call(trainable, non_trainable, x, training=True)
                return self.compute_loss(x, y, y_pred), (y_pred, new_non_trainable)

            (loss, (y_pred, non_trainable)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
            trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
            new_metrics, logs = [], {}
            for metric in self.metrics:
                own = metrics_variables[len(new_metrics): len(new_metrics) + len(metric.variables)]
                own = metric.stateless_update_state(own, loss) if metric.name == "loss" else metric.stateless_update_state(own, y, y_pred)
                logs[metric.name] = metric.stateless_result(own)
                new_metrics += own
            return logs, (trainable, non_trainable, optimizer_variables, new_metrics)

    def build(cls=None):
        if cls is None:
            model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
        else:
            inputs = keras.Input((784,))
            model = cls(inputs, keras.layers.Dense(10)(keras.layers.Dense(64, activation="relu")(inputs)))
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    keras.utils.set_random_seed(0)
    strategy = distribute.MirroredStrategy(devices)
    with strategy.scope():
        ours = build()
        override = build(CustomModel)
    dp = keras.distribution.DataParallel(devices=devices)
    keras.distribution.set_distribution(dp)
    theirs = build()
    keras.distribution.set_distribution(None)

    def epoch(name: str) -> tuple[float, float]:
        model = {"distribute fit": ours, "distribute fit, train_step override": override}.get(name, theirs)
        if model is theirs:
            keras.distribution.set_distribution(dp)
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=True, verbose=0)
            jax.block_until_ready([v.value for v in model.trainable_variables])
            return time.perf_counter() - t0, time.process_time() - c0
        finally:
            keras.distribution.set_distribution(None)

    names = ["distribute fit", "Keras DataParallel fit"] + (["distribute fit, train_step override"] if args.override else [])
    for name in names:
        epoch(name)  # warm-up (compiles)
    seconds: dict = {n: [] for n in names}
    cpu: dict = {n: [] for n in names}
    load = [os.getloadavg()]
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            wall, used = epoch(name)
            seconds[name].append(wall)
            cpu[name].append(used)
    load.append(os.getloadavg())
    pair = [a / b for a, b in zip(seconds[names[1]], seconds[names[0]])]
    med = {n: statistics.median(v) for n, v in seconds.items()}
    cpu_med = {n: statistics.median(v) for n, v in cpu.items()}
    sys.path.insert(0, str(HERE))
    from compare import environment, git_state

    cpu_model = environment(argparse.Namespace(platform="cpu", tf_python=None))["cpu_model"]

    lines = [f"# fit vs Keras DataParallel, one process, alternating epochs ({args.replicas} replicas)", "",
             f"- date: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}; git {git_state()}; jax {jax.__version__}, keras {keras.__version__}; "
             f"{cpu_model} ({os.cpu_count()} cores); load average before/after: {load[0][0]:.2f} / {load[1][0]:.2f}",
             f"- mlp, {args.samples} rows, batch {global_batch}, metrics=['accuracy'], shuffle=True, verbose=0; {args.rounds} rounds", "",
             "| system | epoch s (median) | min-max | examples/s | x Keras DP | CPU s per epoch (all threads; min-max) | DP CPU / ours |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in names:
        lines.append(f"| {n} | {med[n]:.3f} | {min(seconds[n]):.3f}-{max(seconds[n]):.3f} | {args.samples / med[n]:,.0f} | "
                     f"{med[names[1]] / med[n]:.2f} | {cpu_med[n]:.3f} ({min(cpu[n]):.3f}-{max(cpu[n]):.3f}) | {cpu_med[names[1]] / cpu_med[n]:.2f} |")
    lines += ["", f"Per-round ratio (DP epoch / ours), median {statistics.median(pair):.2f}, min-max {min(pair):.2f}-{max(pair):.2f}."]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.md").write_text("\n".join(lines) + "\n")
        (out / "results.json").write_text(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "pair_ratios": pair, "load": load, "argv": sys.argv}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
