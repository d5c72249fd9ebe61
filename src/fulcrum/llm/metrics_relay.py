"""An engine process's metrics, relayed: the child's engine records into `RecordingMetrics` (the
`LLMMetrics` interface, no registry), each step message carries what it recorded since the last
(`MetricEvents`: counter sums, last gauge values, histogram samples), and the server replays it
into the one `LLMMetrics` its registry scrapes, so every fulcrum_llm_* series works as in thread
mode."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fulcrum.llm.metrics import LLMMetrics

_HISTOGRAMS = ("ttft_s", "itl_s", "tpot_s", "e2e_s", "queue_s")
_GAUGES = ("running", "waiting", "kv_usage", "token_budget", "running_limit", "step_predicted_s",
           "step_observed_s", "spec_acceptance_rate", "spec_mean_acceptance_length")  # fmt: skip
_COUNTERS = ("preemptions", "prefix_queries", "prefix_hits", "prompt_tokens",
             "generation_tokens", "restarts", "spec_drafts", "spec_draft_tokens",
             "spec_accepted_tokens")  # fmt: skip


@dataclass(slots=True)
class MetricEvents:
    """What an engine recorded over one step (compact: one entry per series touched)."""

    samples: dict[str, list[float]] = field(default_factory=dict)  # histogram observations
    gauges: dict[str, float] = field(default_factory=dict)  # the last value set
    counts: dict[str, float] = field(default_factory=dict)  # the sum of increments
    finished: list[str] = field(default_factory=list)  # finish reasons of finished requests
    shed: list[str] = field(default_factory=list)  # reasons of requests shed

    def __bool__(self) -> bool:
        return bool(self.samples or self.gauges or self.counts or self.finished or self.shed)

    def replay(self, metrics: LLMMetrics) -> None:
        """Apply the recorded calls to the server's instruments."""
        for name, values in self.samples.items():
            observe_all(getattr(metrics, name), values)
        for name, value in self.gauges.items():
            getattr(metrics, name).set(value)
        for name, amount in self.counts.items():
            getattr(metrics, name).inc(amount)
        for reason in self.finished:
            metrics.request_finished(reason)
        for reason in self.shed:
            metrics.request_shed(reason)


def observe_all(histogram: Any, values: list[float]) -> None:
    """Observe each value as Histogram.observe does (the first bucket whose bound is >= it, and
    the sum), one update per bucket touched: a step's inter-token latencies, one observe each,
    cost the server's reader 2.5 us a token. Reaches prometheus_client's histogram internals;
    anything without them (another version, a test's fake) gets plain observes."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(values) < 2:
        for value in values:
            histogram.observe(value)
        return
    # NaN (v != v) lands in no bucket, as with observe; the sum takes it all the same.
    for index, count in Counter([bisect_left(bounds, v) for v in values if v == v]).items():
        buckets[index].inc(count)
    total.inc(sum(values))


class _Histogram:
    __slots__ = ("_name", "_owner")

    def __init__(self, owner: RecordingMetrics, name: str) -> None:
        self._owner, self._name = owner, name

    def observe(self, value: float) -> None:
        self._owner.events.samples.setdefault(self._name, []).append(value)


class _Gauge:
    __slots__ = ("_name", "_owner")

    def __init__(self, owner: RecordingMetrics, name: str) -> None:
        self._owner, self._name = owner, name

    def set(self, value: float) -> None:
        self._owner.events.gauges[self._name] = value


class _Counter:
    __slots__ = ("_name", "_owner")

    def __init__(self, owner: RecordingMetrics, name: str) -> None:
        self._owner, self._name = owner, name

    def inc(self, amount: float = 1.0) -> None:
        if amount:  # the engine publishes zero increments every step: no entry for them
            counts = self._owner.events.counts
            counts[self._name] = counts.get(self._name, 0.0) + amount


class RecordingMetrics(LLMMetrics):
    """`LLMMetrics` without a registry: records calls until `take` hands them over."""

    def __init__(self) -> None:  # no registry, no series: deliberately not super().__init__
        self.events = MetricEvents()
        for name in _HISTOGRAMS:
            setattr(self, name, _Histogram(self, name))
        for name in _GAUGES:
            setattr(self, name, _Gauge(self, name))
        for name in _COUNTERS:
            setattr(self, name, _Counter(self, name))

    def request_finished(self, finish_reason: str) -> None:
        self.events.finished.append(finish_reason)

    def request_shed(self, reason: str) -> None:
        self.events.shed.append(reason)

    def remove(self) -> None:
        """Nothing to remove: the server's metrics own the series."""

    def take(self) -> MetricEvents | None:
        """What was recorded since the last take (None: nothing)."""
        events = self.events
        if not events:
            return None
        self.events = MetricEvents()
        return events
