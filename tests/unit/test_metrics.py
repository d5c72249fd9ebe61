"""ServerMetrics: a lease per loaded version, gauges that hold their sources weakly, and every
series of a version removed when its last lease is released."""

from __future__ import annotations

import gc
import weakref

from prometheus_client import generate_latest

from fulcrum.metrics import OUTCOMES, PolicyGauges, ServerMetrics, outcome_of


class FakeSource:
    """A loaded version as the gauges see it."""

    def __init__(
        self, queue_depth: int = 0, num_admitted: int = 0, policy: PolicyGauges | None = None
    ) -> None:
        self.queue_depth = queue_depth
        self.num_admitted = num_admitted
        self.policy = policy

    def policy_gauges(self) -> PolicyGauges | None:
        return self.policy


def gauge(metrics: ServerMetrics, name: str, version: str = "1") -> float | None:
    return metrics.registry.get_sample_value(
        name, {"model": "m", "version": version, "variant": "default"}
    )


def series_of(metrics: ServerMetrics, model: str = "m") -> list[str]:
    text = generate_latest(metrics.registry).decode()
    return [line for line in text.splitlines() if f'model="{model}"' in line]


def test_a_lease_creates_series_and_its_release_removes_them_from_every_family() -> None:
    metrics = ServerMetrics()
    empty = generate_latest(metrics.registry)
    lease = metrics.for_model("m", 1)
    lease.request_s.observe(0.01)
    lease.outcomes["success"].inc()
    lines = series_of(metrics)
    names = {line.split("{")[0] for line in lines}
    assert {
        "fulcrum_request_duration_seconds_count",
        "fulcrum_queue_duration_seconds_count",
        "fulcrum_compute_duration_seconds_count",
        "fulcrum_batch_size_count",
        "fulcrum_queue_depth",
        "fulcrum_inflight_requests",
        "fulcrum_requests_total",
    } <= names
    assert sum(line.startswith("fulcrum_requests_total") for line in lines) == len(OUTCOMES)
    lease.release()
    assert series_of(metrics) == []
    assert generate_latest(metrics.registry) == empty
    assert metrics.num_versions == 0


def test_release_is_idempotent_and_other_versions_keep_their_series() -> None:
    metrics = ServerMetrics()
    one, two = metrics.for_model("m", 1), metrics.for_model("m", 2)
    one.release()
    one.release()  # a second stop must not take the reloaded version's lease with it
    assert gauge(metrics, "fulcrum_queue_depth", "2") == 0.0
    assert gauge(metrics, "fulcrum_queue_depth", "1") is None
    two.release()
    assert series_of(metrics) == []


def test_a_reload_of_the_same_version_keeps_the_series_until_the_last_lease_goes() -> None:
    metrics = ServerMetrics()
    old, new = metrics.for_model("m", 1), metrics.for_model("m", 1)  # new starts before old stops
    old_source, new_source = FakeSource(3, 4), FakeSource(1, 2)
    old.watch(old_source)
    new.watch(new_source)
    assert gauge(metrics, "fulcrum_queue_depth") == 4.0  # both serve during the switch
    assert gauge(metrics, "fulcrum_inflight_requests") == 6.0
    old.release()
    assert gauge(metrics, "fulcrum_queue_depth") == 1.0  # the new one's alone
    new.request_s.observe(0.5)  # its children are still the registry's
    assert metrics.registry.get_sample_value(
        "fulcrum_request_duration_seconds_count",
        {"model": "m", "version": "1", "variant": "default"},
    ) == 1.0  # fmt: skip
    new.release()
    assert series_of(metrics) == []


def test_gauges_do_not_keep_their_source_alive() -> None:
    metrics = ServerMetrics()
    lease = metrics.for_model("m", 1)
    source = FakeSource(5, 5)
    lease.watch(source)
    assert gauge(metrics, "fulcrum_queue_depth") == 5.0
    ref = weakref.ref(source)
    del source
    gc.collect()
    assert ref() is None
    assert gauge(metrics, "fulcrum_queue_depth") == 0.0
    lease.release()


def test_policy_gauges_read_the_adaptive_policy_when_scraped() -> None:
    metrics = ServerMetrics()
    lease = metrics.for_model("m", 1)
    static = FakeSource()
    lease.watch(static)
    names = ("fulcrum_batch_model_fixed_seconds", "fulcrum_batch_model_row_seconds",
             "fulcrum_batch_limit", "fulcrum_batch_predicted_seconds",
             "fulcrum_batch_observed_seconds")  # fmt: skip
    assert [gauge(metrics, name) for name in names] == [0.0] * 5  # Triton's rules: no state
    adaptive = FakeSource(policy=PolicyGauges(0.002, 0.0005, 16, 0.004, 0.005))
    lease.watch(adaptive)
    assert [gauge(metrics, name) for name in names] == [0.002, 0.0005, 16.0, 0.004, 0.005]
    adaptive.policy = adaptive.policy._replace(batch_limit=32)  # no write: read when scraped
    assert gauge(metrics, "fulcrum_batch_limit") == 32.0
    lease.release()
    assert [gauge(metrics, name) for name in names] == [None] * 5


def test_outcome_of_maps_error_classes() -> None:
    assert outcome_of(503, "QueueFull") == "queue_full"
    assert outcome_of(500, "SomethingElse") == "error"
    assert outcome_of(400, "SomethingElse") == "invalid_input"
