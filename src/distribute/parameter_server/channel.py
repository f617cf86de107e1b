"""A direct TCP channel from a worker to a ps: a step's reads and updates, nothing else.

Why not a Ray actor call: one carrying a step's 200 KB of gradients out and 200 KB
of weights back costs 1.9 ms of latency and 1.0 ms of the worker's CPU on the
2-core benchmark machine; the same exchange as one framed message each way over
a socket costs 0.24 ms and 0.11 ms (``benchmarks/README.md``).  Ray still creates,
names, places, restarts and watches the actors and carries everything else:
programs, the coordinator's calls, closures and their results.

Wire format: a message is ``pickle`` protocol 5 with its buffers out of band
(numpy arrays travel as their bytes, never copied into the pickle): ``<I`` the
number of parts, ``<Q`` each part's length, the pickle, then each buffer.  A
connection opens with the ps's token (random bytes it hands out through its Ray
actor), compared before anything is unpickled, so only a process that can call
the ps actor can send it a message.

Failures: a closed or reset connection raises ``ConnectionError`` on the worker
(``Connection``); the worker then asks Ray whether the ps is alive (a dead one is
Ray's actor error, classified as the ps's loss).  A worker that dies mid-message
leaves the ps a partial message, which is dropped unread: nothing of it applies.
"""

from __future__ import annotations

import hmac
import pickle
import secrets
import socket
import struct
import threading
from typing import Any, Callable

TOKEN_BYTES = 16
_COUNT = struct.Struct("<I")


def _exact(sock: socket.socket, size: int, waiting: Callable[[], None] | None = None) -> bytearray:
    """``size`` bytes; ``waiting()`` is called each time the socket's timeout passes with none arriving."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        try:
            n = sock.recv_into(view[got:], size - got)
        except TimeoutError:
            if waiting is None:
                raise
            waiting()  # raises if the other end is gone, else the wait goes on
            continue
        if n == 0:
            raise ConnectionError("the other end closed the connection")
        got += n
    return buf


def send(sock: socket.socket, obj: Any) -> None:
    """Sends ``obj`` as one message (pickle 5, buffers out of band)."""
    buffers: list = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    lengths = [len(head)] + [r.nbytes for r in raws]
    sock.sendall(_COUNT.pack(len(lengths)) + struct.pack(f"<{len(lengths)}Q", *lengths) + head)
    for raw in raws:
        sock.sendall(raw)


def receive(sock: socket.socket, waiting: Callable[[], None] | None = None) -> Any:
    """The next message's object (arrays backed by the received bytes, writable)."""
    (count,) = _COUNT.unpack(_exact(sock, _COUNT.size, waiting))
    lengths = struct.unpack(f"<{count}Q", _exact(sock, 8 * count, waiting))
    head = _exact(sock, lengths[0], waiting)
    return pickle.loads(head, buffers=[_exact(sock, n, waiting) for n in lengths[1:]])


def _tuned(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Server:
    """Listens on ``host`` (an ephemeral port); each connection gets a thread answering ``handle(request)``.

    ``handle`` returns the reply object or raises; an exception travels back as
    the reply ``("error", exception)`` and the worker raises it.  ``address`` is
    ``(host, port, token)``.
    """

    def __init__(self, host: str, handle: Callable[[Any], Any]) -> None:
        self._handle = handle
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._listener = socket.create_server((host, 0))
        self.address = (host, self._listener.getsockname()[1], self._token)
        threading.Thread(target=self._accept, name="ps-channel-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # closed
                return
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a vanished worker's thread ends
            threading.Thread(target=self._serve, args=(_tuned(sock),), name="ps-channel", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            try:
                if not hmac.compare_digest(bytes(_exact(sock, TOKEN_BYTES)), self._token):
                    return  # not one of this ps's workers: nothing read is unpickled
                while True:
                    request = receive(sock)
                    try:
                        reply = ("ok", self._handle(request))
                    except Exception as error:  # noqa: BLE001 - travels back to the worker, raised there
                        reply = ("error", error)
                    try:
                        send(sock, reply)
                    except (pickle.PicklingError, TypeError, AttributeError):
                        send(sock, ("error", RuntimeError(f"the ps failed with an error it cannot send: {reply[1]!r}")))
            except (ConnectionError, OSError):
                return  # the worker closed, died or restarted: a partial message is dropped unread

    def close(self) -> None:
        self._listener.close()


class Connection:
    """A worker's connection to one ps: ``send`` requests, then ``receive`` their replies in order.

    While a reply is awaited, ``waiting()`` is called every ``probe_seconds``
    with nothing arriving (the worker asks Ray whether the ps is alive; it
    raises if not).  Raises ``ConnectionError`` (or ``OSError``) when the ps is
    unreachable or the connection broke; the caller decides what that means.
    """

    def __init__(self, address: tuple, waiting: Callable[[], None], probe_seconds: float = 10.0) -> None:
        host, port, token = address
        self._sock = _tuned(socket.create_connection((host, port), timeout=probe_seconds))
        self._sock.sendall(token)
        self._waiting = waiting

    def send(self, request: Any) -> None:
        send(self._sock, request)

    def receive(self) -> Any:
        status, value = receive(self._sock, self._waiting)
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
