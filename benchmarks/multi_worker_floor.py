"""The floor under a multi-worker step: bare JAX on 2 processes x 1 CPU device (loopback, gloo).

    python benchmarks/multi_worker_floor.py --kind psum    # only the gradient all-reduce, per step
    python benchmarks/multi_worker_floor.py --kind step    # hand-written JAX mlp step over both processes

No ``distribute`` code runs in the measured processes: each calls
``jax.distributed.initialize`` itself (gloo CPU collectives), builds a 1-D mesh over
both processes' devices and times a jitted program, at most 2 in flight (the bound
``distribute`` keeps on CPU).  ``psum``: ``shard_map`` of ``lax.psum`` over the mlp's
gradient shapes (784x64, 64, 64x10, 10) plus a scalar, i.e. what one step sends;
``step``: the whole mlp step (784-64-10, softmax cross-entropy, optax Adam 1e-3,
global batch 128 placed by ``make_array_from_process_local_data`` from each
process's 64 rows), the hand-JAX counterpart of ``multi_worker_step.py``'s loop.
Prints one JSON line starting with RESULT per process; used by
``multi_worker_step.py --floor``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

GLOBAL_BATCH = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process(kind: str, process_id: int, port: int, steps: int, samples: int) -> dict:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("replica",))
    batch_sharding = NamedSharding(mesh, P("replica"))
    replicated = NamedSharding(mesh, P())
    shapes = [(784, 64), (64,), (64, 10), (10,)]
    rng = np.random.default_rng(0)
    if kind in ("psum", "psum_scalar"):
        from jax import shard_map

        def reduce(*xs):
            return [jax.lax.psum(x, "replica") for x in xs]

        fn = jax.jit(shard_map(reduce, mesh=mesh, in_specs=P("replica"), out_specs=P("replica")))
        local = [np.ones((1, *s), np.float32) for s in (shapes + [()] if kind == "psum" else [()])]
        args = [jax.make_array_from_process_local_data(batch_sharding, a) for a in local]

        def one_step(_):
            return fn(*args)
    else:
        import optax

        params = [jnp.asarray(rng.normal(0, 0.05, s).astype(np.float32)) for s in shapes]
        params = jax.device_put(params, replicated)
        opt = optax.adam(1e-3)
        opt_state = jax.device_put(opt.init(params), replicated)

        def loss_fn(p, x, y):
            h = jax.nn.relu(x @ p[0] + p[1])
            logits = h @ p[2] + p[3]
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        def train(p, s, x, y):
            loss, g = jax.value_and_grad(loss_fn)(p, x, y)
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s, loss

        train = jax.jit(train, donate_argnums=(0, 1))
        n = (samples // GLOBAL_BATCH) * GLOBAL_BATCH
        x = rng.random((n, 784), dtype=np.float32)
        y = rng.integers(0, 10, size=(n,), dtype=np.int32)
        half = GLOBAL_BATCH // 2
        state = {"p": params, "s": opt_state}

        def one_step(i):
            start = (i % (n // GLOBAL_BATCH)) * GLOBAL_BATCH + process_id * half
            xb = jax.make_array_from_process_local_data(batch_sharding, x[start:start + half])
            yb = jax.make_array_from_process_local_data(batch_sharding, y[start:start + half])
            state["p"], state["s"], loss = train(state["p"], state["s"], xb, yb)
            return loss

    def run(count: int) -> float:
        in_flight: list = []
        t0 = time.perf_counter()
        for i in range(count):
            in_flight.append(one_step(i))
            if len(in_flight) > 2:
                jax.block_until_ready(in_flight.pop(0))
        jax.block_until_ready(in_flight)
        return time.perf_counter() - t0

    run(max(steps // 4, 20))  # warm-up (compile)
    seconds = run(steps)
    jax.distributed.shutdown()
    return {"kind": kind, "process_id": process_id, "step_ms": 1000 * seconds / steps,
            "examples_per_second": GLOBAL_BATCH * steps / seconds}


def measure(kind: str, steps: int = 936, samples: int = 60_000, timeout: float = 300.0) -> dict:
    """Runs both processes; returns process 0's record (step_ms, examples_per_second) or ok=False."""
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", 
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--kind", kind, "--process-id", str(i),
                               "--port", str(port), "--steps", str(steps), "--samples", str(samples)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if any(rc != 0 for rc, _, _ in outputs):
        return {"ok": False, "error": " | ".join(err[-300:] for _, _, err in outputs)}
    records = [json.loads(line[len("RESULT "):]) for _, out, _ in outputs for line in out.splitlines() if line.startswith("RESULT ")]
    chief = records[0]
    chief["ok"] = True
    return chief


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=("psum", "psum_scalar", "step"), default="psum")
    p.add_argument("--steps", type=int, default=936)
    p.add_argument("--samples", type=int, default=60_000)
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.process_id is None:
        print(json.dumps(measure(args.kind, args.steps, args.samples)))
        return 0
    record = _process(args.kind, args.process_id, args.port, args.steps, args.samples)
    print("RESULT " + json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
