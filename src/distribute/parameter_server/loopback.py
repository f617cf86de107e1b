"""Ray on loopback only: one place that keeps every listener of a local Ray cluster on 127.0.0.1.

Ray 2.60 binds each of its listeners to 127.0.0.1 when its node's IP address is
literally ``"127.0.0.1"``, and to every interface (``0.0.0.0`` / ``[::]``)
otherwise: the GCS, the raylet's node manager and object manager and every
core worker (the driver, each actor: ``GrpcServer::Run`` with
``listen_to_localhost_only = node_ip_address == "127.0.0.1"``), the runtime-env
agent (it binds the node address itself), the dashboard agent's gRPC and HTTP
servers and its metrics export (``dashboard/agent.py``, ``reporter_agent.py``:
``is_localhost(ip)``), the autoscaler monitor's metrics (``monitor.py``); the
API server (dashboard) binds ``dashboard_host``, 127.0.0.1 by default.

But Ray replaces a node address of ``"127.0.0.1"`` given to
``ray.init(_node_ip_address=...)`` or ``ray start --node-ip-address`` by the
machine's routable address (``services.resolve_ip_for_localhost``, called at
``_private/worker.py:1844`` and ``scripts/scripts.py:855``), unless Ray's
``ENABLE_RAY_CLUSTER`` is off (``services.get_node_ip_address``: then the
local address is the loopback one).  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
turns it off for a Ray process started with it (Ray reads it at import:
``ray_constants.py:658``); :func:`keep_on_loopback` sets it for this process and
its children.  With it off, ``ray start --address`` (a node joining a head)
refuses to start ("Multi-node Ray clusters are not supported on Windows and
OSX", ``scripts.py:1169``): :func:`node_cli` starts such a node with that one
check passing and the address resolution still off.

Measured with ``ss -ltnp`` before this module: ``ray.init(address="local",
_node_ip_address="127.0.0.1")`` ran its GCS, raylet and workers on ``[::]`` and
its runtime-env agent on the machine's other interface; after it, every
listener of the suite's Ray is on 127.0.0.1 (``tests/test_ps_loopback.py``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

LOOPBACK = "127.0.0.1"

ENVIRONMENT = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""What a Ray process started on loopback needs in its environment (module docstring)."""

# ``ray start`` for a node that joins a loopback head: the ``ray`` command, with only the
# multi-node check of ``scripts.py`` seeing ENABLE_RAY_CLUSTER on (module docstring).
_NODE_CLI = (
    "import sys, types\n"
    "import ray._private.ray_constants as constants\n"
    "from ray.scripts import scripts\n"
    "view = types.ModuleType(constants.__name__)\n"
    "view.__dict__.update(vars(constants))\n"
    "view.ENABLE_RAY_CLUSTER = True\n"
    "scripts.ray_constants = view\n"
    "sys.argv[0] = 'ray'\n"
    "scripts.main()\n"
)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface (``127.x.x.x``, ``::1``, ``localhost``)."""
    return host == "localhost" or host == "::1" or host.startswith("127.")


def keep_on_loopback() -> None:
    """Makes the Ray this process starts or joins next keep its node address (and so its listeners) on 127.0.0.1.

    Sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` for the Ray processes this process
    starts, and Ray's constant already read from it in this process (if Ray is
    imported).  Call it before ``ray.init`` or ``ray start`` on loopback only.
    """
    os.environ.update(ENVIRONMENT)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


def init_local(**kwargs: Any) -> Any:
    """``ray.init`` of a new local Ray instance whose every listener is on 127.0.0.1; returns the ``ray`` module.

    Tests, benchmarks and examples start Ray with this (the embedded
    ParameterServerStrategy starts its own head, ``nodes.start_local_head``, with
    the same settings).  ``kwargs`` are added to (or replace) ``ray.init``'s.
    """
    keep_on_loopback()
    import ray

    options = {"address": "local", "_node_ip_address": LOOPBACK, "include_dashboard": False,
               "dashboard_host": LOOPBACK, "log_to_driver": False, "configure_logging": False, **kwargs}
    ray.init(**options)
    return ray


def node_cli() -> list[str]:
    """The ``ray`` command for ``ray start --address=<loopback head>`` (a node that joins a head on this machine)."""
    return [sys.executable, "-c", _NODE_CLI]


def ray_pids() -> set[int]:
    """The processes of the Ray cluster this process is connected to (on this machine): this driver, every process
    whose command line names the cluster's session directory (its GCS, raylets, dashboard, monitors, client
    server) and their descendants (agents, workers, actors)."""
    import psutil
    import ray

    sessions = {os.path.dirname(os.path.dirname(node["ObjectStoreSocketName"])) for node in ray.nodes()}
    roots = []
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or ())
        if any(session in line for session in sessions):
            roots.append(process)
    pids = {os.getpid()}
    for root in roots:
        try:
            pids.update([root.pid, *(child.pid for child in root.children(recursive=True))])
        except psutil.Error:
            continue
    return pids


def listeners(pids: set[int]) -> list[tuple[int, str, str, int]]:
    """``(pid, process name, address, port)`` of every TCP socket of ``pids`` that listens, sorted."""
    import psutil

    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in pids:
            continue
        try:
            name = psutil.Process(conn.pid).name()
        except psutil.Error:
            name = "?"
        found.append((conn.pid, name, conn.laddr.ip, conn.laddr.port))
    return sorted(found)


def non_loopback(found: list[tuple[int, str, str, int]]) -> list[tuple[int, str, str, int]]:
    """The entries of ``listeners(...)`` whose address is not loopback (``::ffff:127.0.0.1`` is loopback)."""
    return [entry for entry in found if not is_loopback(entry[2].removeprefix("::ffff:"))]
