"""A direct TCP channel to an actor for the per-step traffic: coordinator -> worker steps, worker -> ps reads and updates.

Why not a Ray actor call: one carrying a step's 200 KB of gradients out and 200 KB
of weights back costs 1.9 ms of latency and 1.0 ms of the worker's CPU on the
2-core benchmark machine; the same exchange as one framed message each way over
a socket costs 0.24 ms and 0.11 ms (``benchmarks/README.md``); a Ray task with
small arguments costs the worker about 1.2 ms of its step.  Ray still creates,
names, places, restarts and watches the actors and carries everything else:
programs and plans (once each), datasets, the coordinator's reads and writes.

Wire format: a message is ``pickle`` protocol 5 with its buffers out of band
(numpy arrays travel as their bytes, never copied into the pickle): ``<I`` the
number of parts, ``<Q`` each part's length, the pickle, then each buffer.  A
connection opens with the ps's token (random bytes it hands out through its Ray
actor), compared before anything is unpickled, so only a process that can call
the ps actor can send it a message.

Failures: a closed or reset connection raises ``OSError`` (``ConnectionError``)
on the caller's side; the caller then asks Ray whether the actor is alive.  An
exception raised by the handler comes back as ``RemoteError`` wrapping it (with
its type; the remote traceback as a note).  A caller that dies mid-message leaves
a partial message, which is dropped unread: nothing of it runs.
"""

from __future__ import annotations

import hmac
import pickle
import secrets
import socket
import struct
import threading
import traceback
from typing import Any, Callable

TOKEN_BYTES = 16
_COUNT = struct.Struct("<I")


class RemoteError(Exception):
    """The handler at the other end raised ``error`` (kept with its own type in ``.error``)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


def _sendable(error: BaseException, where: str) -> bytes:
    """``error`` pickled by value where needed (a class defined in a function), with the remote traceback as a
    note; a RuntimeError naming it if it cannot be pickled at all."""
    from ray import cloudpickle

    text = "".join(traceback.format_exception(error))
    try:
        error.add_note(f"(raised in {where}:)\n{text}")
        data = cloudpickle.dumps(error, protocol=5)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001 - an exception type that does not survive pickling
        return cloudpickle.dumps(
            RuntimeError(f"{where} raised {type(error).__name__} (which cannot be sent back): {error}\n{text}"))


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


def _send_all(sock: socket.socket, data: Any, waiting: Callable[[], None] | None) -> None:
    """``sock.sendall(data)``, except that each time the socket's timeout passes with nothing sent, ``waiting()``
    is asked (it raises if the other end is gone) and the rest is sent on."""
    view, sent = memoryview(data).cast("B"), 0
    while sent < len(view):
        try:
            sent += sock.send(view[sent:])
        except TimeoutError:
            if waiting is None:
                raise
            waiting()


def send(sock: socket.socket, obj: Any, waiting: Callable[[], None] | None = None) -> None:
    """Sends ``obj`` as one message (pickle 5, buffers out of band)."""
    buffers: list = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    lengths = [len(head)] + [r.nbytes for r in raws]
    _send_all(sock, _COUNT.pack(len(lengths)) + struct.pack(f"<{len(lengths)}Q", *lengths) + head, waiting)
    for raw in raws:
        _send_all(sock, raw, waiting)


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
    the reply ``("error", the exception pickled by value)`` and the caller's
    ``Connection.receive`` raises it as ``RemoteError``.  ``address`` is
    ``(host, port, token)``.
    """

    def __init__(self, host: str, handle: Callable[[Any], Any], name: str = "an actor") -> None:
        self._handle, self._name = handle, name
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._listener = socket.create_server((host, 0))
        self.address = (host, self._listener.getsockname()[1], self._token)
        threading.Thread(target=self._accept, name=f"channel-accept ({name})", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # closed
                return
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a vanished worker's thread ends
            threading.Thread(target=self._serve, args=(_tuned(sock),), name=f"channel ({self._name})", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            try:
                if not hmac.compare_digest(bytes(_exact(sock, TOKEN_BYTES)), self._token):
                    return  # not a caller the actor handed its token to: nothing read is unpickled
                while True:
                    request = receive(sock)
                    try:
                        reply = ("ok", self._handle(request))
                    except BaseException as error:  # noqa: BLE001 - travels back to the caller, raised there
                        reply = ("error", _sendable(error, self._name))
                    try:
                        send(sock, reply)  # pickles first: a failure here has sent nothing yet
                    except (pickle.PicklingError, TypeError, AttributeError) as error:
                        send(sock, ("error", _sendable(error, self._name)))
            except (ConnectionError, OSError):
                return  # the worker closed, died or restarted: a partial message is dropped unread

    def close(self) -> None:
        self._listener.close()


class Connection:
    """A connection to one actor's ``Server``: ``send`` requests, then ``receive`` their replies in order.

    While a reply is awaited, ``waiting()`` is called every ``probe_seconds``
    with nothing arriving (the caller asks Ray whether the actor is alive; it
    raises if not).  Raises ``OSError`` (``ConnectionError``) when the actor is
    unreachable or the connection broke; the caller decides what that means.
    """

    def __init__(self, address: tuple, waiting: Callable[[], None], probe_seconds: float = 10.0) -> None:
        host, port, token = address
        self._sock = _tuned(socket.create_connection((host, port), timeout=probe_seconds))
        self._sock.sendall(token)
        self._waiting = waiting

    def send(self, request: Any) -> None:
        send(self._sock, request, self._waiting)

    def receive(self) -> Any:
        """The next reply; ``RemoteError`` if the handler raised; ``OSError`` if the connection broke."""
        status, value = receive(self._sock, self._waiting)
        if status == "error":
            try:
                error = pickle.loads(value)
            except Exception as failure:  # noqa: BLE001 - e.g. its class's module is not importable here
                error = RuntimeError(f"the actor raised an error this process cannot unpickle: {failure!r}")
            raise RemoteError(error)
        return value

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
