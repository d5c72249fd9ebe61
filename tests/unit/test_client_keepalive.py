"""The client against a real 127.0.0.1 server whose keep-alive closes race its requests (issue 11):
a pooled connection the server already closed is not reused, and a request whose reused connection
was closed before any byte of an answer is sent again once, when the caller says it is safe; the
load generator's slots do so, and count it."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from fulcrum.client import (
    ClientError,
    ClosedUnanswered,
    Connection,
    Endpoint,
    Stream,
    build_request,
)
from fulcrum.loadgen.kserve import PreparedRequest, V2Target
from fulcrum.loadgen.records import Outcome
from fulcrum.loadgen.streaming import StreamTarget

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
WAIT_S = 10.0  # a bound on waits for the other side, never a measured time


class ScriptedServer:
    """A blocking HTTP/1.1 server on a thread. Connection i plays `scripts[i]`, one action at a
    time: "answer" (read a request, send OK), "drop" (read a request, close unanswered),
    "close" (close unasked, once the test calls `go`)."""

    def __init__(self, scripts: list[list[str]]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.scripts = scripts
        self.num_connections = 0
        self.num_requests = 0
        self.closed = threading.Event()  # a "close" was done
        self._go = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def go(self) -> None:
        self._go.set()

    def _serve(self) -> None:
        for script in self.scripts:
            sock, _ = self.listener.accept()
            self.num_connections += 1
            with sock:
                for action in script:
                    if action == "close":
                        self._go.wait(WAIT_S)
                        break
                    self._read_request(sock)
                    if action == "drop":
                        break
                    sock.sendall(OK)
            if script[-1] == "close":
                self.closed.set()

    def _read_request(self, sock: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            assert chunk, "the client closed mid-request"
            data += chunk
        self.num_requests += 1


@contextmanager
def serving(scripts: list[list[str]]) -> Iterator[ScriptedServer]:
    server = ScriptedServer(scripts)
    server._thread.start()
    try:
        yield server
    finally:
        server.listener.close()
        server._thread.join(WAIT_S)


def get(server: ScriptedServer) -> tuple[Connection, bytes]:
    endpoint = Endpoint("127.0.0.1", server.port)
    return Connection(endpoint), build_request(endpoint, "GET", "/x")


def wait_readable_without_the_loop(connection: Connection) -> None:
    """Block (the loop does not run) until the server's end of stream reaches our socket: what a
    load generator running late sees between the server's close and its own next read."""
    protocol = connection._protocol
    assert protocol is not None and protocol.transport is not None
    fd = protocol.transport.get_extra_info("socket").fileno()
    readable, _, _ = select.select([fd], [], [], WAIT_S)
    assert readable


async def test_a_pooled_connection_the_server_closed_is_not_reused() -> None:
    with serving([["answer", "close"], ["answer"]]) as server:
        connection, raw = get(server)
        assert (await connection.request(raw)).status == 200
        server.go()
        assert server.closed.wait(WAIT_S)
        wait_readable_without_the_loop(connection)
        # Before the fix the request went out on the closed connection and failed.
        assert (await connection.request(raw)).status == 200
    assert (server.num_connections, server.num_requests, connection.num_retried) == (2, 2, 0)


async def test_a_reused_connection_closed_before_any_answer_byte_is_retried_once() -> None:
    with serving([["answer", "drop"], ["answer"]]) as server:
        connection, raw = get(server)
        assert (await connection.request(raw)).status == 200
        response = await connection.request(raw, retry_unanswered=True)
    assert response.status == 200 and response.body == b"ok"
    assert (server.num_requests, connection.num_retried) == (3, 1)


async def test_without_consent_or_twice_in_a_row_the_close_is_an_error() -> None:
    with serving([["answer", "drop"]]) as server:
        connection, raw = get(server)
        await connection.request(raw)
        with pytest.raises(ClosedUnanswered, match="reused connection"):
            await connection.request(raw)  # not known to be safe to repeat: not repeated
    with serving([["answer", "drop"], ["drop"]]) as server:
        connection, raw = get(server)
        await connection.request(raw)
        # the retry (a fresh connection) is cut off too: reported, not retried again
        with pytest.raises(ClientError, match="closed the connection") as caught:
            await connection.request(raw, retry_unanswered=True)
    assert not isinstance(caught.value, ClosedUnanswered) and connection.num_retried == 1


async def test_a_fresh_connection_closed_unanswered_is_never_retried() -> None:
    # Nothing was in flight on it before: the server saw the request and broke on it.
    with serving([["drop"]]) as server:
        connection, raw = get(server)
        with pytest.raises(ClientError, match="closed the connection") as caught:
            await connection.request(raw, retry_unanswered=True)
    assert not isinstance(caught.value, ClosedUnanswered)
    assert (server.num_requests, connection.num_retried) == (1, 0)


async def test_load_generator_slots_retry_and_count_it() -> None:
    with serving([["answer", "drop"], ["answer"]]) as server:
        endpoint = Endpoint("127.0.0.1", server.port)
        target = V2Target(endpoint, [PreparedRequest(build_request(endpoint, "GET", "/x"), 1)])
        slot = target.open_slot()
        outcomes = [await slot.send(WAIT_S), await slot.send(WAIT_S)]
    assert [o.status for o in outcomes] == [200, 200] and target.num_retried == 1


async def read_all(stream: Stream, outcome: Outcome) -> None:
    outcome.error = b"".join([c async for c in stream.chunks()]).decode()


async def test_stream_slots_retry_and_count_it() -> None:
    with serving([["answer", "drop"], ["answer"]]) as server:
        endpoint = Endpoint("127.0.0.1", server.port)
        target = StreamTarget(endpoint, [build_request(endpoint, "GET", "/x")], read_all)
        slot = target.open_slot()
        outcomes = [await slot.send(WAIT_S), await slot.send(WAIT_S)]
    assert [(o.status, o.error) for o in outcomes] == [(200, "ok"), (200, "ok")]
    assert target.num_retried == 1
