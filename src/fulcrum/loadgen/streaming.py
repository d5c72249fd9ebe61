"""A target whose answers are event streams (OpenAI SSE, v2 row streams): prepared requests sent
round-robin on keep-alive connections, each stream read by the target's event reader."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fulcrum.client import ClientTimeout, Connection, Endpoint, Stream
from fulcrum.errors import InvalidInput
from fulcrum.loadgen.records import Outcome

EventReader = Callable[[Stream, Outcome], Awaitable[None]]


class StreamTarget:
    """Hands out slots that send `requests` (raw HTTP) round-robin and read each stream."""

    def __init__(self, endpoint: Endpoint, requests: list[bytes], read: EventReader) -> None:
        if not requests:
            raise InvalidInput("no requests to send")
        self.endpoint = endpoint
        self.requests = requests
        self.read = read
        self.num_sent = 0
        self.num_retried = 0  # sent again after the server's idle close crossed them (client.py)

    def open_slot(self) -> StreamSlot:
        return StreamSlot(self)


class StreamSlot:
    """One keep-alive connection sending streamed requests."""

    def __init__(self, target: StreamTarget) -> None:
        self.target = target
        self.connection = Connection(target.endpoint)

    async def send(self, timeout_s: float) -> Outcome:
        target = self.target
        raw = target.requests[target.num_sent % len(target.requests)]
        target.num_sent += 1
        retried = self.connection.num_retried
        try:
            # The whole stream, not only its headers, must finish within the timeout.
            async with asyncio.timeout(timeout_s):
                return await self._exchange(raw)
        except TimeoutError as exc:
            self.connection.close()
            raise ClientTimeout(f"stream not finished within {timeout_s:g} s") from exc
        except BaseException:
            self.connection.close()  # a half-read stream leaves the connection out of step
            raise
        finally:
            target.num_retried += self.connection.num_retried - retried

    async def _exchange(self, raw: bytes) -> Outcome:
        # A generation is safe to repeat before any byte of it came back: it changes nothing.
        stream = await self.connection.stream(raw, retry_unanswered=True)
        outcome = Outcome(stream.status)
        if not outcome.ok:
            body = b"".join([c async for c in stream.chunks()])
            outcome.error = body[:200].decode(errors="replace")
            return outcome
        await self.target.read(stream, outcome)
        return outcome

    def close(self) -> None:
        self.connection.close()
