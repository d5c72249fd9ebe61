"""Prometheus metric definitions, one registry per service. Histograms (not summaries), so
replicas aggregate. Series exist only for loaded models: junk names never create one."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
OUTCOMES = ("success", "invalid_input", "queue_full", "timeout", "model_error", "unavailable",
            "error")  # fmt: skip


class ServerMetrics:
    """The server's metric families on its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        labels = ("model", "version")
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

    def for_model(self, model: str, version: int) -> ModelMetrics:
        """Label children bound once per loaded version, so the hot path does no lookups."""
        v = str(version)
        return ModelMetrics(
            request_s=self.request_s.labels(model, v),
            queue_s=self.queue_s.labels(model, v),
            compute_s=self.compute_s.labels(model, v),
            batch_size=self.batch_size.labels(model, v),
            queue_depth=self.queue_depth.labels(model, v),
            in_flight=self.in_flight.labels(model, v),
            outcomes={o: self.requests.labels(model, v, o) for o in OUTCOMES},
        )


@dataclass(frozen=True)
class ModelMetrics:
    """One model version's bound metric children."""

    request_s: Histogram
    queue_s: Histogram
    compute_s: Histogram
    batch_size: Histogram
    queue_depth: Gauge
    in_flight: Gauge
    outcomes: dict[str, Counter]


def outcome_of(status_code: int, error_name: str) -> str:
    """The outcome label of a failed request, from its error class."""
    return {
        "InvalidInput": "invalid_input",
        "QueueFull": "queue_full",
        "DeadlineExceeded": "timeout",
        "ModelError": "model_error",
        "Unavailable": "unavailable",
    }.get(error_name, "error" if status_code >= 500 else "invalid_input")
