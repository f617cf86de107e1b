"""jaxlib's coordination service in a process of its own (part of the runtime's JAX seam, with ``join.py``).

``jax.distributed.initialize`` runs the coordination service inside process 0,
so when that worker (the chief) dies the service dies with it and jaxlib ends
every other worker at once with its own message ("Terminating process because
the JAX distributed service detected fatal errors"), naming nobody.  Here worker
0 starts the service as a separate process (its own session, so signals sent to
the chief's process group do not reach it) that outlives the chief: the
survivors keep their key-value store, see the chief's heartbeat stop, and stop
naming it within ``CommunicationOptions.timeout_seconds``.

The service process ends:

- when worker 0 shuts jax.distributed down normally (``jax.distributed.shutdown``,
  or JAX's exit handler: every worker has passed the shutdown barrier);
- ``linger_seconds`` after worker 0 ended any other way (killed, ``os._exit``),
  long enough for the survivors to name it; it then exits by itself;
- when a new job's worker 0 starts a service on the same port meanwhile (the
  job was relaunched by hand with the same TF_CONFIG): the new one ends the
  lingering one (a pid file in the temporary directory says which).

Standard library only in this process; the service process imports only ``jaxlib``.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import time

EXIT_WORKER_LOST = 75  # a worker that stops because another one was lost (EX_TEMPFAIL: relaunch)

# The service process.  argv: port, num_workers, heartbeat_timeout, shutdown_timeout, linger_seconds, parent pid.
_PROGRAM = r"""
import os, select, signal, socket, sys, tempfile, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
port, num_workers, heartbeat, shutdown, linger, parent = sys.argv[1:7]
pid_file = os.path.join(tempfile.gettempdir(), f"distribute-coordination-{port}.pid")


def listening():  # gRPC shares ports (SO_REUSEPORT): a second service would listen beside the first
    try:
        probe = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        address = ("::", int(port))
    except OSError:  # no IPv6 here: gRPC listens on 0.0.0.0
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address = ("0.0.0.0", int(port))
    with probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
            return False
        except OSError:
            return True


def mark(state):  # best effort: without the file, a relaunch on this port is refused until the linger ends
    try:
        with open(pid_file + f".{os.getpid()}", "w") as f:
            f.write(f"{os.getpid()} {state}")
        os.replace(pid_file + f".{os.getpid()}", pid_file)
    except OSError:
        pass


if listening():
    try:  # the service of a previous job on this port, outliving its dead worker 0: that job is over
        pid, state = open(pid_file).read().split()
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:  # that pid is such a service still (not a reused pid)
            theirs = b"distribute-coordination-" in f.read()
        if state == "lingering" and theirs:
            os.kill(int(pid), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while listening() and time.monotonic() < deadline:
                time.sleep(0.05)
    except (OSError, ValueError):
        pass
    if listening():
        print("error another process listens on it", flush=True)
        os._exit(1)
import jaxlib._jax as _jax
try:
    service = _jax.get_distributed_runtime_service(
        "[::]:" + port, int(num_workers), heartbeat_timeout=int(heartbeat), shutdown_timeout=int(shutdown))
except Exception as err:
    print("error " + " ".join(str(err).split()), flush=True)
    os._exit(1)
mark("serving")
print("ready", flush=True)
line = ""
while True:  # until worker 0 says shutdown, or it is gone (EOF, or this process was re-parented)
    ready, _, _ = select.select([sys.stdin], [], [], 0.5)
    if ready:
        line = sys.stdin.readline()
        break
    if os.getppid() != int(parent):
        break
if line.strip() == "shutdown":
    service.shutdown()
else:  # worker 0 died: serve the survivors until they have named it
    mark("lingering")
    time.sleep(float(linger))
try:
    os.remove(pid_file)
except OSError:
    pass
os._exit(0)
"""


class ServiceProcess:
    """The coordination service of one job, running in its own process.

    Has jaxlib's service's ``shutdown()``, so it stands in ``jax.distributed``'s
    global state where the in-process service would be.

    Args:
        port: The TCP port to listen on (all interfaces), worker 0's TF_CONFIG port.
        num_workers: Number of workers (jax processes) in the job.
        heartbeat_timeout: Seconds without a heartbeat after which the service
            itself declares a worker dead (jaxlib's backstop).
        shutdown_timeout: Seconds the shutdown barrier waits.
        linger_seconds: How long the service outlives a worker 0 that ended
            without shutting it down.
        start_timeout_seconds: How long to wait for the service to listen.

    Raises:
        RuntimeError: The service did not start (the port is in use, or jaxlib
            failed); the message names the port and jaxlib's error.
    """

    def __init__(self, port: int, num_workers: int, heartbeat_timeout: int, shutdown_timeout: int,
                 linger_seconds: float, start_timeout_seconds: float):
        self._port, self._shutdown_timeout = port, shutdown_timeout
        self._log = tempfile.TemporaryFile()
        argv = [str(port), str(num_workers), str(heartbeat_timeout), str(shutdown_timeout),
                str(linger_seconds), str(os.getpid())]
        self._proc = subprocess.Popen([sys.executable, "-c", _PROGRAM, *argv], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, start_new_session=True)
        status = self._wait_ready(start_timeout_seconds)
        if status != "ready":
            self._proc.kill()
            self._proc.wait()
            raise RuntimeError(
                f"The coordination service of MultiWorkerMirroredStrategy could not start on port {port} "
                f"(worker 0's TF_CONFIG address): {status}. Free the port or give worker 0 another address."
            )

    @property
    def pid(self) -> int:
        """The service process's id."""
        return self._proc.pid

    def _wait_ready(self, timeout_seconds: float) -> str:
        deadline = time.monotonic() + timeout_seconds
        stdout = self._proc.stdout
        assert stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([stdout], [], [], 0.1)
            if ready:
                line = stdout.readline().decode("utf-8", "replace").strip()
                if line == "ready":
                    return "ready"
                if line.startswith("error "):
                    return line[len("error "):]
                return f"it exited with status {self._proc.wait()} ({self._stderr_tail()})"
        return f"it did not listen within {timeout_seconds:g} s ({self._stderr_tail()})"

    def _stderr_tail(self) -> str:
        self._log.seek(0)
        lines = self._log.read().decode("utf-8", "replace").strip().splitlines()
        return " | ".join(lines[-3:]) or "no output"

    def shutdown(self) -> None:
        """Stops the service (after every worker passed the shutdown barrier); waits for its process, bounded."""
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(b"shutdown\n")
                self._proc.stdin.flush()
                self._proc.wait(timeout=self._shutdown_timeout + 5)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
        self._log.close()
