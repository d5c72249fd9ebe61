"""A loaded batch model version: its instances, its dynamic batcher, its statistics and metrics."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from fulcrum.backends import create_backend
from fulcrum.batcher import BatchRecord, DynamicBatcher, InferResult
from fulcrum.config import ModelConfig
from fulcrum.errors import FulcrumError
from fulcrum.metrics import ModelMetrics, outcome_of
from fulcrum.instances import InstancePool
from fulcrum.stats import ModelStats
from fulcrum.types import TensorMap


class BatchServable:
    """Requests in, batches through `DynamicBatcher` onto an `InstancePool`, results out."""

    def __init__(
        self, config: ModelConfig, version: int, pool: InstancePool, metrics: ModelMetrics
    ) -> None:
        self.config = config
        self.version = version
        self.pool = pool
        self.metrics = metrics
        self.stats = ModelStats()
        self.batcher = DynamicBatcher(config, pool.run, on_batch=self._on_batch)
        self._num_admitted = 0
        self._stopping = False
        metrics.queue_depth.set_function(lambda: self.batcher.queue_depth)
        metrics.in_flight.set_function(lambda: self._num_admitted)

    @classmethod
    async def load(
        cls, config: ModelConfig, version: int, version_dir: Path, metrics: ModelMetrics
    ) -> BatchServable:
        """Create one backend per instance off the event loop, then start the batcher."""
        backends = []
        try:
            for _ in range(config.instances.count):
                backends.append(await asyncio.to_thread(create_backend, config, version_dir))
        except BaseException:
            for backend in backends:
                backend.close()
            raise
        servable = cls(config, version, InstancePool(backends, name=f"{config.name}/{version}"),
                       metrics)  # fmt: skip
        servable.batcher.start()
        return servable

    @property
    def is_ready(self) -> bool:
        return not self._stopping

    async def infer(
        self, inputs: TensorMap, *, priority: int | None, timeout_s: float | None
    ) -> InferResult:
        """Submit one request; record its outcome in statistics and metrics."""
        start = time.perf_counter()
        self._num_admitted += 1
        try:
            result = await self.batcher.submit(inputs, priority=priority, timeout_s=timeout_s)
        except FulcrumError as exc:
            self.stats.record_request(False, time.perf_counter() - start)
            self.metrics.outcomes[outcome_of(exc.status_code, type(exc).__name__)].inc()
            raise
        finally:
            self._num_admitted -= 1
        total_s = time.perf_counter() - start
        self.stats.record_request(True, total_s, result.queue_s)
        m = self.metrics
        m.request_s.observe(total_s)
        m.queue_s.observe(result.queue_s)
        m.compute_s.observe(result.compute_s)
        m.outcomes["success"].inc()
        return result

    def _on_batch(self, record: BatchRecord) -> None:
        self.stats.record_batch(record.batch_size, record.compute_s, record.num_requests)
        self.metrics.batch_size.observe(record.batch_size)

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, finish queued and in-flight ones, then release the instances."""
        self._stopping = True
        try:
            await self.batcher.stop(drain_timeout_s)
        finally:
            await asyncio.to_thread(self.pool.close)
