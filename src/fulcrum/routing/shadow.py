"""Shadow traffic: after the caller is answered, a fraction of requests also runs, as a task, on
a reference variant or version, and the two answers' agreement is recorded.

Never in the caller's way: the shadow starts after the caller's answer is ready, at the
reference's lowest priority, straight to its batcher (no result cache read or filled, no A/B or
caller metrics). Bounded: at most `max_in_flight` shadows of a model run at once, and none is
sent to a reference whose queue is full (or, with one priority level, not empty); those are
dropped and counted, never queued. `close`
cancels the ones running (server shutdown).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Protocol

from fulcrum.batch_request import InferResult
from fulcrum.config import ModelConfig
from fulcrum.errors import FulcrumError
from fulcrum.routing.agreement import agreement
from fulcrum.routing.metrics import RoutingMetrics
from fulcrum.routing.settings import ShadowSettings
from fulcrum.types import TensorMap


class Target(Protocol):
    """What a shadow reads of the caller's and the reference's servable (a `Target`)."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def is_ready(self) -> bool: ...

    @property
    def queue_depth(self) -> int: ...

    def is_full(self, priority: int | None = None) -> bool: ...

    async def infer(
        self, inputs: TensorMap, *, priority: int | None, timeout_s: float | None,
        age_s: float = 0.0,
    ) -> InferResult: ...  # fmt: skip


class ShadowRunner:
    """Starts, bounds and owns every shadow request of the service."""

    def __init__(self, metrics: RoutingMetrics, rng: random.Random | None = None) -> None:
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_flight: dict[str, int] = {}  # model -> shadows running
        self._closed = False

    def in_flight(self, model: str) -> int:
        return self._in_flight.get(model, 0)

    def offer(
        self,
        caller: Target,
        settings: ShadowSettings,
        reference: Callable[[], Target],
        inputs: TensorMap,
        result: InferResult,
    ) -> bool:
        """Maybe shadow one answered batch request (`reference`: finds the reference's
        servable, or raises); True when a shadow was started."""
        model = caller.config.name
        if not self.draws(settings):
            return False
        name = reference_name(settings)
        try:
            target = reference()
        except FulcrumError:
            self._metrics.record_shadow(model, name, "failed")  # the reference is not loaded
            return False
        lowest = target.config.num_priority_levels
        # With one priority level a queued shadow would wait ahead of later real requests:
        # it is sent only to an empty queue. With several it waits behind them all.
        backlog = lowest == 1 and target.queue_depth > 0
        if not target.is_ready or target.is_full(lowest) or backlog:
            self._metrics.record_shadow(model, name, "dropped")
            return False
        output = settings.output or caller.config.outputs[0].name
        batched = caller.config.max_batch_size > 0

        async def compare() -> float | None:
            answer = await target.infer(inputs, priority=lowest,
                                        timeout_s=settings.timeout_ms / 1000)  # fmt: skip
            mine, theirs = result.outputs.get(output), answer.outputs.get(output)
            if mine is None or theirs is None:
                return None
            return agreement(settings.compare, mine, theirs, batched=batched)

        return self.offer_call(model, settings, compare, sampled=True)

    def draws(self, settings: ShadowSettings) -> bool:
        """Whether this request is among the shadowed fraction (and shadows still start)."""
        return not self._closed and self._rng.random() < settings.fraction

    def offer_call(
        self,
        model: str,
        settings: ShadowSettings,
        compare: Callable[[], Awaitable[float | None]],
        *,
        sampled: bool = False,
    ) -> bool:
        """Maybe run `compare` (the reference's call; the agreement, or None when the answers
        cannot be compared) as a shadow (`sampled`: the fraction was drawn already)."""
        if self._closed or (not sampled and not self.draws(settings)):
            return False
        name = reference_name(settings)
        if self.in_flight(model) >= settings.max_in_flight:
            self._metrics.record_shadow(model, name, "dropped")
            return False
        self._metrics.record_shadow(model, name, "sent")
        self._in_flight[model] = self.in_flight(model) + 1
        task = asyncio.ensure_future(self._track(model, name, compare))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # On the task, not in its body: a shadow cancelled before its first step (the server
        # stopping just after the answer went out) never runs its body, and still ends.
        task.add_done_callback(lambda _: self._ended(model))
        return True

    def _ended(self, model: str) -> None:
        self._in_flight[model] -= 1

    async def _track(
        self, model: str, name: str, compare: Callable[[], Awaitable[float | None]]
    ) -> None:
        try:
            score = await compare()
        except (FulcrumError, TimeoutError):
            score = None
        if score is None:
            self._metrics.record_shadow(model, name, "failed")
        else:
            self._metrics.record_agreement(model, name, score)

    async def wait(self) -> None:
        """Until every shadow started so far has finished (tests, benchmarks)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Cancel the shadows running and start no more (the server stops)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def reference_name(settings: ShadowSettings) -> str:
    """The reference's metric label: its variant, or `v<version>`."""
    return settings.variant or f"v{settings.version}"
