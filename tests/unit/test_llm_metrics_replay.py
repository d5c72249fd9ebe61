"""Histogram samples relayed from an engine process are replayed in bulk (`observe_all`): the
same bucket counts and sum as one observe per sample, edge values included."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Histogram

from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.metrics_relay import RecordingMetrics, observe_all

BOUNDS = (0.001, 0.01, 0.1, 1.0)
VALUES = [0.0, 0.001, 0.0010001, 0.01, 0.05, 0.1, 0.5, 1.0, 1.5, 1e9, math.inf, -1.0, 0.05]


def _histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram("h", "h", ["model"], registry=registry, buckets=BOUNDS).labels("m")


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("le", "")): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_bulk_replay_counts_what_one_observe_each_counts() -> None:
    one_by_one, bulk = CollectorRegistry(), CollectorRegistry()
    each = _histogram(one_by_one)
    for value in VALUES:
        each.observe(value)
    observe_all(_histogram(bulk), VALUES)
    expected, got = _samples(one_by_one), _samples(bulk)
    assert got.keys() == expected.keys()
    assert {k: v for k, v in got.items() if k[0] != "h_sum"} == {
        k: v for k, v in expected.items() if k[0] != "h_sum"
    }
    assert got[("h_sum", "")] == expected[("h_sum", "")] == math.inf
    assert got[("h_bucket", "0.001")] == 3 and got[("h_bucket", "+Inf")] == len(VALUES)


def test_nan_lands_in_no_bucket_as_with_observe() -> None:
    one_by_one, bulk = CollectorRegistry(), CollectorRegistry()
    each = _histogram(one_by_one)
    for value in (math.nan, 0.5):
        each.observe(value)
    observe_all(_histogram(bulk), [math.nan, 0.5])
    expected, got = _samples(one_by_one), _samples(bulk)
    assert {k: v for k, v in got.items() if k[0] == "h_bucket"} == {
        k: v for k, v in expected.items() if k[0] == "h_bucket"
    }
    assert math.isnan(got[("h_sum", "")])


def test_a_relayed_step_replays_into_the_servers_series() -> None:
    recording = RecordingMetrics()
    itl = [0.002, 0.004, 0.2, 0.002]
    for value in itl:
        recording.itl_s.observe(value)
    recording.generation_tokens.inc(4)
    events = recording.take()
    assert events is not None
    registry = CollectorRegistry()
    events.replay(LLMMetrics(registry, "tiny", 1))
    labels = {"model": "tiny", "version": "1", "variant": "default"}
    value = registry.get_sample_value
    assert value("fulcrum_llm_inter_token_latency_seconds_count", labels) == 4
    assert value("fulcrum_llm_inter_token_latency_seconds_bucket", {**labels, "le": "0.0025"}) == 2
    assert value("fulcrum_llm_inter_token_latency_seconds_sum", labels) == sum(itl)
    assert value("fulcrum_llm_generation_tokens_total", labels) == 4
