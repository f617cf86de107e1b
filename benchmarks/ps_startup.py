"""ParameterServerStrategy start-up: from ``ParameterServerStrategy()`` to the first finished epoch, by phase (issue 27).

Each run is a fresh Python process (nothing warm but the OS's file cache) that
times, in order:

* ``import``: ``import distribute, keras`` (the coordinator's own imports);
* ``ray_head``: the embedded Ray head (``nodes.start_local_head``: ``ray start
  --head --block`` as a child, until Ray says it runs);
* ``connect``: ``ray.init`` joining it;
* ``actors``: creating the ps and worker actors until the ps answer (the
  workers are waited for at their first use, ``cluster.Cluster.workers``);
* ``model``: ``Sequential([Input((4,)), Dense(1)])`` built and compiled in scope;
* ``first_epoch``: ``model.fit`` of 8 steps of 8 examples (the workers' start,
  their first dataset, the step's trace, export, compile on the workers and ps);
* ``second_epoch``: the same again (the steady state);
* ``to_first_epoch``: ``ParameterServerStrategy()`` called to the first epoch's end.

``--floor`` also runs Ray's own floor in fresh processes: ``ray.init(address="local")``
(loopback, as the suite: ``loopback.init_local``) and one trivial actor's first
answer.  Medians over ``--repeats`` runs; the load average is printed with them.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/ps_startup.py --repeats 3 --floor
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_RUN = r"""
import json, os, sys, time
t0 = time.perf_counter()
phases = {}
def mark(name, since):
    now = time.perf_counter()
    phases[name] = now - since
    return now
import distribute, keras, numpy as np
from distribute.parameter_server import cluster, nodes
t = mark("import", t0)
start_local_head = nodes.start_local_head
def timed_head(*args, **kwargs):
    began = time.perf_counter()
    address = start_local_head(*args, **kwargs)
    phases["ray_head"] = time.perf_counter() - began
    return address
nodes.start_local_head = timed_head
cluster_init = cluster.Cluster.__init__
def timed_cluster(self, *args, **kwargs):
    began = time.perf_counter()
    phases["connect"] = began - t_strategy - phases["ray_head"]
    cluster_init(self, *args, **kwargs)
    phases["actors"] = time.perf_counter() - began
cluster.Cluster.__init__ = timed_cluster
t_strategy = time.perf_counter()
strategy = distribute.ParameterServerStrategy(num_workers=2, num_ps=1)
t = time.perf_counter()
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype(np.float32)
y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.7).astype(np.float32)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
t = mark("model", t)
model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=8, verbose=0)
t = mark("first_epoch", t)
phases["to_first_epoch"] = t - t_strategy
model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=8, verbose=0)
mark("second_epoch", t)
print("PHASES " + json.dumps(phases), flush=True)
"""

_FLOOR = r"""
import json, os, time
t0 = time.perf_counter()
from distribute.parameter_server import loopback
ray = loopback.init_local()
t1 = time.perf_counter()
@ray.remote(num_cpus=0)
class Trivial:
    def ping(self):
        return os.getpid()
ray.get(Trivial.remote().ping.remote())
t2 = time.perf_counter()
print("PHASES " + json.dumps({"ray_init": t1 - t0, "trivial_actor": t2 - t1, "total": t2 - t0}), flush=True)
ray.shutdown()
"""

ORDER = ["import", "ray_head", "connect", "actors", "model", "first_epoch", "second_epoch", "to_first_epoch"]


def _one(code: str) -> dict:
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", RAY_USAGE_STATS_ENABLED="0",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=8"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    line = next((row for row in proc.stdout.splitlines() if row.startswith("PHASES ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line.removeprefix("PHASES "))


def _table(runs: list[dict], order: list[str]) -> list[str]:
    rows = ["| phase | median s | runs (s) |", "| --- | ---: | --- |"]
    for name in order:
        values = [r[name] for r in runs if name in r]
        rows.append(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--floor", action="store_true", help="also measure ray.init + one trivial actor")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    runs, floors = [], []
    for _ in range(args.repeats):
        runs.append(_one(_RUN))
        print(json.dumps(runs[-1]), flush=True)
        if args.floor:
            floors.append(_one(_FLOOR))
            print(json.dumps(floors[-1]), flush=True)
        time.sleep(1)
    print(f"load average (1, 5, 15 min) before: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
          f"after: {' '.join(f'{v:.1f}' for v in os.getloadavg())}; {os.cpu_count()} CPUs")
    print("\n".join(_table(runs, ORDER)))
    if floors:
        print("\nRay's floor (ray.init(address='local') on loopback + one trivial actor):")
        print("\n".join(_table(floors, ["ray_init", "trivial_actor", "total"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
