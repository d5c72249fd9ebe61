"""The HTTP connection at the edge, before the ASGI app: request-head limits (431), slow-client
timeouts (408), the 503 a request still running when the drain timeout runs out receives, idle
closes that spare a request already arrived, and reads held past a refusal budget.

uvicorn's httptools protocol (same parser, same uvloop) with these checks added; `protocol_with`
binds the limits to a class that `uvicorn.Config(http=...)` accepts.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import httptools
import msgspec
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from fulcrum.errors import FulcrumError, HeadersTooLarge, RequestTimeout, Unavailable
from fulcrum.pending_input import input_pending
from fulcrum.server.http import error_body
from fulcrum.server.refusal_budget import RefusalGovernor

if TYPE_CHECKING:
    from uvicorn._types import (
        ASGI3Application,
        ASGIReceiveCallable,
        ASGISendCallable,
        HTTPScope,
        Scope,
    )

log = logging.getLogger(__name__)
# After an error answer the server half-closes and reads (and drops) what the client still
# sends, for at most this long: closing a socket with unread bytes sends a TCP reset, which can
# destroy the answer before the client reads it (Apache's and nginx's "lingering close").
LINGER_S = 2.0


@dataclass(frozen=True)
class EdgeLimits:
    """Per-connection limits, enforced before the app sees a request."""

    # Request line plus headers. Node allows 16 KiB, nginx 4 x 8 KiB; 64 KiB leaves room for
    # large bearer tokens, cookies and tracing headers and still stops a flood at 64 KiB.
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100  # Node's default
    # first byte of a request to the end of its headers; a connection that sends nothing at
    # all is closed (quietly) after the same time
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0  # end of the headers to the end of the body

    def __post_init__(self) -> None:
        if self.max_header_bytes < 1 or self.max_headers < 1:
            raise ValueError(f"header limits must be >= 1: {self}")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError(f"timeouts must be > 0: {self}")


class LimitedHttpProtocol(HttpToolsProtocol):
    """One HTTP/1.1 connection with header limits, read timeouts and a 503 on forced shutdown."""

    limits: ClassVar[EdgeLimits] = EdgeLimits()
    # Each may answer a request head at once (an overloaded model's 503); None: run the app.
    gates: ClassVar[tuple[Callable[[HTTPScope], ASGI3Application | None], ...]] = ()
    refusals: ClassVar[RefusalGovernor | None] = None  # the refusal budget (None: off)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._in_head = True  # the next bytes belong to a request head
        self._head_bytes = 0  # fed to the parser since this head began
        self._num_headers = 0
        self._too_many_headers = False
        self._discarding = False  # an answer ended this connection: input is dropped
        self._draining = False  # the server is shutting down
        self._body_deadline = 0.0
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._refusals = None if self.refusals is None else self.refusals.connection(self.loop)
        super().connection_made(transport)
        # from the connection on: a client that connects and never sends is also closed
        self._header_timer = self._after(self.limits.header_timeout_s, self._header_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        if self._refusals is not None:
            self._refusals.cancel()  # a held connection's next request will never come
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        # The parser is fed at most what is left of the head limit while in a head, so no head
        # is ever buffered past it (httptools joins a header's pieces by copying them). A head
        # that starts inside the chunk that ends the previous request is counted from the next
        # chunk on: at most one read (256 KiB) of slack, only for pipelined requests.
        while data and not self._discarding:
            if self._in_head:
                if self._head_bytes == 0:  # a head begins: its time runs from its first byte
                    self._cancel_timers()
                    self._header_timer = self._after(
                        self.limits.header_timeout_s, self._header_timed_out
                    )
                room = self.limits.max_header_bytes - self._head_bytes
                if room <= 0:
                    kib = self.limits.max_header_bytes / 1024
                    self._refuse_head(HeadersTooLarge(f"request head over {kib:g} KiB"))
                    return
                chunk, data = data[:room], data[room:]
                self._head_bytes += len(chunk)
            else:
                chunk, data = data, b""
            self._feed(chunk)
        if not self._in_head and self._body_timer is None and not self._discarding:
            self._body_timer = self.loop.call_at(self._body_deadline, self._body_timed_out)

    def _feed(self, chunk: bytes) -> None:
        try:
            self.parser.feed_data(chunk)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self._cancel_timers()
                self._discarding = True  # the WebSocket protocol owns the transport now
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            if self._too_many_headers:
                n = self.limits.max_headers
                self._refuse_head(HeadersTooLarge(f"more than {n} header fields"))
                return
            self._discarding = True
            log.debug("invalid HTTP request from %s", self.client)
            self.send_400_response("Invalid HTTP request received.")

    def on_message_begin(self) -> None:
        self._num_headers = 0
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.limits.max_headers:
            self._too_many_headers = True
            raise HeadersTooLarge("too many header fields")  # stops the parser; see _feed
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._body_deadline = self.loop.time() + self.limits.body_timeout_s
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._in_head, self._head_bytes = True, 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        refusals = self._refusals
        delay_s = 0.0 if refusals is None else refusals.hold_s()
        if refusals is None or delay_s <= 0 or self._draining or self.transport.is_closing():
            super().on_response_complete()
            return
        # A refusal past the connection's budget: what the client sends next stays unread, and
        # uvicorn's resume of reading (with any pipelined request) waits for the hold's end.
        self.flow.pause_reading()
        refusals.hold(delay_s, super().on_response_complete)

    def shutdown(self) -> None:
        self._draining = True
        if self._refusals is not None and self._refusals.holding:  # serve what waits, then close
            self._refusals.cancel()
            super().on_response_complete()
        if self._discarding:
            self.transport.close()
            return
        super().shutdown()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        # With no other request in progress on the server nothing is queued for HTTP callers,
        # so no gate would refuse: it is skipped. It refuses only a subset of what the full path
        # does, so this changes no answer. A lone request at light load is spared its cost:
        # 0.17 ms of a ~2.5 ms path outside the model on a 2-core VM, cold after the idle gap,
        # where it takes 19 us back to back (benchmarks/light_path.py, issue 11).
        gates = self.gates if self.server_state.tasks else ()
        for gate in gates:
            try:
                refusing = gate(cycle.scope)
            except Exception:  # a bug in a gate must not cost the request: the app answers
                log.exception("request gate failed")
                refusing = None
            if refusing is not None:
                app = refusing
                break
        if self._refusals is not None:
            app = self._refusals.watch(app)
        super()._start_asgi_task(cycle, self._answer_if_cut_off(cycle, app))

    def _answer_if_cut_off(
        self, cycle: RequestResponseCycle, app: ASGI3Application
    ) -> ASGI3Application:
        """`app`, answering 503 when uvicorn cancels it at the end of the graceful shutdown."""

        async def run(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
            try:
                await app(scope, receive, send)
            except asyncio.CancelledError:
                if not self._draining:
                    raise
                # Left to uvicorn, the client would get a 500 and the log a traceback; the
                # server is going away, so it is 503 with Retry-After, as Triton and vLLM say.
                await self._send_unavailable(cycle)

        return run

    async def _send_unavailable(self, cycle: RequestResponseCycle) -> None:
        if cycle.response_started or cycle.disconnected:
            if not cycle.response_complete:
                self.transport.close()  # half an answer cannot become a 503
            return
        exc = Unavailable("server shutting down: the drain timeout ran out")
        body = msgspec.json.encode(error_body(cycle.scope["path"], exc))
        headers = [(k.lower().encode(), v.encode()) for k, v in exc.headers().items()]
        await cycle.send(
            {
                "type": "http.response.start",
                "status": exc.status_code,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                    *headers,
                ],
            }
        )
        await cycle.send({"type": "http.response.body", "body": body, "more_body": False})

    def timeout_keep_alive_handler(self) -> None:
        """The idle keep-alive timer: closes the connection, unless its next request is here."""
        # The loop runs due timers before it reads the sockets: when it runs late (a busy
        # machine, a long callback), the client's next request can already be waiting, unread,
        # as this fires. Closing then resets the connection under a request the client sent
        # before the timeout (issue 11: 3-32 requests a minute lost at 3x overload, load 4-9).
        if input_pending(self.transport):  # data_received, in this same iteration, takes it
            self.timeout_keep_alive_task = self._after(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            return
        self._close_idle()

    def _header_timed_out(self) -> None:
        self._header_timer = None
        # The server stopped reading, not the client; or the first byte is here, unread (as in
        # timeout_keep_alive_handler).
        if self.flow.read_paused or (self._head_bytes == 0 and input_pending(self.transport)):
            self._header_timer = self._after(self.limits.header_timeout_s, self._header_timed_out)
            return
        if self._head_bytes == 0:
            # Not one byte of a request: close quietly, as a keep-alive timeout does. An
            # unasked-for 408 could be read by a pooling client as the answer to its next request.
            self._discarding = True
            self._close_idle()
            return
        seconds = self.limits.header_timeout_s
        self._refuse_head(RequestTimeout(f"request head not received within {seconds:g} s"))

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        # Not the client's fault: the app has not read what came, or has not yet asked for the
        # body a client sending `Expect: 100-continue` waits to be invited to send.
        if self.flow.read_paused or cycle.waiting_for_100_continue:
            self._body_timer = self._after(self.limits.body_timeout_s, self._body_timed_out)
            return
        if cycle.response_started:  # answered without the body, or mid-answer: just close
            self._discarding = True
            self.transport.close()
            return
        seconds = self.limits.body_timeout_s
        self._answer_and_linger(RequestTimeout(f"request body not received within {seconds:g} s"))

    def _refuse_head(self, exc: FulcrumError) -> None:
        """Answer a head that broke a limit, unless an earlier request's answer is still owed."""
        log.debug("refused request head from %s: %s", self.client, exc.message)
        earlier = self.cycle
        if earlier is not None and not earlier.response_complete:
            # Answers go out in request order: close once the earlier one is sent.
            earlier.keep_alive = False
            self._discarding = True
            self._cancel_timers()
            return
        self._answer_and_linger(exc)

    def _answer_and_linger(self, exc: FulcrumError) -> None:
        """Send `exc` as the answer, close our side, drop what the client still sends."""
        self._discarding = True
        self._cancel_timers()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        path = ""
        if cycle is not None and not cycle.response_complete:
            path = cycle.scope["path"]
            cycle.disconnected = True  # the app's own answer, if any, has nowhere to go now
            cycle.message_event.set()
        self.transport.write(_error_bytes(exc, error_body(path, exc), self._default_headers()))
        self.flow.resume_reading()
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    def _close_idle(self) -> None:
        """Close a connection between requests, the client told at once (our FIN sent now)."""
        transport = self.transport
        if transport.is_closing():
            return
        # transport.close() sends the FIN only after the loop's ready callbacks have run (ms on a
        # busy server): meanwhile the client still sees an open connection, sends its next
        # request on it, and gets a reset. Not with an answer still buffered: it would be cut.
        if not transport.get_write_buffer_size():
            _send_fin_now(transport)
        transport.close()

    def _default_headers(self) -> list[tuple[bytes, bytes]]:
        return list(self.server_state.default_headers)

    def _cancel_timers(self) -> None:
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None

    def _after(self, delay_s: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self.loop.call_later(delay_s, callback)


def _send_fin_now(transport: asyncio.Transport) -> None:
    """Half-close the transport's socket now (shutdown of its write side, through a duplicate:
    transport sockets refuse shutdown); nothing if it has no socket or it is already gone."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    try:
        with sock.dup() as duplicate:
            duplicate.shutdown(socket.SHUT_WR)
    except OSError:  # closed or reset under us: there is no one to tell
        return


def _error_bytes(
    exc: FulcrumError, body: object, default_headers: list[tuple[bytes, bytes]]
) -> bytes:
    """A complete `connection: close` response carrying `body` as JSON."""
    content = msgspec.json.encode(body)
    lines = [STATUS_LINE[exc.status_code]]
    headers = [
        *default_headers,
        (b"content-type", b"application/json"),
        (b"content-length", str(len(content)).encode()),
        (b"connection", b"close"),
        *((k.lower().encode(), v.encode()) for k, v in exc.headers().items()),
    ]
    lines.extend(b"%s: %s\r\n" % (name, value) for name, value in headers)
    return b"".join([*lines, b"\r\n", content])


def protocol_with(
    limits: EdgeLimits,
    early_refusal: Callable[[HTTPScope], ASGI3Application | None] | None = None,
    refusals: RefusalGovernor | None = None,
) -> type[LimitedHttpProtocol]:
    """A protocol class bound to `limits` (and a gate that may answer a head at once, see
    `server.early_refusal`; a refusal budget, see `server.refusal_budget`), for
    `uvicorn.Config(http=...)`."""

    class BoundHttpProtocol(LimitedHttpProtocol):
        pass

    BoundHttpProtocol.limits = limits
    BoundHttpProtocol.gates = () if early_refusal is None else (early_refusal,)
    BoundHttpProtocol.refusals = refusals
    return BoundHttpProtocol
