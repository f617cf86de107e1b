"""The worker-to-ps channel (parameter_server/channel.py): messages, authentication, broken connections."""

from __future__ import annotations

import pickle
import socket
import struct
import threading
import time

import numpy as np
import pytest
from helpers import kill_actor_and_wait

from distribute.parameter_server import channel


class _Recorder:
    """A handler that records the requests it answered; ``fail`` makes it raise."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.requests: list = []
        self.fail = fail

    def __call__(self, request):
        self.requests.append(request)
        if self.fail is not None:
            raise self.fail
        return request


def _server(handler):
    return channel.Server("127.0.0.1", handler)


def test_a_message_keeps_arrays_and_structures_exactly():
    handler = _Recorder()
    server = _server(handler)
    connection = channel.Connection(server.address, waiting=lambda: None)
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    message = ("update", 7, [(3, ((1, 2),), [base, base.T, base[:, ::2], np.float64(2.5), np.zeros((0, 3), np.int8)])],
               {"k": np.array([True, False])}, None)
    connection.send(message)
    reply = connection.receive()
    kind, closure_id, applies, extra, none = reply
    assert (kind, closure_id, none) == ("update", 7, None)
    arrays = applies[0][2]
    for got, want in zip(arrays, message[2][0][2]):
        assert got.dtype == np.asarray(want).dtype and got.shape == np.shape(want)
        np.testing.assert_array_equal(got, want)
    assert arrays[1].flags.f_contiguous or arrays[1].flags.c_contiguous
    arrays[0][0, 0] = -1.0  # received arrays are writable (the ps stores them)
    np.testing.assert_array_equal(extra["k"], [True, False])
    connection.close()
    server.close()


def test_a_connection_without_the_token_is_closed_before_anything_is_unpickled():
    handler = _Recorder()
    server = _server(handler)
    host, port, token = server.address
    raw = socket.create_connection((host, port), timeout=10)
    wrong = bytes(b ^ 0xFF for b in token)
    head = pickle.dumps(("read", (1,)), protocol=5)
    raw.sendall(wrong + struct.pack("<I", 1) + struct.pack("<Q", len(head)) + head)
    raw.settimeout(10)
    try:
        assert raw.recv(1) == b""  # closed by the ps, no reply
    except ConnectionResetError:  # closed with our message unread: also no reply
        pass
    raw.close()
    assert handler.requests == []
    good = channel.Connection(server.address, waiting=lambda: None)  # the right token still works
    good.send(("read", (1,)))
    assert good.receive() == ("read", (1,))
    assert handler.requests == [("read", (1,))]
    server.close()


def test_a_partial_message_is_dropped_unread():
    handler = _Recorder()
    server = _server(handler)
    host, port, token = server.address
    raw = socket.create_connection((host, port), timeout=10)
    head = pickle.dumps(("update", 1), protocol=5)
    raw.sendall(token + struct.pack("<I", 1) + struct.pack("<Q", len(head)) + head[: len(head) // 2])
    raw.close()  # the worker died mid-message
    connection = channel.Connection(server.address, waiting=lambda: None)
    connection.send(("update", 2))
    assert connection.receive() == ("update", 2)
    assert handler.requests == [("update", 2)]
    server.close()


class _Unpicklable(Exception):
    def __init__(self, a, b):  # pickle rebuilds exceptions from .args: this one fails to unpickle
        super().__init__(f"{a}-{b}")


def test_the_handlers_error_comes_back_with_its_type_and_the_remote_traceback():
    server = channel.Server("127.0.0.1", _Recorder(fail=KeyError("no variable 12 on this ps")), "ps 3")
    connection = channel.Connection(server.address, waiting=lambda: None)
    connection.send(("read", (12,)))
    with pytest.raises(channel.RemoteError) as info:
        connection.receive()
    assert type(info.value.error) is KeyError and info.value.error.args == ("no variable 12 on this ps",)
    assert "(raised in ps 3:)" in info.value.error.__notes__[0] and "__call__" in info.value.error.__notes__[0]
    connection.send(("read", (13,)))  # the connection stays usable
    with pytest.raises(channel.RemoteError):
        connection.receive()
    server.close()


def test_an_error_that_cannot_be_pickled_comes_back_as_a_runtime_error_naming_it():
    server = _server(_Recorder(fail=_Unpicklable(1, 2)))
    connection = channel.Connection(server.address, waiting=lambda: None)
    connection.send(("read", (1,)))
    with pytest.raises(channel.RemoteError) as info:
        connection.receive()
    assert type(info.value.error) is RuntimeError
    assert "raised _Unpicklable (which cannot be sent back): 1-2" in str(info.value.error)


def test_waiting_is_asked_while_a_reply_is_slow_and_its_error_ends_the_wait():
    release = threading.Event()

    def slow(request):
        release.wait(30)
        return request

    server = _server(slow)
    asked = []

    def waiting():
        asked.append(time.monotonic())
        if len(asked) == 3:
            raise RuntimeError("ps 0 is dead (Ray says)")

    connection = channel.Connection(server.address, waiting=waiting, probe_seconds=0.05)
    connection.send(("read", (1,)))
    with pytest.raises(RuntimeError, match="ps 0 is dead"):
        connection.receive()
    assert len(asked) == 3
    release.set()
    server.close()


def test_a_worker_reopens_a_broken_channel_and_a_repeated_update_applies_once(ray_instance):
    from distribute.parameter_server.actors import ParameterServer, Worker

    ps = ray_instance.remote(num_cpus=0)(ParameterServer).remote(0)
    try:
        ray_instance.get(ps.create.remote({5: np.zeros(3, np.float32)}))
        worker = Worker(0, [ps])  # in this process: its channel to the ps actor is a real socket
        update = ("update", 99, [], [(5, np.ones(3, np.float32))], [], (5,))
        version, (value,) = worker._exchange({0: update})[0]
        np.testing.assert_array_equal(value, [1.0, 1.0, 1.0])
        worker._channels[0]._sock.shutdown(socket.SHUT_RDWR)  # the connection breaks under the worker
        again, (value,) = worker._exchange({0: update})[0]  # the re-sent update: skipped by the ps
        np.testing.assert_array_equal(value, [1.0, 1.0, 1.0])
        assert again == version
        assert ray_instance.get(ps.num_updates.remote()) == 1
        (read,) = worker._exchange({0: ("read", (5,))})[0]
        np.testing.assert_array_equal(read, [1.0, 1.0, 1.0])
    finally:
        ray_instance.kill(ps, no_restart=True)


def test_a_dead_ps_is_named_by_the_worker_that_finds_it(ray_instance):
    from distribute.parameter_server.errors import PSUnavailableError

    from distribute.parameter_server.actors import ParameterServer, Worker

    ps = ray_instance.remote(num_cpus=0, max_restarts=0)(ParameterServer).remote(0)
    ray_instance.get(ps.create.remote({5: np.zeros(3, np.float32)}))
    worker = Worker(0, [ps])
    worker._exchange({0: ("read", (5,))})
    kill_actor_and_wait(ray_instance, ps)
    with pytest.raises(PSUnavailableError, match=r"parameter server 0 \(ps-0, /job:ps/replica:0/task:0\)") as info:
        worker._exchange({0: ("read", (5,))})
    assert info.value.task_id == 0



def test_a_large_request_to_a_busy_actor_waits_instead_of_failing():
    # The actor reads the next request only after it answered the last: a 64 MB request behind a slow one
    # fills the socket buffers; the sender asks `waiting` and goes on instead of timing out.
    release = threading.Event()

    def handle(request):
        if request[0] == "slow":
            release.wait(30)
        return request[0], int(np.asarray(request[1]).sum())

    server = _server(handle)
    asked = []

    def waiting():
        asked.append(1)
        release.set()

    connection = channel.Connection(server.address, waiting=waiting, probe_seconds=0.2)
    connection.send(("slow", np.ones(1)))
    big = np.ones(16 * 1024 * 1024, np.float32)
    connection.send(("big", big))
    assert connection.receive() == ("slow", 1)
    assert connection.receive() == ("big", big.size)
    assert asked
    server.close()
