"""Every Ray process of the suite listens on loopback only (issue 27, item 5).

The suite's Ray (``ray_instance``: ``loopback.init_local``) with a
ParameterServerStrategy on it that ran a step (so its ps and worker actors
opened their channels too): each TCP socket that any of its processes listens
on (``psutil.net_connections`` of the GCS, raylet, agents, workers, actors and
this driver) is bound to 127.0.0.1.  Before ``loopback.py``, the GCS, raylet and
every worker listened on ``[::]`` and the runtime-env agent on the machine's
other interface, although ``_node_ip_address="127.0.0.1"`` was passed.
"""

from __future__ import annotations

import keras
import pytest

import distribute
from distribute.coordinator import ClusterCoordinator
from distribute.parameter_server import loopback

pytestmark = pytest.mark.multiprocess


def test_every_listener_of_the_suites_ray_is_on_loopback(ray_instance):
    assert ray_instance.util.get_node_ip_address() == "127.0.0.1"
    assert ray_instance.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    strategy = distribute.ParameterServerStrategy(num_workers=1, num_ps=1)
    try:
        coordinator = ClusterCoordinator(strategy)
        with strategy.scope():
            v = keras.Variable(1.0)

        def step():
            v.assign_add(2.0)

        coordinator.schedule(step)
        coordinator.join()
        assert float(v.numpy()) == 3.0
        found = loopback.listeners(loopback.ray_pids())
    finally:
        strategy._shutdown()
    names = {name for _, name, _, _ in found}
    # The check sees the cluster's servers (else it could pass by finding nothing).
    assert {"gcs_server", "raylet", "ray::ParameterServer", "ray::Worker"} <= names, found
    assert loopback.non_loopback(found) == [], f"Ray listeners off loopback: {loopback.non_loopback(found)}"


def test_loopback_addresses():
    assert all(loopback.is_loopback(h) for h in ("127.0.0.1", "127.0.1.1", "localhost", "::1"))
    assert not any(loopback.is_loopback(h) for h in ("0.0.0.0", "::", "192.0.2.2", ""))
    found = [(1, "raylet", "::ffff:127.0.0.1", 5), (2, "gcs_server", "::", 6), (3, "agent", "192.0.2.2", 7)]
    assert loopback.non_loopback(found) == found[1:]
