"""The engine process's heartbeat and its text split, on the tiny Llama: a process whose step hangs
(with requests in flight) is killed after engine_step_timeout_s, its requests get a 503 naming
the stall, and it is restarted; an idle one is never taken for hung. The stepping engine sends
token ids only, but still ends a stop-string request in the step that hits the stop."""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from fulcrum.errors import ConfigError, Unavailable
from fulcrum.llm.engine import AsyncLLMEngine
from fulcrum.llm.engine_core import serve
from fulcrum.llm.engine_process import ProcessEngineClient
from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import load_checkpoint
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.metrics_relay import RecordingMetrics
from fulcrum.llm.outputs import RequestOutput
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.supervisor import RestartPolicy
from fulcrum.llm.sync_engine import LLMEngine

PARAMS = EngineParams(num_kv_blocks=64, engine_process=True, engine_step_timeout_s=2.0)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
HANG_MARKER = "FULCRUM_TEST_HANG_MARKER"  # a path: the first process to create it hangs


@pytest.fixture(scope="module")
def version_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models")
    build_tiny_llama(directory)
    return directory / "tiny-llama" / "1"


def hanging_serve(conn: Connection, version_dir: str, params: EngineParams) -> None:
    """`serve` whose fourth step blocks for good (a deadlock, a stuck kernel), in the first
    process only: the one that creates the marker file; a restarted one steps normally."""
    step = LLMEngine.step
    calls = itertools.count()
    try:
        os.close(os.open(os.environ[HANG_MARKER], os.O_CREAT | os.O_EXCL))
        hangs = True
    except FileExistsError:
        hangs = False

    def hanging_step(self: LLMEngine) -> list[RequestOutput]:
        if hangs and next(calls) >= 3:
            threading.Event().wait()  # never set: only SIGKILL ends it
        return step(self)

    LLMEngine.step = hanging_step  # type: ignore[method-assign]
    serve(conn, version_dir, params)


async def test_a_hung_process_is_killed_its_requests_get_503_and_it_restarts(
    version_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HANG_MARKER, str(tmp_path / "hung"))  # the spawned child inherits it
    registry = CollectorRegistry()
    client = await asyncio.to_thread(
        functools.partial(ProcessEngineClient, target=hanging_serve),
        version_dir, PARAMS, "tiny", LLMMetrics(registry, "tiny", 1),
    )  # fmt: skip
    engine = AsyncLLMEngine(
        client.front, model_name="tiny", client=client,
        restart_policy=RestartPolicy(initial_backoff_s=0.0),
    )  # fmt: skip
    await engine.start()
    hung_pid = client.pid
    streams = [engine.generate("Hello", LONG) for _ in range(2)]
    for stream in streams:
        with pytest.raises(Unavailable) as caught:
            async for _ in stream:
                pass
        message = str(caught.value)
        assert f"(pid {hung_pid}) stalled: no step for 2 s (engine_step_timeout_s)" in message
        assert "being restarted" in message
    assert client._gen.process.exitcode == -9  # killed, not left hanging
    assert engine._restart_task is not None
    await engine._restart_task
    assert engine.is_healthy and client.pid != hung_pid and engine.num_restarts == 1
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len([o async for o in engine.generate("Hello", short)]) == 4
    await engine.stop()


async def test_an_idle_process_is_not_taken_for_hung(version_dir: Path) -> None:
    metrics = LLMMetrics(CollectorRegistry(), "tiny", 1)
    client = await asyncio.to_thread(ProcessEngineClient, version_dir, PARAMS, "tiny", metrics)
    engine = AsyncLLMEngine(client.front, model_name="tiny", client=client)
    await engine.start()
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    assert len([o async for o in engine.generate("Hello", short)]) == 2
    gen = client._gen
    client._check_stall(gen, 2.0)  # what the reader does after a silent timeout: nothing
    assert gen.stalled_s is None and gen.process.is_alive() and engine.is_healthy
    await engine.stop()


def test_engine_step_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="engine_step_timeout_s"):
        EngineParams.from_parameters({"engine_step_timeout_s": 0})
    assert EngineParams().engine_step_timeout_s == 60.0


def test_an_engine_without_text_still_ends_stop_strings_in_their_step(version_dir: Path) -> None:
    params = EngineParams(num_kv_blocks=64, num_threads=1)
    cases = {
        "plain": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        "stop": SamplingParams(max_tokens=32, temperature=0.0, stop=("e",)),
    }
    finals: dict[bool, dict[str, tuple[object, ...]]] = {}
    for detokenize in (True, False):
        engine = LLMEngine(load_checkpoint(version_dir), params, detokenize=detokenize)
        for request_id, sampling in cases.items():
            engine.add_request(request_id, engine.encode("The cat"), sampling)
        texts = {request_id: "" for request_id in cases}
        finals[detokenize] = {}
        while engine.has_unfinished():
            for out in engine.step():
                texts[out.request_id] += out.new_text
                if out.finished:
                    finals[detokenize][out.request_id] = (out.finish_reason, out.usage)
        if not detokenize:
            assert texts["plain"] == ""  # token ids only: the server makes the text
        else:
            assert texts["plain"] and "e" not in texts["stop"]
    assert finals[False] == finals[True]  # the same step ends each, for the same reason
    assert finals[False]["stop"][0] == "stop"


def test_a_stop_found_by_the_server_finishes_the_request_as_a_stop(version_dir: Path) -> None:
    metrics = RecordingMetrics()
    params = EngineParams(num_kv_blocks=64, num_threads=1)
    engine = LLMEngine(load_checkpoint(version_dir), params, metrics=metrics, detokenize=False)
    engine.add_request("a", engine.encode("Hello"), LONG)
    assert engine.step()[0].finish_reason is None  # running
    engine.finish_stopped("a")
    engine.finish_stopped("never-seen")  # already finished, say: ignored
    assert not engine.has_unfinished() and engine.scheduler.num_running == 0
    events = metrics.take()
    assert events is not None and events.finished == ["stop"]
