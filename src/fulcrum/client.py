"""A lean HTTP/1.1 client on raw asyncio: keep-alive connections, prebuilt requests, httptools.

The load generator shares the CPU with the server it measures, so a request is a prebuilt bytes
object written to a socket and a response is parsed by llhttp (httptools) in C; no per-request
objects beyond the response itself. Chunked bodies (SSE streams) are handed over chunk by chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

import httptools
import msgspec

from fulcrum.errors import FulcrumError
from fulcrum.pending_input import input_pending


class ClientError(FulcrumError):
    """Client side: the server could not be reached, closed the connection or sent bad HTTP."""

    status_code = 502


class ClientTimeout(ClientError):
    """Client side: no complete response within the request's timeout."""

    status_code = 504


class ClosedUnanswered(ClientError):
    """Client side: the server closed a reused keep-alive connection before any byte of the
    response: the idle-close race of RFC 9112 9.3.1, after which a request may be retried."""


@dataclass(slots=True)
class HttpResponse:
    """One complete response; header names are lower-case."""

    status: int
    headers: dict[str, str]
    body: bytes = b""

    def json(self) -> object:
        """The body decoded as JSON."""
        try:
            return msgspec.json.decode(self.body)
        except msgspec.DecodeError as exc:
            raise ClientError(f"response body is not JSON: {self.body[:200]!r}") from exc

    def server_timing_ms(self) -> dict[str, float]:
        """The `Server-Timing` durations by metric name, in ms (empty when absent)."""
        value = self.headers.get("server-timing")
        return parse_server_timing(value) if value else {}


@dataclass(slots=True)
class Endpoint:
    """Where a server listens: host, port and the Host header value."""

    host: str
    port: int
    base_path: str = ""
    host_header: str = field(init=False)

    def __post_init__(self) -> None:
        self.host_header = f"{self.host}:{self.port}"

    @classmethod
    def from_url(cls, url: str) -> Endpoint:
        """Parse `http://HOST:PORT[/prefix]`; only plain HTTP is supported."""
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ClientError(f"unsupported URL {url!r}: expected http://HOST:PORT")
        return cls(parts.hostname, parts.port or 80, parts.path.rstrip("/"))


def parse_server_timing(value: str) -> dict[str, float]:
    """`queue;dur=1.2, batch;desc=4` -> {"queue": 1.2, "batch": 4.0}; bad parts skipped.

    A metric's `dur` (ms) is taken; without one, a numeric `desc` (Fulcrum's batch size).
    """
    timings: dict[str, float] = {}
    for metric in value.split(","):
        name, _, params = metric.strip().partition(";")
        found = dict(p.strip().partition("=")[::2] for p in params.split(";"))
        raw = found.get("dur", found.get("desc"))
        if not name or raw is None:
            continue
        try:
            timings[name] = float(raw.strip('"'))
        except ValueError:
            continue
    return timings


def build_request(
    endpoint: Endpoint,
    method: str,
    path: str,
    *,
    headers: Mapping[str, str] | None = None,
    body: bytes = b"",
) -> bytes:
    """The raw bytes of one HTTP/1.1 keep-alive request; build once, send many times."""
    lines = [f"{method} {endpoint.base_path}{path} HTTP/1.1", f"Host: {endpoint.host_header}"]
    lines.extend(f"{name}: {value}" for name, value in (headers or {}).items())
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Exchange:
    """Parser callbacks for the response in flight on one connection."""

    __slots__ = ("answered", "chunks", "done", "error", "headers", "status", "stream")

    def __init__(self, done: asyncio.Future[None], stream: asyncio.Queue[bytes | None] | None):
        self.done = done
        self.stream = stream
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.error: ClientError | None = None  # set when a stream broke after its headers
        self.answered = False  # a byte of the response arrived

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        if self.stream is not None:
            self.stream.put_nowait(body)
        else:
            self.chunks.append(body)


class _Protocol(asyncio.Protocol):
    """Feeds socket bytes to httptools and resolves the exchange in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.keep_alive = True
        self.num_responses = 0  # completed on this connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have the same methods.
        self.transport = cast(asyncio.Transport, transport)
        # One parser per connection: llhttp parses keep-alive responses one after another.
        self.parser = httptools.HttpResponseParser(self)

    def begin(self, exchange: _Exchange) -> None:
        self.exchange = exchange

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.exchange is not None
        self.exchange.on_header(name, value)

    def on_headers_complete(self) -> None:
        assert self.exchange is not None and self.parser is not None
        self.exchange.status = self.parser.get_status_code()
        if self.exchange.stream is not None and not self.exchange.done.done():
            # Streams hand headers over at once; the body follows through the queue.
            self.exchange.done.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.exchange is not None
        self.exchange.on_body(body)

    def on_message_complete(self) -> None:
        exchange, self.exchange = self.exchange, None
        assert exchange is not None and self.parser is not None
        self.num_responses += 1
        self.keep_alive = bool(self.parser.should_keep_alive())
        if exchange.stream is not None:
            exchange.stream.put_nowait(None)
        if not exchange.done.done():
            exchange.done.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.parser is None or self.exchange is None:
            self.keep_alive = False  # bytes nobody asked for: the connection is out of step
            return
        self.exchange.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ClientError(f"malformed HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.keep_alive = False
        self.transport = None
        exchange = self.exchange
        if exchange is None:
            return
        if not exchange.answered and self.num_responses > 0:
            # The server's idle timeout crossed our request on the wire: it never saw it.
            message = "server closed the reused connection before any byte of the response"
            self._fail(ClosedUnanswered(message))
            return
        self._fail(ClientError("server closed the connection before the response ended"))

    def _fail(self, error: ClientError) -> None:
        exchange, self.exchange = self.exchange, None
        self.keep_alive = False
        if exchange is None:
            return
        if not exchange.done.done():
            exchange.done.set_exception(error)
        if exchange.stream is not None:
            # The reader sees the end of the queue, then `Stream.chunks` raises this error.
            exchange.error = error
            exchange.stream.put_nowait(None)


class Stream:
    """A response whose body arrives chunk by chunk (chunked transfer, e.g. SSE)."""

    def __init__(self, exchange: _Exchange, queue: asyncio.Queue[bytes | None]) -> None:
        self.status = exchange.status
        self.headers = exchange.headers
        self._exchange = exchange
        self._queue = queue

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive, until the response ends; ClientError if it broke off."""
        while True:
            chunk = await self._queue.get()
            if chunk is None:
                if self._exchange.error is not None:
                    raise self._exchange.error
                return
            yield chunk


class Connection:
    """One keep-alive connection; it reconnects when the server closed the previous one."""

    def __init__(self, endpoint: Endpoint, *, connect_timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint
        self.connect_timeout_s = connect_timeout_s
        self._protocol: _Protocol | None = None
        self.num_retried = 0  # requests sent again after a ClosedUnanswered

    async def _ensure_open(self) -> _Protocol:
        protocol = self._protocol
        # An idle connection with input waiting is one the server closed (or broke): its end of
        # stream arrived but our loop, running late, has not read it yet. urllib3 and httpcore
        # make the same check before reusing a pooled connection.
        if (
            protocol is not None
            and protocol.transport is not None
            and protocol.keep_alive
            and not input_pending(protocol.transport)
        ):
            return protocol
        self.close()
        loop = asyncio.get_running_loop()
        try:
            _, opened = await asyncio.wait_for(
                loop.create_connection(_Protocol, self.endpoint.host, self.endpoint.port),
                self.connect_timeout_s,
            )
        except TimeoutError as exc:
            raise ClientTimeout(f"connect to {self.endpoint.host_header} timed out") from exc
        except OSError as exc:
            raise ClientError(f"cannot connect to {self.endpoint.host_header}: {exc}") from exc
        self._protocol = opened
        return opened

    async def request(
        self, raw: bytes, *, timeout_s: float | None = None, retry_unanswered: bool = False
    ) -> HttpResponse:
        """Send prebuilt request bytes; the complete response. `retry_unanswered`: send it once
        more, on a new connection, after a ClosedUnanswered (for requests safe to repeat)."""
        exchange = await self._send(raw, False, timeout_s, retry_unanswered)
        return HttpResponse(exchange.status, exchange.headers, b"".join(exchange.chunks))

    async def stream(
        self, raw: bytes, *, timeout_s: float | None = None, retry_unanswered: bool = False
    ) -> Stream:
        """Send prebuilt request bytes; the response once its headers arrived."""
        exchange = await self._send(raw, True, timeout_s, retry_unanswered)
        assert exchange.stream is not None
        return Stream(exchange, exchange.stream)

    async def _send(
        self, raw: bytes, streamed: bool, timeout_s: float | None, retry_unanswered: bool
    ) -> _Exchange:
        loop = asyncio.get_running_loop()
        deadline_s = None if timeout_s is None else loop.time() + timeout_s
        try:
            return await self._attempt(raw, streamed, deadline_s)
        except ClosedUnanswered:
            if not retry_unanswered:
                raise
            # RFC 9112 9.3.1: a request cut off this way may be sent again where repeating it is
            # safe; once, so a server that closes on every request is still seen failing.
            self.num_retried += 1
            return await self._attempt(raw, streamed, deadline_s)

    async def _attempt(self, raw: bytes, streamed: bool, deadline_s: float | None) -> _Exchange:
        protocol = await self._ensure_open()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes | None] | None = asyncio.Queue() if streamed else None
        exchange = _Exchange(loop.create_future(), queue)
        timeout_s = None if deadline_s is None else max(0.0, deadline_s - loop.time())
        await self._exchange(protocol, exchange, raw, timeout_s)
        return exchange

    async def _exchange(
        self, protocol: _Protocol, exchange: _Exchange, raw: bytes, timeout_s: float | None
    ) -> None:
        assert protocol.transport is not None and protocol.exchange is None
        protocol.begin(exchange)
        protocol.transport.write(raw)
        timer = None
        if timeout_s is not None:
            timer = asyncio.get_running_loop().call_later(timeout_s, self._time_out, exchange)
        try:
            await exchange.done
        except BaseException:
            # Timed out, cancelled or broken: the connection is out of step, never reuse it.
            self.close()
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _time_out(self, exchange: _Exchange) -> None:
        if not exchange.done.done():
            exchange.done.set_exception(ClientTimeout("no response within the timeout"))

    def close(self) -> None:
        """Close the socket; the next request reconnects."""
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()


async def get_json(endpoint: Endpoint, path: str, *, timeout_s: float = 10.0) -> object:
    """GET `path` on a fresh connection; the decoded JSON body, or ClientError on non-2xx."""
    connection = Connection(endpoint)
    try:
        raw = build_request(endpoint, "GET", path, headers={"Accept": "application/json"})
        response = await connection.request(raw, timeout_s=timeout_s)
    finally:
        connection.close()
    if not 200 <= response.status < 300:
        raise ClientError(f"GET {path}: HTTP {response.status}: {response.body[:200]!r}")
    return response.json()
