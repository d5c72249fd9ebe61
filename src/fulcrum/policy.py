"""Batch formation as pure policy: queued items per priority level, admission, and `plan()`.

No asyncio and no real clock here: every decision takes `now`, so Triton's rules are tested with
a fake clock and without sleeps. The batcher (the async shell) owns the only instance.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from fulcrum.config import ModelConfig, QueuePolicy
from fulcrum.errors import InvalidInput, QueueFull
from fulcrum.types import TensorMap

# Item states. An item leaves the queue lazily: its state changes at once, its deque slot is
# popped when it reaches the head, so cancel and expiry never scan a deque.
QUEUED, DELAYED, DONE = 0, 1, 2


class Pending:
    """One queued request as the policy sees it; the batcher subclasses it to carry the payload."""

    __slots__ = (
        "cancelled",
        "deadline_s",
        "enqueue_s",
        "key",
        "level",
        "num_rows",
        "seq",
        "state",
        "timeout_action",
    )

    def __init__(self, num_rows: int, key: Hashable, enqueue_s: float) -> None:
        self.num_rows = num_rows
        self.key = key  # items with different keys never share a batch
        self.enqueue_s = enqueue_s  # clock seconds
        self.seq = -1  # set by admit: arrival order
        self.level = 0  # set by admit: 1 is the highest priority
        self.deadline_s: float | None = None  # absolute clock seconds; None: no timeout
        self.timeout_action = "reject"  # or "delay"
        self.state = QUEUED
        self.cancelled = False

    def __repr__(self) -> str:
        return f"Pending(seq={self.seq}, rows={self.num_rows}, level={self.level})"


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


class PendingQueue:
    """Pending items per priority level: FIFO deques; DELAY-expired items go behind the rest."""

    def __init__(self, config: ModelConfig) -> None:
        self.num_levels = config.num_priority_levels
        self.default_level = config.default_priority
        self._policies: list[QueuePolicy] = [
            config.queue_policy(level) for level in range(1, self.num_levels + 1)
        ]
        self._ready: list[deque[Pending]] = [deque() for _ in range(self.num_levels)]
        self._delayed: list[deque[Pending]] = [deque() for _ in range(self.num_levels)]
        self._num_live = [0] * self.num_levels
        self._num_total = 0
        self._deadlines: list[tuple[float, int, Pending]] = []  # min-heap, lazily pruned
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._num_total

    def depth(self, level: int) -> int:
        """Live items waiting at one priority level."""
        return self._num_live[level - 1]

    def level_of(self, priority: int | None) -> int:
        """The level a request's priority maps to: 0/None -> the default; 1..levels else 400."""
        if not priority:
            return self.default_level
        if not 1 <= priority <= self.num_levels:
            raise InvalidInput(f"priority {priority} is outside 1..{self.num_levels}")
        return priority

    def timeout_of(self, level: int, timeout_s: float | None) -> float | None:
        """The effective timeout in seconds (None: none); a request's 0/None means not given."""
        if timeout_s is not None and timeout_s < 0:
            raise InvalidInput(f"timeout {timeout_s} s is negative")
        policy = self._policies[level - 1]
        default_s = policy.default_timeout_ms / 1000 if policy.default_timeout_ms > 0 else None
        if not timeout_s or not policy.allow_timeout_override:
            return default_s
        # A request may only shorten the model's default, never extend it.
        return timeout_s if default_s is None else min(timeout_s, default_s)

    def admit(self, item: Pending, *, priority: int | None, timeout_s: float | None) -> None:
        """Queue `item`, or raise InvalidInput (bad priority/timeout) or QueueFull (at once)."""
        level = self.level_of(priority)
        policy = self._policies[level - 1]
        if policy.max_queue_size and self._num_live[level - 1] >= policy.max_queue_size:
            raise QueueFull(
                f"queue for priority level {level} is full "
                f"({policy.max_queue_size} requests waiting)"
            )
        timeout = self.timeout_of(level, timeout_s)
        item.level = level
        item.timeout_action = policy.timeout_action
        item.seq = next(self._seq)
        if timeout is not None:
            item.deadline_s = item.enqueue_s + timeout
            heapq.heappush(self._deadlines, (item.deadline_s, item.seq, item))
        self._ready[level - 1].append(item)
        self._num_live[level - 1] += 1
        self._num_total += 1

    def live(self) -> Iterator[Pending]:
        """Live items in service order: per level (1 first), on-time items, then DELAY-expired."""
        for level in range(self.num_levels):
            if not self._num_live[level]:
                continue
            for item in self._ready[level]:
                if item.state == QUEUED:
                    yield item
            for item in self._delayed[level]:
                if item.state != DONE:
                    yield item

    def take(self, items: Sequence[Pending]) -> None:
        """Remove items chosen to run (or reject); they are a prefix of `live()` in practice."""
        num_live = self._num_live
        for item in items:  # inlined _retire: this runs once per request on the hot path
            if item.state != DONE:
                item.state = DONE
                num_live[item.level - 1] -= 1
                self._num_total -= 1
        self._trim()
        self._prune_deadlines()

    def cancel(self, item: Pending) -> bool:
        """Mark a queued item cancelled so it never runs; False when it already left the queue."""
        if item.state == DONE:
            return False
        item.cancelled = True
        self._retire(item)
        self._trim()
        self._prune_deadlines()
        return True

    def expire(self, now: float) -> list[Pending]:
        """Apply timeouts due by `now`: return REJECT items (removed); move DELAY items back."""
        rejected: list[Pending] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            item = heapq.heappop(heap)[2]
            if item.state != QUEUED:
                continue
            if item.timeout_action == "delay":
                item.state = DELAYED
                self._delayed[item.level - 1].append(item)
            else:
                self._retire(item)
                rejected.append(item)
        if rejected:
            self._trim()
        return rejected

    @property
    def next_deadline_s(self) -> float | None:
        """The earliest deadline of a still-queued item, or None."""
        self._prune_deadlines()
        heap = self._deadlines
        return heap[0][0] if heap else None

    def drain(self) -> list[Pending]:
        """Remove and return every live item (shutdown)."""
        items = list(self.live())
        for item in items:
            self._retire(item)
        for dq in (*self._ready, *self._delayed):
            dq.clear()
        self._deadlines.clear()
        return items

    def _retire(self, item: Pending) -> None:
        if item.state == DONE:
            return
        item.state = DONE
        self._num_live[item.level - 1] -= 1
        self._num_total -= 1

    def _prune_deadlines(self) -> None:
        # Entries of items that left the queue hold their payloads: drop them from the top (with
        # one timeout per level, deadlines are FIFO, so that is where they are), and rebuild the
        # heap when mixed timeouts leave too many deeper down.
        heap = self._deadlines
        while heap and heap[0][2].state != QUEUED:
            heapq.heappop(heap)
        if len(heap) > 2 * self._num_total + 64:
            heap[:] = [entry for entry in heap if entry[2].state == QUEUED]
            heapq.heapify(heap)

    def _trim(self) -> None:
        # Pop retired items off the deque heads so their payloads are freed; levels are few.
        for level in range(self.num_levels):
            ready, delayed = self._ready[level], self._delayed[level]
            if not self._num_live[level]:
                ready.clear()
                delayed.clear()
                continue
            while ready and ready[0].state != QUEUED:
                ready.popleft()
            while delayed and delayed[0].state == DONE:
                delayed.popleft()


@dataclass(frozen=True, slots=True)
class Plan:
    """What the batcher does now: run `run` (if any), fail `reject` with 504, else wait."""

    run: tuple[Pending, ...] = ()
    reject: tuple[Pending, ...] = ()
    wake_at_s: float | None = None  # when to plan again if nothing new arrives; None: no need


class BatchPolicy(Protocol):
    """Decides which queued items form the next batch; takes them out of the queue."""

    def plan(self, queue: PendingQueue, now: float) -> Plan: ...


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

    def plan(self, queue: PendingQueue, now: float) -> Plan:
        """Reject expired items, then run a batch now or say when to look again."""
        rejected = tuple(queue.expire(now))
        if not queue:
            return Plan(reject=rejected)
        if not self.batched:
            head = next(queue.live())
            queue.take((head,))
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
