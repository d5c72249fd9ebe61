"""The dynamic batcher: queue requests, let the policy form batches, dispatch, split the outputs.

The async shell around `fulcrum.policy`: one loop task per model, one task per batch; every
future resolves exactly once (success, model error, queue timeout, cancellation, shutdown).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from fulcrum.config import ModelConfig
from fulcrum.errors import DeadlineExceeded, FulcrumError, InvalidInput, ModelError, Unavailable
from fulcrum.policy import BatchPolicy, Pending, PendingQueue, TritonPolicy, compat_key
from fulcrum.policy import dynamic_axes as find_dynamic_axes
from fulcrum.types import Array, Clock, MonotonicClock, TensorMap

_logger = logging.getLogger(__name__)

Dispatch = Callable[[TensorMap], Awaitable[TensorMap]]


@dataclass(frozen=True, slots=True)
class InferResult:
    """One request's outputs (its own rows) and where its time went."""

    outputs: TensorMap
    queue_s: float  # submit -> batch dispatch
    compute_s: float  # the dispatch call of its batch
    batch_size: int  # rows in its batch


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """What one batch did; handed to `on_batch` (metrics, adaptive policies)."""

    batch_size: int
    num_requests: int
    compute_s: float
    queue_s: list[float]
    failed: bool


class _Request(Pending):
    """A queued request: the policy's view plus the payload and the caller's future."""

    __slots__ = ("future", "inputs", "submit_perf_s")

    def __init__(
        self,
        num_rows: int,
        key: Hashable,
        enqueue_s: float,
        inputs: TensorMap,
        future: asyncio.Future[InferResult],
    ) -> None:
        super().__init__(num_rows, key, enqueue_s)
        self.inputs = inputs
        self.future = future
        self.submit_perf_s = time.perf_counter()


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
    ) -> None:
        self._config = config
        self._dispatch = dispatch
        self._policy: BatchPolicy = policy or TritonPolicy(config)
        self._clock: Clock = clock or MonotonicClock()
        self._max_batches = max_concurrent_batches or config.instances.count
        self._on_batch = on_batch
        self._queue = PendingQueue(config)
        self._batched = config.max_batch_size > 0
        self._dynamic_axes = find_dynamic_axes(config)
        self._pad_values = {spec.name: spec.pad_value for spec in config.inputs}
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

    @property
    def queue_depth(self) -> int:
        """Requests waiting in the queue."""
        return len(self._queue)

    @property
    def num_in_flight(self) -> int:
        """Requests in batches being run."""
        return self._num_in_flight

    def start(self) -> None:
        """Start the loop task on the running event loop."""
        if self._loop_task is None:
            name = f"batcher-{self._config.name}"
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name=name)

    async def submit(
        self, inputs: TensorMap, *, priority: int | None = None, timeout_s: float | None = None
    ) -> InferResult:
        """Queue one request (axis 0 is its rows) and wait for its own rows of the outputs."""
        if self._stopping or self._loop_task is None:
            state = "is shutting down" if self._stopping else "has no running batcher"
            raise Unavailable(f"model {self._config.name!r} {state}")
        num_rows = self._count_rows(inputs) if self._batched else 1
        key = compat_key(inputs, self._dynamic_axes) if self._batched else None
        future: asyncio.Future[InferResult] = asyncio.get_running_loop().create_future()
        request = _Request(num_rows, key, self._clock.now(), inputs, future)
        self._queue.admit(request, priority=priority, timeout_s=timeout_s)
        if self._listening or request.deadline_s is not None:
            self._wakeup.set()
        try:
            return await future
        except asyncio.CancelledError:
            # Still queued: it never runs. Already running: its result is dropped.
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

    def _count_rows(self, inputs: TensorMap) -> int:
        num_rows = -1
        for name, array in inputs.items():
            if array.ndim == 0:
                raise InvalidInput(f"input {name!r} is a scalar; it needs a batch axis")
            if num_rows < 0:
                num_rows = array.shape[0]
            elif array.shape[0] != num_rows:
                raise InvalidInput(
                    f"input {name!r} has {array.shape[0]} rows; other inputs have {num_rows}"
                )
        if num_rows < 1:
            raise InvalidInput("request has no rows")
        if num_rows > self._config.max_batch_size:
            raise InvalidInput(
                f"request has {num_rows} rows; model {self._config.name!r} takes at most "
                f"{self._config.max_batch_size} (max_batch_size)"
            )
        return num_rows

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as exc:
            # A bug in the policy must not strand callers: fail them all, refuse new ones.
            _logger.exception("batcher %s: loop failed", self._config.name)
            self._stopping = True
            self._fail_queued(Unavailable(f"model {self._config.name!r} batcher failed: {exc}"))

    async def _loop(self) -> None:
        queue = self._queue
        while True:
            self._wakeup.clear()
            now = self._clock.now()
            if self._num_batches < self._max_batches:
                plan = self._policy.plan(queue, now)
                self._reject(plan.reject, now)
                if plan.run:
                    self._launch(cast("Sequence[_Request]", plan.run))
                    continue
                wake_at_s, self._listening = plan.wake_at_s, True
            else:
                self._reject(queue.expire(now), now)
                wake_at_s, self._listening = queue.next_deadline_s, False
            self._check_drained()
            await self._wait(wake_at_s)
            self._listening = False

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

    def _launch(self, requests: Sequence[_Request]) -> None:
        # A caller cancelled after planning but before now: drop it before it runs.
        live = [r for r in requests if not r.future.done()]
        if not live:
            return
        self._num_batches += 1
        self._num_in_flight += len(live)
        task = asyncio.get_running_loop().create_task(self._run_batch(live))
        self._batch_tasks.add(task)
        task.add_done_callback(self._batch_tasks.discard)

    async def _run_batch(self, requests: list[_Request]) -> None:
        num_rows = sum(r.num_rows for r in requests)
        start_s = time.perf_counter()
        queue_s = [start_s - r.submit_perf_s for r in requests]
        compute_s = 0.0
        failed = holds_slot = True
        try:
            batch = self._assemble(requests)
            start_s = time.perf_counter()
            queue_s = [start_s - r.submit_perf_s for r in requests]
            try:
                outputs = await self._dispatch(batch)
            finally:
                compute_s = time.perf_counter() - start_s
                holds_slot = self._free_slot()
            # Two yields: the loop plans the next batch (1), its task dispatches it (2), and only
            # then do this batch's callers wake up, so the model works while they run.
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            self._resolve(requests, outputs, queue_s, compute_s, num_rows)
            failed = False
        except asyncio.CancelledError:
            _fail(requests, Unavailable(f"model {self._config.name!r} stopped while running"))
            raise
        except Exception as exc:
            _fail(requests, _model_error(exc))
        finally:
            if holds_slot:
                self._free_slot()
            self._num_in_flight -= len(requests)
            self._check_drained()
            self._record(BatchRecord(num_rows, len(requests), compute_s, queue_s, failed))

    def _free_slot(self) -> bool:
        self._num_batches -= 1
        self._wakeup.set()
        return False

    def _assemble(self, requests: list[_Request]) -> TensorMap:
        if len(requests) == 1:
            return requests[0].inputs
        return {
            name: self._concat(name, [r.inputs[name] for r in requests])
            for name in requests[0].inputs
        }

    def _concat(self, name: str, arrays: list[Array]) -> Array:
        if name in self._dynamic_axes:
            row_shapes = {a.shape[1:] for a in arrays}
            if len(row_shapes) > 1:
                return _pad_concat(arrays, self._pad_values.get(name, 0.0))
        return np.concatenate(arrays, axis=0)

    def _resolve(
        self,
        requests: list[_Request],
        outputs: TensorMap,
        queue_s: list[float],
        compute_s: float,
        num_rows: int,
    ) -> None:
        if len(requests) == 1:
            request = requests[0]
            if not request.future.done():
                request.future.set_result(InferResult(outputs, queue_s[0], compute_s, num_rows))
            return
        for name, array in outputs.items():
            if array.ndim == 0 or array.shape[0] != num_rows:
                rows = array.shape[0] if array.ndim else "no"
                raise ModelError(f"output {name!r} has {rows} rows; the batch had {num_rows}")
        start = 0
        for request, waited_s in zip(requests, queue_s, strict=True):
            end = start + request.num_rows
            if not request.future.done():
                own = {name: array[start:end] for name, array in outputs.items()}
                request.future.set_result(InferResult(own, waited_s, compute_s, num_rows))
            start = end

    def _reject(self, items: Sequence[Pending], now: float) -> None:
        for item in items:
            request = cast(_Request, item)
            if not request.future.done():
                waited_s = now - request.enqueue_s
                request.future.set_exception(
                    DeadlineExceeded(f"request timed out after {waited_s:.3f} s in the queue")
                )

    def _fail_queued(self, error: FulcrumError) -> None:
        _fail(cast("list[_Request]", self._queue.drain()), error)

    def _check_drained(self) -> None:
        if self._stopping and not self._queue and not self._num_in_flight:
            self._drained.set()

    def _record(self, record: BatchRecord) -> None:
        if self._on_batch is None:
            return
        try:
            self._on_batch(record)
        except Exception:
            _logger.exception("batcher %s: on_batch callback failed", self._config.name)


def _fail(requests: Sequence[_Request], error: FulcrumError) -> None:
    for request in requests:
        if not request.future.done():
            request.future.set_exception(error)


def _model_error(exc: Exception) -> FulcrumError:
    if isinstance(exc, FulcrumError):
        return exc
    error = ModelError(f"model failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _pad_concat(arrays: list[Array], pad_value: float) -> Array:
    """Concatenate on axis 0, padding every other axis to the batch's longest with `pad_value`."""
    row_shape = tuple(max(sizes) for sizes in zip(*(a.shape[1:] for a in arrays), strict=True))
    num_rows = sum(a.shape[0] for a in arrays)
    out = np.full((num_rows, *row_shape), pad_value, dtype=arrays[0].dtype)
    start = 0
    for array in arrays:
        end = start + array.shape[0]
        out[(slice(start, end), *(slice(0, d) for d in array.shape[1:]))] = array
        start = end
    return out
