"""The queue of pending requests per priority level: admission (bounded), timeouts, service order.

FIFO within a level for Triton's policy; earliest deadline first (a heap on each item's SLO
deadline) for the adaptive one. Admission is O(1) before the push, so a full queue answers 503
without touching anything else. No asyncio, no clock: every call that needs time takes `now`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Hashable, Iterator, Sequence

from fulcrum.config import ModelConfig, QueuePolicy
from fulcrum.errors import InvalidInput, QueueFull

# Item states. An item leaves the queue lazily: its state changes at once, its deque slot is
# popped when it reaches the head, so cancel and expiry never scan a deque.
QUEUED, DELAYED, DONE = 0, 1, 2
# Without max_queue_size a level holds this many full batches per instance: at 5-50 ms a batch
# that is 0.3-3 s of work, so a load the model keeps up with never sees a 503, while an overload
# is refused at once instead of growing latency and memory without limit.
DEFAULT_QUEUE_BATCHES = 64

_Entry = tuple[float, int, "Pending"]


class Pending:
    """One queued request as the policy sees it; the batcher subclasses it to carry the payload."""

    __slots__ = (
        "cancelled",
        "deadline_s",
        "due_s",
        "enqueue_s",
        "key",
        "level",
        "num_rows",
        "origin_s",
        "seq",
        "state",
        "timeout_action",
    )

    def __init__(
        self, num_rows: int, key: Hashable, enqueue_s: float, origin_s: float | None = None
    ) -> None:
        self.num_rows = num_rows
        self.key = key  # items with different keys never share a batch
        self.enqueue_s = enqueue_s  # clock seconds
        # When the request reached the server (clock seconds): its SLO counts from there, so
        # the time its body took to arrive and decode is not hidden from the policy.
        self.origin_s = enqueue_s if origin_s is None else min(origin_s, enqueue_s)
        self.seq = -1  # set by admit: arrival order
        self.level = 0  # set by admit: 1 is the highest priority
        self.deadline_s: float | None = None  # queue timeout (504), absolute; None: none
        self.due_s = math.inf  # SLO deadline: origin + SLO - reserve, or the timeout if sooner
        self.timeout_action = "reject"  # or "delay"
        self.state = QUEUED
        self.cancelled = False

    def __repr__(self) -> str:
        return f"Pending(seq={self.seq}, rows={self.num_rows}, level={self.level})"


def default_queue_bound(config: ModelConfig) -> int:
    """The bound of a level whose config leaves max_queue_size out (before any SLO-derived one)."""
    return DEFAULT_QUEUE_BATCHES * max(1, config.max_batch_size) * config.instances.count


class PendingQueue:
    """Pending items per priority level: FIFO deques (or EDF heaps); DELAY-expired items go
    behind the rest of their level."""

    def __init__(self, config: ModelConfig) -> None:
        batching = config.dynamic_batching
        self.num_levels = config.num_priority_levels
        self.default_level = config.default_priority
        self.edf = batching is not None and batching.policy == "adaptive"
        # Time from arrival to the end of a request's batch; the policy lowers it by the
        # measured time a request spends outside the queue and the batch (`OverheadReserve`).
        self.slo_s = batching.slo_p99_ms / 1000 if batching else 0.0
        self._policies: list[QueuePolicy] = [
            config.queue_policy(level) for level in range(1, self.num_levels + 1)
        ]
        sizes = [p.max_queue_size for p in self._policies]
        self._derived = [size is None for size in sizes]  # levels whose bound the policy sets
        default = default_queue_bound(config)
        self._bounds = [default if size is None else max(size, 0) for size in sizes]  # 0: none
        self.retry_after_s = 1.0  # what a QueueFull says; the adaptive policy keeps it current
        self._ready: list[deque[Pending]] = [deque() for _ in range(self.num_levels)]
        self._heaps: list[list[_Entry]] = [[] for _ in range(self.num_levels)]
        self._delayed: list[deque[Pending]] = [deque() for _ in range(self.num_levels)]
        self._num_live = [0] * self.num_levels
        self._num_total = 0
        self.num_rows = 0  # rows of live items
        self._level_rows = [0] * self.num_levels
        self._deadlines: list[_Entry] = []  # min-heap, lazily pruned
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._num_total

    def rows_through(self, level: int) -> int:
        """Rows waiting at this priority level and every higher one (what runs before it)."""
        return sum(self._level_rows[:level])

    def depth(self, level: int) -> int:
        """Live items waiting at one priority level."""
        return self._num_live[level - 1]

    def bound(self, level: int) -> int:
        """The most items a level holds (0: unbounded)."""
        return self._bounds[level - 1]

    def set_derived_bound(self, bound: int) -> None:
        """Bound every level whose config left max_queue_size out (the policy measured it)."""
        for i, derived in enumerate(self._derived):
            if derived:
                self._bounds[i] = max(1, bound)

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
        full = self.place(item, priority)
        if full is not None:
            raise full
        level = item.level
        timeout = self.timeout_of(level, timeout_s)
        item.seq = seq = next(self._seq)
        if timeout is not None:
            item.deadline_s = deadline_s = item.enqueue_s + timeout
            item.due_s = min(item.due_s, deadline_s)
            heapq.heappush(self._deadlines, (deadline_s, seq, item))
        if self.edf:
            heapq.heappush(self._heaps[level - 1], (item.due_s, seq, item))
        else:
            self._ready[level - 1].append(item)
        self._num_live[level - 1] += 1
        self._num_total += 1
        self.num_rows += item.num_rows
        self._level_rows[level - 1] += item.num_rows

    def place(self, item: Pending, priority: int | None) -> QueueFull | None:
        """Give `item` its level, queue policy and SLO due time without queueing it; the
        QueueFull its level's bound gives it now, else None (InvalidInput: a bad priority)."""
        level = self.level_of(priority)
        bound = self._bounds[level - 1]
        if bound and self._num_live[level - 1] >= bound:
            return QueueFull(
                f"queue for priority level {level} is full ({bound} requests waiting)",
                retry_after_s=self.retry_after_s,
            )
        item.level = level
        item.timeout_action = self._policies[level - 1].timeout_action
        if self.slo_s > 0:
            item.due_s = item.origin_s + self.slo_s
        return None

    def live(self) -> Iterator[Pending]:
        """Live items in service order: per level (1 first), on-time items, then DELAY-expired."""
        for level in range(1, self.num_levels + 1):
            yield from self.level_items(level)

    def level_items(self, level: int) -> Iterator[Pending]:
        """One level's live items in service order (FIFO or EDF), DELAY-expired ones last."""
        if not self._num_live[level - 1]:
            return
        if self.edf:
            yield from _in_order(self._heaps[level - 1])
        else:
            for item in self._ready[level - 1]:
                if item.state == QUEUED:
                    yield item
        for item in self._delayed[level - 1]:
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
                self.num_rows -= item.num_rows
                self._level_rows[item.level - 1] -= item.num_rows
        self._trim()
        self._prune_deadlines()

    def delay(self, item: Pending) -> None:
        """Move a queued item behind the rest of its level (it runs late: timeout_action delay)."""
        if item.state == QUEUED:
            item.state = DELAYED
            self._delayed[item.level - 1].append(item)
            self._trim()

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
        moved = False
        while heap and heap[0][0] <= now:
            item = heapq.heappop(heap)[2]
            if item.state != QUEUED:
                continue
            if item.timeout_action == "delay":
                item.state = DELAYED
                self._delayed[item.level - 1].append(item)
                moved = True
            else:
                self._retire(item)
                rejected.append(item)
        if rejected or moved:
            self._trim()
        return rejected

    @property
    def next_deadline_s(self) -> float | None:
        """The earliest queue-timeout deadline of a still-queued item, or None."""
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
        for level_heap in self._heaps:
            level_heap.clear()
        self._deadlines.clear()
        return items

    def _retire(self, item: Pending) -> None:
        if item.state == DONE:
            return
        item.state = DONE
        self._num_live[item.level - 1] -= 1
        self._num_total -= 1
        self.num_rows -= item.num_rows
        self._level_rows[item.level - 1] -= item.num_rows

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
        # Pop retired items off the deque and heap heads so their payloads are freed.
        for level in range(self.num_levels):
            ready, delayed, edf = self._ready[level], self._delayed[level], self._heaps[level]
            if not self._num_live[level]:
                ready.clear()
                delayed.clear()
                edf.clear()
                continue
            while ready and ready[0].state != QUEUED:
                ready.popleft()
            while edf and edf[0][2].state != QUEUED:
                heapq.heappop(edf)
            while delayed and delayed[0].state == DONE:
                delayed.popleft()


def _in_order(heap: list[_Entry]) -> Iterator[Pending]:
    """A heap's queued items in ascending order, lazily: O(k log k) for the first k, no copy."""
    if not heap:
        return
    frontier = [(heap[0], 0)]
    size = len(heap)
    while frontier:
        entry, i = heapq.heappop(frontier)
        if entry[2].state == QUEUED:
            yield entry[2]
        for child in (2 * i + 1, 2 * i + 2):
            if child < size:
                heapq.heappush(frontier, (heap[child], child))
