"""A loaded batch model version: its instances, its dynamic batcher, its statistics and metrics."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from fulcrum.backends import Backend, create_backend, distinct, shared_between_instances
from fulcrum.batcher import BatchRecord, DynamicBatcher, InferResult
from fulcrum.config import ModelConfig
from fulcrum.errors import FulcrumError, QueueFull, Shed, Unavailable
from fulcrum.instances import InstancePool
from fulcrum.metrics import ModelMetrics, PolicyGauges, outcome_of
from fulcrum.policy_adaptive import AdaptivePolicy
from fulcrum.stats import ModelStats
from fulcrum.thread_priority import call_lowered
from fulcrum.types import TensorMap


class BatchServable:
    """Requests in, batches through `DynamicBatcher` onto an `InstancePool`, results out."""

    def __init__(
        self,
        config: ModelConfig,
        version: int,
        pool: InstancePool,
        metrics: ModelMetrics,
        variant: str = "default",
    ) -> None:
        self.config = config  # the variant's config: its parameters laid over the model's
        self.version = version
        self.variant = variant
        self.pool = pool
        self.metrics = metrics
        self.stats = ModelStats()
        self.batcher = DynamicBatcher(
            config, pool.run, on_batch=self._on_batch, dispatch_lone=pool.lone_dispatch
        )
        self.stats.policy_state = self.batcher.policy.state
        self.stats.lone_states = pool.lone_states
        policy = self.batcher.policy
        self._adaptive = policy if isinstance(policy, AdaptivePolicy) else None
        self._num_admitted = 0
        self._stopping = False
        metrics.watch(self)  # weakly: the registry outlives this version

    @classmethod
    async def load(
        cls,
        config: ModelConfig,
        version: int,
        version_dir: Path,
        metrics: ModelMetrics,
        variant: str = "default",
        compute_nice: int = 0,
    ) -> BatchServable:
        """Create one backend per instance off the event loop (one for all where the backend
        is shared between instances), then start the batcher.
        Takes ownership of `metrics`: a load that fails releases them."""
        backends: list[Backend] = []
        try:
            for _ in range(config.instances.count):
                if backends and shared_between_instances(backends[0]):
                    backends.append(backends[0])
                    continue
                # Built on a lowered thread: the runtime pools it spawns inherit its priority.
                backend = await call_lowered(compute_nice, create_backend, config, version_dir)
                backends.append(backend)
        except BaseException:
            for backend in distinct(backends):
                backend.close()
            metrics.release()
            raise
        timeout_s = config.instances.execution_timeout_ms / 1000  # 0: no limit
        pool = InstancePool(
            backends, name=f"{config.name}/{version}/{variant}", execution_timeout_s=timeout_s,
            compute_nice=compute_nice,
        )  # fmt: skip
        servable = cls(config, version, pool, metrics, variant)
        servable.batcher.start()
        return servable

    @property
    def is_ready(self) -> bool:
        """Not stopping, the batcher loop alive, and at least one instance not hung."""
        return not self._stopping and self.batcher.is_healthy and self.pool.is_healthy

    @property
    def queue_depth(self) -> int:
        """Requests waiting in the batcher's queue (a gauge)."""
        return self.batcher.queue_depth

    def estimate_finish_s(self, num_rows: int, now: float) -> float:
        """Predicted seconds from `now` (time.monotonic) until a new request of `num_rows` rows
        would be answered: the rows queued ahead and the running batches, then its own batch."""
        batcher = self.batcher
        return batcher.policy.estimate_finish_s(batcher.num_queued_rows, num_rows, now)

    def is_full(self, priority: int | None = None) -> bool:
        """True when a request at this priority would be refused now: its queue is full."""
        return self.batcher.is_full(priority)

    @property
    def num_admitted(self) -> int:
        """Requests admitted and not yet answered (a gauge)."""
        return self._num_admitted

    async def infer(
        self,
        inputs: TensorMap,
        *,
        priority: int | None,
        timeout_s: float | None,
        age_s: float = 0.0,
    ) -> InferResult:
        """Submit one request (`age_s`: seconds since it reached the server); record its
        outcome in statistics and metrics."""
        start = time.perf_counter()
        self._num_admitted += 1
        try:
            result = await self.batcher.submit(
                inputs, priority=priority, timeout_s=timeout_s, age_s=age_s
            )
        except FulcrumError as exc:
            self._count_failure(exc, time.perf_counter() - start)
            raise
        finally:
            self._num_admitted -= 1
        total_s = time.perf_counter() - start
        # What the request spent here besides queueing and running: mostly after its batch
        # ended, until this coroutine ran again (a busy event loop). The time before it was
        # queued is not in it: its deadline already counts from arrival (`age_s`).
        overhead_s = total_s - result.queue_s - result.compute_s
        self.batcher.policy.observe_answer(overhead_s, age_s + total_s)
        num_rows = _num_rows(inputs) if self.config.max_batch_size > 0 else 1
        self.stats.record_success(num_rows, total_s, result.queue_s, result.compute_s)
        m = self.metrics
        m.request_s.observe(total_s)
        m.queue_s.observe(result.queue_s)
        m.compute_s.observe(result.compute_s)
        m.outcomes["success"].inc()
        return result

    def early_refusal(self, priority: int | None, age_s: float) -> Unavailable | None:
        """The 503 a one-row request would get now, before its body is read (`DynamicBatcher.
        early_refusal`), counted in statistics and metrics as the same refusal in `infer` is."""
        refusal = self.batcher.early_refusal(priority, age_s)
        if refusal is not None:
            self._count_failure(refusal, 0.0)
        return refusal

    def _count_failure(self, exc: FulcrumError, seconds: float) -> None:
        self.stats.record_failure(seconds)
        self.metrics.outcomes[outcome_of(exc.status_code, type(exc).__name__)].inc()
        if isinstance(exc, QueueFull | Shed):
            self.stats.shed[exc.reason] += 1
            self.metrics.shed[exc.reason].inc()

    def _on_batch(self, record: BatchRecord) -> None:
        if not record.failed:  # Triton counts successful executions only
            self.stats.record_execution(record.batch_size, record.compute_s)
        self.metrics.batch_size.observe(record.batch_size)
        for num_rows, compute_s in record.retried_batches:  # isolation re-runs that succeeded
            self.stats.record_execution(num_rows, compute_s)
            self.metrics.batch_size.observe(num_rows)
        if record.num_retried_dispatches:
            self.metrics.retried_dispatches.inc(record.num_retried_dispatches)
            self.metrics.retry_compute_s.inc(record.retry_compute_s)

    def policy_gauges(self) -> PolicyGauges | None:
        """The adaptive policy's state for its gauges, read when `/metrics` is."""
        policy = self._adaptive
        if policy is None:
            return None
        return PolicyGauges(policy.model.a_s, policy.model.c_s, policy.batch_limit,
                            policy.last_predicted_s, policy.last_observed_s)  # fmt: skip

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, finish queued and in-flight ones, then release the instances."""
        self._stopping = True
        try:
            await self.batcher.stop(drain_timeout_s)
        finally:
            try:
                await asyncio.to_thread(self.pool.close)
            finally:
                self.metrics.release()  # an unloaded version leaves no series behind


def _num_rows(inputs: TensorMap) -> int:
    """A batched request's rows (Triton's "inferences"): axis 0, which the batcher checked."""
    first = next(iter(inputs.values()), None)
    return int(first.shape[0]) if first is not None and first.ndim else 1
