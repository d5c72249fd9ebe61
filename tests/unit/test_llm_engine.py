"""LLMEngine (sync step loop) and AsyncLLMEngine (thread + asyncio streams) on the tiny Llama."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from fulcrum.config import ModelConfig
from fulcrum.errors import ConfigError, InvalidInput, ModelError, QueueFull, Shed, Unavailable
from fulcrum.llm.budget import StepRecord
from fulcrum.llm.engine import AsyncLLMEngine, LLMEngine
from fulcrum.llm.examples import build_tiny_gpt2, build_tiny_llama
from fulcrum.llm.loader import LoadedLLM, load_checkpoint
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.params import EngineParams
from fulcrum.llm.runner import Sampled
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.scheduler import ScheduledBatch
from fulcrum.types import FakeClock

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models")
    build_tiny_llama(directory)
    return directory / "tiny-llama"


@pytest.fixture
def loaded(model_dir: Path) -> LoadedLLM:
    return load_checkpoint(model_dir / "1")


def _engine(loaded: LoadedLLM, **params: object) -> LLMEngine:
    return LLMEngine(loaded, EngineParams(**{"num_kv_blocks": 32, **params}))  # type: ignore[arg-type,unused-ignore]


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_params_name_the_bad_key_and_value() -> None:
    with pytest.raises(ConfigError, match="max_num_seqs' = 0"):
        EngineParams.from_parameters({"max_num_seqs": 0})
    with pytest.raises(ConfigError, match="block_size' = True"):
        EngineParams.from_parameters({"block_size": True})
    with pytest.raises(ConfigError, match=r"parameters\.bogus"):
        EngineParams.from_parameters({"bogus": 1})
    with pytest.raises(ConfigError, match="dtype"):
        EngineParams.from_parameters({"dtype": "int3"})
    assert EngineParams.from_parameters({"kv_cache_memory_mb": 8}).kv_cache_memory_mb == 8.0


def test_requests_that_can_never_run_fail_before_queueing(loaded: LoadedLLM) -> None:
    engine = _engine(loaded, max_model_len=64)
    with pytest.raises(InvalidInput, match="max_tokens"):
        engine.add_request("a", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidInput, match="prompt"):
        engine.add_request("b", [loaded.model.vocab_size], GREEDY)
    small_pool = _engine(loaded, num_kv_blocks=2, block_size=4)
    assert small_pool.max_model_len == 8  # the KV pool caps the context
    with pytest.raises(InvalidInput, match="max_model_len"):
        small_pool.add_request("k", [5] * 4, GREEDY)
    with pytest.raises(InvalidInput, match="temperature"):
        engine.add_request("c", [5], SamplingParams(temperature=-1.0))
    assert not engine.has_unfinished()


def test_usage_counts_prompt_completion_and_cached_tokens(loaded: LoadedLLM) -> None:
    engine = _engine(loaded, block_size=4)
    prompt = list(range(5, 30))
    engine.add_request("first", prompt, GREEDY)
    _run(engine)
    engine.add_request("second", prompt, GREEDY)
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            last = out
    assert last is not None and last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (25, 8)
    assert last.usage.cached_tokens == 24  # six full blocks; the last token is recomputed


def test_abort_frees_blocks_at_once(loaded: LoadedLLM) -> None:
    engine = _engine(loaded, block_size=4)
    engine.add_request("a", list(range(5, 20)), SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    assert engine.block_manager.num_free_blocks() < 32
    final = engine.abort("a")
    assert final is not None and final.finish_reason == "abort"
    assert not engine.has_unfinished()
    assert engine.block_manager.usage() == 0.0


def test_stop_string_finishes_with_stop(loaded: LoadedLLM) -> None:
    engine = _engine(loaded)
    engine.add_request("free", [5, 6, 7], GREEDY)
    text = ""
    while engine.has_unfinished():
        text += "".join(out.new_text for out in engine.step())
    stop = text[2:4]
    assume = stop.strip() and stop not in text[:2]
    if not assume:
        pytest.skip(f"the tiny model's text {text!r} gives no usable stop string")
    engine.add_request(
        "stopped",
        [5, 6, 7],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=(stop,)),
    )
    outputs = [out for _ in range(20) for out in engine.step()]
    assert outputs[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in outputs) == text[: text.index(stop)]


def test_metrics_follow_vllm_meanings(loaded: LoadedLLM) -> None:
    registry = CollectorRegistry()
    clock = FakeClock()
    engine = LLMEngine(
        loaded, EngineParams(num_kv_blocks=32), metrics=LLMMetrics(registry, "m"), clock=clock
    )
    engine.add_request(
        "a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    )
    clock.advance(1.0)  # queued one second before the first step
    while engine.has_unfinished():
        engine.step()
        clock.advance(0.5)

    def value(name: str, **labels: str) -> float:
        result = registry.get_sample_value(
            name, {"model": "m", "version": "1", "variant": "default", **labels}
        )
        assert result is not None, name
        return result

    assert value("fulcrum_llm_request_queue_time_seconds_sum") == 1.0
    assert value("fulcrum_llm_time_to_first_token_seconds_sum") == 1.0
    assert value("fulcrum_llm_inter_token_latency_seconds_count") == 2
    assert value("fulcrum_llm_inter_token_latency_seconds_sum") == 1.0
    assert value("fulcrum_llm_e2e_request_latency_seconds_sum") == 2.0
    assert value("fulcrum_llm_time_per_output_token_seconds_sum") == 0.5
    assert value("fulcrum_llm_generation_tokens_total") == 3
    assert value("fulcrum_llm_request_success_total", finished_reason="length") == 1
    assert value("fulcrum_llm_num_requests_running") == 0


def _async_engine(loaded: LoadedLLM, **params: object) -> AsyncLLMEngine:
    return AsyncLLMEngine(_engine(loaded, **params), model_name="tiny")


async def test_async_streams_match_the_sync_engine(loaded: LoadedLLM) -> None:
    sync = _engine(loaded)
    for i in range(3):
        sync.add_request(str(i), [5 + i, 6, 7], GREEDY)
    expected = _run(sync)
    engine = _async_engine(loaded)
    await engine.start()

    async def collect(i: int) -> list[int]:
        return [
            t async for out in engine.generate([5 + i, 6, 7], GREEDY) for t in out.new_token_ids
        ]

    got = await asyncio.gather(*(collect(i) for i in range(3)))
    assert got == [expected[str(i)] for i in range(3)]
    assert engine.is_healthy
    await engine.stop()
    assert not engine.is_healthy


async def test_closing_a_stream_aborts_and_frees_its_blocks(loaded: LoadedLLM) -> None:
    engine = _async_engine(loaded)
    await engine.start()
    stream = engine.generate(
        [5, 6, 7], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    )
    await anext(stream)
    await stream.aclose()  # what a client disconnect does to the route's iteration
    # Commands apply in order: once a later request finished, the abort has been applied.
    async for _ in engine.generate([9], SamplingParams(max_tokens=1, temperature=0.0)):
        pass
    assert not engine.engine.has_unfinished()
    assert engine.engine.block_manager.usage() == 0.0
    await engine.stop(timeout_s=5.0)


async def test_stop_aborts_what_does_not_drain_in_time(loaded: LoadedLLM) -> None:
    engine = _async_engine(loaded)
    await engine.start()
    stream = engine.generate(
        [5, 6, 7], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    )
    await anext(stream)
    await engine.stop(timeout_s=0.0)
    with pytest.raises(Unavailable, match="shutting down"):
        async for _ in stream:
            pass
    assert not engine.engine.has_unfinished()
    assert engine.engine.block_manager.usage() == 0.0


async def test_queue_full_beyond_max_num_waiting(loaded: LoadedLLM) -> None:
    engine = _async_engine(loaded, max_num_waiting=2)
    await engine.start()
    engine._num_waiting = 2  # as the engine thread publishes it under load
    with pytest.raises(QueueFull):
        engine.generate([5, 6], GREEDY)
    await engine.stop()


async def test_engine_death_fails_requests_and_readiness(loaded: LoadedLLM) -> None:
    engine = _async_engine(loaded)

    def broken_step() -> list[object]:
        raise RuntimeError("CUDA error: device lost")

    engine.engine.step = broken_step
    await engine.start()
    with pytest.raises(ModelError, match="device lost"):
        async for _ in engine.generate([5, 6], GREEDY):
            pass
    assert not engine.is_healthy
    with pytest.raises(Unavailable):
        engine.generate([5, 6], GREEDY)
    await engine.stop(timeout_s=1.0)


async def test_from_config_reads_parameters(model_dir: Path) -> None:
    config = ModelConfig(
        name="tiny-llama",
        platform="llm",
        parameters={"num_kv_blocks": 20, "block_size": 8, "max_model_len": 100},
    )
    engine = AsyncLLMEngine.from_config(config, model_dir / "1")
    assert engine.model_name == "tiny-llama"
    assert engine.max_model_len == 100
    assert engine.engine.block_manager.num_blocks == 20
    with pytest.raises(Unavailable):  # not started
        engine.generate([5], GREEDY)


def test_metrics_share_one_registry_across_models_and_reloads() -> None:
    registry = CollectorRegistry()
    first, again, other = (LLMMetrics(registry, m) for m in ("a", "a", "b"))
    first.generation_tokens.inc()
    again.generation_tokens.inc()  # a reloaded version counts into the same series
    other.request_finished("stop")
    labels = {"model": "a", "version": "1", "variant": "default"}
    assert registry.get_sample_value("fulcrum_llm_generation_tokens_total", labels) == 2
    labels = {"model": "b", "version": "1", "variant": "default", "finished_reason": "stop"}
    assert registry.get_sample_value("fulcrum_llm_request_success_total", labels) == 1


async def test_an_iterator_never_started_does_not_outlive_its_request(loaded: LoadedLLM) -> None:
    engine = _async_engine(loaded)
    await engine.start()
    unstarted = engine.generate([5, 6], SamplingParams(max_tokens=2, temperature=0.0))
    async for _ in engine.generate([5, 6], SamplingParams(max_tokens=3, temperature=0.0)):
        pass
    assert engine._streams == {}  # the finished request's queue lives only in its iterator
    assert [o.finish_reason async for o in unstarted][-1] == "length"
    await engine.stop(timeout_s=5.0)


# --- the SLO token budget ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> LoadedLLM:
    directory = tmp_path_factory.mktemp("gpt2")
    build_tiny_gpt2(directory)
    return load_checkpoint(directory / "tiny-gpt2" / "1")


class SlowRunner:
    """The real runner, but each step advances the fake clock by a machine's step time."""

    def __init__(self, engine: LLMEngine, clock: FakeClock, per_token_s: float) -> None:
        self.run_real: Callable[[ScheduledBatch], list[Sampled]] = engine.runner.run
        self.clock = clock
        self.per_token_s = per_token_s

    def run(self, batch: ScheduledBatch) -> list[Sampled]:
        self.clock.advance(0.002 + self.per_token_s * batch.num_batched_tokens)
        return self.run_real(batch)


def _slo_run(
    gpt2: LoadedLLM, prompts: list[list[int]], **params: object
) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """Greedy tokens per request and (token budget, running) after each step."""
    clock = FakeClock()
    values: dict[str, object] = {"num_kv_blocks": 64, "max_num_batched_tokens": 64, **params}
    engine = LLMEngine(gpt2, EngineParams(**values), clock=clock)  # type: ignore[arg-type,unused-ignore]
    engine.runner.run = SlowRunner(engine, clock, per_token_s=0.001).run
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=12, temperature=0.0))
    tokens: dict[str, list[int]] = {}
    dial: list[tuple[int, int]] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        budget = engine.scheduler.token_budget or engine.scheduler.max_num_batched_tokens
        dial.append((budget, engine.scheduler.num_running))
    return tokens, dial


def test_slo_budget_moves_the_dial_and_keeps_greedy_tokens(gpt2: LoadedLLM) -> None:
    prompts = [[(7 * i + j) % 200 + 5 for j in range(20 + 3 * i)] for i in range(6)]
    expected, static = _slo_run(gpt2, prompts)
    assert {budget for budget, _ in static} == {64}  # no SLO keys: the dial never moves
    # 30 ms per output token: at 1 ms a token plus 2 ms a step, about 25 tokens fit a step.
    got, dial = _slo_run(gpt2, prompts, slo_tpot_ms=30.0, slo_ttft_ms=10_000.0)
    assert got == expected
    assert min(budget for budget, _ in dial) <= 25
    assert all(running <= budget <= 64 for budget, running in dial)


def test_without_slo_keys_the_engine_has_no_budget(gpt2: LoadedLLM) -> None:
    engine = LLMEngine(gpt2, EngineParams(num_kv_blocks=32))
    engine.add_request("a", [5, 6, 7], GREEDY)
    _run(engine)
    assert engine.budget is None
    assert (engine.scheduler.token_budget, engine.scheduler.max_running) == (None, None)


def _seed_a_long_queue(engine: LLMEngine) -> None:
    """Publish what the engine thread would after slow steps under a queue of 50k tokens."""
    assert engine.budget is not None
    for num_tokens in (64, 32, 48, 16):
        engine.budget.observe_step(
            StepRecord(num_tokens, 0, 0.002 + 0.001 * num_tokens, 0, 0, 50_000)
        )


async def test_a_request_that_would_miss_ttft_gets_503_at_the_call(gpt2: LoadedLLM) -> None:
    registry = CollectorRegistry()
    params = EngineParams(num_kv_blocks=32, max_num_batched_tokens=64, slo_ttft_ms=500.0)
    sync = LLMEngine(gpt2, params, metrics=LLMMetrics(registry, "g"))
    engine = AsyncLLMEngine(sync, model_name="g")
    await engine.start()
    _seed_a_long_queue(sync)
    with pytest.raises(Shed, match="slo_ttft_ms") as shed:
        engine.generate([5, 6, 7], GREEDY)
    assert shed.value.retry_after_s > 0.5  # the queue ahead takes longer than the SLO
    labels = {"model": "g", "version": "1", "variant": "default", "reason": "slo_ttft"}
    assert registry.get_sample_value("fulcrum_llm_requests_shed_total", labels) == 1
    assert not sync.has_unfinished()
    await engine.stop()
    assert registry.get_sample_value("fulcrum_llm_requests_shed_total", labels) is None


async def test_queue_action_admits_a_request_predicted_late(gpt2: LoadedLLM) -> None:
    params = EngineParams(num_kv_blocks=32, slo_ttft_ms=500.0, slo_ttft_action="queue")
    engine = AsyncLLMEngine(LLMEngine(gpt2, params), model_name="g")
    await engine.start()
    _seed_a_long_queue(engine.engine)
    outputs = [out async for out in engine.generate([5, 6, 7], GREEDY)]
    assert outputs[-1].finish_reason == "length"
    await engine.stop()


def test_an_engine_left_idle_by_aborts_admits_again(gpt2: LoadedLLM) -> None:
    engine = LLMEngine(gpt2, EngineParams(num_kv_blocks=32, slo_ttft_ms=500.0))
    engine.add_request("a", [5, 6, 7], GREEDY)
    _seed_a_long_queue(engine)  # the last step saw a long queue...
    with pytest.raises(Shed):
        engine.add_request("b", [5, 6, 7], GREEDY)
    engine.abort("a")  # ...then every request went away, and no step will run to say so
    engine.add_request("b", [5, 6, 7], GREEDY)
    assert _run(engine)["b"]
