"""What a model's queue may hold when its config sets no `max_queue_size`, and how much of the SLO
a request spends outside the queue and its batch.

`DerivedBound` turns the fitted batch time into a capacity and bounds the queue at the rows the
instances drain within the time a request may wait: the SLO's waiting time when the model has
one, else `DEFAULT_WAIT_S`. Both batch policies use it, so a model whose config says nothing
answers an overload with fast 503s (Retry-After = the full queue's drain time) instead of latency
and memory that grow without limit.

`OverheadReserve` keeps a high quantile of the time a request spends in the server outside the
queue and the batch (waking the caller, the event loop's other work) so the adaptive policy plans
batches to end that much before the SLO, not at it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the policies import this module
    from fulcrum.latency_model import LatencyModel
    from fulcrum.pending import PendingQueue
    from fulcrum.policy import BatchRecord

# Without an SLO a request may wait about this long before the queue refuses newcomers: long
# enough that a load the model keeps up with (bursts included) never sees a 503, short enough
# that an overload is refused at once rather than answered seconds late.
DEFAULT_WAIT_S = 1.0
# Share of the waiting time the bound fills: the fit times the backend only, not the event
# loop's work between batches, so a queue filled exactly to the fit's capacity drains late.
QUEUE_HEADROOM = 0.8
MEAN_ROWS_WEIGHT = 0.05  # EWMA weight of one batch in the mean rows per request
RESERVE_WINDOW = 256  # requests the overhead quantile looks back over
RESERVE_QUANTILE = 0.99
RESERVE_EVERY = 32  # requests between recomputations of the quantile (a sort of the window)
MAX_RESERVE_SHARE = 0.5  # the reserve never takes more than this share of the SLO


class DerivedBound:
    """The queue bound (in requests) and the Retry-After of a full queue, from the fitted
    capacity; 0 until the latency model has seen enough batches (the queue's default holds)."""

    def __init__(self, num_instances: int, slo_s: float) -> None:
        self.num_instances = num_instances
        self.slo_s = slo_s  # 0: no SLO, the waiting time is DEFAULT_WAIT_S
        self.bound = 0
        self.retry_after_s = 1.0
        self._mean_rows = 1.0
        self._changed = False

    def observe(self, record: BatchRecord) -> None:
        """Track the mean rows per request (the bound counts requests, capacity counts rows)."""
        rows_per_request = record.batch_size / max(1, record.num_requests)
        self._mean_rows += MEAN_ROWS_WEIGHT * (rows_per_request - self._mean_rows)

    def refresh(self, model: LatencyModel, batch_limit: int, reserve_s: float = 0.0) -> None:
        """Recompute from the model's fit at the batch size the policy runs at most."""
        if not model.trusted:
            return
        # Its slow runs, not its mean: the bound then agrees with the adaptive policy's arrival
        # check (which plans with them too), so an overload meets the O(1) full queue first.
        limit_s = model.predict_high(batch_limit)
        capacity_rows_s = self.num_instances * batch_limit / limit_s
        if self.slo_s > 0:
            # Admitted requests must drain, then run in their own batch, within the SLO.
            wait_s = max(self.slo_s - reserve_s - limit_s, limit_s) * QUEUE_HEADROOM
        else:
            wait_s = DEFAULT_WAIT_S
        floor = self.num_instances * batch_limit
        bound = max(floor, math.floor(capacity_rows_s * wait_s / self._mean_rows))
        self.retry_after_s = bound * self._mean_rows / capacity_rows_s
        if bound != self.bound:
            self.bound = bound
            self._changed = True

    def apply(self, queue: PendingQueue) -> None:
        """Hand a changed bound to the queue (called from the policy's plan: the batcher's loop
        owns the queue)."""
        if self._changed:
            self._changed = False
            queue.set_derived_bound(self.bound)
            queue.retry_after_s = self.retry_after_s


class OverheadReserve:
    """A high quantile of the seconds a request spends outside the queue and its batch."""

    def __init__(self, slo_s: float) -> None:
        self._max_s = slo_s * MAX_RESERVE_SHARE
        self._window: list[float] = []
        self._next = 0
        self._count = 0
        self.reserve_s = 0.0

    def add(self, seconds: float) -> None:
        if not seconds >= 0 or math.isinf(seconds):
            return
        if len(self._window) < RESERVE_WINDOW:
            self._window.append(seconds)
        else:
            self._window[self._next] = seconds
            self._next = (self._next + 1) % RESERVE_WINDOW
        self._count += 1
        if self._count % RESERVE_EVERY == 0:
            ordered = sorted(self._window)
            at = min(len(ordered) - 1, math.ceil(RESERVE_QUANTILE * len(ordered)) - 1)
            self.reserve_s = min(ordered[at], self._max_s)
