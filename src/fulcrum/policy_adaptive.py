"""The SLO-aware adaptive batch policy: batches as large as the queued requests' deadlines allow.

Each request is due at enqueue + `slo_p99_ms` (sooner when its own timeout says so). The policy
keeps an online model of batch run time (`LatencyModel`) and, whenever an instance is free:
sheds the requests that would miss their deadline even if they ran next alone (503, Retry-After
= the queue's predicted drain time), or moves them behind their level when its queue policy says
"delay"; then takes, earliest deadline first (levels strictly in order), the largest batch that
still finishes before the earliest deadline in its slow runs (the fit times `LatencyModel.error`,
as the arrival check also plans) and within the per-batch share of the SLO; and waits
(up to max_queue_delay_ms) only while waiting cannot make the earliest request miss. It also
bounds the queue (when the config does not) at what the instances drain within the SLO.

What a burst teaches must not refuse the light load after it: a request alone on an idle
instance is refused only when the fit says it cannot finish within its SLO (not the due time
that keeps the overhead reserve free), the arrival margin relaxes while the instance sits idle,
one probe far faster than the fit rescales it, and batches grow from the largest one measured.
"""

from __future__ import annotations

import heapq

from fulcrum.config import ModelConfig
from fulcrum.latency_model import LatencyModel
from fulcrum.pending import DELAYED, Pending, PendingQueue
from fulcrum.policy import BatchRecord, Plan
from fulcrum.queue_bound import DerivedBound, OverheadReserve

# The arrival check's margin on the predicted drain: a request admitted on arrival but shed
# later at the head shows the prediction was optimistic (gaps between batches, a busy loop), so
# each such shed raises the margin; every batch lowers it again, down to 1 (the prediction as
# is). Under steady overload it settles where raising and lowering balance: ln(1/DOWN) /
# ln(UP) late sheds a batch, 0.02 (at 0.99 it was 0.2: one late 503 in five batches, 1-2% of
# all 503s on minilm at 3x, which put the 503 P99 at the SLO instead of near zero).
MARGIN_UP = 1.05  # per late shed
MARGIN_DOWN = 0.999  # per batch
MAX_MARGIN = 3.0
# ... and while the instance sits idle (nothing queued or running) the margin's excess over 1
# halves every this many SLOs: a burst's late sheds say nothing about the light load after it,
# where so few batches run that the per-batch decay alone would keep the margin for minutes. An
# overload never leaves the instance idle, so this never touches the balance above.
MARGIN_IDLE_HALF_LIFE_SLOS = 10.0
MAX_GROWTH = 2  # the batch limit is at most this many times the largest batch measured
# Closed loop on what the plans are for, answers within the SLO. A batch is sized so that its
# head makes its deadline in the batch's slow runs, the fit times 1 + (error - 1) x caution. At
# caution 1 (the fit's P99 error in full) batches near capacity shrink for heads they would
# have made anyway, and the throughput lost queues and refuses more than it saves (on minilm at
# 290-320/s, 18 paired runs: 0.75 points more requests late or refused on average than near
# caution 0, worse in 14); at 3x capacity caution 0 let 1-2% of the admitted answers end past
# the SLO (P99 103-104 ms).
# So every answer past its due time (see `observe_answer`) raises the caution and every answer
# on time lowers it, and it settles where LATE_TARGET of the answers are late: half of what a
# P99 objective allows.
LATE_TARGET = 0.005
CAUTION_UP = 0.05  # per late answer: 20 late answers from none to full caution
CAUTION_DOWN = CAUTION_UP * LATE_TARGET / (1.0 - LATE_TARGET)  # per answer on time
# EWMA weight of one arrival in the mean time from a request's head to its queue (body read
# and decoded): the head's check runs that much later in its prediction.
AGE_WEIGHT = 0.02


NOTHING_TO_DO = Plan()  # wait for the next arrival


class AdaptivePolicy:
    """EDF batching under a latency SLO, fitted online; `plan` runs once per batch, not per item."""

    def __init__(self, config: ModelConfig) -> None:
        batching = config.dynamic_batching
        if batching is None or not batching.slo_p99_ms > 0 or config.max_batch_size < 1:
            raise ValueError("the adaptive policy needs batching, max_batch_size and slo_p99_ms")
        self.max_batch_size = config.max_batch_size
        self.num_instances = config.instances.count
        self.slo_s = batching.slo_p99_ms / 1000
        self.batch_budget_s = self.slo_s * batching.slo_batch_fraction
        self.max_queue_delay_s = batching.max_queue_delay_ms / 1000
        self.model = LatencyModel()
        self.batch_limit = self.max_batch_size  # rows one batch may hold now
        self.derived = DerivedBound(self.num_instances, self.slo_s)
        self.overhead = OverheadReserve(self.slo_s)
        self.num_shed = 0
        self.num_shed_late = 0  # of num_shed: admitted, then hopeless at the head of the queue
        self.num_shed_head = 0  # of num_shed: refused from the request head, body unread
        self.arrival_margin = 1.0
        self.caution = 1.0  # share of the fit's error a batch is sized for (see LATE_TARGET)
        self.num_late_answers = 0
        self.arrival_age_s = 0.0  # mean seconds from a request's head to its queue
        self.last_predicted_s = self.last_observed_s = 0.0
        self.num_probes = 0
        self._probing = False  # the next batch to end is a probe
        self._busy_until: list[float] = []  # predicted ends of running batches (min-heap)
        self._last_start_s: float | None = None  # when the last batch was sent (None: never)
        self._shed_since_start = 0
        self._idle_since_s: float | None = None  # since when nothing was queued or running

    @property
    def queue_bound(self) -> int:
        """The derived queue bound (0: not measured yet, the queue's default holds)."""
        return self.derived.bound

    def plan(self, queue: PendingQueue, now: float) -> Plan:
        """Time out, shed the hopeless, then run the largest on-time batch or say when to look."""
        rejected = tuple(queue.expire(now))
        self.derived.apply(queue)
        # Newly admitted requests are due early enough for the time they will still spend
        # outside the batch (waking the caller, encoding) to fit within the SLO.
        queue.slo_s = self.slo_s - self.overhead.reserve_s
        if self._last_start_s is None:
            self._last_start_s = now
        if not rejected and not len(queue):  # nothing to shed or run: twice per lone request
            self._note_idle(now)
            return NOTHING_TO_DO
        shed = self._shed_hopeless(queue, now, probe=self._starved(now))
        retry_after_s = self.drain_s(queue.num_rows, now) if shed else 0.0
        head = next(queue.live(), None)
        if head is None:
            self._note_idle(now)
            return Plan(reject=rejected, shed=shed, retry_after_s=retry_after_s)
        self._end_idle(now)
        # The largest batch that still finishes by the head's deadline, within the budget.
        by_deadline = self.batch_limit
        if head.state != DELAYED:  # a late one runs with the largest batch allowed
            error = 1.0 + (self.model.error - 1.0) * self.caution
            by_deadline = self.model.max_rows((head.due_s - now) / error)
        max_rows = max(head.num_rows, min(self.batch_limit, by_deadline))
        items, num_rows, can_grow = self._fill(queue, now, head, max_rows)
        if can_grow and num_rows < max_rows and self.max_queue_delay_s > 0:
            oldest_s = min(item.enqueue_s for item in items)
            wake_at_s = min(
                oldest_s + self.max_queue_delay_s, head.due_s - self.model.predict_high(max_rows)
            )
            if now < wake_at_s:
                next_deadline_s = queue.next_deadline_s
                if next_deadline_s is not None:
                    wake_at_s = min(wake_at_s, next_deadline_s)
                return Plan(
                    reject=rejected, shed=shed, retry_after_s=retry_after_s, wake_at_s=wake_at_s
                )
        queue.take(items)
        self._last_start_s = now
        self._shed_since_start = 0
        predicted_s = self.model.predict(num_rows)
        busy = self._busy_until
        heapq.heappush(busy, now + predicted_s)
        if len(busy) > self.num_instances:  # a batch dropped unrun (all cancelled) never ends
            heapq.heappop(busy)
        return Plan(run=tuple(items), reject=rejected, shed=shed, retry_after_s=retry_after_s)

    def observe(self, record: BatchRecord) -> None:
        """Refit the run-time model on one finished batch; refresh the limits that follow."""
        if self._busy_until:
            heapq.heappop(self._busy_until)
        if record.failed:  # a failure's time says nothing about the model's speed
            return
        self.arrival_margin = max(1.0, self.arrival_margin * MARGIN_DOWN)
        # Predicted before this batch taught the model anything: the error it really made.
        self.last_predicted_s = self.model.predict(record.batch_size)
        self.last_observed_s = record.compute_s
        probe, self._probing = self._probing, False
        self.model.observe(record.batch_size, record.compute_s, probe=probe)
        for num_rows, compute_s in record.retried_batches:
            self.model.observe(num_rows, compute_s)
        self.derived.observe(record)
        self._refresh()

    def on_arrival(self, queue: PendingQueue, item: Pending, now: float) -> float | None:
        """Refuse at once a request predicted to miss its deadline behind the rows ahead of it
        (its level and higher ones) and the running batches: the fast 503 an overload needs,
        rather than a wait that ends in one. Retry-After is the whole queue's drain time.

        `item` may also be a probe from the request head (not queued: its body is not read
        yet, `DynamicBatcher.early_refusal`): then its own rows are added to the queue's, and
        the check runs as it will when the request is queued, the measured time from the head
        to the queue later, so that the head refuses what the full path would (at a quarter of
        its cost) and what it lets through is rarely refused after its body was decoded."""
        if not self.model.trusted or item.timeout_action == "delay":
            return None
        self._end_idle(now)
        queued = item.seq >= 0  # admit() numbers queued items; a probe keeps -1
        if queued:
            age_s = max(0.0, now - item.origin_s)
            self.arrival_age_s += AGE_WEIGHT * (age_s - self.arrival_age_s)
            own_rows, at_s = 0, now
        else:
            own_rows, at_s = item.num_rows, now + self.arrival_age_s
        through = queue.rows_through(item.level) + own_rows
        ahead = max(0, through - item.num_rows)
        if ahead == 0 and self._starved(now):
            return None  # nothing ahead and no batch for a while: it runs now, as a probe
        # The margin weighs the work ahead (gaps between batches, a busy loop), not its own
        # batch: alone on an idle instance, a request is refused only when the fit says it
        # cannot make it at all.
        drain_s = self.drain_s(through, now)
        if ahead or self._busy_until:  # planned with the slow runs, as batches are
            drain_s *= self.model.error
        if ahead:
            drain_s += (self.arrival_margin - 1.0) * self.drain_s(ahead, now)
        if at_s + drain_s <= (item.due_s if ahead else self._deadline_s(item)):
            return None
        self.num_shed += 1
        self.num_shed_head += not queued
        self._shed_since_start += 1
        return self.drain_s(queue.num_rows + own_rows - item.num_rows, now)  # the queue without it

    def observe_answer(self, overhead_s: float, latency_s: float) -> None:
        """One answered request's time outside the queue and its batch (the overhead reserve),
        and whether it was on time (the caution batches are sized with)."""
        self.overhead.add(overhead_s)
        # Late by the time batches are planned to end by (the reserve before the SLO): what an
        # answer still spends after this (encoding, sending, the client) is not in latency_s,
        # and at the SLO itself 0.5% late here was 1%+ late at the client (P99 101 ms at 3x).
        if latency_s > self.slo_s - self.overhead.reserve_s:
            self.num_late_answers += 1
            self.caution = min(1.0, self.caution + CAUTION_UP)
        else:
            self.caution = max(0.0, self.caution - CAUTION_DOWN)

    def drain_s(self, num_rows: int, now: float) -> float:
        """Predicted seconds until `num_rows` queued rows and the running batches are done."""
        limit = max(1, self.batch_limit)
        full, rest = divmod(num_rows, limit)
        work_s = sum(max(0.0, end_s - now) for end_s in self._busy_until)
        work_s += full * self.model.predict(limit) + (self.model.predict(rest) if rest else 0.0)
        return work_s / self.num_instances

    def estimate_finish_s(self, num_queued_rows: int, num_rows: int, now: float) -> float:
        """The queue's and the running batches' drain, then its own batch and the time a
        request spends outside the batch."""
        own_s = self.model.predict(num_rows) + self.overhead.reserve_s
        return self.drain_s(num_queued_rows, now) + own_s

    def state(self) -> dict[str, object]:
        fit = self.model.fit()
        return {
            "name": "adaptive",
            "slo_p99_ms": self.slo_s * 1000,
            "batch_fixed_ms": fit.a_s * 1000,
            "batch_row_ms": fit.c_s * 1000,
            "batch_error": self.model.error,
            "batches_observed": self.model.num_observed,
            "speed_changes": fit.num_shifts,
            "batch_limit": self.batch_limit,
            "predicted_batch_ms": self.last_predicted_s * 1000,
            "observed_batch_ms": self.last_observed_s * 1000,
            "queue_bound": self.queue_bound,
            "overhead_reserve_ms": self.overhead.reserve_s * 1000,
            "shed_deadline": self.num_shed,
            "shed_late": self.num_shed_late,
            "shed_head": self.num_shed_head,
            "arrival_margin": self.arrival_margin,
            "caution": self.caution,
            "late_answers": self.num_late_answers,
            "arrival_age_ms": self.arrival_age_s * 1000,
            "probes": self.num_probes,
        }

    def _deadline_s(self, item: Pending) -> float:
        # What "hopeless" is judged by: the SLO itself (or the request's own timeout), not the
        # due time that also keeps the overhead reserve free. The reserve is a planning margin
        # (batches aim to end that much early); a request that runs next, with nothing ahead,
        # and finishes within its SLO is answered in time in all but the reserve's slowest
        # cases, whereas refusing it is a certain failure. A burst also inflates the reserve
        # (a busy event loop), and light load refreshes it only over hundreds of requests.
        deadline_s = item.origin_s + self.slo_s
        return deadline_s if item.deadline_s is None else min(deadline_s, item.deadline_s)

    def _end_idle(self, now: float) -> None:
        idle_since_s = self._idle_since_s
        if idle_since_s is not None:
            self._idle_since_s = None
            halvings = (now - idle_since_s) / (MARGIN_IDLE_HALF_LIFE_SLOS * self.slo_s)
            self.arrival_margin = 1.0 + (self.arrival_margin - 1.0) * 0.5 ** max(0.0, halvings)

    def _note_idle(self, now: float) -> None:
        if not self._busy_until and self._idle_since_s is None:
            self._idle_since_s = now  # nothing queued or running from now on

    def _starved(self, now: float) -> bool:
        # Only a batch that runs can correct a fit that is too pessimistic (a slow warm-up, a
        # burst of contention): if it predicts every head late, everything is shed, nothing runs
        # and the fit never learns otherwise. So when no batch has started for a whole SLO while
        # requests were shed, the head runs as a probe unless it is already late. (The batcher
        # plans only when an instance is free, so the probe never waits behind a batch.)
        last_s = self._last_start_s
        idle_s = now - last_s if last_s is not None else 0.0
        return self._shed_since_start > 0 and idle_s > self.slo_s

    def _shed_hopeless(
        self, queue: PendingQueue, now: float, *, probe: bool
    ) -> tuple[Pending, ...]:
        # Only heads can be hopeless first: EDF puts the earliest deadline in front, and one
        # that fits leaves the rest (later deadlines) to later plans. Collect, then act: acting
        # reorders the heap under the iterator.
        # A request alone (nothing else queued or running) is judged as on arrival, by its SLO;
        # with others queued, by its due time, which keeps the overhead reserve free for them.
        hopeless: list[Pending] = []
        alone = len(queue) == 1 and not self._busy_until
        for level in range(1, queue.num_levels + 1):
            for item in queue.level_items(level):
                due_s = self._deadline_s(item) if alone else item.due_s
                if item.state == DELAYED or now + self.model.predict(item.num_rows) <= due_s:
                    break
                if probe and now < self._deadline_s(item):
                    self.num_probes += 1
                    self._probing = True
                    probe = False
                    break
                hopeless.append(item)
        shed = tuple(item for item in hopeless if item.timeout_action != "delay")
        for item in hopeless:
            if item.timeout_action == "delay":
                queue.delay(item)  # runs late, after its level's on-time requests
        if shed:
            queue.take(shed)
            self.num_shed += len(shed)
            self.num_shed_late += len(shed)
            self._shed_since_start += len(shed)
            self.arrival_margin = min(MAX_MARGIN, self.arrival_margin * MARGIN_UP ** len(shed))
        return shed

    def _fill(
        self, queue: PendingQueue, now: float, head: Pending, max_rows: int
    ) -> tuple[list[Pending], int, bool]:
        # Service order (levels first, EDF within), stopping where the batch cannot grow (like
        # Triton: no skipping ahead to a smaller item). Lower-level items join only when they
        # would still make their own deadline.
        items: list[Pending] = []
        num_rows = 0
        finish_s = now + self.model.predict(max_rows)
        for item in queue.live():
            if item.key != head.key or num_rows + item.num_rows > max_rows:
                return items, num_rows, False
            if items and item.level != head.level and item.due_s < finish_s:
                return items, num_rows, False
            items.append(item)
            num_rows += item.num_rows
        return items, num_rows, True

    def _refresh(self) -> None:
        rows = min(self.max_batch_size, max(1, self.model.max_rows(self.batch_budget_s)))
        # Beyond the largest batch ever run the fit is a guess: lone rows at light load say
        # little about the per-row cost, and a slope within their noise put 32-47 rows within
        # a 50 ms budget that 16 rows overran 3x. Growing at most MAX_GROWTH-fold past what was
        # measured still reaches 32 rows within five batches of a rising load. (The queue bound
        # keeps the fit's own limit: a burst's first batches must find room to queue.)
        self.batch_limit = min(rows, MAX_GROWTH * max(1, self.model.max_observed_rows))
        self.derived.refresh(self.model, rows, self.overhead.reserve_s)
