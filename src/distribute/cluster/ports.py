"""Free TCP ports for the tasks of a local cluster (the launchers, the Ray nodes of a TF_CONFIG cluster)."""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time

# Ports the kernel never hands out by itself: above Ray's worker ports (min/max_worker_port, 10002-19999 by
# default) and below the ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default),
# from which every bind to port 0 and every outgoing connection's source port is drawn.
_FIRST_PORT = 20000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_MIN_CHOICES = 1000  # fewer ports than this between the two: fall back to the kernel's choice
# A port handed out here is not handed out again, by any process of this machine, for this long: the task it
# was chosen for binds it only after starting (imports, seconds to a minute on a loaded machine).
RESERVE_SECONDS = 300.0
_RESERVATIONS = os.path.join(tempfile.gettempdir(), "distribute-ports")


def _reserve(port: int) -> bool:
    """Marks ``port`` handed out (a file per port); False when another process handed it out recently.

    Where the directory cannot be written (another user's, a read-only
    temporary directory), no reservation is made and True is returned: the
    port is still one the kernel never hands out by itself.
    """
    path = os.path.join(_RESERVATIONS, str(port))
    for _ in range(2):
        try:
            os.makedirs(_RESERVATIONS, exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return True
        except FileExistsError:
            try:
                if time.time() - os.stat(path).st_mtime < RESERVE_SECONDS:
                    return False
                os.unlink(path)  # an old reservation: its task bound the port long ago, or never will
            except FileNotFoundError:
                pass
            except OSError:  # another user's reservation we may not remove
                return False
        except OSError:
            return True
    return False


def _ephemeral_start() -> int | None:
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Returns ``count`` distinct TCP ports free on ``host`` right now (``""``: on every interface).

    The ports are drawn at random from below the kernel's ephemeral range (and
    above Ray's worker ports), checked free by binding them: a task starts
    seconds after its port is chosen, and in that time a port from the
    ephemeral range can be taken by any process's bind to port 0 or outgoing
    connection (a Gloo pair, a Ray worker), so the task would fail with "port
    in use".  A port is also reserved for :data:`RESERVE_SECONDS` in a file of
    the temporary directory (``distribute-ports/<port>``), so two launchers of
    this machine (two jobs, the test suite's processes) never hand out the same
    port while neither task has bound it: a worker of one would join the
    other's cluster.  Where the ephemeral range leaves no room below it, the
    kernel picks (bind to port 0), as before.
    """
    sockets: list[socket.socket] = []
    try:
        ephemeral = _ephemeral_start()
        if ephemeral is not None and ephemeral - _FIRST_PORT >= _MIN_CHOICES:
            candidates = list(range(_FIRST_PORT, ephemeral))
            random.SystemRandom().shuffle(candidates)
            for port in candidates:
                if len(sockets) == count:
                    break
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.bind((host, port))
                except OSError:
                    s.close()
                    continue
                if not _reserve(port):  # another launcher of this machine chose it and may not have bound it yet
                    s.close()
                    continue
                sockets.append(s)
        while len(sockets) < count:  # no room below the ephemeral range, or too few ports free there
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
