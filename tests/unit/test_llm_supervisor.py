"""Engine supervision: the pure restart policy on given times, and an AsyncLLMEngine whose step
is made to crash (a hand-written fault-injecting wrapper) on the tiny Llama."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from fulcrum.errors import ConfigError, ModelError, Unavailable
from fulcrum.llm.engine import AsyncLLMEngine
from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import LoadedLLM, load_checkpoint
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.outputs import RequestOutput
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.supervisor import RestartPolicy, RestartTracker
from fulcrum.llm.sync_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
NO_WAIT = RestartPolicy(initial_backoff_s=0.0)


def test_backoff_doubles_up_to_its_cap() -> None:
    tracker = RestartTracker(
        RestartPolicy(initial_backoff_s=0.5, max_backoff_s=3.0, max_restarts=100, window_s=1.0)
    )
    waits = []
    for i in range(5):
        now_s = 10.0 * i  # apart by more than the window, within healthy_after_s
        waits.append(tracker.on_crash(now_s))
        tracker.on_restart(now_s)
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_backoff_starts_over_after_a_healthy_period() -> None:
    tracker = RestartTracker(RestartPolicy(initial_backoff_s=0.5, healthy_after_s=60.0))
    assert tracker.on_crash(0.0) == 0.5
    tracker.on_restart(0.5)
    assert tracker.on_crash(1.0) == 1.0  # crashed again soon: longer
    tracker.on_restart(2.0)
    assert tracker.on_crash(62.0) == 0.5  # up for a minute: healthy again


def test_too_many_restarts_in_the_window_stay_down_and_old_ones_expire() -> None:
    tracker = RestartTracker(RestartPolicy(max_restarts=2, window_s=60.0))
    for now_s in (0.0, 1.0):
        assert tracker.on_crash(now_s) is not None
        tracker.on_restart(now_s)
    assert tracker.on_crash(2.0) is None  # a third within 60 s
    assert tracker.on_crash(60.5) is not None  # the first restart left the window
    assert tracker.num_restarts == 2


def test_a_negative_setting_is_refused() -> None:
    with pytest.raises(ConfigError, match="max_backoff_s"):
        RestartPolicy(max_backoff_s=-1.0)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedLLM:
    directory = tmp_path_factory.mktemp("models")
    build_tiny_llama(directory)
    return load_checkpoint(directory / "tiny-llama" / "1")


class CrashingStep:
    """Stands in for LLMEngine.step: raises for the first `num_crashes` calls, then delegates."""

    def __init__(self, step: Callable[[], list[RequestOutput]], num_crashes: int) -> None:
        self._step = step
        self.num_crashes = num_crashes

    def __call__(self) -> list[RequestOutput]:
        if self.num_crashes > 0:
            self.num_crashes -= 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self._step()


def _engine(
    loaded: LoadedLLM, registry: CollectorRegistry, num_crashes: int, policy: RestartPolicy
) -> AsyncLLMEngine:
    metrics = LLMMetrics(registry, "tiny", 3)
    sync = LLMEngine(loaded, EngineParams(num_kv_blocks=32), metrics=metrics)
    sync.step = CrashingStep(sync.step, num_crashes)  # type: ignore[method-assign]
    return AsyncLLMEngine(sync, model_name="tiny", version=3, restart_policy=policy)


async def _tokens(engine: AsyncLLMEngine, prompt: list[int]) -> list[int]:
    return [t async for out in engine.generate(prompt, GREEDY) for t in out.new_token_ids]


async def test_a_crashed_engine_fails_its_requests_goes_unready_and_comes_back(
    loaded: LoadedLLM,
) -> None:
    reference = LLMEngine(loaded, EngineParams(num_kv_blocks=32))
    reference.add_request("r", [5, 6, 7], GREEDY)
    expected: list[int] = []
    while reference.has_unfinished():
        expected += [t for out in reference.step() for t in out.new_token_ids]
    registry = CollectorRegistry()
    engine = _engine(loaded, registry, num_crashes=1, policy=NO_WAIT)
    await engine.start()
    assert engine.is_healthy
    with pytest.raises(ModelError, match=r"crashed.*illegal memory access.*being restarted"):
        await _tokens(engine, [5, 6, 7])
    assert not engine.is_healthy  # readiness off while it restarts
    with pytest.raises(Unavailable, match="restarting after a crash"):
        engine.generate([5], GREEDY)
    assert engine._restart_task is not None
    await engine._restart_task
    assert engine.is_healthy
    assert engine.num_restarts == 1
    labels = {"model": "tiny", "version": "3", "variant": "default"}
    assert registry.get_sample_value("fulcrum_llm_engine_restarts_total", labels) == 1
    failed = {**labels, "finished_reason": "error"}
    assert registry.get_sample_value("fulcrum_llm_request_success_total", failed) == 1
    assert await _tokens(engine, [5, 6, 7]) == expected  # later requests are served
    assert engine.engine.block_manager.usage() == 0.0
    await engine.stop(timeout_s=5.0)


async def test_an_engine_that_keeps_crashing_stays_down(loaded: LoadedLLM) -> None:
    policy = RestartPolicy(initial_backoff_s=0.0, max_restarts=2, window_s=3600.0)
    engine = _engine(loaded, CollectorRegistry(), num_crashes=100, policy=policy)
    await engine.start()
    for _ in range(2):
        with pytest.raises(ModelError, match="crashed"):
            await _tokens(engine, [5, 6])
        assert engine._restart_task is not None
        await engine._restart_task
        assert engine.is_healthy
    with pytest.raises(ModelError, match="crashed"):
        await _tokens(engine, [5, 6])
    assert not engine.is_healthy
    assert engine._restart_task is not None and engine._restart_task.done()  # no new restart
    assert engine.num_restarts == 2
    with pytest.raises(Unavailable, match="crashed repeatedly and stays down"):
        engine.generate([5], GREEDY)
    await engine.stop(timeout_s=1.0)


async def test_stop_during_the_backoff_cancels_the_restart(loaded: LoadedLLM) -> None:
    engine = _engine(loaded, CollectorRegistry(), num_crashes=1, policy=RestartPolicy())
    await engine.start()
    with pytest.raises(ModelError):
        await _tokens(engine, [5, 6])
    task = engine._restart_task
    assert task is not None and not task.done()  # waiting out its 0.5 s backoff
    await engine.stop(timeout_s=1.0)
    assert task.cancelled()
    assert not engine.is_healthy and engine.num_restarts == 0
