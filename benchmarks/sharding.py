"""Sharded state (``sharding=``): bytes per device, compiled temporary bytes, communication and speed per level.

    PYTHONPATH=src python benchmarks/sharding.py --replicas 8 --out benchmarks/results/sharding

The workload: an MLP 1024-2048-1536-10 (5.26M parameters), Adam, MSE, per-replica
batch 32, trained with Keras ``fit`` under ``MirroredStrategy(sharding=level)``
for each level, on 8 virtual CPU devices.

* **memory** (one fresh process per level): bytes resident on each device
  (``jax.live_arrays()``' shards on that device, each buffer counted once by
  ``unsafe_buffer_pointer()``: a cross-replica read is a view of a replica's
  buffer) before the model exists, after building model and optimizer, and
  after training; the compiled step's ``memory_analysis()`` (temporary,
  argument, output bytes: the peak beyond the resident state); and the
  collectives in the compiled step's HLO (bytes each device sends per step,
  with ring all-reduce / all-gather / reduce-scatter).
* **speed** (one process, all levels built side by side, alternating epochs in a
  rotating order after one warm-up epoch each): median wall and CPU seconds per
  epoch and the ratio of each level's median to NONE's.
* **largest model** per level within a per-device budget, from the measured
  bytes per parameter (resident state plus the step's temporary bytes).

Writes ``results.json`` and ``results.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
HERE = Path(__file__).resolve().parent
LEVELS = ("none", "optimizer_state", "gradients", "full")
WIDTHS = (1024, 2048, 1536, 10)
PER_REPLICA_BATCH = 32
_DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "pred": 1, "u8": 1, "s8": 1}


def build(strategy):
    import keras

    keras.utils.set_random_seed(0)
    with strategy.scope():
        layers = [keras.Input((WIDTHS[0],))] + [keras.layers.Dense(w, activation="relu") for w in WIDTHS[1:-1]] + [keras.layers.Dense(WIDTHS[-1])]
        model = keras.Sequential(layers)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def data(num_replicas: int, steps: int):
    import numpy as np

    rng = np.random.default_rng(0)
    n = steps * PER_REPLICA_BATCH * num_replicas
    return rng.normal(size=(n, WIDTHS[0])).astype(np.float32), rng.normal(size=(n, WIDTHS[-1])).astype(np.float32)


def resident(devices) -> list[int]:
    """Bytes of live arrays on each device, each buffer once."""
    import gc

    import jax

    gc.collect()
    per_device: list[dict[int, int]] = [{} for _ in devices]
    index = {d: i for i, d in enumerate(devices)}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            if shard.device in index:
                per_device[index[shard.device]][shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return [sum(d.values()) for d in per_device]


def collectives(hlo: str, num_replicas: int) -> dict:
    """Collectives of one compiled step: count and payload bytes per kind, and the bytes one device sends (ring)."""
    out: dict = {}
    pattern = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-reduce|all-gather|reduce-scatter)(?:-start)?\(")
    for shapes, kind in pattern.findall(hlo):
        size = 0
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shapes):
            count = 1
            for d in filter(None, dims.split(",")):
                count *= int(d)
            size += count * _DTYPE_BYTES.get(dtype, 4)
        whole = size * num_replicas if kind == "reduce-scatter" else size  # reduce-scatter's output is a slice
        sent = whole * (num_replicas - 1) / num_replicas * (2 if kind == "all-reduce" else 1)
        entry = out.setdefault(kind, {"ops": 0, "bytes": 0, "sent_per_device": 0.0})
        entry["ops"] += 1
        entry["bytes"] += whole
        entry["sent_per_device"] += sent
    out["sent_per_device_total"] = sum(v["sent_per_device"] for v in out.values() if isinstance(v, dict))
    return out


def step_program(model):
    """The compiled single-step SPMD program of ``model.fit`` (the engine's cache)."""
    runner = next(c.cell_contents for c in model.train_function.__closure__ if type(c.cell_contents).__name__ == "_StepRunner")
    return next(iter(runner.cache.values()))


def measure_memory(level: str, num_replicas: int, steps: int) -> dict:
    import jax

    import distribute

    devices = jax.devices()[:num_replicas]
    before = resident(devices)
    strategy = distribute.MirroredStrategy(devices, sharding=level)
    model = build(strategy)
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    built = resident(devices)
    x, y = data(num_replicas, steps)
    model.fit(x, y, batch_size=PER_REPLICA_BATCH * num_replicas, epochs=1, shuffle=False, verbose=0)
    del x, y
    trained = resident(devices)
    program = step_program(model)
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True, optimizer_variables=True, metrics_variables=True)
    leaves = [jax.ShapeDtypeStruct((num_replicas, PER_REPLICA_BATCH, w), "float32", sharding=strategy.extended.replica_mesh.per_replica_sharding)
              for w in (WIDTHS[0], WIDTHS[-1])]
    compiled = program.lower(state, leaves).compile()
    analysis = compiled.memory_analysis()
    params = model.count_params()
    return {
        "level": level, "params": params, "before": before, "built": built, "trained": trained,
        "temp_bytes": analysis.temp_size_in_bytes, "argument_bytes": analysis.argument_size_in_bytes,
        "output_bytes": analysis.output_size_in_bytes, "alias_bytes": analysis.alias_size_in_bytes,
        "collectives": collectives(compiled.as_text(), num_replicas),
    }


def measure_speed(num_replicas: int, steps: int, rounds: int) -> dict:
    import jax

    import distribute

    devices = jax.devices()[:num_replicas]
    x, y = data(num_replicas, steps)
    models = {level: build(distribute.MirroredStrategy(devices, sharding=level)) for level in LEVELS}

    def epoch(model) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        model.fit(x, y, batch_size=PER_REPLICA_BATCH * num_replicas, epochs=1, shuffle=False, verbose=0)
        jax.block_until_ready([v.value for v in model.trainable_variables[:1]])
        return time.perf_counter() - wall, time.process_time() - cpu

    for model in models.values():
        epoch(model)  # compile
    times: dict = {level: {"wall": [], "cpu": []} for level in LEVELS}
    for r in range(rounds):
        order = LEVELS[r % len(LEVELS):] + LEVELS[: r % len(LEVELS)]
        for level in order:
            wall, cpu = epoch(models[level])
            times[level]["wall"].append(wall)
            times[level]["cpu"].append(cpu)
    base = statistics.median(times["none"]["wall"])
    base_cpu = statistics.median(times["none"]["cpu"])
    return {level: {**t, "median_wall": statistics.median(t["wall"]), "median_cpu": statistics.median(t["cpu"]),
                    "speed_vs_none": base / statistics.median(t["wall"]), "cpu_speed_vs_none": base_cpu / statistics.median(t["cpu"]),
                    "steps_per_second": steps / statistics.median(t["wall"])} for level, t in times.items()}


def largest_models(memory: dict, budgets_gib=(16, 80)) -> dict:
    """Parameters each level fits in a per-device budget: measured (resident + temporary) bytes per parameter."""
    out = {}
    for level, m in memory.items():
        resident_state = max(m["trained"]) - max(m["before"])
        per_param = (resident_state + m["temp_bytes"]) / m["params"]
        out[level] = {"bytes_per_param": per_param, **{f"{b}GiB": int(b * 2**30 / per_param) for b in budgets_gib}}
    return out


def _machine() -> dict:
    import platform

    import jax
    import keras

    return {"jax": jax.__version__, "keras": keras.__version__, "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "load": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M")}


def _markdown(result: dict) -> str:
    r, lines = result["replicas"], []
    lines.append(f"# Sharded state, {r} replicas (CPU), MLP {'-'.join(map(str, WIDTHS))}, Adam\n")
    lines.append(f"machine: {json.dumps(result['machine'])}\n")
    lines.append("| level | resident MB / device (max) | x NONE | temporary MB (step) | sent MB / device / step | collectives | speed x NONE (wall) | speed x NONE (CPU) |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    none = max(result["memory"]["none"]["trained"]) - max(result["memory"]["none"]["before"])
    for level in LEVELS:
        m, s = result["memory"][level], result.get("speed", {}).get(level, {})
        state = max(m["trained"]) - max(m["before"])
        kinds = ", ".join(f"{k} x{v['ops']}" for k, v in m["collectives"].items() if isinstance(v, dict))
        lines.append(f"| {level} | {state / 1e6:.1f} | {state / none:.3f} | {m['temp_bytes'] / 1e6:.1f} | "
                     f"{m['collectives']['sent_per_device_total'] / 1e6:.1f} | {kinds} | {s.get('speed_vs_none', float('nan')):.2f} | "
                     f"{s.get('cpu_speed_vs_none', float('nan')):.2f} |")
    lines.append("\n| level | bytes / parameter / device | largest model, 16 GiB / device | 80 GiB / device |")
    lines.append("| --- | --- | --- | --- |")
    for level, v in result["largest"].items():
        lines.append(f"| {level} | {v['bytes_per_param']:.2f} | {v['16GiB'] / 1e9:.2f} B | {v['80GiB'] / 1e9:.2f} B |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="steps per epoch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a memory measurement in this process
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.replicas}".strip()
    if args.one:
        print("RESULT " + json.dumps(measure_memory(args.one, args.replicas, args.steps)), flush=True)
        return 0
    memory = {}
    for level in LEVELS:
        done = subprocess.run([sys.executable, __file__, "--one", level, "--replicas", str(args.replicas), "--steps", str(args.steps)],
                              capture_output=True, text=True, timeout=1800)
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        memory[level] = json.loads(line[len("RESULT "):])
        print(level, "resident per device", max(memory[level]["trained"]), "temp", memory[level]["temp_bytes"], flush=True)
    result = {"replicas": args.replicas, "machine": _machine(), "memory": memory, "largest": largest_models(memory)}
    if not args.skip_speed:
        result["speed"] = measure_speed(args.replicas, args.steps, args.rounds)
        result["machine"]["load_after"] = os.getloadavg()
    text = _markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1))
        (out / "results.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent / "src"))
    sys.exit(main())
