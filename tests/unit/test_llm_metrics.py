"""LLM metrics per (model, version): series removed when an engine stops, gauges right after an
abort with no step after it, and engines built off the event loop (as the service loads them)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fulcrum.config import ModelConfig
from fulcrum.llm.engine import AsyncLLMEngine
from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import LoadedLLM, load_checkpoint
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.outputs import RequestOutput
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.sync_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
CONFIG = ModelConfig(name="tiny-llama", platform="llm", parameters={"num_kv_blocks": 32})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models")
    build_tiny_llama(directory)
    return directory / "tiny-llama"


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> LoadedLLM:
    return load_checkpoint(model_dir / "1")


def _gauges(registry: CollectorRegistry, model: str, version: str) -> list[float | None]:
    labels = {"model": model, "version": version, "variant": "default"}
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    return [registry.get_sample_value(f"fulcrum_llm_{name}", labels) for name in names]


async def _cycle(model_dir: Path, registry: CollectorRegistry, version: int) -> None:
    # As the service loads a model: the blocking build in a worker thread, start on the loop.
    engine = await asyncio.to_thread(
        AsyncLLMEngine.from_config, CONFIG, model_dir / "1", version=version, registry=registry
    )
    await engine.start()
    async for _ in engine.generate([5, 6, 7], GREEDY):
        pass
    labels = {"model": "tiny-llama", "version": str(version), "variant": "default"}
    assert registry.get_sample_value("fulcrum_llm_generation_tokens_total", labels) == 3
    await engine.stop(timeout_s=5.0)
    assert registry.get_sample_value("fulcrum_llm_generation_tokens_total", labels) is None


async def test_load_stop_cycles_leave_metrics_text_flat(model_dir: Path) -> None:
    registry = CollectorRegistry()
    await _cycle(model_dir, registry, version=1)
    size_after_one = len(generate_latest(registry))
    for version in (1, 2, 3, 2, 4):  # reloads of one version and new versions
        await _cycle(model_dir, registry, version)
    assert len(generate_latest(registry)) == size_after_one
    assert b'version="' not in generate_latest(registry)


def test_overlapping_engines_of_one_version_keep_the_series_until_the_last_goes() -> None:
    registry = CollectorRegistry()
    old, new = LLMMetrics(registry, "m", 1), LLMMetrics(registry, "m", 1)
    new.generation_tokens.inc()
    old.remove()  # the old engine of a same-version reload stops after the new one started
    old.remove()  # idempotent: must not take the new engine's share
    labels = {"model": "m", "version": "1", "variant": "default"}
    assert registry.get_sample_value("fulcrum_llm_generation_tokens_total", labels) == 1
    new.request_finished("stop")
    new.remove()
    assert registry.get_sample_value("fulcrum_llm_generation_tokens_total", labels) is None
    assert b'model="m"' not in generate_latest(registry)


def test_an_abort_updates_the_gauges_without_another_step(loaded: LoadedLLM) -> None:
    registry = CollectorRegistry()
    engine = LLMEngine(loaded, EngineParams(num_kv_blocks=32), metrics=LLMMetrics(registry, "m", 2))
    engine.add_request("a", [5, 6, 7], LONG)
    engine.add_request("b", [5, 6, 8], LONG)
    assert _gauges(registry, "m", "2")[1] == 2  # waiting, before any step
    engine.step()
    running, waiting, kv_usage = _gauges(registry, "m", "2")
    assert (running, waiting) == (2, 0) and kv_usage is not None and kv_usage > 0
    engine.abort("a")
    engine.abort("b")
    assert _gauges(registry, "m", "2") == [0, 0, 0]


class RecordingAbort:
    """Wraps LLMEngine.abort; sets an event once it has run (on the engine thread)."""

    def __init__(self, engine: LLMEngine) -> None:
        self._abort = engine.abort
        self.done = threading.Event()

    def __call__(self, request_id: str) -> RequestOutput | None:
        output = self._abort(request_id)
        self.done.set()
        return output


async def test_gauges_read_zero_once_an_aborted_stream_leaves_the_engine_idle(
    loaded: LoadedLLM,
) -> None:
    registry = CollectorRegistry()
    sync = LLMEngine(loaded, EngineParams(num_kv_blocks=32), metrics=LLMMetrics(registry, "m"))
    recorder = RecordingAbort(sync)
    sync.abort = recorder  # type: ignore[method-assign]
    engine = AsyncLLMEngine(sync, model_name="m")
    await engine.start()
    stream = engine.generate([5, 6, 7], LONG)
    await anext(stream)
    await stream.aclose()  # a client went away: the engine aborts and then sleeps, idle
    assert await asyncio.to_thread(recorder.done.wait, 10.0)
    assert _gauges(registry, "m", "1") == [0, 0, 0]
    await engine.stop(timeout_s=5.0)
