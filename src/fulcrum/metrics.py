"""Prometheus metric definitions, one registry per service. Histograms (not summaries), so
replicas aggregate. Series exist only for loaded models: junk names never create one, and an
unloaded version's series go with it."""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import NamedTuple, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
OUTCOMES = ("success", "invalid_input", "queue_full", "shed", "timeout", "model_error",
            "unavailable", "error")  # fmt: skip
SHED_REASONS = ("queue_full", "deadline")  # refused at admission; deadline out of reach
# A cold start runs from a few milliseconds (echo) to minutes (an LLM's weights and kernels).
COLD_START_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GaugeSource(Protocol):
    """What a loaded version reports on its gauges when `/metrics` is read."""

    @property
    def queue_depth(self) -> int: ...

    @property
    def num_admitted(self) -> int: ...

    def policy_gauges(self) -> PolicyGauges | None:
        """The adaptive policy's state (None: another policy, whose gauges read 0)."""


class PolicyGauges(NamedTuple):
    """The adaptive batch policy's state on its gauges: the fit t(b) = a + c*b, the batch
    limit, and the last batch's predicted and observed run time."""

    fixed_s: float
    row_s: float
    batch_limit: int
    predicted_s: float
    observed_s: float


def _policy_value(sources: weakref.WeakSet[GaugeSource], field: int) -> float:
    """One field of the first watched source's adaptive policy state, else 0."""
    for source in sources:
        gauges = source.policy_gauges()
        if gauges is not None:
            return float(gauges[field])
    return 0.0


class _Series:
    """One (model, version)'s shared state: how many leases hold it, and its gauge sources.

    Sources are held weakly: the registry outlives every servable, so a strong reference from a
    gauge callback would keep an unloaded model (and its weights) alive forever.
    """

    def __init__(self) -> None:
        self.num_leases = 0
        self.sources: weakref.WeakSet[GaugeSource] = weakref.WeakSet()


class ServerMetrics:
    """The server's metric families on its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        labels = ("model", "version", "variant")
        r = self.registry
        self.request_s = Histogram("fulcrum_request_duration_seconds",
                                   "Time from request decoded to response ready.",
                                   labels, buckets=LATENCY_BUCKETS_S, registry=r)  # fmt: skip
        self.queue_s = Histogram("fulcrum_queue_duration_seconds",
                                 "Time a request waited in the batcher's queue.",
                                 labels, buckets=LATENCY_BUCKETS_S, registry=r)  # fmt: skip
        self.compute_s = Histogram("fulcrum_compute_duration_seconds",
                                   "Time the model took for the batch that held the request.",
                                   labels, buckets=LATENCY_BUCKETS_S, registry=r)  # fmt: skip
        self.batch_size = Histogram("fulcrum_batch_size", "Rows in each executed batch.",
                                    labels, buckets=BATCH_BUCKETS, registry=r)  # fmt: skip
        self.queue_depth = Gauge("fulcrum_queue_depth", "Requests waiting in the queue.",
                                 labels, registry=r, multiprocess_mode="livesum")  # fmt: skip
        self.in_flight = Gauge("fulcrum_inflight_requests", "Requests admitted, not yet answered.",
                               labels, registry=r, multiprocess_mode="livesum")  # fmt: skip
        self.requests = Counter("fulcrum_requests", "Requests by outcome.",
                                (*labels, "outcome"), registry=r)  # fmt: skip
        self.retried_dispatches = Counter(
            "fulcrum_isolation_dispatches",
            "Extra batch dispatches run to find which requests of a failed batch fail alone.",
            labels, registry=r)  # fmt: skip
        self.retry_compute_s = Counter(
            "fulcrum_isolation_compute_seconds",
            "Model time spent on those extra dispatches.", labels, registry=r)  # fmt: skip
        # The adaptive policy's state (zero under Triton's static policy), read when `/metrics`
        # is, not set after every batch (5 gauge writes on each lone request's path).
        self.policy_fixed_s = Gauge("fulcrum_batch_model_fixed_seconds",
                                    "Fitted fixed cost a of a batch: t(b) = a + c*b.",
                                    labels, registry=r, multiprocess_mode="max")  # fmt: skip
        self.policy_row_s = Gauge("fulcrum_batch_model_row_seconds",
                                  "Fitted cost c of each row of a batch: t(b) = a + c*b.",
                                  labels, registry=r, multiprocess_mode="max")  # fmt: skip
        self.batch_limit = Gauge("fulcrum_batch_limit", "Rows the batch policy allows a batch now.",
                                 labels, registry=r, multiprocess_mode="max")  # fmt: skip
        self.predicted_batch_s = Gauge("fulcrum_batch_predicted_seconds",
                                       "Predicted run time of the last batch.",
                                       labels, registry=r, multiprocess_mode="max")  # fmt: skip
        self.observed_batch_s = Gauge("fulcrum_batch_observed_seconds",
                                      "Observed run time of the last batch.",
                                      labels, registry=r, multiprocess_mode="max")  # fmt: skip
        self.shed = Counter("fulcrum_shed_requests",
                            "Requests refused with 503 before they ran, by reason.",
                            (*labels, "reason"), registry=r)  # fmt: skip
        self.lane_routes = Counter(
            "fulcrum_lane_routes",
            "Requests by lane taken and outcome: routed (its home lane), spilled (home lane "
            "saturated), failed_over (home lane down), refused (503; lane: the home lane).",
            ("model", "lane", "outcome"), registry=r)  # fmt: skip
        self.refusal_holds = Counter(
            "fulcrum_refusal_holds",
            "Connections left unread for a while after a refusal past their refusal budget "
            "(a client retrying 503s at once).", registry=r)  # fmt: skip
        self._series: dict[tuple[str, str, str], _Series] = {}
        self.lifecycle = LifecycleMetrics(r)
        # In PolicyGauges' field order.
        self._policy_families = (self.policy_fixed_s, self.policy_row_s, self.batch_limit,
                                 self.predicted_batch_s, self.observed_batch_s)  # fmt: skip

    def for_model(self, model: str, version: int, variant: str = "default") -> ModelMetrics:
        """A lease on one version's series (label children bound once, so the hot path does no
        lookups). Every lease must be released; the series go when the last one is.

        Leases count because a reload of the same version starts the new servable before the
        old one stops: both hold the same series, and the old one's release must not drop them.
        """
        key = (model, str(version), variant)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series()
            sources = series.sources  # the callbacks close over the weak set, not a servable
            self.queue_depth.labels(*key).set_function(lambda: sum(s.queue_depth for s in sources))
            self.in_flight.labels(*key).set_function(lambda: sum(s.num_admitted for s in sources))
            for field, family in enumerate(self._policy_families):
                family.labels(*key).set_function(functools.partial(_policy_value, sources, field))
        series.num_leases += 1
        return ModelMetrics(self, key, series)

    @property
    def num_versions(self) -> int:
        """Versions that have series now."""
        return len(self._series)

    def _release(self, key: tuple[str, str, str]) -> None:
        series = self._series.get(key)
        if series is None:
            return
        series.num_leases -= 1
        if series.num_leases > 0:
            return
        del self._series[key]
        for family in (self.request_s, self.queue_s, self.compute_s, self.batch_size,
                       self.queue_depth, self.in_flight, self.retried_dispatches,
                       self.retry_compute_s, self.policy_fixed_s, self.policy_row_s,
                       self.batch_limit, self.predicted_batch_s,
                       self.observed_batch_s):  # fmt: skip
            family.remove(*key)
        for outcome in OUTCOMES:
            self.requests.remove(*key, outcome)
        for reason in SHED_REASONS:
            self.shed.remove(*key, reason)


class LifecycleMetrics:
    """Scale to zero and the memory budget, per model (only models of the repository: a junk
    name never reaches a load, so never makes a series)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.cold_start_s = Histogram("fulcrum_model_cold_start_seconds",
                                      "Time from a request finding its model unloaded to the "
                                      "model loaded.", ("model",),
                                      buckets=COLD_START_BUCKETS_S, registry=r)  # fmt: skip
        self.cold_start_failures = Counter("fulcrum_model_cold_start_failures",
                                           "Loads started by a request that failed.",
                                           ("model",), registry=r)  # fmt: skip
        self.unloads = Counter("fulcrum_model_unloads",
                               "Models the server unloaded, by reason (idle, memory_budget).",
                               ("model", "reason"), registry=r)  # fmt: skip
        self.memory_bytes = Gauge("fulcrum_model_memory_bytes",
                                  "Memory measured at the model's load; 0 while unloaded.",
                                  ("model",), registry=r, multiprocess_mode="livesum")  # fmt: skip
        self.budget_bytes = Gauge("fulcrum_memory_budget_bytes",
                                  "The server's memory budget for models (0: none).",
                                  registry=r, multiprocess_mode="max")  # fmt: skip
        self.used_bytes = Gauge("fulcrum_memory_used_bytes",
                                "Memory of the loaded models, as measured at their loads.",
                                registry=r, multiprocess_mode="livesum")  # fmt: skip

    def forget(self, model: str) -> None:
        """Drop a model's series: the user unloaded it (a parked model keeps them)."""
        for family in (self.cold_start_s, self.cold_start_failures, self.memory_bytes):
            with contextlib.suppress(KeyError):  # a series it never had
                family.remove(model)
        for reason in ("idle", "memory_budget"):
            with contextlib.suppress(KeyError):
                self.unloads.remove(model, reason)


class ModelMetrics:
    """One model version's bound metric children: a lease from `ServerMetrics.for_model`."""

    def __init__(self, server: ServerMetrics, key: tuple[str, str, str], series: _Series) -> None:
        self._server = server
        self._key = key
        self._series = series
        self._watched: list[weakref.ref[GaugeSource]] = []
        self._released = False
        self.request_s = server.request_s.labels(*key)
        self.queue_s = server.queue_s.labels(*key)
        self.compute_s = server.compute_s.labels(*key)
        self.batch_size = server.batch_size.labels(*key)
        self.queue_depth = server.queue_depth.labels(*key)
        self.in_flight = server.in_flight.labels(*key)
        self.outcomes = {o: server.requests.labels(*key, o) for o in OUTCOMES}
        self.retried_dispatches = server.retried_dispatches.labels(*key)
        self.retry_compute_s = server.retry_compute_s.labels(*key)
        self.shed = {reason: server.shed.labels(*key, reason) for reason in SHED_REASONS}

    def watch(self, source: GaugeSource) -> None:
        """Report `source`'s queue depth, admitted requests and policy state on the gauges
        (held weakly)."""
        self._series.sources.add(source)
        self._watched.append(weakref.ref(source))

    def release(self) -> None:
        """Stop reporting this lease's sources; the last lease removes the version's series
        from every family. Idempotent."""
        if self._released:
            return
        self._released = True
        for ref in self._watched:
            source = ref()
            if source is not None:
                self._series.sources.discard(source)
        self._watched.clear()
        self._server._release(self._key)


def outcome_of(status_code: int, error_name: str) -> str:
    """The outcome label of a failed request, from its error class."""
    return {
        "InvalidInput": "invalid_input",
        "QueueFull": "queue_full",
        "Shed": "shed",
        "DeadlineExceeded": "timeout",
        "ModelError": "model_error",
        "ExecutionTimeout": "model_error",
        "Unavailable": "unavailable",
    }.get(error_name, "error" if status_code >= 500 else "invalid_input")
