"""Elastic recovery vs a relaunch with BackupAndRestore: seconds from a worker's death to the next step, steps redone.

    PYTHONPATH=src python benchmarks/elastic.py [--models small,20m] [--out results.json]

For each model a 2-worker Keras fit job (1 CPU device per worker,
``distribute.BackupAndRestore``, a backup each epoch) loses worker 1 (SIGKILL)
mid-epoch, and is recovered two ways:

- elastic: ``--num-workers 2:2`` (``launch_elastic``): the survivor hands its
  committed step to the launcher, which starts generation 1 at once; it restores
  that step from memory (JAX's persistent compilation cache is shared);
- relaunch: ``--num-workers 2`` ends when the survivor stops (exit 75) and the
  same job is launched again at once; BackupAndRestore resumes from the last
  epoch's backup on disk.

Both workers pause SETTLE_SECONDS one step before the kill (a job trains a
while before it loses a worker; by then the elastic launcher's spare processes
have done their imports).  Recovery seconds: from the killed worker's last line (just before its SIGKILL)
to the first step completed after recovery.  Steps redone: steps applied before
the death that the recovered job applies again.  The in-memory commit's cost per
step is measured in this process (one device), beside the step time.
Models: "small" is the project's main job (MLP 784-64-10, batch 64); "20m" is
an MLP 784-4096-4096-10 (20.0M parameters, Adam: 60M floats committed a step).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve()
SETTLE_SECONDS = 30.0
MODELS = {  # hidden sizes, rows, global batch, epochs, kill step (global, 1-based)
    "small": ((64,), 1024, 64, 3, 26),
    "20m": ((4096, 4096), 256, 32, 3, 12),
}


def _data(model: str):
    _, rows, _, _, _ = MODELS[model]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 784)).astype(np.float32)
    return x, rng.integers(0, 10, size=(rows,)).astype(np.int32)


def _model(model: str, strategy):
    import keras

    hidden = MODELS[model][0]
    with strategy.scope():
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((784,)), *[keras.layers.Dense(h, activation="relu") for h in hidden],
                                keras.layers.Dense(10)])
        net.compile(optimizer=keras.optimizers.Adam(1e-3),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return net


def worker(model: str, backup_dir: str, kill_step: int) -> None:
    print(f"P {time.time():.4f} program starts", flush=True)
    import keras

    import distribute
    from distribute.multi_worker import CommunicationOptions

    print(f"P {time.time():.4f} imported", flush=True)
    strategy = distribute.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=30))
    me = strategy.cluster_resolver.task_id
    print(f"P {time.time():.4f} strategy", flush=True)
    net = _model(model, strategy)
    print(f"P {time.time():.4f} model built", flush=True)
    x, y = _data(model)
    _, rows, batch, epochs, _ = MODELS[model]
    steps = rows // batch
    backup = distribute.BackupAndRestore(backup_dir)

    class Times(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, b, logs=None):
            step = self.epoch * steps + b + 1
            if step <= (backup.resumed_step or 0):
                return
            print(f"T {time.time():.4f} worker {me} step {step}", flush=True)
            if step == kill_step - 1 and os.environ.get("DISTRIBUTE_ELASTIC_GENERATION", "0") == "0":
                time.sleep(SETTLE_SECONDS)  # a job trains a while before a loss: the launcher's spares are ready
            if me == 1 and step == kill_step and os.environ.get("DISTRIBUTE_ELASTIC_GENERATION", "0") == "0":
                print(f"KILL {time.time():.4f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    net.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[backup, Times()])


def _steps(output: str) -> list[tuple[float, int]]:
    return [(float(t), int(s)) for t, s in re.findall(r"T (\S+) worker 0 step (\d+)", output)]


def _recovery(first: str, second: str, kill_step: int) -> dict:
    killed = float(re.search(r"KILL (\S+)", first).group(1))
    t_next, s_next = _steps(second)[0]
    # The killed worker's last step is the last one completed (fit's callbacks may run before a step ends,
    # so the survivor's own lines can name a step that never completed).
    phases = {name: round(float(t) - killed, 2) for t, name in re.findall(r"\[worker 0[^\]]*\] P (\S+) (.+)", second)}
    return {"recovery_seconds": round(t_next - killed, 2), "steps_redone": max(0, kill_step - (s_next - 1)),
            "seconds_after_the_kill": phases,
            "resumed_at_step": s_next - 1, "killed_after_step": kill_step}


def run_recovery(model: str) -> dict:
    from distribute.launch import launch
    from distribute.launch._elastic import ElasticConfig, launch_elastic

    kill = MODELS[model][4]
    env = {"KERAS_BACKEND": "jax", "PYTHONPATH": str(HERE.parents[1] / "src")}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        backup = os.path.join(tmp, "backup")
        result = launch_elastic([str(HERE), "--worker", model, backup, str(kill)], ElasticConfig(2, 2, max_restarts=1),
                                devices_per_worker=1, env=env, timeout_seconds=900, echo=False)
        assert result.returncode == 0, result.output[-3000:]
        first, _, second = result.output.partition("[launch] generation 1")
        out["elastic"] = _recovery(first, second, kill)
        shutil.rmtree(backup, ignore_errors=True)
        first = launch([str(HERE), "--worker", model, backup, str(kill)], 2, 1, env=env, timeout_seconds=900, echo=False)
        assert first.returncode != 0, first.output[-3000:]
        second = launch([str(HERE), "--worker", model, backup, "-1"], 2, 1, env=env, timeout_seconds=900, echo=False)
        assert second.returncode == 0, second.output[-3000:]
        out["relaunch_backup_and_restore"] = _recovery(first.output, second.output, kill)
    return out


def commit_cost(model: str, repeats: int = 3) -> dict:
    """Milliseconds per fit step without and with the in-memory commit after each step, one device.

    The commit is what ``BackupAndRestore`` does under an elastic launch (it syncs
    the step's state into the variables and dispatches one device-side copy of
    them); ``commit_ready_ms`` also waits for that copy, and ``hand_off_read_ms``
    is reading the commit to host memory (what a worker does once, when it stops).
    """
    import keras

    import distribute
    import distribute.checkpoint._elastic as elastic
    import distribute.runtime.elastic as runtime

    strategy = distribute.MirroredStrategy(["/cpu:0"])
    net = _model(model, strategy)
    x, y = _data(model)
    batch = MODELS[model][2]
    steps = len(x) // batch

    class Commit(keras.callbacks.Callback):
        def __init__(self, wait: bool):
            super().__init__()
            self.wait = wait

        def on_train_batch_end(self, b, logs=None):
            elastic.commit({"model": self.model, "optimizer": self.model.optimizer}, {"step": b})
            if self.wait:
                jax.block_until_ready(runtime.newest()[1])

    import jax

    def timed(callbacks) -> float:
        best = float("inf")
        for _ in range(repeats):
            begin = time.perf_counter()
            net.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
            best = min(best, (time.perf_counter() - begin) / steps * 1e3)
        return best

    timed([Commit(True)])  # compiles
    plain, committed, ready = timed([]), timed([Commit(False)]), timed([Commit(True)])
    begin = time.perf_counter()
    runtime.committed()
    read_ms = (time.perf_counter() - begin) * 1e3
    floats = sum(int(np.prod(v.shape)) for v in net.variables) + sum(int(np.prod(v.shape)) for v in net.optimizer.variables)
    return {"fit_step_ms": round(plain, 2), "fit_step_with_commit_ms": round(committed, 2),
            "fit_step_with_commit_ready_ms": round(ready, 2), "hand_off_read_ms": round(read_ms, 1),
            "parameters": int(net.count_params()), "committed_floats": floats}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="small,20m")
    parser.add_argument("--out", default=None, help="write the results here (kept: benchmarks/results/elastic/results.json)")
    args = parser.parse_args()
    os.environ.setdefault("KERAS_BACKEND", "jax")
    results = {}
    for model in args.models.split(","):
        results[model] = {**run_recovery(model), "commit": commit_cost(model)}
        print(json.dumps({model: results[model]}), flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        os.environ.setdefault("KERAS_BACKEND", "jax")
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
