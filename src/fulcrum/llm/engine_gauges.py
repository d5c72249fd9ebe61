"""One LLMEngine's state on its Prometheus series: the scheduler's and the KV pool's gauges set,
and its cumulative counts (preemptions, prefix-cache queries and hits) added as they grew."""

from __future__ import annotations

from fulcrum.llm.block_manager import BlockManager
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.scheduler import Scheduler
from fulcrum.llm.speculative import Speculation


class EngineGauges:
    """Publishes one scheduler and block manager (a reset makes a new one with them)."""

    def __init__(self, metrics: LLMMetrics, scheduler: Scheduler, blocks: BlockManager) -> None:
        self.metrics = metrics
        self.scheduler = scheduler
        self.blocks = blocks
        self._num_preemptions_seen = 0
        self._prefix_seen = (0, 0)  # (queries, hits)

    def publish(self, speculation: Speculation | None) -> None:
        """Set the gauges and add the counters' increments since the last call."""
        metrics, scheduler = self.metrics, self.scheduler
        metrics.running.set(scheduler.num_running)
        metrics.waiting.set(scheduler.num_waiting)
        metrics.kv_usage.set(self.blocks.usage())
        metrics.token_budget.set(scheduler.token_budget or scheduler.max_num_batched_tokens)
        metrics.running_limit.set(scheduler.max_running or scheduler.max_num_seqs)
        num_preemptions = scheduler.num_preemptions
        metrics.preemptions.inc(num_preemptions - self._num_preemptions_seen)
        self._num_preemptions_seen = num_preemptions
        stats = self.blocks.stats
        seen_queries, seen_hits = self._prefix_seen
        metrics.prefix_queries.inc(stats.num_queries - seen_queries)
        metrics.prefix_hits.inc(stats.num_hits - seen_hits)
        self._prefix_seen = (stats.num_queries, stats.num_hits)
        if speculation is not None:
            speculation.publish(metrics)
