"""The refusal budget: the per-connection bucket and the server-wide allowance on a fake clock,
and the edge protocol holding a connection that retries its 503s at once (fake transport)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
import uvicorn
from test_limits import FakeClock, FakeTransport
from uvicorn.server import ServerState

from fulcrum.cli import build_parser
from fulcrum.server.limits import EdgeLimits, protocol_with
from fulcrum.server.refusal_budget import (
    ALLOWANCE_REFUSALS,
    RefusalAllowance,
    RefusalBucket,
    RefusalBudget,
    RefusalGovernor,
)

LIMITS = EdgeLimits(header_timeout_s=5, body_timeout_s=7)
STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) ")


def test_bucket_allows_a_burst_then_one_refusal_per_refill() -> None:
    bucket = RefusalBucket(rate_per_s=10, burst=3, now_s=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.1)  # wait for the next token
    assert bucket.take(0.1) == pytest.approx(0.1)  # the held read spent it: the same again
    assert bucket.take(0.5) == 0.0  # 0.3 s of refill: tokens again, up to the burst
    assert bucket.take(10.0) == 0.0


def test_bucket_debt_is_at_most_one_refusal() -> None:
    bucket = RefusalBucket(rate_per_s=1, burst=1, now_s=0.0)
    bucket.take(0.0)
    waits = [bucket.take(0.0) for _ in range(5)]  # refusals the hold did not space out
    assert waits == [pytest.approx(1.0)] * 5  # never 2 s, 3 s, ...


def test_allowance_storms_only_past_the_ratio_and_recovers() -> None:
    allowance = RefusalAllowance(refusals_per_answer=4)
    for _ in range(1000):  # an open-loop 3x overload: two refusals per answer
        allowance.note(False)
        allowance.note(True)
        allowance.note(True)
        assert not allowance.storming
    for _ in range(int(ALLOWANCE_REFUSALS)):  # a retry storm: refusals only
        allowance.note(True)
    assert allowance.storming
    for _ in range(int(ALLOWANCE_REFUSALS / 4)):
        allowance.note(False)
    assert not allowance.storming
    assert RefusalAllowance(refusals_per_answer=0).storming  # 0: hold at any ratio


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"refusals_per_s": -1}, "refusals_per_s must be a number >= 0, got -1"),
        ({"refusals_per_s": float("nan")}, "refusals_per_s must be a number >= 0, got nan"),
        ({"burst": 0}, "burst must be >= 1, got 0"),
        ({"refusals_per_answer": float("inf")}, "refusals_per_answer must be a number >= 0"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        RefusalBudget(**kwargs)


def test_a_budget_of_zero_is_off() -> None:
    assert not RefusalBudget(refusals_per_s=0).enabled
    with pytest.raises(ValueError, match="off"):
        RefusalGovernor(RefusalBudget(refusals_per_s=0))


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--refusals-per-connection", "-1"),
        ("--refusals-per-connection", "nan"),
        ("--refusal-burst", "0"),
        ("--refusals-per-answer", "-0.5"),
    ],
)
def test_cli_refuses_bad_values(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--repository", "r", flag, value])
    err = capsys.readouterr().err
    assert flag in err and "must be a number >=" in err


def test_cli_defaults_and_off() -> None:
    args = build_parser().parse_args(["serve", "--repository", "r"])
    assert (args.refusals_per_connection, args.refusal_burst, args.refusals_per_answer) == (
        8.0,
        8,
        4.0,
    )
    off = build_parser().parse_args(
        ["serve", "--repository", "r", "--refusals-per-connection", "0"]
    )
    assert not RefusalBudget(refusals_per_s=off.refusals_per_connection).enabled


class RefusingApp:
    """`/full`: 503 with `Retry-After` (the body unread, as the early refusal does);
    `/no-retry-after`: 503 without one; anything else: 200."""

    def __init__(self, retry_after: bytes = b"1") -> None:
        self.retry_after = retry_after
        self.paths: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.paths.append(scope["path"])
        status, headers = 200, [(b"content-length", b"2")]
        if scope["path"] == "/full":
            status, headers = 503, [*headers, (b"retry-after", self.retry_after)]
        elif scope["path"] == "/no-retry-after":
            status = 503
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})


class Conn:
    """One connection of a server bound to `governor` (None: no budget), on a fake clock."""

    def __init__(
        self,
        governor: RefusalGovernor | None,
        app: RefusingApp | None = None,
        clock: FakeClock | None = None,
    ) -> None:
        self.app = app or RefusingApp()
        self.clock = clock or FakeClock(asyncio.get_running_loop())
        self.transport = FakeTransport()
        config = uvicorn.Config(self.app, log_config=None, lifespan="off")
        self.protocol = protocol_with(LIMITS, None, governor)(
            config=config,
            server_state=ServerState(),
            app_state={},
            _loop=self.clock,  # type: ignore[arg-type]
        )
        self.protocol.connection_made(self.transport)

    async def ask(self, path: str) -> None:
        """Send one request (when the server reads) and let the app answer."""
        self.protocol.data_received(request(path))
        await settle()

    def statuses(self) -> list[int]:
        return [int(status) for status in STATUS.findall(bytes(self.transport.written))]


def request(path: str) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: a\r\n\r\n" % path.encode()


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def governor(rate: float = 10, burst: int = 4, per_answer: float = 0) -> RefusalGovernor:
    return RefusalGovernor(RefusalBudget(rate, burst, per_answer))


async def storm(conn: Conn, seconds: float, step_s: float = 0.001) -> int:
    """A closed loop that ignores Retry-After: a new request whenever the server reads."""
    for _ in range(round(seconds / step_s)):
        if conn.transport.reading and not conn.protocol.pipeline:
            await conn.ask("/full")
        conn.clock.advance(step_s)
        await settle()
    return len(conn.statuses())


async def test_a_closed_loop_ignoring_retry_after_is_held_to_its_budget() -> None:
    gov = governor(rate=10, burst=4)
    conn = Conn(gov)
    num_refused = await storm(conn, seconds=0.5)
    # 4 at once, then one per 0.1 s: ~9 in 0.5 s where the loop alone would make 500
    assert 4 + 0.5 * 10 - 1 <= num_refused <= 4 + 0.5 * 10 + 1
    assert set(conn.statuses()) == {503}
    assert gov.num_holds == num_refused - 4


async def test_the_hold_delays_the_next_request_until_a_token_is_back() -> None:
    gov = governor(rate=10, burst=1)
    conn = Conn(gov)
    await conn.ask("/full")  # the burst
    await conn.ask("/full")  # past it: held 0.1 s
    assert not conn.transport.reading and conn.protocol._refusals.holding
    conn.clock.advance(0.099)
    await settle()
    assert not conn.transport.reading
    conn.clock.advance(0.001)
    await settle()
    assert conn.transport.reading and not conn.protocol._refusals.holding
    await conn.ask("/ok")
    assert conn.statuses() == [503, 503, 200]


async def test_a_client_that_waits_retry_after_is_never_held() -> None:
    gov = governor(rate=1, burst=1)
    conn = Conn(gov)
    for _ in range(20):
        await conn.ask("/full")
        assert conn.transport.reading
        conn.clock.advance(1.0)  # Retry-After: 1
    assert gov.num_holds == 0 and len(conn.statuses()) == 20


async def test_a_hold_never_outlasts_retry_after() -> None:
    gov = governor(rate=0.01, burst=1)  # a token every 100 s
    conn = Conn(gov)
    await conn.ask("/full")
    await conn.ask("/full")
    assert not conn.transport.reading
    conn.clock.advance(1.0)  # the answer's Retry-After
    await settle()
    assert conn.transport.reading


async def test_only_refusals_with_retry_after_count() -> None:
    gov = governor(rate=1, burst=1)
    conn = Conn(gov)
    for path in ["/ok", "/no-retry-after"] * 5 + ["/full"]:
        await conn.ask(path)
    assert conn.transport.reading and gov.num_holds == 0
    date_app = RefusingApp(retry_after=b"Wed, 21 Oct 2026 07:28:00 GMT")
    dated = Conn(gov, date_app)
    for _ in range(3):
        await dated.ask("/full")
    assert dated.transport.reading and gov.num_holds == 0


async def test_a_pipelined_request_already_read_is_held_too() -> None:
    gov = governor(rate=10, burst=1)
    conn = Conn(gov)
    await conn.ask("/full")
    conn.protocol.data_received(request("/full") + request("/ok"))  # both in one read
    await settle()
    assert conn.statuses() == [503, 503]  # /ok waits, parsed, in the pipeline
    assert conn.app.paths == ["/full", "/full"]
    conn.clock.advance(0.1)
    await settle()
    assert conn.statuses() == [503, 503, 200]


async def test_timers_of_a_held_connection_do_not_fire_because_of_the_hold() -> None:
    gov = governor(rate=0.01, burst=1)
    conn = Conn(gov, RefusingApp(retry_after=b"60"))
    await conn.ask("/full")
    conn.protocol.data_received(request("/full") + b"GET /ok HTTP/1.1\r\n")  # a head begun
    await settle()
    assert conn.protocol._refusals.holding
    conn.clock.advance(LIMITS.header_timeout_s * 3)  # the server is not reading: not a 408
    await settle()
    assert conn.statuses() == [503, 503] and not conn.transport.closed
    conn.clock.advance(60)
    conn.protocol.data_received(b"Host: a\r\n\r\n")
    await settle()
    assert conn.statuses() == [503, 503, 200]


async def test_a_connection_closed_while_held_leaves_no_timer() -> None:
    gov = governor(rate=10, burst=1)
    conn = Conn(gov)
    await conn.ask("/full")
    await conn.ask("/full")
    refusals = conn.protocol._refusals
    assert refusals is not None and refusals.holding
    timer = refusals.timer
    conn.protocol.connection_lost(None)
    assert refusals.timer is None and timer.is_cancelled  # type: ignore[union-attr]
    assert all(t.is_cancelled for t in conn.clock.timers)


async def test_shutdown_of_a_held_connection_serves_what_waits_then_closes() -> None:
    gov = governor(rate=10, burst=1)
    conn = Conn(gov)
    await conn.ask("/full")
    conn.protocol.data_received(request("/full") + request("/ok"))
    await settle()
    conn.protocol.shutdown()
    await settle()
    assert conn.statuses() == [503, 503, 200]
    assert conn.transport.closed


async def test_other_connections_are_untouched_during_a_storm() -> None:
    gov = governor(rate=10, burst=1)
    stormer = Conn(gov)
    other = Conn(gov, clock=stormer.clock)
    await storm(stormer, seconds=0.05)
    assert gov.num_holds > 0
    await other.ask("/ok")
    await other.ask("/full")  # its own burst
    assert other.statuses() == [200, 503] and other.transport.reading


async def test_no_holds_while_the_server_answers_enough() -> None:
    gov = governor(rate=1, burst=1, per_answer=4)
    refused, served = Conn(gov), Conn(gov)
    for _ in range(50):  # two refusals per answer, as under an open-loop 3x overload
        await refused.ask("/full")
        await refused.ask("/full")
        await served.ask("/ok")
        assert refused.transport.reading
    assert gov.num_holds == 0
    for _ in range(int(ALLOWANCE_REFUSALS)):  # now refusals only: a storm
        if refused.transport.reading:
            await refused.ask("/full")
    assert gov.num_holds == 1 and not refused.transport.reading


async def test_holds_are_counted_for_the_metric() -> None:
    counted: list[int] = []
    gov = RefusalGovernor(RefusalBudget(10, 1, 0), on_hold=lambda: counted.append(1))
    conn = Conn(gov)
    await storm(conn, seconds=0.3)
    assert len(counted) == gov.num_holds >= 2


async def test_without_a_budget_nothing_is_held() -> None:
    conn = Conn(None)
    num_refused = await storm(conn, seconds=0.2)
    assert num_refused == 200 and conn.transport.reading
