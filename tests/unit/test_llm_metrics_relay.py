"""An engine process's metrics: recorded in the child by `RecordingMetrics`, carried in each
step message, replayed into the server's `LLMMetrics`; and the step message itself pickles
whole (errors and logprobs included). Also the `engine_process` parameter and the child's
default torch threads."""

from __future__ import annotations

import pickle

import pytest
from prometheus_client import CollectorRegistry

from fulcrum.errors import ConfigError, ModelError, QueueFull
from fulcrum.llm.budget import BudgetState
from fulcrum.llm.engine_core import StepReport, child_num_threads
from fulcrum.llm.logprobs import TokenLogprob
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.metrics_relay import RecordingMetrics
from fulcrum.llm.outputs import RequestOutput, Usage, pack_outputs, unpack_outputs
from fulcrum.llm.params import EngineParams

LABELS = {"model": "m", "version": "1", "variant": "default"}


def _calls(metrics: LLMMetrics) -> None:
    """A step's worth of what the engine calls, zero increments included."""
    metrics.ttft_s.observe(0.02)
    metrics.itl_s.observe(0.01)
    metrics.itl_s.observe(0.03)
    metrics.running.set(3)
    metrics.running.set(2)  # the last value set is what a scrape sees
    metrics.generation_tokens.inc(2)
    metrics.generation_tokens.inc()
    metrics.preemptions.inc(0)
    metrics.request_finished("length")
    metrics.request_shed("queue_full")


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_replayed_calls_give_the_same_series_as_direct_calls() -> None:
    direct = CollectorRegistry()
    _calls(LLMMetrics(direct, "m", 1))
    relayed = CollectorRegistry()
    target = LLMMetrics(relayed, "m", 1)
    recorder = RecordingMetrics()
    _calls(recorder)
    events = recorder.take()
    assert events is not None
    pickle.loads(pickle.dumps(events)).replay(target)
    assert _samples(relayed) == _samples(direct)
    assert relayed.get_sample_value("fulcrum_llm_num_requests_running", LABELS) == 2
    assert relayed.get_sample_value("fulcrum_llm_generation_tokens_total", LABELS) == 3
    assert "preemptions" not in events.counts  # a zero increment carries nothing


def test_take_hands_over_each_call_once() -> None:
    recorder = RecordingMetrics()
    assert recorder.take() is None
    recorder.kv_usage.set(0.5)
    first = recorder.take()
    assert first is not None and first.gauges == {"kv_usage": 0.5}
    assert recorder.take() is None
    recorder.remove()  # the server's metrics own the series: nothing to do, no error


def test_a_step_message_pickles_whole() -> None:
    outputs = [
        RequestOutput("a", [5, 6], "hi", None, Usage(3, 2, 0),
                      new_logprobs=[TokenLogprob(5, -0.5, 1, ((5, -0.5), (7, -1.0)))]),
        RequestOutput("b", [], "", "error", Usage(3, 0, 0), error=ModelError("bad row")),
    ]  # fmt: skip
    report = StepReport(
        outputs=pack_outputs(outputs),
        errors=[("c", QueueFull("full"))],
        num_applied=4,
        num_waiting=1,
        budget_state=BudgetState(512, 8),
        metrics=None,
    )
    back = pickle.loads(pickle.dumps(report))
    unpacked = unpack_outputs(back.outputs)
    assert unpacked[0] == outputs[0]
    assert unpacked[1].finish_reason == "error" and str(unpacked[1].error) == "bad row"
    assert isinstance(back.errors[0][1], QueueFull) and back.errors[0][1].status_code == 503
    assert back.budget_state == report.budget_state


def test_engine_process_is_a_checked_boolean_parameter() -> None:
    assert EngineParams().engine_process is False  # thread mode unless a config asks
    assert EngineParams.from_parameters({"engine_process": True}).engine_process is True
    with pytest.raises(ConfigError, match="engine_process' = 1: expected bool"):
        EngineParams.from_parameters({"engine_process": 1})


def test_the_engine_process_leaves_the_server_a_core_by_default() -> None:
    assert child_num_threads(3) == 3  # as set
    assert child_num_threads(0) >= 1
