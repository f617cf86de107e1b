"""The elastic agent's in-memory store: an HTTP server in the launcher process, or in a Ray actor under Ray Train.

The launcher (``--num-workers MIN:MAX``) serves it on 127.0.0.1 in its own
process; under Ray Train, ``distribute.experimental.RayTrainElasticState``
serves it from a Ray actor of the training run, on that actor's node address.
Workers of an elastic job hand their committed state (``runtime/elastic.py``'s
wire format: raw bytes, never unpickled) to it when they stop for a lost peer or
a regroup; the next generation reads it back.  The store keeps the state of the
newest step it was given (the header's ``meta.step``, ties: the first); it
never parses the arrays.  ``PUT /ready?worker=PID`` marks a worker that stops
at a step boundary on SIGUSR1 (so the agent may ask its generation to grow).

Standard library only.
"""

from __future__ import annotations

import http.server
import json
import socket
import struct
import threading
import urllib.parse


def _step_of(body: bytes) -> tuple[int, int]:
    """``(epoch-major step key, generation)`` of a state message: the order in which states are newer."""
    (size,) = struct.unpack_from("<Q", body, 0)
    meta = json.loads(body[8:8 + size].decode("utf-8"))["meta"]
    return int(meta.get("step", -1)), int(meta.get("generation", -1))


class StateStore:
    """The newest handed-over state, and which worker processes are ready for a regroup signal."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.lock = threading.Lock()
        self.body: bytes | None = None
        self.key: tuple[int, int] | None = None
        self.ready: set[int] = set()
        self.num_handed_off = 0
        server = type("_Server", (http.server.ThreadingHTTPServer,),
                      {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
        self._server = server((host.strip("[]"), 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="distribute-elastic-agent", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def step(self) -> int | None:
        """The step of the state held (None: no state)."""
        with self.lock:
            return None if self.key is None else self.key[0]

    def put(self, body: bytes) -> None:
        key = _step_of(body)
        with self.lock:
            self.num_handed_off += 1
            if self.key is None or key[0] > self.key[0]:
                self.body, self.key = body, key

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(store: StateStore) -> type:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _reply(self, status: int, body: bytes = b"") -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if body:
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path != "/state":
                self._reply(404, b"unknown path")
                return
            with store.lock:
                body = store.body
            self._reply(204) if body is None else self._reply(200, body)

        def do_PUT(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length) if length else b""
            url = urllib.parse.urlparse(self.path)
            if url.path == "/state":
                if len(body) != length:  # the sender ended mid-message (killed while handing off): keep the last whole one
                    self._reply(400, f"truncated state message: {len(body)} of {length} bytes".encode())
                    return
                try:
                    store.put(body)
                except (ValueError, struct.error, KeyError) as err:
                    self._reply(400, f"bad state message: {err}".encode())
                    return
                self._reply(200)
            elif url.path == "/ready":
                pid = int(urllib.parse.parse_qs(url.query).get("worker", ["0"])[0])
                with store.lock:
                    store.ready.add(pid)
                self._reply(200)
            else:
                self._reply(404, b"unknown path")

    return Handler
