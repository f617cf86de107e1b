"""Multi-worker step cost: 2 workers x 1 CPU device (loopback) against one process with 2 devices.

    python benchmarks/multi_worker_step.py                       # 3 interleaved repeats
    python benchmarks/multi_worker_step.py --baseline-src /tmp/old/src --repeats 5 --out benchmarks/results/multi_worker

Both run the mlp custom loop of ``_worker.py`` (``dist_loop``: 784-64-10, Adam,
global batch 128, ``strategy.run`` + ``strategy.reduce`` every step, last
partial batch dropped) over ``experimental_distribute_dataset``, one warm-up
epoch then timed epochs, and an input-only pass (iterating the distributed
dataset without steps: the per-step end-of-data agreement plus placement).
With ``--baseline-src`` the 2-worker run is repeated with that ``src/`` too
(interleaved), for before/after figures.  Writes ``results.json`` and
``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
GLOBAL_BATCH = 128


def _measure(strategy, samples: int, epochs: int) -> dict:
    import jax
    import keras
    import numpy as np

    import distribute
    from distribute.data import Dataset

    rng = np.random.default_rng(0)
    n = (samples // GLOBAL_BATCH) * GLOBAL_BATCH
    x = rng.random((n, 784), dtype=np.float32)
    y = rng.integers(0, 10, size=(n,), dtype=np.int32)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
        optimizer = keras.optimizers.Adam(1e-3)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def train_step(xb, yb):
        def loss_fn():
            return distribute.compute_average_loss(loss_object(yb, model(xb, training=True)))

        loss, grads = distribute.compute_gradients(loss_fn, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dataset = Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)
    dist = strategy.experimental_distribute_dataset(dataset)
    steps = n // GLOBAL_BATCH
    epoch_seconds, losses = [], []
    for _ in range(1 + epochs):
        t0 = time.perf_counter()
        total = 0.0
        for xb, yb in dist:
            total = total + strategy.reduce("SUM", strategy.run(train_step, args=(xb, yb)), axis=None)
        losses.append(float(total) / steps)
        jax.block_until_ready([v.value for v in model.trainable_variables])
        epoch_seconds.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    count = sum(1 for _ in dist)
    input_seconds = time.perf_counter() - t0
    timed = sum(epoch_seconds[1:])
    return {"examples_per_second": n * epochs / timed, "step_ms": 1000 * timed / (steps * epochs),
            "input_ms_per_step": 1000 * input_seconds / count, "final_loss": losses[-1]}


def _role(role: str, out: str, samples: int, epochs: int) -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    import distribute

    if role == "worker":
        strategy = distribute.MultiWorkerMirroredStrategy()
        _, me = strategy.extended.input_policy.input_pipelines()
    else:
        strategy = distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        me = 0
    profile = os.environ.get("MW_STEP_PROFILE")  # a path prefix: cProfile of the measurement, one file per worker
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        result = profiler.runcall(_measure, strategy, samples, epochs)
        profiler.dump_stats(f"{profile}.{role}{me}.prof")
    else:
        result = _measure(strategy, samples, epochs)
    Path(out, f"{role}{me}.json").write_text(json.dumps(result))


def _run(kind: str, src: Path, args) -> dict:
    if kind.startswith("jax "):
        from multi_worker_floor import measure

        record = measure(kind.split()[1], steps=(args.samples // GLOBAL_BATCH) * args.epochs, samples=args.samples, timeout=args.timeout)
        record.setdefault("input_ms_per_step", float("nan"))
        return record
    out = tempfile.mkdtemp(prefix="mwstep")
    env = {"KERAS_BACKEND": "jax", "PYTHONPATH": str(src), "JAX_PLATFORMS": "cpu"}
    cmd = [str(Path(__file__)), "--role", "worker" if kind != "single" else "single", "--role-out", out,
           "--samples", str(args.samples), "--epochs", str(args.epochs)]
    start = time.perf_counter()
    if kind == "single":
        import subprocess

        flags = "--xla_force_host_platform_device_count=2"
        proc = subprocess.run([sys.executable, *cmd], env={**os.environ, **env, "XLA_FLAGS": flags},
                              capture_output=True, text=True, timeout=args.timeout)
        ok, output = proc.returncode == 0, proc.stderr
        files = [Path(out, "single0.json")]
    else:
        sys.path.insert(0, str(src))
        from distribute.launch import launch

        result = launch(cmd, 2, 1, env=env, timeout_seconds=args.timeout, echo=False)
        ok, output = result.returncode == 0, result.output
        files = [Path(out, f"worker{w}.json") for w in range(2)]
    if not ok or not all(f.exists() for f in files):
        return {"ok": False, "error": output[-600:], "wall_seconds": time.perf_counter() - start}
    records = [json.loads(f.read_text()) for f in files]
    chief = records[0]
    chief.update(ok=True, wall_seconds=time.perf_counter() - start,
                 input_ms_per_step=max(r["input_ms_per_step"] for r in records))
    return chief


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=60_000)
    p.add_argument("--timeout", type=float, default=400.0)
    p.add_argument("--baseline-src", default=None, help="another commit's src/: adds 2-worker runs with it")
    p.add_argument("--floor", action="store_true",
                   help="adds bare-JAX runs on 2 processes (multi_worker_floor.py): the mlp step, and its all-reduce alone")
    p.add_argument("--out", default=str(HERE / "results" / "multi_worker"))
    p.add_argument("--role", choices=("worker", "single"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--role-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        _role(args.role, args.role_out, args.samples, args.epochs)
        return 0
    sys.path.insert(0, str(HERE))
    from compare import environment, git_state

    env = environment(argparse.Namespace(platform="cpu", tf_python=None))  # date and load at the start
    kinds = [("single", SRC), ("2x1", SRC)] + ([("2x1 baseline", Path(args.baseline_src).resolve())] if args.baseline_src else [])
    kinds += [("jax step 2x1", SRC), ("jax psum 2x1", SRC)] if args.floor else []
    runs: list = []
    started = time.perf_counter()
    for repeat in range(args.repeats):
        order = kinds[repeat % len(kinds):] + kinds[:repeat % len(kinds)]
        for kind, src in order:
            record = _run(kind, src, args)
            runs.append({**record, "kind": kind, "repeat": repeat})
            shown = f"{record['examples_per_second']:,.0f} ex/s, {record['step_ms']:.2f} ms/step, input {record['input_ms_per_step']:.3f} ms/step" if record["ok"] else "FAILED " + record["error"][-200:]
            print(f"[{repeat + 1}/{args.repeats}] {kind}: {shown}", flush=True)
    rows = []
    for kind, _ in kinds:
        ok = [r for r in runs if r["kind"] == kind and r["ok"]]
        row = {"kind": kind, "runs_ok": len(ok), "runs": len([r for r in runs if r["kind"] == kind])}
        for field in ("examples_per_second", "step_ms", "input_ms_per_step"):
            values = [r[field] for r in ok if r[field] == r[field]]  # the bare-JAX runs have no input-only pass (nan)
            row[field] = {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None
        rows.append(row)
    single = rows[0]["examples_per_second"]
    floor = next((r["examples_per_second"] for r in rows if r["kind"] == "jax step 2x1"), None)
    floor_note = [] if floor is None else [
        "- `jax step 2x1`: hand-written JAX doing the same step on the same 2 processes (no `distribute` code), "
        "`jax psum 2x1`: only its gradient all-reduce; `x jax 2x1` compares with the first, the floor of a "
        "2-worker step here"]
    lines = ["# Multi-worker step cost", "",
             f"- date: {env['date']}; host CPU: {env['cpu_model']} ({env['cpu_count']} cores); load average at start: "
             + ", ".join(f"{x:.2f}" for x in env["loadavg_at_start"]),
             f"- jax {env['jax']}, keras {env['keras']}; git {git_state()}; baseline src: {args.baseline_src or '-'}",
             f"- mlp custom loop, global batch {GLOBAL_BATCH}, {args.epochs} timed epochs after 1 warm-up, {args.repeats} interleaved repeats; "
             f"total {time.perf_counter() - started:.0f} s", *floor_note, "",
             "| run | examples/s | min-max | x one process | x jax 2x1 | ms/step (min-max) | input-only ms/step (min-max) | ok |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        e, s, i = row["examples_per_second"], row["step_ms"], row["input_ms_per_step"]
        if e is None:
            lines.append(f"| {row['kind']} | - | - | - | - | - | - | 0/{row['runs']} |")
            continue
        ratio = f"{e['median'] / single['median']:.2f}" if single else "-"
        to_floor = f"{e['median'] / floor['median']:.2f}" if floor else "-"
        shown_input = f"{i['median']:.3f} ({i['min']:.3f}-{i['max']:.3f})" if i else "-"
        lines.append(f"| {row['kind']} | {e['median']:,.0f} | {e['min']:,.0f}-{e['max']:,.0f} | {ratio} | {to_floor} "
                     f"| {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | {shown_input} | {row['runs_ok']}/{row['runs']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"environment": env, "rows": rows, "runs": runs, "argv": sys.argv}, indent=1))
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
