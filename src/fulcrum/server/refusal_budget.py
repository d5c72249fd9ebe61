"""The refusal budget: how many 503s (or 429s) with Retry-After one connection may be answered
before the server stops reading it for a while, so a client that retries at once cannot make
the server spend its CPU refusing it (a retry storm) while the model starves.

Each connection has a token bucket of refusals (nginx's limit_req with delay, per connection):
a refusal takes a token; when there is none, the connection's next request is read only once a
token is back, and never later than the refusal's Retry-After. Nothing is parsed or answered
meanwhile: the request waits in the socket. Holds engage only while the whole server refuses
more than `refusals_per_answer` requests per request it answers (gRPC's retry throttling, seen
from the server): an open-loop overload, whose clients send new requests at their own pace and
whatever the answers, is refused a few per answer and never held.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from uvicorn._types import (
        ASGI3Application,
        ASGIReceiveCallable,
        ASGISendCallable,
        ASGISendEvent,
        Scope,
    )

# The server-wide allowance's size, in refusals: half of it, in refusals beyond the ratio, must
# go before any connection is held. Large, so that an open-loop overload's refusals between two
# answers never spend it (at 3x on a busy 2-core machine, ~130 refusals/s while a slow batch
# runs; 64 held its pooled connections), while a storm of 1,000 refusals/s spends it in 0.25 s.
ALLOWANCE_REFUSALS = 512.0
REFUSAL_STATUSES = (429, 503)


@dataclass(frozen=True)
class RefusalBudget:
    """Settings: refusals a connection may take (`burst`, then `refusals_per_s`) while the
    server refuses more than `refusals_per_answer` requests per answer (0: at any ratio)."""

    refusals_per_s: float = 8.0  # 0: off
    burst: int = 8
    refusals_per_answer: float = 4.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.refusals_per_s) and self.refusals_per_s >= 0):
            raise ValueError(f"refusals_per_s must be a number >= 0, got {self.refusals_per_s}")
        if self.burst < 1:
            raise ValueError(f"burst must be >= 1, got {self.burst}")
        if not (math.isfinite(self.refusals_per_answer) and self.refusals_per_answer >= 0):
            raise ValueError(
                f"refusals_per_answer must be a number >= 0, got {self.refusals_per_answer}"
            )

    @property
    def enabled(self) -> bool:
        return self.refusals_per_s > 0


class RefusalBucket:
    """One connection's refusals: `burst` tokens refilled at `rate_per_s`; pure, takes `now`."""

    def __init__(self, rate_per_s: float, burst: int, now_s: float) -> None:
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        self.tokens = float(burst)
        self.updated_s = now_s

    def take(self, now_s: float) -> float:
        """Count a refusal; the seconds until the connection may be read again (0: at once)."""
        elapsed_s = max(0.0, now_s - self.updated_s)
        self.tokens = min(self.burst, self.tokens + elapsed_s * self.rate_per_s)
        self.updated_s = now_s
        # At most one refusal in debt: a hold cut short by Retry-After does not pile up waits.
        self.tokens = max(-1.0, self.tokens - 1.0)
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate_per_s


class RefusalAllowance:
    """Server-wide: each answer adds `refusals_per_answer` refusals (up to ALLOWANCE_REFUSALS),
    each refusal spends one; the server is in a storm while less than half is left."""

    def __init__(self, refusals_per_answer: float) -> None:
        self.refusals_per_answer = refusals_per_answer
        self.left = ALLOWANCE_REFUSALS

    def note(self, refused: bool) -> None:
        if refused:
            self.left = max(0.0, self.left - 1.0)
        else:
            self.left = min(ALLOWANCE_REFUSALS, self.left + self.refusals_per_answer)

    @property
    def storming(self) -> bool:
        return self.refusals_per_answer <= 0 or self.left < ALLOWANCE_REFUSALS / 2


class RefusalGovernor:
    """The server's budget and allowance; hands each connection its `ConnectionRefusals`."""

    def __init__(self, budget: RefusalBudget, on_hold: Callable[[], None] = lambda: None):
        if not budget.enabled:
            raise ValueError("a refusal budget of 0 refusals per second is off: build no governor")
        self.budget = budget
        self.allowance = RefusalAllowance(budget.refusals_per_answer)
        self.on_hold = on_hold
        self.num_holds = 0

    def connection(self, loop: asyncio.AbstractEventLoop) -> ConnectionRefusals:
        return ConnectionRefusals(self, loop)


class ConnectionRefusals:
    """One connection's side: notes each answer's Retry-After (`watch`), decides at its end
    whether the connection's reading waits (`hold_s`), and owns the timer that ends the wait."""

    def __init__(self, governor: RefusalGovernor, loop: asyncio.AbstractEventLoop) -> None:
        self.governor = governor
        self.loop = loop
        budget = governor.budget
        self.bucket = RefusalBucket(budget.refusals_per_s, budget.burst, loop.time())
        self.retry_after_s: float | None = None  # the answer being sent: a refusal's Retry-After
        self.timer: asyncio.TimerHandle | None = None

    def watch(self, app: ASGI3Application) -> ASGI3Application:
        """`app`, with its answer's status and Retry-After noted on the way out."""

        async def run(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
            async def noting(message: ASGISendEvent) -> None:
                if message["type"] == "http.response.start":
                    self.retry_after_s = _retry_after_s(message)
                await send(message)

            await app(scope, receive, noting)

        return run

    def hold_s(self) -> float:
        """The answer just went out: how long to leave the connection unread (0: not at all)."""
        retry_after_s, self.retry_after_s = self.retry_after_s, None
        governor = self.governor
        governor.allowance.note(retry_after_s is not None)
        if retry_after_s is None:
            return 0.0
        wait_s = self.bucket.take(self.loop.time())
        if wait_s <= 0 or not governor.allowance.storming:
            return 0.0
        return min(wait_s, retry_after_s)  # never longer than the client was told to wait

    def hold(self, delay_s: float, release: Callable[[], None]) -> None:
        """Call `release` in `delay_s` (the caller paused reading); counted as a hold."""
        self.governor.num_holds += 1
        self.governor.on_hold()

        def end() -> None:
            self.timer = None
            release()

        self.timer = self.loop.call_later(delay_s, end)

    @property
    def holding(self) -> bool:
        return self.timer is not None

    def cancel(self) -> None:
        """Drop the hold without releasing (the connection is gone)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def _retry_after_s(message: ASGISendEvent) -> float | None:
    """A refusal's Retry-After in seconds; None for any other answer (or an HTTP-date)."""
    if message.get("status") not in REFUSAL_STATUSES:
        return None
    for name, value in message.get("headers", ()):  # type: ignore[attr-defined]
        if name.lower() == b"retry-after":
            try:
                return max(0.0, float(int(value)))
            except ValueError:
                return None
    return None
