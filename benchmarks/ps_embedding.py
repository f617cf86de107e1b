"""ParameterServerStrategy at embedding scale: step time against table size, ours against TF 2.21 (issue 16).

Model (as the issue): ``Embedding(rows, 32)`` -> ``Flatten`` -> ``Dense(1)``, MSE, a
batch of 64 examples of 4 ids each, SGD (0.01) or Adagrad (0.01); 2 ps with
``MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)`` (TF's recommended
partitioner: the 1,000-row table, 128 KB, stays whole; the larger ones are split
in 2 shards, one per ps); 1 or 2 workers; a custom loop of
``coordinator.schedule(step, args=(iterator,))`` then ``join()``.

* ours: ``distribute.ParameterServerStrategy`` (embedded Ray), Keras 3 layers and
  optimizers built in scope; the table is read and updated by looked-up rows.
* tf: TF 2.21's ``ParameterServerStrategy`` on its in-process cluster (the
  tutorial's ``create_in_process_cluster``: ``tf.distribute.Server`` per worker and
  ps task in one process), the same model with ``tf_keras`` layers and
  optimizers (TF's Embedding gathers per shard; its optimizers apply sparse
  updates to ``IndexedSlices``).

Each (system, workers, rows) is a fresh subprocess that runs both optimizers;
runs are interleaved (ours, tf, then tf, ours, ...) and repeated.  A
measurement schedules ``warmup`` steps and joins, then times ``steps`` steps
(or as many as fit in ``--max-seconds``, whole chunks of 10) and a ``join``.
Also reported for ours: each worker's and ps's resident memory (RSS) after the
run, and the coordinator's.

Usage::

    .venv/bin/python benchmarks/ps_embedding.py --tf-python /work/tfvenv/bin/python --repeats 3 \\
        --out benchmarks/results/ps_embedding
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
HERE = Path(__file__).resolve().parent
BATCH, IDS, DIM, SAMPLES = 64, 4, 32, 8192
OPTIMIZERS = ("sgd", "adagrad")


def _data(rows: int):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.integers(0, rows, size=(SAMPLES, IDS)).astype(np.int32)
    y = rng.normal(size=(SAMPLES, 1)).astype(np.float32)
    return x, y


def _rss_mb(pid: int | None = None) -> float:
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _timed(schedule, join, steps: int, warmup: int, max_seconds: float) -> tuple[int, float]:
    """Warm up (pairs of steps, joined), then time ``steps`` steps and a join; fewer when the warm-up says
    ``steps`` would take longer than ``max_seconds`` (whole tens, at least 10)."""
    t0, warmed = time.perf_counter(), 0
    while warmed < warmup and (warmed < 2 or time.perf_counter() - t0 < max_seconds / 2):
        schedule()
        schedule()
        join()
        warmed += 2
    per_step = (time.perf_counter() - t0) / warmed
    steps = max(10, min(steps, int(max_seconds / per_step) // 10 * 10))
    t0 = time.perf_counter()
    for _ in range(steps):
        schedule()
    join()
    return steps, time.perf_counter() - t0


# -- ours ------------------------------------------------------------------------------------------------------------
def child_ours(workers: int, rows: int, steps: int, warmup: int, max_seconds: float) -> dict:
    import keras
    import ray

    import distribute
    from distribute.coordinator import ClusterCoordinator
    from distribute.data import Dataset

    x, y = _data(rows)
    t0 = time.perf_counter()
    partitioner = distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)
    strategy = distribute.ParameterServerStrategy(num_workers=workers, num_ps=2, variable_partitioner=partitioner)
    coordinator = ClusterCoordinator(strategy)
    out = {"startup_seconds": time.perf_counter() - t0}
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH, drop_remainder=True)))
    loss_fn = keras.losses.MeanSquaredError()
    for name in OPTIMIZERS:
        t0 = time.perf_counter()
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((IDS,), dtype="int32"), keras.layers.Embedding(rows, DIM),
                                      keras.layers.Flatten(), keras.layers.Dense(1)])
            optimizer = keras.optimizers.SGD(0.01) if name == "sgd" else keras.optimizers.Adagrad(0.01)

        def step(iterator, model=model, optimizer=optimizer):
            bx, by = next(iterator)
            loss, grads = distribute.compute_gradients(lambda: loss_fn(by, model(bx, training=True)),
                                                       model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        results = []
        done, seconds = _timed(lambda: results.append(coordinator.schedule(step, args=(iterator,))),
                               coordinator.join, steps, warmup, max_seconds)
        plan = next(s.plan for s in coordinator._traced.values() if s.plan.rows is not None) if any(
            s.plan.rows is not None for s in coordinator._traced.values()) else None
        out[name] = {"examples_per_second": done * BATCH / seconds, "step_ms": 1000 * seconds / done, "steps": done,
                     "setup_seconds": time.perf_counter() - t0 - seconds, "last_loss": float(results[-1].fetch()),
                     "row_tables": [t.name for t in plan.rows.tables] if plan else []}
        coordinator._traced.clear()
    cluster = strategy.extended._cluster
    pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in cluster.workers + cluster.ps])
    out["worker_rss_mb"] = [_rss_mb(p) for p in pids[:workers]]
    out["ps_rss_mb"] = [_rss_mb(p) for p in pids[workers:]]
    out["coordinator_rss_mb"] = _rss_mb()
    strategy._shutdown()
    return out


# -- TF 2.21 ---------------------------------------------------------------------------------------------------------
def child_tf(workers: int, rows: int, steps: int, warmup: int, max_seconds: float) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    import socket

    import tensorflow as tf
    import tf_keras

    def ports(n):
        socks = [socket.socket() for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        out = [s.getsockname()[1] for s in socks]
        for s in socks:
            s.close()
        return out

    x, y = _data(rows)
    t0 = time.perf_counter()
    p = ports(workers + 2)
    spec = {"worker": [f"127.0.0.1:{q}" for q in p[:workers]], "ps": [f"127.0.0.1:{q}" for q in p[workers:]]}
    cluster_spec = tf.train.ClusterSpec(spec)
    worker_config = tf.compat.v1.ConfigProto()
    if (os.cpu_count() or 1) < workers + 1:  # as the tutorial
        worker_config.inter_op_parallelism_threads = workers + 1
    servers = [tf.distribute.Server(cluster_spec, job_name="worker", task_index=i, config=worker_config,
                                    protocol="grpc") for i in range(workers)]
    servers += [tf.distribute.Server(cluster_spec, job_name="ps", task_index=j, protocol="grpc") for j in range(2)]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(cluster_spec, rpc_layer="grpc")
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    out = {"startup_seconds": time.perf_counter() - t0}

    def dataset_fn():
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH, drop_remainder=True)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    for name in OPTIMIZERS:
        t0 = time.perf_counter()
        with strategy.scope():
            tf_keras.utils.set_random_seed(0)
            model = tf_keras.Sequential([tf_keras.Input((IDS,), dtype="int32"), tf_keras.layers.Embedding(rows, DIM),
                                         tf_keras.layers.Flatten(), tf_keras.layers.Dense(1)])
            optimizer = tf_keras.optimizers.SGD(0.01) if name == "sgd" else tf_keras.optimizers.Adagrad(0.01)
            optimizer.build(model.trainable_variables)
        def replica_fn(bx, by, model=model, optimizer=optimizer):
            with tf.GradientTape() as tape:  # MSE (a Keras loss object refuses the default reduction under TF PS)
                loss = tf.reduce_mean(tf.square(by - model(bx, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        def make_step(replica_fn):
            @tf.function
            def step(iterator):  # the tutorial's step: strategy.run inside the scheduled function
                bx, by = next(iterator)
                return strategy.reduce("SUM", strategy.run(replica_fn, args=(bx, by)), axis=None)

            return step

        step = make_step(replica_fn)

        results = []
        done, seconds = _timed(lambda: results.append(coordinator.schedule(step, args=(iterator,))),
                               coordinator.join, steps, warmup, max_seconds)
        out[name] = {"examples_per_second": done * BATCH / seconds, "step_ms": 1000 * seconds / done, "steps": done,
                     "setup_seconds": time.perf_counter() - t0 - seconds, "last_loss": float(results[-1].fetch()),
                     "shards": len(getattr(model.layers[0].embeddings, "variables", [None]))}
    out["process_rss_mb"] = _rss_mb()
    return out


# -- driver ----------------------------------------------------------------------------------------------------------
def run_child(python: str, system: str, workers: int, rows: int, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(q for q in (str(HERE.parent / "src"), env.get("PYTHONPATH")) if q)
    env.setdefault("KERAS_BACKEND", "jax")
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [python, str(Path(__file__).resolve()), "--child", system, "--workers", str(workers), "--rows", str(rows),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--max-seconds", str(args.max_seconds)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired as err:
        return {"system": system, "workers": workers, "rows": rows, "error": f"timed out after {args.timeout} s: {err}"}
    line = next((row for row in proc.stdout.splitlines() if row.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"system": system, "workers": workers, "rows": rows, "error": (proc.stdout + proc.stderr)[-2000:]}
    result = json.loads(line[len("RESULT "):])
    result.update(system=system, workers=workers, rows=rows, wall_seconds=time.perf_counter() - t0,
                  load=os.getloadavg()[0], stderr_lines=len(proc.stderr.splitlines()))
    return result


def summarize(runs: list[dict]) -> list[dict]:
    out = []
    keys = sorted({(r["rows"], r["workers"]) for r in runs})
    for rows, workers in keys:
        for name in OPTIMIZERS:
            row = {"rows": rows, "workers": workers, "optimizer": name}
            for system in ("ours", "tf"):
                ok = [r[name] for r in runs if r["system"] == system and r["rows"] == rows and r["workers"] == workers
                      and "error" not in r]
                if ok:
                    row[system] = statistics.median(m["step_ms"] for m in ok)
                    row[f"{system}_eps"] = statistics.median(m["examples_per_second"] for m in ok)
                    row[f"{system}_runs"] = len(ok)
            mem = [r for r in runs if r["system"] == "ours" and r["rows"] == rows and r["workers"] == workers
                   and "error" not in r]
            if mem:
                row["worker_rss_mb"] = statistics.median(max(r["worker_rss_mb"]) for r in mem)
                row["ps_rss_mb"] = statistics.median(max(r["ps_rss_mb"]) for r in mem)
                row["coordinator_rss_mb"] = statistics.median(r["coordinator_rss_mb"] for r in mem)
            out.append(row)
    return out


def markdown(meta: dict, rows: list[dict], runs: list[dict]) -> str:
    lines = ["# ParameterServerStrategy at embedding scale: ours vs TF 2.21", "",
             f"commit {meta['commit']}, {meta['date']}, {meta['machine']}; load average (1 min) before/after "
             f"{meta['load_before']} / {meta['load_after']}, per run {meta['loads']}; {meta['repeats']} interleaved "
             f"repeat(s); up to {meta['steps']} timed steps (at most {meta['max_seconds']} s) after {meta['warmup']}; "
             f"batch {BATCH} x {IDS} ids, Embedding(rows, {DIM}) -> Flatten -> Dense(1), 2 ps, "
             "MinSizePartitioner(256 KiB, max_shards=2).", "",
             "| rows | workers | optimizer | ours ms/step | TF ms/step | ours examples/s | TF examples/s | ours/TF "
             "| worker RSS MB | ps RSS MB | coordinator RSS MB |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = f"{r['ours_eps'] / r['tf_eps']:.2f}x" if "ours_eps" in r and "tf_eps" in r else "-"

        def cell(key, fmt):
            return format(r[key], fmt) if key in r else "-"
        lines.append(f"| {r['rows']:,} | {r['workers']} | {r['optimizer']} | {cell('ours', '.2f')} | {cell('tf', '.2f')} | "
                     f"{cell('ours_eps', ',.0f')} | {cell('tf_eps', ',.0f')} | {ratio} | {cell('worker_rss_mb', '.0f')} | "
                     f"{cell('ps_rss_mb', '.0f')} | {cell('coordinator_rss_mb', '.0f')} |")
    smallest = {(r["workers"], r["optimizer"]): r.get("ours") for r in rows if r["rows"] == min(x["rows"] for x in rows)}
    largest = [r for r in rows if r["rows"] == max(x["rows"] for x in rows) and "ours" in r]
    if largest and all(smallest.get((r["workers"], r["optimizer"])) for r in largest):
        lines += ["", "Largest over smallest table, ours (ms/step): " + ", ".join(
            f"{r['workers']} worker(s) {r['optimizer']} {r['ours'] / smallest[(r['workers'], r['optimizer'])]:.2f}x"
            for r in largest)]
    errors = [r for r in runs if "error" in r]
    if errors:
        lines += ["", f"{len(errors)} run(s) failed:"] + [
            f"- {r['system']} rows={r['rows']} workers={r['workers']}: {r['error'][-300:]!r}" for r in errors]
    return "\n".join(lines) + "\n"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", choices=("ours", "tf"))
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--rows", default="1000,300000,3000000")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--systems", default="ours,tf")
    parser.add_argument("--tf-python", default=None)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=str(HERE / "results" / "ps_embedding"))
    args = parser.parse_args(argv)
    if args.child:
        fn = child_ours if args.child == "ours" else child_tf
        print("RESULT " + json.dumps(fn(int(args.workers), int(args.rows), args.steps, args.warmup, args.max_seconds)),
              flush=True)
        return 0
    systems = [s for s in args.systems.split(",") if s != "tf" or args.tf_python]
    meta = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "load_before": f"{os.getloadavg()[0]:.1f}", "repeats": args.repeats, "steps": args.steps,
            "warmup": args.warmup, "max_seconds": args.max_seconds}
    runs, turn = [], 0
    for _ in range(args.repeats):
        for rows in (int(r) for r in args.rows.split(",")):
            for workers in (int(w) for w in args.workers.split(",")):
                order = systems if turn % 2 == 0 else systems[::-1]
                turn += 1
                for system in order:
                    python = args.tf_python if system == "tf" else sys.executable
                    result = run_child(python, system, workers, rows, args)
                    runs.append(result)
                    print(json.dumps(result)[:600], flush=True)
    meta["load_after"] = f"{os.getloadavg()[0]:.1f}"
    meta["loads"] = "-".join(f"{r['load']:.1f}" for r in runs if "load" in r)
    rows = summarize(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1))
    (out / "results.md").write_text(markdown(meta, rows, runs))
    print(markdown(meta, rows, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
