"""The caches on `/metrics` (`fulcrum_cache_*`): read from each model's counters when scraped,
so the request path pays nothing for them and an unloaded model's series go with its cache."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fulcrum.cache.stats import TIERS

if TYPE_CHECKING:
    from fulcrum.cache.tiered import ModelCache

Models = Callable[[], list[tuple[str, "ModelCache"]]]


class CacheCollector(Collector):
    """Per model and tier: hits, misses, evictions, entries, bytes, verifier rejections by
    reason, backend errors and the compute time hits saved."""

    def __init__(self, models: Models) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        hits = CounterMetricFamily(
            "fulcrum_cache_hits", "Requests answered by the cache.", labels=("model", "tier")
        )
        saved = CounterMetricFamily(
            "fulcrum_cache_saved_seconds",
            "Compute time the answered requests took when they were computed.",
            labels=("model", "tier"),
        )
        misses = CounterMetricFamily(
            "fulcrum_cache_misses", "Requests the cache could not answer.", labels=("model",)
        )
        coalesced = CounterMetricFamily(
            "fulcrum_cache_coalesced",
            "Misses answered by an identical request's computation.",
            labels=("model",),
        )
        rejections = CounterMetricFamily(
            "fulcrum_cache_verifier_rejections",
            "Semantic candidates the verifier refused, by the difference it found.",
            labels=("model", "reason"),
        )
        evictions = CounterMetricFamily(
            "fulcrum_cache_evictions", "Live entries pushed out for room.", labels=("model",)
        )
        errors = CounterMetricFamily(
            "fulcrum_cache_errors",
            "Backend failures (Redis down or slow) served as misses.",
            labels=("model", "tier"),
        )
        entries = GaugeMetricFamily(
            "fulcrum_cache_entries", "Entries held.", labels=("model", "tier")
        )
        size = GaugeMetricFamily("fulcrum_cache_bytes", "Bytes held.", labels=("model",))
        for name, cache in self._models():
            stats, store = cache.stats, cache.exact.store.stats()
            for tier in TIERS:
                hits.add_metric((name, tier), stats.hits[tier])
                saved.add_metric((name, tier), stats.saved_s[tier])
            misses.add_metric((name,), stats.misses)
            coalesced.add_metric((name,), stats.coalesced)
            for reason, count in sorted(stats.rejections.items()):
                rejections.add_metric((name, reason), count)
            evictions.add_metric((name,), store.evictions)
            errors.add_metric((name, "exact"), store.errors)
            errors.add_metric((name, "semantic"), stats.semantic_errors)
            entries.add_metric((name, "exact"), store.entries)
            num_semantic = cache.semantic_entries()
            if num_semantic is not None:
                entries.add_metric((name, "semantic"), num_semantic)
            size.add_metric((name,), store.bytes)
        yield from (hits, saved, misses, coalesced, rejections, evictions, errors, entries, size)
