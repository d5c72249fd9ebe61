"""The dynamic batcher: queue requests, let the policy form batches, dispatch, split the outputs.

The async shell around `fulcrum.policy`: one loop task per model, one task per batch; every
future resolves exactly once (success, model error, queue timeout, cancellation, shutdown). A
batch of several requests that fails is re-run in halves, so a failure stays with its request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import cast

from fulcrum.batch_request import (
    InferResult,
    QueuedRequest,
    Ran,
    Tally,
    fail,
    model_error,
    shed_error,
    time_out,
)
from fulcrum.collate import Collator
from fulcrum.config import ModelConfig
from fulcrum.errors import FulcrumError, Unavailable
from fulcrum.isolation import isolate, may_rerun, shared_error
from fulcrum.policy import (
    BatchPolicy,
    BatchRecord,
    Pending,
    PendingQueue,
    Plan,
    compat_key,
    make_policy,
)
from fulcrum.types import Clock, MonotonicClock, TensorMap

__all__ = ["BatchRecord", "DynamicBatcher", "InferResult"]

_logger = logging.getLogger(__name__)

Dispatch = Callable[[TensorMap], Awaitable[TensorMap]]


class DynamicBatcher:
    """Batches one model's requests on axis 0 and runs at most `max_concurrent_batches` at once."""

    def __init__(
        self,
        config: ModelConfig,
        dispatch: Dispatch,
        *,
        policy: BatchPolicy | None = None,
        clock: Clock | None = None,
        max_concurrent_batches: int | None = None,
        on_batch: Callable[[BatchRecord], None] | None = None,
        isolate_failures: bool = True,
        dispatch_lone: Dispatch | None = None,
    ) -> None:
        self._config = config
        self._dispatch = dispatch
        # Takes a lone request that starts with nothing queued and no other batch running.
        self._dispatch_lone = dispatch_lone
        self._policy: BatchPolicy = policy or make_policy(config)
        self._clock: Clock = clock or MonotonicClock()
        self._max_batches = max_concurrent_batches or config.instances.count
        self._on_batch = on_batch
        self._isolate_failures = isolate_failures
        self._queue = PendingQueue(config)
        self._batched = config.max_batch_size > 0
        self._collator = Collator(config)
        self._wakeup = asyncio.Event()
        self._drained = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._batch_tasks: set[asyncio.Task[None]] = set()
        self._num_batches = 0
        self._num_in_flight = 0
        # The loop listens to submits only while it could form a batch; while every slot is
        # busy, requests pile up without waking it (that is where batches grow).
        self._listening = False
        self._stopping = False
        self._failed = False

    @property
    def queue_depth(self) -> int:
        """Requests waiting in the queue."""
        return len(self._queue)

    @property
    def num_queued_rows(self) -> int:
        """Rows waiting in the queue (the lane router's estimate counts them)."""
        return self._queue.num_rows

    def is_full(self, priority: int | None = None) -> bool:
        """True when a request at this priority would be refused: its level's queue is full."""
        level = self._queue.level_of(priority)
        bound = self._queue.bound(level)
        return bool(bound) and self._queue.depth(level) >= bound

    def early_refusal(self, priority: int | None, age_s: float = 0.0) -> Unavailable | None:
        """The 503 a one-row request at `priority` would get now (QueueFull or Shed), decided
        before its body is read or decoded, so that refusing under overload costs far less than
        serving. None: it may be admitted; its rows and own timeout decide in `submit`, which
        refuses a superset of what this refuses (more rows, an earlier deadline)."""
        if not self._batched or self._stopping or self._loop_task is None:
            return None  # `submit` says why, in full
        now = self._clock.now()
        probe = Pending(1, None, now, origin_s=now - max(0.0, age_s))
        full = self._queue.place(probe, priority)
        if full is not None:
            return full
        retry_after_s = self._policy.on_arrival(self._queue, probe, now)
        return None if retry_after_s is None else shed_error(retry_after_s)

    @property
    def num_in_flight(self) -> int:
        """Requests in batches being run."""
        return self._num_in_flight

    @property
    def policy(self) -> BatchPolicy:
        """The batch policy (its `state()` feeds the statistics API and metrics)."""
        return self._policy

    @property
    def is_healthy(self) -> bool:
        """False once the loop ended other than by `stop()`: the model can serve nothing more."""
        task = self._loop_task
        return not self._failed and (task is None or not task.done() or self._stopping)

    def start(self) -> None:
        """Start the loop task on the running event loop."""
        if self._loop_task is None:
            name = f"batcher-{self._config.name}"
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name=name)
            self._loop_task.add_done_callback(self._on_loop_done)

    async def submit(
        self,
        inputs: TensorMap,
        *,
        priority: int | None = None,
        timeout_s: float | None = None,
        age_s: float = 0.0,
    ) -> InferResult:
        """Queue one request (axis 0 is its rows) and wait for its own rows of the outputs;
        `age_s` is how long ago it reached the server: its SLO deadline counts from then."""
        if self._stopping or self._loop_task is None:
            stopped = self._stopping and not self._failed
            state = "is shutting down" if stopped else "has no running batcher"
            raise Unavailable(f"model {self._config.name!r} {state}")
        num_rows = self._collator.count_rows(inputs) if self._batched else 1
        key = compat_key(inputs, self._collator.dynamic_axes) if self._batched else None
        future: asyncio.Future[InferResult] = asyncio.get_running_loop().create_future()
        now = self._clock.now()
        request = QueuedRequest(num_rows, key, now, inputs, future, origin_s=now - max(0.0, age_s))
        self._queue.admit(request, priority=priority, timeout_s=timeout_s)
        retry_after_s = self._policy.on_arrival(self._queue, request, now)
        if retry_after_s is not None:
            self._queue.take((request,))
            raise shed_error(retry_after_s)
        if not self._num_batches and len(self._queue) == 1:
            self._start(self._run_planned())  # nothing runs or waits: a loop hop sooner
        elif self._listening or request.deadline_s is not None:
            self._wakeup.set()
        try:
            return await future
        except asyncio.CancelledError:
            # Still queued: it never runs. Already running: its result is dropped, and a
            # failed batch does not re-run it.
            self._queue.cancel(request)
            raise

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, finish queued and running ones, then fail what is left."""
        self._stopping = True
        self._wakeup.set()
        task = self._loop_task
        if task is not None and not task.done():
            self._check_drained()
            try:
                await asyncio.wait_for(self._drained.wait(), drain_timeout_s)
            except TimeoutError:
                _logger.warning("batcher %s: drain timed out", self._config.name)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._fail_queued(Unavailable(f"model {self._config.name!r} stopped before it ran"))
        batches = list(self._batch_tasks)
        for batch in batches:
            batch.cancel()
        await asyncio.gather(*batches, return_exceptions=True)

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as exc:
            # A bug in the policy must not strand callers: fail them all, refuse new ones.
            _logger.exception("batcher %s: loop failed", self._config.name)
            self._die(f"failed ({type(exc).__name__}; see the server log)")

    def _on_loop_done(self, _: asyncio.Task[None]) -> None:
        if not self._stopping:  # cancelled by someone other than stop(), maybe before it ran
            _logger.error("batcher %s: loop ended unexpectedly", self._config.name)
            self._die("ended unexpectedly")

    def _die(self, reason: str) -> None:
        self._failed = self._stopping = True
        self._fail_queued(Unavailable(f"model {self._config.name!r} batcher {reason}"))

    async def _loop(self) -> None:
        queue = self._queue
        while True:
            self._wakeup.clear()
            now = self._clock.now()
            if self._num_batches < self._max_batches:
                plan = self._step(now)
                if plan.run:
                    self._launch(cast("Sequence[QueuedRequest]", plan.run))
                    continue
                wake_at_s, self._listening = plan.wake_at_s, True
            else:
                time_out(queue.expire(now), now)
                wake_at_s, self._listening = queue.next_deadline_s, False
            self._check_drained()
            await self._wait(wake_at_s)
            self._listening = False

    def _step(self, now: float) -> Plan:
        """Plan once: fail what the plan rejects (504) or sheds (503)."""
        plan = self._policy.plan(self._queue, now)
        time_out(plan.reject, now)
        if plan.shed:
            fail(cast("list[QueuedRequest]", plan.shed), shed_error(plan.retry_after_s))
        return plan

    async def _wait(self, wake_at_s: float | None) -> None:
        if wake_at_s is None:
            await self._wakeup.wait()
            return
        delay_s = wake_at_s - self._clock.now()
        if delay_s <= 0:
            await asyncio.sleep(0)  # yield once, so a faulty policy cannot starve the loop
            return
        try:
            async with asyncio.timeout(delay_s):
                await self._wakeup.wait()
        except TimeoutError:
            pass

    def _launch(self, requests: Sequence[QueuedRequest]) -> None:
        # A caller cancelled after planning but before now: drop it before it runs.
        live = [r for r in requests if not r.future.done()]
        if not live:
            return
        self._num_in_flight += len(live)
        self._start(self._run_batch(live))

    def _start(self, batch: Coroutine[None, None, None]) -> None:
        self._num_batches += 1  # the task holds a slot from now
        task = asyncio.get_running_loop().create_task(batch)
        self._batch_tasks.add(task)
        task.add_done_callback(self._batch_tasks.discard)

    async def _run_planned(self) -> None:
        """Started by a request into an idle batcher: plan in the loop turn the loop would (so
        requests that came in beside it join) and run the plan's batch, one task hop sooner."""
        try:
            plan = self._step(self._clock.now())
        except Exception:
            plan = Plan()  # the loop plans again and fails as its own plan does
        live = [r for r in cast("Sequence[QueuedRequest]", plan.run) if not r.future.done()]
        if not live:
            self._num_batches -= 1
            self._wakeup.set()
            return
        self._num_in_flight += len(live)
        await self._run_batch(live)

    async def _run_batch(self, requests: list[QueuedRequest]) -> None:
        now_s = time.perf_counter()
        tally = Tally(
            sum(r.num_rows for r in requests),
            len(requests),
            [now_s - r.submit_perf_s for r in requests],
        )
        try:
            try:
                ran = await self._execute(requests, tally, retry=False)
            except Exception as exc:
                tally.failed = True
                await self._recover(requests, exc, tally)
            else:
                if self._queue:
                    self._free_slot(tally)
                    # Two yields: the loop plans the next batch (1), its task dispatches it (2),
                    # and only then do this batch's callers wake up, so the model works while
                    # they run. With nothing queued, the callers wake before the loop does.
                    await asyncio.sleep(0)
                    await asyncio.sleep(0)
                self._resolve(requests, ran)
                # The batch's accounting runs after its callers' wake-ups and before the loop
                # plans again: off a lone request's path to its answer, and still learnt from
                # before the next batch is planned.
                asyncio.get_running_loop().call_soon(self._record, tally)
                tally.recorded = True
                self._free_slot(tally)  # if not freed above
        except asyncio.CancelledError:
            fail(requests, Unavailable(f"model {self._config.name!r} stopped while running"))
            raise
        except Exception as exc:  # outputs that do not split by rows: the batch's, not a row's
            tally.failed = True
            fail(requests, model_error(exc))
        finally:
            self._free_slot(tally)
            self._num_in_flight -= len(requests)
            self._check_drained()
            if not tally.recorded:
                self._record(tally)

    async def _execute(self, group: list[QueuedRequest], tally: Tally, *, retry: bool) -> Ran:
        """Stack `group` into one batch and dispatch it; account for the time it took."""
        batch = self._collator.stack([r.inputs for r in group])
        dispatch = self._dispatch
        if self._dispatch_lone is not None and not retry and self._runs_alone(group):
            dispatch = self._dispatch_lone
        start_s = time.perf_counter()
        try:
            outputs = await dispatch(batch)
        finally:
            compute_s = time.perf_counter() - start_s
            if retry:
                tally.num_retried_dispatches += 1
                tally.retry_compute_s += compute_s
            else:
                tally.compute_s = compute_s
                tally.queue_s = [start_s - r.submit_perf_s for r in group]
        return Ran(outputs, start_s, compute_s)

    def _runs_alone(self, group: list[QueuedRequest]) -> bool:
        # One request, nothing queued, no other batch: light load (several requests in a batch
        # queued: load). Read as the batch task starts: one that came in since is queued by now.
        return len(group) == 1 and not self._queue and self._num_batches == 1

    async def _recover(self, requests: list[QueuedRequest], error: Exception, tally: Tally) -> None:
        """A batch failed: re-run its requests apart, on its own slot, or fail them all."""
        if len(requests) > 1 and self._isolate_failures and may_rerun(error):
            await isolate(
                requests,
                run=lambda group: self._rerun(group, tally),
                fail=lambda group, exc: self._fail_isolated(group, exc, tally),
                is_live=lambda request: not request.future.done(),
            )
        elif len(requests) > 1 and may_rerun(error):
            fail(requests, shared_error(self._config.name, error, len(requests)))
        else:
            fail(requests, model_error(error))

    async def _rerun(self, group: list[QueuedRequest], tally: Tally) -> None:
        ran = await self._execute(group, tally, retry=True)
        self._resolve(group, ran)
        tally.retried_batches.append((sum(r.num_rows for r in group), ran.compute_s))

    def _fail_isolated(self, group: list[QueuedRequest], error: Exception, tally: Tally) -> None:
        tally.num_isolated_failures += len(group)
        fail(group, model_error(error))

    def _free_slot(self, tally: Tally) -> None:
        if tally.holds_slot:
            tally.holds_slot = False
            self._num_batches -= 1
            if self._queue or not self._listening:  # else nothing to plan till a request
                self._wakeup.set()

    def _resolve(self, requests: list[QueuedRequest], ran: Ran) -> None:
        row_counts = [r.num_rows for r in requests]
        num_rows = sum(row_counts)
        parts = self._collator.split(ran.outputs, row_counts)
        for request, own in zip(requests, parts, strict=True):
            if not request.future.done():
                waited_s = ran.start_s - request.submit_perf_s
                request.future.set_result(InferResult(own, waited_s, ran.compute_s, num_rows))

    def _fail_queued(self, error: FulcrumError) -> None:
        fail(cast("list[QueuedRequest]", self._queue.drain()), error)

    def _check_drained(self) -> None:
        if self._stopping and not self._queue and not self._num_in_flight:
            self._drained.set()

    def _record(self, tally: Tally) -> None:
        try:
            record = tally.record()
            self._policy.observe(record)
            if self._on_batch is not None:
                self._on_batch(record)
        except Exception:
            _logger.exception("batcher %s: observe or on_batch failed", self._config.name)
