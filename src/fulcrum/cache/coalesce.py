"""Request coalescing: concurrent identical misses are computed once. The first caller of a key
computes; callers arriving while it runs wait for its result. A leader that fails or is cancelled
never takes its followers down with it: each then computes for itself."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from fulcrum.errors import DeadlineExceeded

T = TypeVar("T")


class _LeaderGone(Exception):
    """The leader's computation failed or was cancelled; its followers compute alone."""


class Coalescer(Generic[T]):
    """In-flight computations by key (one process; the cache shares results across processes)."""

    def __init__(self) -> None:
        self._in_flight: dict[bytes, asyncio.Future[T]] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def run(
        self, key: bytes, compute: Callable[[], Awaitable[T]], *, timeout_s: float | None = None
    ) -> tuple[T, bool]:
        """The result of `compute()` for `key` and whether it was another caller's;
        `timeout_s` bounds only the wait for another caller (504 past it)."""
        shared = self._in_flight.get(key)
        if shared is not None:
            try:
                return await _follow(shared, timeout_s), True
            except _LeaderGone:
                return await compute(), False
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        try:
            result = await compute()
        except BaseException as exc:
            # Not the leader's own error: a follower's request may be fine (another deadline,
            # still connected); `exception()` marks it retrieved when nobody follows.
            future.set_exception(_LeaderGone(type(exc).__name__))
            future.exception()
            raise
        else:
            future.set_result(result)
            return result, False
        finally:
            del self._in_flight[key]


async def _follow(shared: asyncio.Future[T], timeout_s: float | None) -> T:
    try:
        async with asyncio.timeout(timeout_s):
            # Shielded: a follower that goes away must not cancel the leader's computation.
            return await asyncio.shield(shared)
    except TimeoutError:
        raise DeadlineExceeded("request passed its deadline waiting for an identical one") from None
