"""A PS step's traffic over three transports: our channel, Ray actor calls, Ray compiled graphs (issue 16).

One step of the parameter-server loop moves: the coordinator's small request to
a worker, the worker's update to its ps (``--kb`` KB of gradients) and the ps's
reply (as many KB of values read back), the worker's small reply.  Each
transport carries exactly that, between 3 processes (this driver, a "worker"
actor, a "ps" actor), ``--steps`` times in a row; reported: median and p90 ms
per step.

* ``channel``: ``parameter_server/channel.py`` (what the strategy uses): a TCP
  connection per actor, pickle 5 with arrays out of band.
* ``ray_calls``: ``ray.get(worker.step.remote(...))``, the worker calling
  ``ray.get(ps.update.remote(grads))``.
* ``compiled_graph``: a Ray compiled graph (``ray.dag``: ``InputNode`` ->
  ``worker.compute`` -> ``ps.update`` -> ``worker.finish``,
  ``experimental_compile()``: shared-memory channels between the processes of
  one node, no Ray task per call).

Usage::

    .venv/bin/python benchmarks/ps_transport.py --kb 16,200,2000 --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def _actors():
    import ray

    from distribute.parameter_server.channel import Connection, Server

    @ray.remote(num_cpus=0)
    class PS:
        def __init__(self):
            self._server = None

        def channel(self):
            self._server = Server(ray.util.get_node_ip_address(), self._handle, "ps")
            return self._server.address

        def _handle(self, request):
            return self.update(request[1])

        def update(self, grads):
            return grads * np.float32(0.5)  # a reply of the same size (the values read back)

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, ps, kb):
            self._ps, self._grads, self._server, self._conn = ps, np.ones(kb * 256, np.float32), None, None

        def channel(self):
            self._conn = Connection(ray.get(self._ps.channel.remote()), lambda: None)
            self._server = Server(ray.util.get_node_ip_address(), self._step_channel, "worker")
            return self._server.address

        def _step_channel(self, request):
            self._conn.send(("update", self._grads))
            return float(self._conn.receive()[0])

        def step_ray(self, _):
            return float(ray.get(self._ps.update.remote(self._grads))[0])

        def compute(self, _):
            return self._grads

        def finish(self, values):
            return float(values[0])

    return PS, Worker, Connection


def measure(kb: int, steps: int, transports: list[str]) -> dict:
    import ray
    from ray.dag import InputNode

    PS, Worker, Connection = _actors()
    out = {"kb": kb}
    for transport in transports:
        ps = PS.remote()
        worker = Worker.remote(ps, kb)
        ray.get([ps.__ray_ready__.remote(), worker.__ray_ready__.remote()])
        if transport == "channel":
            conn = Connection(ray.get(worker.channel.remote()), lambda: None)

            def one(conn=conn):
                conn.send(("run", 0))
                conn.receive()
        elif transport == "ray_calls":
            def one(worker=worker):
                ray.get(worker.step_ray.remote(0))
        else:
            with InputNode() as inp:
                dag = worker.finish.bind(ps.update.bind(worker.compute.bind(inp)))
            compiled = dag.experimental_compile()

            def one(compiled=compiled):
                ray.get(compiled.execute(0))
        for _ in range(20):
            one()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            one()
            times.append(1000 * (time.perf_counter() - t0))
        times.sort()
        out[transport] = {"median_ms": statistics.median(times), "p90_ms": times[int(0.9 * len(times))]}
        if transport == "compiled_graph":
            compiled.teardown(kill_actors=True)  # a plain teardown can hang on a loaded machine
        else:
            ray.kill(worker)
            ray.kill(ps)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kb", default="16,200,2000")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--transports", default="channel,ray_calls,compiled_graph")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from distribute.parameter_server import loopback

    ray = loopback.init_local()  # every Ray listener on 127.0.0.1
    load = os.getloadavg()[0]
    results = []
    for repeat in range(args.repeats):
        for kb in (int(k) for k in args.kb.split(",")):
            transports = args.transports.split(",")
            result = measure(kb, args.steps, transports if repeat % 2 == 0 else transports[::-1])
            results.append(result)
            print(json.dumps(result), flush=True)
    print(f"load average before/after: {load:.1f} / {os.getloadavg()[0]:.1f}")
    print("| KB each way | " + " | ".join(f"{t} median (p90) ms" for t in args.transports.split(",")) + " |")
    print("| ---: |" + " ---: |" * len(args.transports.split(",")))
    for kb in (int(k) for k in args.kb.split(",")):
        mine = [r for r in results if r["kb"] == kb]
        cells = []
        for t in args.transports.split(","):
            med = statistics.median(r[t]["median_ms"] for r in mine)
            p90 = statistics.median(r[t]["p90_ms"] for r in mine)
            cells.append(f"{med:.2f} ({p90:.2f})")
        print(f"| {kb} | " + " | ".join(cells) + " |")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
