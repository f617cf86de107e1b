"""A ParameterServerStrategy that starts its own Ray and succeeds prints nothing alarming (issue 16).

Before: every start printed Ray's token notice, JAX's ``RuntimeWarning: os.fork()
was called ... will likely lead to a deadlock`` (Ray forked its processes with a
``preexec_fn``, Python running in the child of a multithreaded process) and
Ray's ``core_worker.cc ... the actor restart will fail`` for the workers (their
constructor arguments were in the object store).  Now the local Ray head is a
child spawned without Python between fork and exec, the token mode is chosen
explicitly, and workers get plain constructor arguments.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess

_SCRIPT = """
import keras, distribute
from distribute.coordinator import ClusterCoordinator
strategy = distribute.ParameterServerStrategy(num_workers=2, num_ps=1)
coordinator = ClusterCoordinator(strategy)
with strategy.scope():
    v = keras.Variable(0.0)
def add():
    v.assign_add(1.0)
for _ in range(5):
    coordinator.schedule(add)
coordinator.join()
print(float(v.numpy()))
"""
_ALARMING = ("os.fork()", "deadlock", "Token authentication", "core_worker.cc", "restart will fail", "Traceback",
             "Warning", "WARNING", "Error")


def test_an_embedded_cluster_starts_and_stops_quietly():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "5.0\n"
    noisy = [line for line in proc.stderr.splitlines() if any(word in line for word in _ALARMING)]
    assert not noisy, "\n".join(noisy)
