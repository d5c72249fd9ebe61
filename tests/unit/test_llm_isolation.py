"""A request that fails inside a step fails alone: a row the sampler cannot draw, a whole failed
step, and the hostile sampling values of issue 9 (finding 1), on the tiny Llama."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

from fulcrum.errors import InvalidInput, ModelError
from fulcrum.llm.engine import AsyncLLMEngine
from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import LoadedLLM, load_checkpoint
from fulcrum.llm.logits_processors import TokenHistory
from fulcrum.llm.params import EngineParams
from fulcrum.llm.runner import Sampled
from fulcrum.llm.sampler import SampledToken, Sampler
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.scheduler import ScheduledBatch
from fulcrum.llm.sync_engine import MAX_CONSECUTIVE_FAILED_STEPS, LLMEngine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
POISON_SEED = 666
POISONED = SamplingParams(max_tokens=6, temperature=1.0, seed=POISON_SEED, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedLLM:
    directory = tmp_path_factory.mktemp("models")
    build_tiny_llama(directory)
    return load_checkpoint(directory / "tiny-llama" / "1")


def _engine(loaded: LoadedLLM) -> LLMEngine:
    return LLMEngine(loaded, EngineParams(num_kv_blocks=32, block_size=4))


def _alone(loaded: LoadedLLM, prompt: list[int]) -> list[int]:
    engine = _engine(loaded)
    engine.add_request("alone", prompt, GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    return tokens


class PoisonSampler(Sampler):
    """Fails any draw that includes the poisoned request's row, as NaN logits make
    torch.multinomial fail; rows drawn without it sample normally."""

    def sample_tokens(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seq_ids: list[int],
        histories: list[TokenHistory] | None = None,
    ) -> list[SampledToken]:
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return super().sample_tokens(logits, params, seq_ids, histories)


class FailingRun:
    """Stands in for ModelRunner.run: raises for the first `num_failures` calls."""

    def __init__(self, run: Callable[[ScheduledBatch], list[Sampled]], num_failures: int) -> None:
        self._run = run
        self.num_failures = num_failures

    def __call__(self, batch: ScheduledBatch) -> list[Sampled]:
        if self.num_failures > 0:
            self.num_failures -= 1
            raise RuntimeError("forward failed")
        return self._run(batch)


def test_a_row_that_cannot_be_sampled_fails_only_its_request(loaded: LoadedLLM) -> None:
    engine = _engine(loaded)
    engine.runner.sampler = PoisonSampler(engine.runner.device)
    engine.add_request("good", [5, 6, 7], GREEDY)
    engine.add_request("bad", [8, 9], POISONED)
    outputs = {out.request_id: out for out in engine.step()}
    bad = outputs["bad"]
    assert bad.finish_reason == "error" and isinstance(bad.error, ModelError)
    assert "nan" in bad.error.message
    tokens = list(outputs["good"].new_token_ids)
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == _alone(loaded, [5, 6, 7])
    assert engine.block_manager.usage() == 0.0


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(loaded: LoadedLLM) -> None:
    engine = _engine(loaded)
    engine.runner.run = FailingRun(engine.runner.run, 1)  # type: ignore[method-assign]
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.add_request("b", [8, 9], GREEDY)
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ["a", "b"]
    assert all(o.finish_reason == "error" and o.error is not None for o in outputs)
    assert not engine.has_unfinished()
    assert engine.block_manager.usage() == 0.0
    engine.add_request("c", [5, 6, 7], GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == _alone(loaded, [5, 6, 7])


def test_steps_failing_in_a_row_end_the_engine_thread_for_its_supervisor(
    loaded: LoadedLLM,
) -> None:
    engine = _engine(loaded)
    engine.runner.run = FailingRun(engine.runner.run, 100)  # type: ignore[method-assign]
    for i in range(MAX_CONSECUTIVE_FAILED_STEPS - 1):
        engine.add_request(str(i), [5, 6], GREEDY)
        assert [o.finish_reason for o in engine.step()] == ["error"]
    engine.add_request("last", [5, 6], GREEDY)
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.step()


async def test_a_poisoned_stream_fails_alone_and_the_engine_stays_healthy(
    loaded: LoadedLLM,
) -> None:
    sync = _engine(loaded)
    sync.runner.sampler = PoisonSampler(sync.runner.device)
    engine = AsyncLLMEngine(sync, model_name="tiny")
    await engine.start()

    async def collect(sampling: SamplingParams) -> list[int]:
        return [t async for out in engine.generate([5, 6, 7], sampling) for t in out.new_token_ids]

    good, bad = await asyncio.gather(collect(GREEDY), collect(POISONED), return_exceptions=True)
    assert good == _alone(loaded, [5, 6, 7])
    assert isinstance(bad, ModelError) and "sampling failed for this request" in bad.message
    assert engine.is_healthy
    await engine.stop(timeout_s=5.0)


HOSTILE = [
    SamplingParams(max_tokens=4, temperature=1e-308),
    SamplingParams(max_tokens=4, temperature=5e-324),
    SamplingParams(max_tokens=4, temperature=1.0, top_p=1e-300),
    SamplingParams(max_tokens=4, temperature=1.0, top_k=2**31 - 1),
]


async def test_hostile_sampling_values_never_kill_the_engine(loaded: LoadedLLM) -> None:
    engine = AsyncLLMEngine(_engine(loaded), model_name="tiny")
    await engine.start()
    with pytest.raises(InvalidInput, match="top_k"):
        engine.generate([5, 6], SamplingParams(max_tokens=4, temperature=1.0, top_k=2**63))
    for sampling in HOSTILE:
        outputs = [out async for out in engine.generate([5, 6], sampling)]
        assert outputs[-1].finish_reason in ("length", "stop")
        assert engine.is_healthy
    greedy_tokens = [t async for o in engine.generate([5, 6, 7], GREEDY) for t in o.new_token_ids]
    assert greedy_tokens == _alone(loaded, [5, 6, 7])
    await engine.stop(timeout_s=5.0)
