"""Free TCP ports for the tasks of a local cluster (the launchers, the Ray nodes of a TF_CONFIG cluster)."""

from __future__ import annotations

import socket


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Returns ``count`` distinct TCP ports free on ``host`` right now (``""``: on every interface).

    The ports are found by binding and closing sockets, so another process can
    take one before the caller binds it; the launchers start their tasks at once.
    """
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
