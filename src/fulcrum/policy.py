"""Batch formation as pure policy: the `BatchPolicy` seam, its `Plan`, and Triton's rules.

No asyncio and no real clock here: every decision takes `now`, so the rules are tested with a
fake clock and without sleeps. The batcher (the async shell) owns the only instance, made by
`make_policy` from the model's config; the queue itself lives in `fulcrum.pending`.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from fulcrum.config import ModelConfig
from fulcrum.latency_model import LatencyModel
from fulcrum.pending import DELAYED, DONE, QUEUED, Pending, PendingQueue, default_queue_bound
from fulcrum.queue_bound import DerivedBound
from fulcrum.types import TensorMap

__all__ = [
    "DELAYED",
    "DONE",
    "QUEUED",
    "BatchPolicy",
    "BatchRecord",
    "Pending",
    "PendingQueue",
    "Plan",
    "TritonPolicy",
    "compat_key",
    "default_queue_bound",
    "dynamic_axes",
    "make_policy",
]


def dynamic_axes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensor axes (batch axis is 0) that may differ between requests and are padded; not BYTES."""
    if config.max_batch_size <= 0:
        return {}
    return {
        spec.name: axes
        for spec in config.inputs
        if spec.datatype != "BYTES"
        and (axes := tuple(i + 1 for i, d in enumerate(spec.shape) if d == -1))
    }


def compat_key(inputs: TensorMap, axes_by_input: Mapping[str, tuple[int, ...]]) -> Hashable:
    """Equal keys mean the inputs concatenate on axis 0: same names, dtypes, fixed per-row dims."""
    parts: list[tuple[str, object, tuple[int, ...]]] = []
    for name in sorted(inputs):
        array = inputs[name]
        row_shape: tuple[int, ...] = array.shape[1:]
        axes = axes_by_input.get(name)
        if axes:
            row_shape = tuple(-1 if i + 1 in axes else d for i, d in enumerate(row_shape))
        parts.append((name, array.dtype, row_shape))
    return tuple(parts)


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """What one batch did, its re-runs included; handed to the policy's `observe`, then to
    `on_batch` (statistics, metrics)."""

    batch_size: int
    num_requests: int
    compute_s: float  # the first dispatch
    queue_s: list[float]
    failed: bool  # the first dispatch (or splitting its outputs) failed
    num_retried_dispatches: int = 0  # extra dispatches made to isolate a failure
    num_isolated_failures: int = 0  # requests that failed again when re-run apart
    retry_compute_s: float = 0.0  # time those extra dispatches took
    # (rows, compute_s) of each extra dispatch that succeeded: executions like any other
    retried_batches: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Plan:
    """What the batcher does now: run `run` (if any), fail `reject` with 504 (queue timeout),
    fail `shed` with 503 + Retry-After `retry_after_s` (deadline out of reach), else wait."""

    run: tuple[Pending, ...] = ()
    reject: tuple[Pending, ...] = ()
    wake_at_s: float | None = None  # when to plan again if nothing new arrives; None: no need
    shed: tuple[Pending, ...] = ()
    retry_after_s: float = 0.0  # the predicted drain time of the queue, precise


class BatchPolicy(Protocol):
    """Decides which queued items form the next batch; takes them out of the queue."""

    def plan(self, queue: PendingQueue, now: float) -> Plan: ...

    def observe(self, record: BatchRecord) -> None:
        """What a batch really cost, after it ran (failed ones too); called once per batch."""

    def observe_answer(self, overhead_s: float, latency_s: float) -> None:
        """One answered request: its time in the server outside the queue and its batch, and
        its whole time since it reached the server."""

    def on_arrival(self, queue: PendingQueue, item: Pending, now: float) -> float | None:
        """Just admitted: None to keep it, else refuse it at once (503) with this Retry-After."""

    def state(self) -> dict[str, object]:
        """The policy's current state for the statistics API and metrics (JSON-ready)."""

    def estimate_finish_s(self, num_queued_rows: int, num_rows: int, now: float) -> float:
        """Predicted seconds from `now` until a new request of `num_rows` rows, queued behind
        `num_queued_rows` rows, has run (the lane router's view of this batcher)."""


def make_policy(config: ModelConfig) -> BatchPolicy:
    """The policy `[dynamic_batching] policy` names ("triton" when there is none)."""
    batching = config.dynamic_batching
    if batching is not None and batching.policy == "adaptive" and config.max_batch_size > 0:
        from fulcrum.policy_adaptive import AdaptivePolicy  # it imports this module

        return AdaptivePolicy(config)
    return TritonPolicy(config)


@dataclass(slots=True)
class _Scan:
    items: list[Pending]
    num_rows: int
    num_best: int  # items in the best prefix to run before the delay expires; 0: none
    send_now: bool  # the next item cannot join: the batch cannot grow
    oldest_s: float


class TritonPolicy:
    """Triton's dynamic batcher: max and preferred batch sizes, queue delay, priority levels."""

    def __init__(self, config: ModelConfig) -> None:
        batching = config.dynamic_batching
        # Like Triton, a model without [dynamic_batching] runs each request on its own.
        self.batched = batching is not None and config.max_batch_size > 0
        self.max_batch_size = max(1, config.max_batch_size)
        self.max_queue_delay_s = batching.max_queue_delay_ms / 1000 if batching else 0.0
        self.preferred = frozenset(batching.preferred_batch_sizes if batching else ())
        self.max_preferred = max(self.preferred, default=self.max_batch_size)
        # Triton's batching rules are static; only the queue bound a config leaves out is
        # learned, from the measured batch time, so overload is refused instead of queued.
        self.model = LatencyModel()
        slo_s = batching.slo_p99_ms / 1000 if batching else 0.0
        self.derived = DerivedBound(config.instances.count, slo_s)
        # The batch it runs under a backlog: with preferred sizes and no added wait, Triton's rule
        # takes the largest preferred size the queue fills, so the queue drains in those.
        backlog_batch = self.max_preferred if self.max_queue_delay_s == 0 else self.max_batch_size
        self._limit = backlog_batch if self.batched else 1
        self.num_instances = config.instances.count
        self._busy_until: list[float] = []  # predicted ends of running batches (min-heap)

    def observe(self, record: BatchRecord) -> None:
        if self._busy_until:
            heapq.heappop(self._busy_until)
        if record.failed:  # a failure's time says nothing about the model's speed
            return
        self.model.observe(record.batch_size, record.compute_s)
        self.derived.observe(record)
        self.derived.refresh(self.model, self._limit)

    def observe_answer(self, overhead_s: float, latency_s: float) -> None:
        """Static rules plan no deadlines: how long an answer took changes nothing."""

    def on_arrival(self, queue: PendingQueue, item: Pending, now: float) -> float | None:
        """Static rules refuse only at the queue bound (the queue itself does that)."""
        return None

    def estimate_finish_s(self, num_queued_rows: int, num_rows: int, now: float) -> float:
        """The queue in full batches and the running batches spread over the instances, the
        queue delay (it may wait that long for company), then its own batch."""
        full, rest = divmod(num_queued_rows, self._limit)
        work_s = sum(max(0.0, end_s - now) for end_s in self._busy_until)
        work_s += full * self.model.predict(self._limit)
        work_s += self.model.predict(rest) if rest else 0.0
        own_s = self.max_queue_delay_s + self.model.predict(num_rows)
        return work_s / self.num_instances + own_s

    def _started(self, items: Sequence[Pending], now: float) -> None:
        busy = self._busy_until
        heapq.heappush(busy, now + self.model.predict(sum(i.num_rows for i in items)))
        if len(busy) > self.num_instances:  # a batch dropped unrun (all cancelled) never ends
            heapq.heappop(busy)

    def state(self) -> dict[str, object]:
        fit = self.model.fit()
        return {
            "name": "triton",
            "batch_limit": self._limit,
            "batch_fixed_ms": fit.a_s * 1000,
            "batch_row_ms": fit.c_s * 1000,
            "queue_bound": self.derived.bound,
        }

    def plan(self, queue: PendingQueue, now: float) -> Plan:
        """Reject expired items, then run a batch now or say when to look again."""
        rejected = tuple(queue.expire(now))
        self.derived.apply(queue)
        if not queue:
            return Plan(reject=rejected)
        if not self.batched:
            head = next(queue.live())
            queue.take((head,))
            self._started((head,), now)
            return Plan(run=(head,), reject=rejected)
        scan = self._scan(queue)
        delay_s = self.max_queue_delay_s
        delay_exceeded = delay_s > 0 and now - scan.oldest_s >= delay_s
        if scan.num_best and not delay_exceeded:
            run = scan.items[: scan.num_best]
        elif scan.send_now or scan.num_rows >= self.max_preferred or delay_s == 0 or delay_exceeded:
            run = scan.items
        else:
            wake_at_s = scan.oldest_s + delay_s
            next_deadline_s = queue.next_deadline_s
            if next_deadline_s is not None:
                wake_at_s = min(wake_at_s, next_deadline_s)
            return Plan(reject=rejected, wake_at_s=wake_at_s)
        queue.take(run)
        self._started(run, now)
        return Plan(run=tuple(run), reject=rejected)

    def _scan(self, queue: PendingQueue) -> _Scan:
        # Walk items in service order while they fit and match the first one (Triton stops at
        # the first item that cannot join rather than skipping it: FIFO within a level holds).
        # Runs once per batch over up to max_batch_size items: kept lean.
        items: list[Pending] = []
        num_rows = num_best = 0
        send_now = False
        oldest_s = float("inf")
        key: Hashable = None
        max_preferred, max_batch_size, preferred = (
            self.max_preferred,
            self.max_batch_size,
            self.preferred,
        )
        for item in queue.live():
            if items:
                grown = num_rows + item.num_rows
                if grown > max_preferred and not num_best:
                    num_best = len(items)
                if grown > max_batch_size or item.key != key:
                    send_now = True
                    break
            else:
                key = item.key
            items.append(item)
            num_rows += item.num_rows
            if item.enqueue_s < oldest_s:
                oldest_s = item.enqueue_s
            if num_rows in preferred:
                num_best = len(items)
        return _Scan(items, num_rows, num_best, send_now, oldest_s)
