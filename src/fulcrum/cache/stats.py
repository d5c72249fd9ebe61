"""One model's cache counters: hits per tier, misses, coalesced waits, verifier rejections by
reason, values refused and the compute time hits saved. Plain counters; the statistics API and
the `/metrics` collector read them."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from fulcrum.cache.protocols import StoreStats

TIERS = ("exact", "semantic")


@dataclass
class CacheStats:
    """Counts since the model's cache was built (a reload with new settings starts anew)."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    saved_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIERS, 0.0))
    misses: int = 0
    coalesced: int = 0  # misses answered by an identical request's computation
    uncacheable: int = 0  # requests the cache could not take (sampled generation, logprobs)
    not_stored: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    rejections: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    semantic_errors: int = 0  # embedder or index failures, served as misses

    def hit(self, tier: str, saved_s: float) -> None:
        self.hits[tier] += 1
        self.saved_s[tier] += max(0.0, saved_s)

    def to_json(self, store: StoreStats, semantic_entries: int | None) -> dict[str, object]:
        tiers: dict[str, object] = {
            "exact": {
                "hits": self.hits["exact"],
                "saved_s": round(self.saved_s["exact"], 6),
                "entries": store.entries,
                "bytes": store.bytes,
                "evictions": store.evictions,
                "errors": store.errors,
            }
        }
        if semantic_entries is not None:
            tiers["semantic"] = {
                "hits": self.hits["semantic"],
                "saved_s": round(self.saved_s["semantic"], 6),
                "entries": semantic_entries,
                "rejections": dict(sorted(self.rejections.items())),
                "errors": self.semantic_errors,
            }
        return {
            "misses": self.misses,
            "coalesced": self.coalesced,
            "uncacheable": self.uncacheable,
            "not_stored": dict(sorted(self.not_stored.items())),
            "tiers": tiers,
        }
