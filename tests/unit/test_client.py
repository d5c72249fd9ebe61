"""The lean HTTP client, driven through a fake transport: parsing, keep-alive, streams, errors."""

from __future__ import annotations

import asyncio

import pytest

from fulcrum.client import (
    ClientError,
    ClientTimeout,
    Connection,
    Endpoint,
    _Protocol,
    build_request,
    parse_server_timing,
)

ENDPOINT = Endpoint.from_url("http://127.0.0.1:8123/prefix/")


class FakeTransport:
    """Answers each write with the next scripted reply, delivered in pieces on the loop."""

    def __init__(self, protocol: _Protocol, replies: list[list[bytes]]) -> None:
        self.protocol = protocol
        self.replies = replies
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)
        loop = asyncio.get_running_loop()
        if self.replies:
            for piece in self.replies.pop(0):
                loop.call_soon(self.protocol.data_received, piece)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.protocol.connection_lost(None)

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default  # no socket: nothing is ever found waiting unread


def connect(replies: list[list[bytes]]) -> tuple[Connection, FakeTransport]:
    connection = Connection(ENDPOINT)
    protocol = _Protocol()
    transport = FakeTransport(protocol, replies)
    protocol.connection_made(transport)  # type: ignore[arg-type]
    connection._protocol = protocol
    return connection, transport


OK = (
    b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n"
    b"Server-Timing: queue;dur=1.5, compute;dur=3.25, batch;desc=8\r\n\r\nhello world"
)


def test_endpoint_and_request_bytes() -> None:
    assert (ENDPOINT.host, ENDPOINT.port, ENDPOINT.base_path) == ("127.0.0.1", 8123, "/prefix")
    raw = build_request(ENDPOINT, "POST", "/v2/x", headers={"A": "b"}, body=b"{}")
    assert raw == (
        b"POST /prefix/v2/x HTTP/1.1\r\nHost: 127.0.0.1:8123\r\nA: b\r\nContent-Length: 2\r\n\r\n{}"
    )
    assert b"Content-Length" not in build_request(ENDPOINT, "GET", "/")
    with pytest.raises(ClientError):
        Endpoint.from_url("https://example.com")


def test_server_timing_parse() -> None:
    assert parse_server_timing('queue;dur=1.2, compute;desc="x";dur=3.4, batch;desc=4') == {
        "queue": 1.2,
        "compute": 3.4,
        "batch": 4.0,
    }
    assert parse_server_timing("cache, junk;dur=abc, ;dur=1") == {}


async def test_response_in_pieces_and_keep_alive_reuse() -> None:
    split = [OK[:20], OK[20:70], OK[70:]]
    connection, transport = connect([split, [OK]])
    first = await connection.request(b"GET / HTTP/1.1\r\n\r\n", timeout_s=1.0)
    second = await connection.request(b"GET / HTTP/1.1\r\n\r\n")
    assert first.status == 200 and first.body == b"hello world" == second.body
    assert first.server_timing_ms() == {"queue": 1.5, "compute": 3.25, "batch": 8.0}
    assert len(transport.written) == 2 and not transport.closed  # one connection, reused


async def test_chunked_stream_arrives_chunk_by_chunk() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = [b"6\r\ndata: \r\n", b"5\r\nhello\r\n", b"0\r\n\r\n"]
    connection, _ = connect([[head, *chunks]])
    stream = await connection.stream(b"POST / HTTP/1.1\r\n\r\n")
    assert stream.status == 200
    assert [c async for c in stream.chunks()] == [b"data: ", b"hello"]


async def test_timeout_is_a_client_timeout_and_the_connection_is_dropped() -> None:
    connection, transport = connect([[]])  # the server never answers
    with pytest.raises(ClientTimeout):
        await connection.request(b"GET / HTTP/1.1\r\n\r\n", timeout_s=0.001)
    assert transport.closed


async def test_malformed_and_cut_responses_are_client_errors() -> None:
    connection, _ = connect([[b"NOT HTTP AT ALL\r\n\r\n"]])
    with pytest.raises(ClientError, match="malformed"):
        await connection.request(b"GET / HTTP/1.1\r\n\r\n")
    connection, transport = connect([[OK[:30]]])
    task = asyncio.ensure_future(connection.request(b"GET / HTTP/1.1\r\n\r\n"))
    for _ in range(3):
        await asyncio.sleep(0)
    transport.close()  # the server goes away mid-response
    with pytest.raises(ClientError, match="closed the connection"):
        await task


async def test_stream_cut_off_mid_body_raises_from_chunks() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    connection, transport = connect([[head, b"5\r\nhello\r\n"]])
    stream = await connection.stream(b"POST / HTTP/1.1\r\n\r\n")
    received: list[bytes] = []
    with pytest.raises(ClientError, match="closed the connection"):
        async for chunk in stream.chunks():
            received.append(chunk)
            transport.close()  # the server dies after the first chunk
    assert received == [b"hello"]
