"""ParameterServerStrategy throughput: ours (Ray) against TF 2.21's ParameterServerStrategy, mlp workload.

Each measurement runs in a fresh subprocess; repeats are interleaved (ours 1
worker, TF 1 worker, ours 2 workers, TF 2 workers, then again), so a change in
machine load hits both systems alike.  Reported: median examples/s with min-max.

* ours: ``distribute.ParameterServerStrategy(num_workers=W, num_ps=1)`` (the
  embedded local Ray cluster), a model built in scope (Dense 784-64 relu - 10,
  softmax cross-entropy, Keras Adam 1e-3), a per-worker dataset of batches of 64,
  ``coordinator.schedule(step, args=(iterator,))`` ``steps`` times, then
  ``join()``; timed after ``warmup`` scheduled steps.  Also, with 1 worker: the
  per-step time against a raw Ray round trip (``ray.get(actor.ping.remote())``
  to the same ps actor) and against the step's compute alone (the same jitted
  forward+backward+Adam on one device, in process).
* tf: TF 2.21's own in-process cluster, as its parameter_server_training tutorial
  builds it (``tf.distribute.Server`` per worker and ps task on loopback in this
  process, ``SimpleClusterResolver``, ``ParameterServerStrategy``,
  ``ClusterCoordinator``), the same model as ``tf.Variable`` s with Adam written
  out (Keras 3 has no parameter-server support), ``tf.function`` step over a
  per-worker ``tf.data`` dataset; the same schedule/join timing.

``--baseline-src DIR`` adds "base": ours run from another ``src`` tree (e.g.
``git archive main src | tar -x -C /tmp/base``), interleaved with the others, so
a change is measured against its baseline under the same load.

Usage::

    /work/venv/bin/python benchmarks/ps_compare.py --tf-python /work/tfvenv/bin/python \\
        --repeats 3 --steps 200 --out benchmarks/results/ps
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

HERE = Path(__file__).resolve().parent
BATCH, FEATURES, HIDDEN, CLASSES, SAMPLES = 64, 784, 64, 10, 4096


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.uniform(size=(SAMPLES, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(SAMPLES,)).astype(np.int32)
    return x, y


# -- ours ------------------------------------------------------------------------------------------------------------
def child_ours(workers: int, steps: int, warmup: int) -> dict:
    import keras

    import distribute
    from distribute.coordinator import ClusterCoordinator
    from distribute.data import Dataset

    x, y = _data()
    t0 = time.perf_counter()
    strategy = distribute.ParameterServerStrategy(num_workers=workers, num_ps=1)
    coordinator = ClusterCoordinator(strategy)
    startup = time.perf_counter() - t0
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="relu"),
                                  keras.layers.Dense(CLASSES)])
        optimizer = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH, drop_remainder=True)))

    def step(iterator):
        bx, by = next(iterator)
        loss, grads = distribute.compute_gradients(lambda: loss_fn(by, model(bx, training=True)),
                                                   model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for _ in range(warmup):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    t0 = time.perf_counter()
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps)]
    coordinator.join()
    seconds = time.perf_counter() - t0
    out = {"examples_per_second": steps * BATCH / seconds, "step_ms": 1000 * seconds / steps,
           "startup_seconds": startup, "last_loss": float(results[-1].fetch()),
           "iterations": int(optimizer.iterations.numpy())}
    if workers == 1:
        import ray

        ps = strategy.extended._cluster.ps[0]
        times = []
        for _ in range(200):
            t = time.perf_counter()
            ray.get(ps.ping.remote())
            times.append(time.perf_counter() - t)
        out["ray_round_trip_ms"] = 1000 * statistics.median(times)
        out["compute_ms"] = _compute_ms(x, y)
    strategy._shutdown()
    return out


def _compute_ms(x, y) -> float:
    """The same step (forward, backward, Adam) jitted on one device: what a step costs without any RPC."""
    import jax
    import jax.numpy as jnp
    import optax

    key = jax.random.PRNGKey(0)
    k1, k2 = jax.random.split(key)
    params = {"w1": jax.random.normal(k1, (FEATURES, HIDDEN)) * 0.05, "b1": jnp.zeros(HIDDEN),
              "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) * 0.05, "b2": jnp.zeros(CLASSES)}
    opt = optax.adam(1e-3)
    state = opt.init(params)

    def loss(p, bx, by):
        logits = jax.nn.relu(bx @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, by).mean()

    @jax.jit
    def step(p, s, bx, by):
        value, grads = jax.value_and_grad(loss)(p, bx, by)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    bx, by = jnp.asarray(x[:BATCH]), jnp.asarray(y[:BATCH])
    for _ in range(5):
        params, state, value = step(params, state, bx, by)
    value.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(200):
        params, state, value = step(params, state, bx, by)
    value.block_until_ready()
    return 1000 * (time.perf_counter() - t0) / 200


# -- TF 2.21 ---------------------------------------------------------------------------------------------------------
def child_tf(workers: int, steps: int, warmup: int) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import socket

    import tensorflow as tf

    def ports(n):
        socks = [socket.socket() for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        out = [s.getsockname()[1] for s in socks]
        for s in socks:
            s.close()
        return out

    x, y = _data()
    t0 = time.perf_counter()
    # TF's parameter_server_training tutorial, create_in_process_cluster: worker and ps servers in this process;
    # the strategy adds this process as the chief (coordinator).
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    p = ports(workers + 1)
    spec = {"worker": [f"127.0.0.1:{q}" for q in p[:workers]], "ps": [f"127.0.0.1:{p[-1]}"]}
    cluster_spec = tf.train.ClusterSpec(spec)
    worker_config = tf.compat.v1.ConfigProto()
    if (os.cpu_count() or 1) < workers + 1:  # as the tutorial
        worker_config.inter_op_parallelism_threads = workers + 1
    servers = [tf.distribute.Server(cluster_spec, job_name="worker", task_index=i, config=worker_config,
                                    protocol="grpc") for i in range(workers)]
    servers.append(tf.distribute.Server(cluster_spec, job_name="ps", task_index=0, protocol="grpc"))
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(cluster_spec, rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    startup = time.perf_counter() - t0
    with strategy.scope():
        init = tf.random.stateless_normal
        params = [tf.Variable(init((FEATURES, HIDDEN), seed=(0, 1)) * 0.05), tf.Variable(tf.zeros(HIDDEN)),
                  tf.Variable(init((HIDDEN, CLASSES), seed=(0, 2)) * 0.05), tf.Variable(tf.zeros(CLASSES))]
        m = [tf.Variable(tf.zeros_like(v)) for v in params]
        v2 = [tf.Variable(tf.zeros_like(v)) for v in params]
        t = tf.Variable(0.0)

    def dataset_fn():
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH, drop_remainder=True)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(iterator):
        bx, by = next(iterator)
        with tf.GradientTape() as tape:
            w1, b1, w2, b2 = params
            logits = tf.nn.relu(bx @ w1 + b1) @ w2 + b2
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(by, logits))
        grads = tape.gradient(loss, params)
        t.assign_add(1.0)
        lr = 1e-3 * tf.sqrt(1.0 - 0.999 ** t) / (1.0 - 0.9 ** t)
        for var, g, mi, vi in zip(params, grads, m, v2):
            mi.assign(0.9 * mi + 0.1 * g)
            vi.assign(0.999 * vi + 0.001 * g * g)
            var.assign_sub(lr * mi / (tf.sqrt(vi) + 1e-7))
        return loss

    for _ in range(warmup):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    t0 = time.perf_counter()
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps)]
    coordinator.join()
    seconds = time.perf_counter() - t0
    return {"examples_per_second": steps * BATCH / seconds, "step_ms": 1000 * seconds / steps,
            "startup_seconds": startup, "last_loss": float(results[-1].fetch()), "iterations": int(t.numpy())}


# -- driver ----------------------------------------------------------------------------------------------------------
def run_child(python: str, system: str, workers: int, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    src = args.baseline_src if system == "base" else str(HERE.parent / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    env.setdefault("KERAS_BACKEND", "jax")
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [python, str(Path(__file__).resolve()), "--child", "ours" if system == "base" else system, "--workers", str(workers),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    line = next((row for row in proc.stdout.splitlines() if row.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"system": system, "workers": workers, "error": (proc.stdout + proc.stderr)[-2000:]}
    result = json.loads(line[len("RESULT "):])
    result.update(system=system, workers=workers, wall_seconds=time.perf_counter() - t0)
    return result


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for system in ("ours", "base", "tf"):
        for workers in sorted({r["workers"] for r in runs}):
            ok = [r for r in runs if r["system"] == system and r["workers"] == workers and "error" not in r]
            if not ok:
                continue
            eps = [r["examples_per_second"] for r in ok]
            row = {"system": system, "workers": workers, "runs": len(ok), "median": statistics.median(eps),
                   "min": min(eps), "max": max(eps), "step_ms": statistics.median(r["step_ms"] for r in ok),
                   "startup_seconds": statistics.median(r["startup_seconds"] for r in ok)}
            for key in ("ray_round_trip_ms", "compute_ms"):
                if all(key in r for r in ok):
                    row[key] = statistics.median(r[key] for r in ok)
            rows.append(row)
    return rows


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=HERE, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def markdown(meta: dict, rows: list[dict], runs: list[dict]) -> str:
    lines = ["# ParameterServerStrategy: ours (Ray) vs TF 2.21, mlp", "",
             f"commit {meta['commit']}, {meta['date']}, {meta['machine']}, load average before/after "
             f"{meta['load_before']} / {meta['load_after']}; {meta['repeats']} interleaved repeats, "
             f"{meta['steps']} timed steps after {meta['warmup']}, batch {BATCH} per worker, 1 ps.", "",
             "| system | workers | examples/s median | min-max | ms/step | start-up s | vs TF |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    tf_rows = {r["workers"]: r for r in rows if r["system"] == "tf"}
    for r in rows:
        ratio = f"{r['median'] / tf_rows[r['workers']]['median']:.2f}x" if r["workers"] in tf_rows else "-"
        lines.append(f"| {r['system']} | {r['workers']} | {r['median']:,.0f} | {r['min']:,.0f}-{r['max']:,.0f} | "
                     f"{r['step_ms']:.2f} | {r['startup_seconds']:.1f} | {ratio} |")
    base_rows = {r["workers"]: r for r in rows if r["system"] == "base"}
    if base_rows:
        lines += ["", f"base: ours from {meta.get('baseline_src')}; ours vs base (median examples/s): " + ", ".join(
            f"{r['median'] / base_rows[r['workers']]['median']:.2f}x with {r['workers']} worker(s)"
            for r in rows if r["system"] == "ours" and r["workers"] in base_rows)]
    one = next((r for r in rows if r["system"] == "ours" and r["workers"] == 1 and "ray_round_trip_ms" in r), None)
    if one:
        lines += ["", f"Per step, ours with 1 worker: {one['step_ms']:.2f} ms; a raw Ray round trip to the ps actor: "
                  f"{one['ray_round_trip_ms']:.2f} ms; the step's compute alone (jitted, in process): "
                  f"{one['compute_ms']:.2f} ms. Overhead beyond compute: {one['step_ms'] - one['compute_ms']:.2f} ms "
                  f"= {(one['step_ms'] - one['compute_ms']) / one['ray_round_trip_ms']:.1f} Ray round trips."]
    errors = [r for r in runs if "error" in r]
    if errors:
        lines += ["", f"{len(errors)} run(s) failed:"] + [f"- {r['system']} {r['workers']}: {r['error'][-300:]!r}"
                                                         for r in errors]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", choices=("ours", "tf"))
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tf-python", default=None)
    parser.add_argument("--baseline-src", default=None, help="a src tree to run as 'base', interleaved")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=str(HERE / "results" / "ps"))
    args = parser.parse_args(argv)
    if args.child:
        fn = child_ours if args.child == "ours" else child_tf
        print("RESULT " + json.dumps(fn(int(args.workers), args.steps, args.warmup)), flush=True)
        return 0
    workers = [int(w) for w in args.workers.split(",")]
    meta = {"commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
            "load_before": " ".join(f"{x:.1f}" for x in os.getloadavg()), "repeats": args.repeats,
            "steps": args.steps, "warmup": args.warmup, "baseline_src": args.baseline_src}
    runs = []
    for repeat in range(args.repeats):
        for w in workers:
            systems = ([("ours", sys.executable)] + ([("base", sys.executable)] if args.baseline_src else [])
                       + ([("tf", args.tf_python)] if args.tf_python else []))
            for system, python in (systems if repeat % 2 == 0 else systems[::-1]):
                result = run_child(python, system, w, args)
                runs.append(result)
                shown = {k: v for k, v in result.items() if k != "error"}
                print(json.dumps(shown) if "error" not in result else f"{system} {w}: FAILED {result['error'][-500:]}",
                      flush=True)
    meta["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = summarize(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1))
    (out / "results.md").write_text(markdown(meta, rows, runs))
    print(markdown(meta, rows, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
