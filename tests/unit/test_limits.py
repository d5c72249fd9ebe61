"""The edge protocol: head size and count limits (431), head and body timeouts (408), and the 503
for a request cut off by shutdown; driven through a fake transport and a fake clock."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from fulcrum.server.limits import LINGER_S, EdgeLimits, LimitedHttpProtocol, protocol_with

LIMITS = EdgeLimits(max_header_bytes=1024, max_headers=10, header_timeout_s=5, body_timeout_s=7)


class FakeTimer:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when, self.callback = when, callback
        self.is_cancelled = False

    def cancel(self) -> None:
        self.is_cancelled = True


class FakeClock:
    """The protocol's loop: timers fire only when the test advances time; tasks run for real."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.now = 0.0
        self.timers: list[FakeTimer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> FakeTimer:
        self.timers.append(FakeTimer(when, callback))
        return self.timers[-1]

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> FakeTimer:
        return self.call_at(self.now + delay_s, callback)

    def create_task(self, coro: Any, **kwargs: Any) -> asyncio.Task[None]:
        return self._loop.create_task(coro, **kwargs)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        while due := [t for t in self.timers if t.when <= self.now and not t.is_cancelled]:
            timer = min(due, key=lambda t: t.when)
            self.timers.remove(timer)
            timer.callback()


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = self.eof_written = False
        self.reading = True
        self.num_bytes_buffered = 0  # written, not yet flushed to the socket

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def get_write_buffer_size(self) -> int:
        return self.num_bytes_buffered

    def write_eof(self) -> None:
        self.eof_written = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name)


class App:
    """Reads the whole body and answers its length; `/hang` then waits forever."""

    def __init__(self) -> None:
        self.num_calls = 0
        self.events: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.num_calls += 1
        num_bytes, more = 0, True
        while more:
            message = await receive()
            self.events.append(message["type"])
            if message["type"] == "http.disconnect":
                return
            num_bytes, more = num_bytes + len(message["body"]), message["more_body"]
        if scope["path"] == "/hang":
            await asyncio.Event().wait()
        body = json.dumps({"num_bytes": num_bytes}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class Conn:
    """One connection: the protocol over a fake transport, with its app, clock and tasks."""

    def __init__(
        self,
        limits: EdgeLimits = LIMITS,
        transport: FakeTransport | None = None,
        *,
        gate: Callable[[Any], Any] | None = None,
        state: ServerState | None = None,  # another connection's: the same server
    ) -> None:
        self.app = App()
        self.clock = FakeClock(asyncio.get_running_loop())
        self.transport = transport or FakeTransport()
        self.state = state or ServerState()
        config = uvicorn.Config(self.app, log_config=None, lifespan="off")
        self.protocol = protocol_with(limits, gate)(
            config=config,
            server_state=self.state,
            app_state={},
            _loop=self.clock,  # type: ignore[arg-type]
        )
        self.protocol.connection_made(self.transport)

    def send(self, data: bytes, chunk_bytes: int = 1 << 16) -> None:
        for start in range(0, len(data), chunk_bytes):
            self.protocol.data_received(data[start : start + chunk_bytes])

    async def settle(self) -> None:
        """Let the app run until it answers or waits on something that will not come."""
        for _ in range(20):
            await asyncio.sleep(0)

    def answers(self) -> list[tuple[int, dict[str, str], Any]]:
        """(status, headers, JSON body) of every response written so far."""
        out, rest = [], bytes(self.transport.written)
        while rest:
            head, _, rest = rest.partition(b"\r\n\r\n")
            status_line, *lines = head.decode().split("\r\n")
            headers = dict(line.lower().split(": ", 1) for line in lines)
            size = int(headers["content-length"])
            body, rest = rest[:size], rest[size:]
            out.append((int(status_line.split()[1]), headers, json.loads(body)))
        return out


def head(target: str = "/x", *, extra: bytes = b"", body_bytes: int | None = None) -> bytes:
    length = b"" if body_bytes is None else b"Content-Length: %d\r\n" % body_bytes
    return b"POST %s HTTP/1.1\r\nHost: a\r\n%s%s\r\n" % (target.encode(), length, extra)


def padded_head(num_bytes: int) -> bytes:
    """A GET head of exactly `num_bytes` bytes."""
    bare = b"GET /x HTTP/1.1\r\nHost: a\r\nX-Pad: \r\n\r\n"
    return bare.replace(b"X-Pad: ", b"X-Pad: " + b"p" * (num_bytes - len(bare)))


async def test_head_at_the_limit_is_served_one_byte_more_is_431() -> None:
    ok, over = Conn(), Conn()
    ok.send(padded_head(LIMITS.max_header_bytes), chunk_bytes=100)
    over.send(padded_head(LIMITS.max_header_bytes + 1), chunk_bytes=100)
    await ok.settle()
    await over.settle()
    assert [a[0] for a in ok.answers()] == [200]
    [(status, headers, body)] = over.answers()
    assert (status, headers["connection"], over.app.num_calls) == (431, "close", 0)
    assert body == {"error": "request head over 1 KiB"}
    assert over.transport.eof_written and not over.transport.closed  # lingers, then closes
    over.clock.advance(LINGER_S)
    assert over.transport.closed


class CountingParser:
    """Wraps the real parser to count what it is fed."""

    def __init__(self, parser: Any) -> None:
        self.parser, self.num_bytes_fed = parser, 0

    def feed_data(self, data: bytes) -> None:
        self.num_bytes_fed += len(data)
        self.parser.feed_data(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


async def test_huge_header_line_is_never_parsed_past_the_limit() -> None:
    conn = Conn()
    counting = CountingParser(conn.protocol.parser)
    conn.protocol.parser = counting
    conn.send(b"GET / HTTP/1.1\r\nX-Big: " + b"b" * (8 << 20))
    assert counting.num_bytes_fed == LIMITS.max_header_bytes
    assert [a[0] for a in conn.answers()] == [431]


@pytest.mark.parametrize(("num_headers", "status"), [(10, 200), (11, 431), (10_000, 431)])
async def test_header_count_limit(num_headers: int, status: int) -> None:
    conn = Conn(EdgeLimits(max_header_bytes=1 << 20, max_headers=10))
    fields = b"".join(b"h%d: v\r\n" % i for i in range(num_headers - 1))  # + Host
    conn.send(b"GET /x HTTP/1.1\r\nHost: a\r\n" + fields + b"\r\n")
    await conn.settle()
    [(got, _, body)] = conn.answers()
    assert got == status
    if status == 431:
        assert body == {"error": "more than 10 header fields"}
        assert conn.app.num_calls == 0


async def test_stalled_head_gets_408_after_the_header_timeout() -> None:
    conn = Conn()
    conn.send(b"GET /x HTTP/1.1\r\nHost: a\r\n")
    conn.clock.advance(LIMITS.header_timeout_s - 0.1)
    assert conn.answers() == []
    conn.clock.advance(0.1)
    [(status, headers, body)] = conn.answers()
    assert (status, headers["connection"], conn.app.num_calls) == (408, "close", 0)
    assert body == {"error": "request head not received within 5 s"}
    conn.clock.advance(LINGER_S)
    assert conn.transport.closed


async def test_silent_connection_is_closed_quietly_after_the_header_timeout() -> None:
    conn = Conn()
    conn.clock.advance(LIMITS.header_timeout_s - 0.1)
    assert not conn.transport.closed
    conn.clock.advance(0.1)
    assert conn.transport.closed and conn.answers() == []


async def test_header_timeout_runs_from_the_first_byte_of_each_request() -> None:
    conn = Conn()
    conn.clock.advance(LIMITS.header_timeout_s - 1)
    conn.send(b"GET /x HTTP/1.1\r\n")
    conn.clock.advance(2)  # past the connection's deadline, not the head's
    conn.send(b"Host: a\r\n\r\n")
    await conn.settle()
    conn.clock.advance(2)  # past the first deadline: the first head was complete
    conn.send(b"GET /x HTTP/1.1\r\n")  # the second request's head starts now
    conn.clock.advance(LIMITS.header_timeout_s - 1)
    assert [a[0] for a in conn.answers()] == [200]
    conn.clock.advance(1)
    assert [a[0] for a in conn.answers()] == [200, 408]


async def test_stalled_body_gets_408_and_the_app_sees_a_disconnect() -> None:
    conn = Conn()
    conn.send(head(body_bytes=10) + b"1234")
    await conn.settle()
    conn.clock.advance(LIMITS.body_timeout_s)
    await conn.settle()
    [(status, _, body)] = conn.answers()  # the app's own answer never goes out
    assert (status, body) == (408, {"error": "request body not received within 7 s"})
    assert conn.app.events == ["http.request", "http.disconnect"]
    assert not conn.state.tasks


async def test_body_deadline_covers_the_whole_body_not_each_chunk() -> None:
    conn = Conn()
    conn.send(head(body_bytes=100))
    for _ in range(7):  # a dribbler: one byte a second
        conn.send(b"x")
        conn.clock.advance(1)
    await conn.settle()
    assert [a[0] for a in conn.answers()] == [408]


async def test_body_timer_waits_while_the_server_is_not_reading() -> None:
    conn = Conn()
    conn.send(head(body_bytes=10) + b"1234")
    conn.protocol.flow.pause_reading()  # e.g. a pipelined request waiting its turn
    conn.clock.advance(LIMITS.body_timeout_s)
    assert conn.answers() == []
    conn.protocol.flow.resume_reading()
    conn.clock.advance(LIMITS.body_timeout_s)
    await conn.settle()
    assert [a[0] for a in conn.answers()] == [408]


async def test_body_timer_waits_while_the_client_awaits_100_continue() -> None:
    conn = Conn()
    conn.send(head(body_bytes=4, extra=b"Expect: 100-continue\r\n"))
    conn.clock.advance(LIMITS.body_timeout_s)  # the app has not asked for the body yet
    assert conn.transport.written == b""
    await conn.settle()  # now it has: "100 Continue" goes out, and the client's time starts
    assert conn.transport.written == b"HTTP/1.1 100 Continue\r\n\r\n"
    conn.transport.written.clear()
    conn.clock.advance(LIMITS.body_timeout_s)
    await conn.settle()
    assert [a[0] for a in conn.answers()] == [408]


async def test_body_in_time_is_served_and_no_timer_fires_later() -> None:
    conn = Conn()
    conn.send(head(body_bytes=10) + b"12345")
    conn.clock.advance(LIMITS.body_timeout_s - 1)
    conn.send(b"67890")
    await conn.settle()
    conn.clock.advance(LIMITS.body_timeout_s)
    assert [(s, b) for s, _, b in conn.answers()] == [(200, {"num_bytes": 10})]


async def test_request_cut_off_by_shutdown_gets_503_with_retry_after() -> None:
    conn = Conn()
    conn.send(head("/hang", body_bytes=0))
    await conn.settle()
    conn.protocol.shutdown()  # what uvicorn does first; it cancels the tasks once time is up
    for task in conn.state.tasks:
        task.cancel()
    await asyncio.wait_for(asyncio.gather(*conn.state.tasks), 5)
    [(status, headers, body)] = conn.answers()
    assert (status, headers["retry-after"], headers["connection"]) == (503, "1", "close")
    assert "shutting down" in body["error"]


async def test_the_gate_is_asked_only_while_another_request_is_in_progress() -> None:
    asked: list[str] = []

    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    def gate(scope: Any) -> Any:
        asked.append(scope["path"])
        return refuse

    first = Conn(gate=gate)
    first.send(head("/alone", body_bytes=0))
    await first.settle()
    first.send(head("/hang", body_bytes=0))  # the first request has ended: still none in progress
    await first.settle()
    assert asked == [] and [a[0] for a in first.answers()] == [200]
    second = Conn(gate=gate, state=first.state)  # another connection to the same server
    second.send(head("/busy", body_bytes=0))
    await second.settle()
    assert asked == ["/busy"] and [a[0] for a in second.answers()] == [503]
    for task in first.state.tasks:
        task.cancel()
    await asyncio.gather(*first.state.tasks, return_exceptions=True)


async def test_a_head_over_the_limit_waits_for_an_earlier_answer() -> None:
    conn = Conn()
    conn.send(head("/hang", body_bytes=0))
    await conn.settle()
    conn.send(padded_head(LIMITS.max_header_bytes + 1))  # pipelined behind /hang
    assert conn.answers() == []  # answers go in order: nothing may cut in
    assert conn.protocol.cycle.keep_alive is False  # closes once /hang is answered
    for task in conn.state.tasks:
        task.cancel()


class SocketTransport(FakeTransport):
    """A fake transport over one end of a real socket pair: what the peer sends waits there,
    unread, until the test feeds it to the protocol (the loop's read, after its timers)."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.sock if name == "socket" else super().get_extra_info(name, default)


KEEP_ALIVE_S = uvicorn.Config(App()).timeout_keep_alive


@contextlib.asynccontextmanager
async def answered_once() -> AsyncIterator[tuple[Conn, socket.socket]]:
    """A connection over a real socket pair that has answered one request; and the peer."""
    ours, peer = socket.socketpair()
    with ours, peer:
        peer.setblocking(False)
        conn = Conn(transport=SocketTransport(ours))
        conn.send(head(body_bytes=0))
        await conn.settle()
        yield conn, peer


async def test_keep_alive_timeout_spares_a_request_already_waiting_unread() -> None:
    async with answered_once() as (conn, peer):
        peer.sendall(head(body_bytes=0))  # the next request: arrived, not yet read
        conn.clock.advance(KEEP_ALIVE_S)  # a late loop runs the idle timer before the read
        assert not conn.transport.closed  # it used to close (and reset) the connection here
        conn.send(conn.transport.sock.recv(1 << 16))  # the read of the same loop iteration
        await conn.settle()
        assert [a[0] for a in conn.answers()] == [200, 200]
        conn.clock.advance(KEEP_ALIVE_S)  # idle again, nothing waiting: closed as before
        assert conn.transport.closed
        assert peer.recv(1) == b""  # and the client was told at once (see the next test)


async def test_idle_close_sends_its_end_of_stream_at_once() -> None:
    # A real transport's close() sends the FIN only after the loop's other ready callbacks:
    # a window in which the client still sees an open connection and sends into a reset.
    async with answered_once() as (conn, peer):
        conn.clock.advance(KEEP_ALIVE_S - 0.1)
        assert not conn.transport.closed
        conn.clock.advance(0.1)
        assert conn.transport.closed and len(conn.answers()) == 1
        assert peer.recv(1) == b""  # the fake's close() did not touch the socket: the FIN did


async def test_idle_close_leaves_a_still_buffered_answer_to_close() -> None:
    async with answered_once() as (conn, peer):
        conn.transport.num_bytes_buffered = 10  # a slow reader: the answer is not all out yet
        conn.clock.advance(KEEP_ALIVE_S)
        assert conn.transport.closed  # close() flushes, then closes
        with pytest.raises(BlockingIOError):
            peer.recv(1)  # no early FIN: it would have cut the answer short


async def test_silent_connection_timer_spares_a_first_byte_waiting_unread() -> None:
    ours, peer = socket.socketpair()
    with ours, peer:
        peer.setblocking(False)
        conn = Conn(transport=SocketTransport(ours))
        peer.sendall(b"GET /x HTTP/1.1\r\n")
        conn.clock.advance(LIMITS.header_timeout_s)
        assert not conn.transport.closed
        conn.send(ours.recv(1 << 16) + b"Host: a\r\n\r\n")
        await conn.settle()
        assert [a[0] for a in conn.answers()] == [200]


def test_limits_are_validated_and_bound_per_class() -> None:
    with pytest.raises(ValueError, match="header limits"):
        EdgeLimits(max_headers=0)
    with pytest.raises(ValueError, match="timeouts"):
        EdgeLimits(body_timeout_s=0)
    bound = protocol_with(LIMITS)
    assert bound.limits is LIMITS and LimitedHttpProtocol.limits == EdgeLimits()
