"""What the batcher passes around: a queued request (the policy's view plus its payload and
future), one batch's running account, one dispatch's outputs, the result a caller gets, and
the errors a request ends with."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import cast

from fulcrum.errors import DeadlineExceeded, FulcrumError, ModelError, Shed
from fulcrum.pending import Pending
from fulcrum.policy import BatchRecord
from fulcrum.types import TensorMap


@dataclass(frozen=True, slots=True)
class InferResult:
    """One request's outputs (its own rows) and where its time went."""

    outputs: TensorMap
    queue_s: float  # submit -> dispatch of the batch that answered it
    compute_s: float  # the dispatch call of that batch
    batch_size: int  # rows in that batch
    # The `Fulcrum-Route` header: the lane taken (laned models only); keyword-only, so subclasses
    # (CachedResult) keep their positional fields.
    route: str | None = field(default=None, kw_only=True)


class QueuedRequest(Pending):
    """A queued request: the policy's view plus the payload and the caller's future."""

    __slots__ = ("future", "inputs", "submit_perf_s")

    def __init__(
        self,
        num_rows: int,
        key: Hashable,
        enqueue_s: float,
        inputs: TensorMap,
        future: asyncio.Future[InferResult],
        *,
        origin_s: float | None = None,
    ) -> None:
        super().__init__(num_rows, key, enqueue_s, origin_s)
        self.inputs = inputs
        self.future = future
        self.submit_perf_s = time.perf_counter()


@dataclass(slots=True)
class Tally:
    """One batch's running account; becomes its BatchRecord."""

    num_rows: int
    num_requests: int
    queue_s: list[float]
    compute_s: float = 0.0
    failed: bool = False
    num_retried_dispatches: int = 0
    num_isolated_failures: int = 0
    retry_compute_s: float = 0.0
    retried_batches: list[tuple[int, float]] = field(default_factory=list)
    holds_slot: bool = True
    recorded: bool = False  # its record is out to the policy and the statistics (or on its way)

    def record(self) -> BatchRecord:
        return BatchRecord(
            self.num_rows, self.num_requests, self.compute_s, self.queue_s, self.failed,
            self.num_retried_dispatches, self.num_isolated_failures, self.retry_compute_s,
            tuple(self.retried_batches),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Ran:
    """One dispatch's outputs and when it started (perf_counter seconds) and how long it took."""

    outputs: TensorMap
    start_s: float
    compute_s: float


def shed_error(drain_s: float) -> Shed:
    """The 503 for a request that cannot finish within its deadline."""
    why = f"it cannot finish within its deadline (queue drains in {drain_s:.3f} s)"
    return Shed(why, retry_after_s=drain_s)


def fail(requests: Sequence[QueuedRequest], error: FulcrumError) -> None:
    """End every request not ended yet with `error`."""
    for request in requests:
        if not request.future.done():
            request.future.set_exception(error)


def model_error(exc: Exception) -> FulcrumError:
    """A backend's exception as the error its callers get (a ModelError unless it is ours)."""
    if isinstance(exc, FulcrumError):
        return exc
    error = ModelError(f"model failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def time_out(items: Sequence[Pending], now: float) -> None:
    """End each queued request not ended yet with a 504: it waited past its queue timeout."""
    for item in items:
        request = cast(QueuedRequest, item)
        if not request.future.done():
            waited_s = now - request.enqueue_s
            request.future.set_exception(
                DeadlineExceeded(f"request timed out after {waited_s:.3f} s in the queue")
            )
