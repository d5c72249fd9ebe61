"""One guarded connection to Redis for the cache: a caller waits at most a timeout, failures are
counted and fed to a circuit breaker, reconnection is left to redis-py's pool. The Redis store
and the Redis vector index each own one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from fulcrum.cache.breaker import CircuitBreaker
from fulcrum.errors import ConfigError, Unavailable
from fulcrum.extras import require

if TYPE_CHECKING:
    from redis.asyncio import Redis

T = TypeVar("T")
# Failures that mean "Redis is slow, down or confused", each served as a miss. redis-py's own
# errors join them when the link is made (imported lazily: redis is an extra).
_OS_FAILURES: tuple[type[BaseException], ...] = (OSError, TimeoutError, EOFError)
# A call's own bound, past the caller's: long enough for a connect on a busy machine, short
# enough that calls to a paused Redis do not pile up (the breaker sends at most one per back-off).
MIN_OP_TIMEOUT_S = 1.0
# More calls than this in flight means Redis is not keeping up: skip it (a miss) meanwhile.
DEFAULT_MAX_IN_FLIGHT = 256


class RedisLink:
    """Calls to one Redis URL that never keep a caller longer than `timeout_s` and never raise
    anything but `Unavailable` (skipped, timed out or failed); the caller makes that a miss.

    A call runs as a task of its own, bounded by `op_timeout_s`: a caller that stops waiting
    leaves it to finish, so a connection being set up is not torn down by every short timeout
    (on a busy machine a connect can take longer than the timeout, and would never succeed)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        breaker: CircuitBreaker | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        op_timeout_s: float | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"redis timeout must be > 0 s, got {timeout_s}")
        feature = "the Redis cache backend"
        # Imported here, not on the first call: the import alone takes longer than a timeout.
        self._redis = require("cache", "redis.asyncio", feature=feature)
        self._retry = require("cache", "redis.asyncio.retry", feature=feature)
        self._backoff = require("cache", "redis.backoff", feature=feature)
        exceptions = require("cache", "redis.exceptions", feature=feature)
        self._failures: tuple[type[BaseException], ...] = (*_OS_FAILURES, exceptions.RedisError)
        self.url = url
        self.timeout_s = timeout_s
        self.op_timeout_s = max(MIN_OP_TIMEOUT_S, timeout_s, op_timeout_s or 0.0)
        self.breaker = breaker or CircuitBreaker()
        self.clock = clock
        self.max_in_flight = max_in_flight
        self.num_errors = 0
        self.num_skipped = 0  # calls not sent: the breaker was open, or too many in flight
        self._client: Redis | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    def _connect(self) -> Redis:
        # Created on first use, inside the running loop: redis-py's asyncio pool binds to it.
        if self._client is None:
            client: Redis = self._redis.Redis.from_url(
                self.url,
                socket_timeout=self.op_timeout_s,
                socket_connect_timeout=self.op_timeout_s,
                # No retries: one attempt per call, the breaker decides when to try again.
                retry=self._retry.Retry(self._backoff.NoBackoff(), 0),
                # One connection per call in flight; more calls are skipped before the pool
                # refuses them (which would count as a Redis failure).
                max_connections=self.max_in_flight,
            )
            self._client = client
        return self._client

    async def call(
        self, op: Callable[[Redis], Awaitable[T]], *, timeout_s: float | None = None
    ) -> T:
        """`op`'s result within the timeout; Unavailable when the breaker skips the call or the
        call fails or is late (counted in `num_errors`, opening the breaker)."""
        if len(self._tasks) >= self.max_in_flight or not self.breaker.allow(self.clock()):
            self.num_skipped += 1
            raise Unavailable(f"redis {self.url}: skipped after a recent failure")
        is_probe = self.breaker.is_open
        task = asyncio.get_running_loop().create_task(self._run(op))
        self._tasks.add(task)
        task.add_done_callback(_forget(self._tasks))
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s or self.timeout_s)
        except BaseException:
            # A cancelled caller says nothing about Redis; only hand back the probe it held.
            if is_probe:
                self.breaker.release_probe()
            raise
        if not done:  # late: a miss for this caller; the task finishes (or fails) on its own
            return self._failed(f"no answer within {timeout_s or self.timeout_s:g} s", None)
        error = task.exception()
        if isinstance(error, self._failures):
            return self._failed(f"{type(error).__name__}: {error}", error)
        if error is not None:
            raise error
        self.breaker.success()
        return task.result()

    async def _run(self, op: Callable[[Redis], Awaitable[T]]) -> T:
        async with asyncio.timeout(self.op_timeout_s):  # a cancel disconnects the connection
            return await op(self._connect())

    def _failed(self, why: str, error: BaseException | None) -> NoReturn:
        self.num_errors += 1
        self.breaker.failure(self.clock())
        raise Unavailable(f"redis {self.url}: {why}") from error

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


def _forget(tasks: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    def done(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a late failure was counted as the caller's timeout

    return done


def decode_info(info: dict[str, Any], key: str) -> int:
    """An integer field of an INFO reply (0 when absent: an older or trimmed server)."""
    value = info.get(key, 0)
    return int(value) if isinstance(value, int | float | str) else 0
