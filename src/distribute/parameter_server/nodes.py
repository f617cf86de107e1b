"""The Ray nodes of a TF_CONFIG cluster: the chief's Ray head, one node per ps and worker task.

A TF_CONFIG cluster for ParameterServerStrategy has a ``chief`` (the
coordinator: it runs the user program), ``ps`` tasks and ``worker`` tasks.  On
Ray it becomes one Ray cluster:

* the chief's ``host:port`` is the Ray head's address: the chief's
  ``ParameterServerStrategy`` starts the head there (``ray start --head --block
  --port=<port>``, a child process that ends with the chief), unless something
  already listens there (a head the operator started), then joins it;
* each ps task ``j`` and worker task ``i`` runs :class:`Server` (TF's
  ``tf.distribute.Server(...).join()``): it waits for the head, joins it as a Ray
  node offering the custom resource ``distribute_ps_<j>`` (``distribute_worker_<i>``)
  and blocks; the strategy pins actor ``ps-<j>`` (``worker-<i>``) to that resource,
  so each actor runs in its own task's process tree;
* when the chief ends, its head goes, and every Server ends (exit status 0)
  within seconds.  ``python -m distribute.launch --num-ps N`` runs all of this on
  one machine.

The ports TF_CONFIG gives ps and worker tasks are not used: Ray picks its own.
Ray's authentication mode must be set (``RAY_AUTH_MODE``) on every task before
it starts (Ray >= 2.59 turns tokens on for a new head, not for a client that
joins one); the launcher sets ``token``.  The token is ``RAY_AUTH_TOKEN`` /
``RAY_AUTH_TOKEN_PATH`` / ``~/.ray/auth_token`` (created on the chief's machine
when missing: on several machines, copy it to each).

Standard library only at import (a Server starts in a fraction of a second);
Ray runs as ``ray start`` child processes.  On Linux each child gets
``PR_SET_PDEATHSIG`` (SIGTERM when its parent dies), so a killed task leaves no
Ray processes behind.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from distribute.cluster import _env
from distribute.cluster.ports import free_ports
from distribute.parameter_server import loopback

# Ray passes an object of up to this size inside the RPC message (by default 100 KiB;
# larger ones go through the object store: an extra put/get, ~1 ms for 200 KB).  A
# step's pull and push are a model's weights and gradients per ps, often a few hundred
# KB, so the Ray a strategy starts (embedded, or a TF_CONFIG chief's head) inlines up to 1 MiB (measured: a 200 KB pull
# 2.3 -> 1.2 ms, push 2.7 -> 1.4 ms).  Ray's gRPC messages carry up to 512 MiB.
SYSTEM_CONFIG = {"max_direct_call_object_size": 1 << 20}

logger = logging.getLogger("distribute")

__all__ = ["Server", "node_resource", "start_local_head", "start_or_join_head", "wait_for_tasks"]

_HEAD_RESOURCE = "distribute_chief"
_POLL_SECONDS = 0.2
# A Server ends when its head has refused connections this many times in a row, one poll apart.
_HEAD_GONE_POLLS = 5
# A node that fails to start (Ray gives a raylet 30 s to register) is started again, at most _START_RETRIES times.
_START_RETRIES, _START_SECONDS = 3, 180.0
_STARTED_LINE = "Ray runtime started"


def node_resource(task_type: str, task_id: int) -> str:
    """The Ray custom resource a task's node offers: ``distribute_ps_0``, ``distribute_worker_1``."""
    return f"distribute_{task_type}_{int(task_id)}"


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"cluster address {address!r} is not 'host:port'; TF_CONFIG addresses look like '127.0.0.1:2222'.")
    return host, int(port)


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _ray_cli() -> list[str]:
    beside = os.path.join(os.path.dirname(sys.executable), "ray")
    if os.path.exists(beside):
        return [beside]
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"]


# A child of a process that runs JAX's threads must not run Python between fork and exec (a
# ``preexec_fn``: a lock another thread held at the fork, e.g. the dynamic loader's, never
# opens in the child; JAX warns "os.fork() was called ... will likely lead to a deadlock").  So
# the child execs a fresh Python first, which asks to die with its parent (PR_SET_PDEATHSIG,
# kept across exec), checks that the parent is still the one that started it, then execs Ray.
_TRAMPOLINE = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def _spawned(command: list[str]) -> list[str]:
    """``command`` started through the trampoline (Linux: dies with this process); as it is elsewhere."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), *command]


def _ray_environment(who: str, host: str) -> dict[str, str]:
    """The environment of this cluster's Ray processes (on ``host``: loopback keeps them there); the authentication
    mode must be chosen.

    Raises:
        ValueError: ``RAY_AUTH_MODE`` is unset (``ray start --head`` would turn
            token authentication on and this process's Ray client would not).
    """
    mode = _env.read("RAY_AUTH_MODE")
    if mode is None:
        raise ValueError(
            f"{who}: RAY_AUTH_MODE is unset. Set it in the environment of every task of the cluster before it "
            "starts: RAY_AUTH_MODE=token (Ray's default for new clusters; every task needs the same token: "
            "~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH), or RAY_AUTH_MODE=disabled on a trusted "
            "network. python -m distribute.launch --num-ps sets token."
        )
    env = dict(os.environ)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # No Ray Serve here: a node told to stop stops at once (Ray >= 2.5x drains up to 30 s first).
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    if loopback.is_loopback(host):
        loopback.keep_on_loopback()  # this process's ray.init too
        env.update(loopback.ENVIRONMENT)
    return env


def _ensure_token(env: Mapping[str, str]) -> None:
    if env.get("RAY_AUTH_MODE", "").lower() != "token":
        return
    if env.get("RAY_AUTH_TOKEN") or env.get("RAY_AUTH_TOKEN_PATH"):
        return
    if os.path.exists(os.path.join(os.path.expanduser("~"), ".ray", "auth_token")):
        return
    subprocess.run([*_ray_cli(), "get-auth-token", "--generate"], env=dict(env), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)


def _port_options(head: bool) -> list[str]:
    """Free ports for the per-node agents whose defaults are fixed (several nodes share one machine here)."""
    names = ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
             "--runtime-env-agent-port", *(["--ray-client-server-port"] if head else [])]
    return [f"{name}={port}" for name, port in zip(names, free_ports(len(names), host=""))]


class _RayStart:
    """One ``ray start --block`` child: its output is echoed; ``started`` is set once Ray says it runs."""

    def __init__(self, args: list[str], env: Mapping[str, str], cli: list[str] | None = None):
        args = [*args, *_port_options("--head" in args)]
        self.proc = subprocess.Popen(_spawned([*(cli or _ray_cli()), *args]), env=dict(env), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.started = threading.Event()
        self.last_lines: collections.deque[str] = collections.deque(maxlen=20)  # for error messages
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if _STARTED_LINE in line:
                self.started.set()
            self.last_lines.append(line)
            logger.info("%s", line)

    def output_tail(self) -> str:
        """Ray's last output lines, for an error message."""
        return "\n".join(self.last_lines)

    def wait_started(self, timeout_seconds: float) -> bool:
        """True once Ray runs; False if the child exited or ``timeout_seconds`` passed first."""
        deadline = time.monotonic() + timeout_seconds
        while not self.started.wait(_POLL_SECONDS):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return self.started.is_set()
        return True


def _lock_path(port: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"distribute-ray-start-{port}.lock")


@contextlib.contextmanager
def _one_start_at_a_time(port: int) -> Iterator[None]:
    """Serializes Ray node start-ups on this machine for one cluster.

    Nodes of one Ray cluster started at the same moment on one machine pick the
    same session file names (sockets, logs) and their raylets die with "bind:
    Address already in use"; Ray's own test clusters start nodes one by one too.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(_lock_path(port), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stop(proc: subprocess.Popen, timeout_seconds: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its Ray processes on SIGTERM
        try:
            proc.wait(timeout_seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def start_or_join_head(chief_address: str, timeout_seconds: float = 120.0) -> str:
    """Makes sure a Ray head listens at the chief's ``host:port``; returns the address to ``ray.init``.

    Starts ``ray start --head --block`` there as a child of this process (stopped
    at exit) unless something already listens on that port.

    Raises:
        ValueError: ``chief_address`` is not ``host:port``, or ``RAY_AUTH_MODE`` is unset.
        RuntimeError: the head did not come up within ``timeout_seconds`` (its
            exit status is named).
    """
    host, port = _split_address(chief_address)
    env = _ray_environment("ParameterServerStrategy (TF_CONFIG chief)", host)
    if _listening(host, port):
        return chief_address
    _ensure_token(env)
    with _one_start_at_a_time(port):
        head = _RayStart(["start", "--head", "--block", f"--port={port}", f"--node-ip-address={host}",
                          "--include-dashboard=false", "--disable-usage-stats", "--num-cpus=0",
                          f"--resources={json.dumps({_HEAD_RESOURCE: 1})}",
                          f"--system-config={json.dumps(SYSTEM_CONFIG)}"], env)
        atexit.register(_stop_head, head.proc, port)
        if not head.wait_started(timeout_seconds):
            _stop(head.proc)
            raise RuntimeError(
                f"ParameterServerStrategy: the Ray head for the chief at {chief_address} did not start within "
                f"{timeout_seconds} s (exit status {head.proc.returncode}; is port {port} taken?), or start it "
                f"yourself with `ray start --head --port={port}`. Ray's last output:\n{head.output_tail()}"
            )
    return chief_address


def start_local_head(timeout_seconds: float = 180.0) -> str:
    """Starts a Ray head on this machine for an embedded ParameterServerStrategy; returns its address.

    ``ray start --head --block`` on a free loopback port, a child of this process
    (stopped at exit, and with this process), started without running Python
    between fork and exec (``_spawned``), so a coordinator that already runs JAX
    forks safely; ``ray.init(address="local")`` would start Ray's processes with
    a ``preexec_fn``.  ``RAY_AUTH_MODE`` unset becomes ``token`` (what Ray chooses
    for a new local cluster, said here instead of in Ray's start-up notice).

    Raises:
        RuntimeError: the head did not come up within ``timeout_seconds``.
    """
    if _env.read("RAY_AUTH_MODE") is None:
        _choose_token_auth()
    env = _ray_environment("ParameterServerStrategy", loopback.LOOPBACK)
    _ensure_token(env)
    (port,) = free_ports(1, host="127.0.0.1")
    with _one_start_at_a_time(port):
        # No autoscaler monitor nor log monitor (a fixed cluster; log_to_driver=False): two Python processes fewer
        # starting beside the head (benchmarks/ps_startup.py).
        head = _RayStart(["start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
                          "--include-dashboard=false", "--disable-usage-stats", "--no-monitor",
                          "--include-log-monitor=false", f"--system-config={json.dumps(SYSTEM_CONFIG)}"], env)
        atexit.register(_stop_head, head.proc, port)
        if not head.wait_started(timeout_seconds):
            _stop(head.proc)
            raise RuntimeError(
                f"ParameterServerStrategy: the local Ray head did not start within {timeout_seconds} s (exit status "
                f"{head.proc.returncode}). Ray's last output:\n{head.output_tail()}"
            )
    return f"127.0.0.1:{port}"


def _choose_token_auth() -> None:
    """Token authentication for this process and its children, as ``ray.init()`` turns it on for a new local
    cluster (Ray's ``_enable_token_auth``: the variable, then Ray's configuration re-read), without its notice."""
    os.environ["RAY_AUTH_MODE"] = "token"
    from ray._private.authentication import authentication_token_setup

    authentication_token_setup._enable_token_auth()


def _stop_head(head: subprocess.Popen, port: int) -> None:
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    finally:
        _stop(head)
        with contextlib.suppress(OSError):
            os.remove(_lock_path(port))


def wait_for_tasks(num_workers: int, num_ps: int, timeout_seconds: float = 300.0) -> None:
    """Waits until every ps and worker task's node has joined the Ray cluster (this process is connected).

    Raises:
        TimeoutError: some tasks have not joined after ``timeout_seconds``; names them.
    """
    import ray

    wanted = {node_resource("ps", j): f"ps {j}" for j in range(num_ps)}
    wanted.update({node_resource("worker", i): f"worker {i}" for i in range(num_workers)})
    deadline = time.monotonic() + timeout_seconds
    while True:
        missing = [name for resource, name in wanted.items() if resource not in ray.cluster_resources()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"ParameterServerStrategy: the TF_CONFIG task(s) {', '.join(missing)} did not join the Ray cluster "
                f"within {timeout_seconds} s. Start each ps and worker task with distribute.Server(cluster_spec, "
                "job_name=..., task_index=...).join() (python -m distribute.launch --num-ps N does)."
            )
        time.sleep(_POLL_SECONDS)


class Server:
    """A ps or worker task of a ParameterServerStrategy cluster (TF: ``tf.distribute.Server``).

    As TF's programs do on their ps and worker tasks::

        resolver = distribute.cluster_resolver.TFConfigClusterResolver()
        if resolver.task_type in ("worker", "ps"):
            server = distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                       task_index=resolver.task_id, protocol=resolver.rpc_layer or "grpc")
            server.join()

    ``start()`` waits for the chief's Ray head (the ``chief`` job's address) and
    joins it as a Ray node that hosts this task's actor (``ps-<j>`` or
    ``worker-<i>``); ``join()`` blocks until the chief's head is gone (the
    coordinator's program ended: returns) or the node fails (raises).  SIGTERM
    stops the node and returns from ``join()``.

    Args:
        server_or_cluster_def: a ``ClusterSpec`` or its dict (must have a ``chief``).
        job_name: ``"ps"`` or ``"worker"``.
        task_index: the task's index in its job.
        protocol: accepted for TF compatibility (``"grpc"``); Ray has its own.
        config: accepted for TF compatibility; ignored.
        start: start at once (TF's default).
        start_timeout_seconds: how long to wait for the chief's head.

    Raises:
        ValueError: a job other than ps/worker, no such task, or no chief job.
    """

    def __init__(self, server_or_cluster_def: Any, job_name: str | None = None, task_index: int | None = None,
                 protocol: str | None = None, config: Any = None, start: bool = True,
                 *, start_timeout_seconds: float = 300.0):
        from distribute.cluster.roles import normalize_cluster_spec

        spec = normalize_cluster_spec(server_or_cluster_def).as_dict()
        if job_name not in ("ps", "worker"):
            raise ValueError(
                f"distribute.Server: job_name={job_name!r}; a ParameterServerStrategy cluster runs a Server on its "
                "'ps' and 'worker' tasks only (the chief creates ParameterServerStrategy, which starts the Ray head)."
            )
        tasks = spec.get(job_name, [])
        index = int(task_index or 0)
        if not 0 <= index < len(tasks):
            raise ValueError(f"distribute.Server: task_index={task_index!r} is not a task of job {job_name!r} ({len(tasks)} tasks).")
        if not spec.get("chief"):
            raise ValueError(
                f"distribute.Server: the cluster {spec} has no 'chief' job; its address is the Ray head's, so "
                "add one: {'chief': ['host:port'], 'ps': [...], 'worker': [...]}."
            )
        self.job_name, self.task_index, self.protocol = job_name, index, protocol or "grpc"
        self.head_address = spec["chief"][0]
        self._timeout = start_timeout_seconds
        self._node: subprocess.Popen | None = None
        self._stopping = threading.Event()
        if start:
            self.start()

    @property
    def target(self) -> str:
        """The Ray address this task joined (TF: the server's ``grpc://`` target)."""
        return self.head_address

    def start(self) -> None:
        """Waits for the chief's Ray head, then joins it as this task's node (idempotent).

        Raises:
            TimeoutError: the head did not listen within ``start_timeout_seconds``.
        """
        if self._node is not None:
            return
        host, port = _split_address(self.head_address)
        deadline = time.monotonic() + self._timeout
        while not _listening(host, port):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"distribute.Server ({self.job_name} {self.task_index}): no Ray head at the chief's address "
                    f"{self.head_address} after {self._timeout} s; start the chief's program "
                    "(its ParameterServerStrategy starts the head)."
                )
            time.sleep(_POLL_SECONDS)
        self._spawn_node()

    def _spawn_node(self) -> None:
        host, port = _split_address(self.head_address)
        env = _ray_environment(f"distribute.Server ({self.job_name} {self.task_index})", host)
        resource = node_resource(self.job_name, self.task_index)
        args = ["start", "--block", f"--address={self.head_address}", f"--node-ip-address={host}", "--num-cpus=0",
                "--disable-usage-stats", f"--resources={json.dumps({resource: 1})}"]
        with _one_start_at_a_time(port):
            node = None
            for attempt in range(1 + _START_RETRIES):
                node = _RayStart(args, env, loopback.node_cli() if loopback.is_loopback(host) else None)
                if node.wait_started(_START_SECONDS):
                    self._node = node.proc
                    return
                _stop(node.proc)
                logger.warning("distribute.Server (%s %s): its Ray node did not start (status %s); %s", self.job_name,
                               self.task_index, node.proc.returncode, "retrying" if attempt < _START_RETRIES else "giving up")
        raise RuntimeError(
            f"distribute.Server ({self.job_name} {self.task_index}): its Ray node did not start after "
            f"{1 + _START_RETRIES} attempts. Ray's last output:\n{node.output_tail() if node else ''}"
        )

    def join(self) -> None:
        """Blocks until the chief's Ray head is gone (returns) or this task's node ends (raises).

        Raises:
            RuntimeError: the Ray node exited on its own; its status is named.
        """
        self.start()
        previous = self._install_sigterm()
        host, port = _split_address(self.head_address)
        refused = 0
        try:
            while not self._stopping.wait(1.0):
                if self._node.poll() is not None:
                    raise RuntimeError(
                        f"distribute.Server ({self.job_name} {self.task_index}): its Ray node exited with status "
                        f"{self._node.returncode}; its output is in the 'distribute' log (INFO)."
                    )
                refused = 0 if _listening(host, port) else refused + 1
                if refused >= _HEAD_GONE_POLLS:
                    return  # the chief's program ended
        finally:
            _stop(self._node)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _install_sigterm(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return None
        return signal.signal(signal.SIGTERM, lambda _s, _f: self._stopping.set())


def main() -> int:
    """``python -m distribute.parameter_server.nodes``: this TF_CONFIG task's Server, until the chief ends."""
    from distribute.cluster import TFConfigClusterResolver

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    resolver = TFConfigClusterResolver()
    server = Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id,
                    protocol=resolver.rpc_layer or "grpc")
    logger.info("distribute.Server: %s %s joined the Ray head at %s", resolver.task_type, resolver.task_id, server.target)
    server.join()
    logger.info("distribute.Server: %s %s: the chief's Ray head is gone; exiting", resolver.task_type, resolver.task_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
