"""Data-parallel engine processes (`num_engine_processes = 2`) on the tiny Llama: the same tokens
as the engine thread with requests spread over both processes, metrics summed; an abort reaches
the process holding the request; a killed process fails only its own requests while the other
serves, and restarts; with every process dead the model goes down and comes back whole; stop
and a dead server leave no process behind; a load the machine cannot hold is refused."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from fulcrum.config import load_model_config
from fulcrum.errors import ConfigError, Unavailable
from fulcrum.llm.engine import AsyncLLMEngine
from fulcrum.llm.engine_group import EngineGroupClient
from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import load_checkpoint
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.outputs import RequestOutput
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.supervisor import RestartPolicy
from fulcrum.llm.sync_engine import LLMEngine
from process_exit import pid_gone, wait_gone

# One torch thread each, as the thread engine compared against: the same float sums.
PARAMS = EngineParams(num_kv_blocks=64, num_engine_processes=2, num_threads=1)
LABELS = {"model": "tiny", "version": "1", "variant": "default"}
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
NOW = RestartPolicy(initial_backoff_s=0.0)


@pytest.fixture(scope="module")
def version_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models")
    build_tiny_llama(directory)
    return directory / "tiny-llama" / "1"


@pytest.fixture
async def started() -> AsyncIterator[list[AsyncLLMEngine]]:
    """Engines a test started: stopped even when it fails (a process client left running would
    hold the interpreter's exit, which joins its children)."""
    engines: list[AsyncLLMEngine] = []
    yield engines
    for engine in engines:
        await engine.stop(timeout_s=0.0)


async def _group(
    version_dir: Path,
    registry: CollectorRegistry,
    started: list[AsyncLLMEngine],
    policy: RestartPolicy | None = None,
) -> tuple[AsyncLLMEngine, EngineGroupClient]:
    metrics = LLMMetrics(registry, "tiny", 1)
    client = await asyncio.to_thread(
        functools.partial(EngineGroupClient, restart_policy=NOW),
        version_dir, PARAMS, "tiny", metrics,
    )  # fmt: skip
    engine = AsyncLLMEngine(client.front, model_name="tiny", client=client, restart_policy=policy)
    started.append(engine)
    await engine.start()
    return engine, client


async def _collect(stream: AsyncIterator[RequestOutput]) -> list[object]:
    """Text, tokens, finish reason, usage and logprobs' tokens: exact whatever the batch; the
    logprobs' values move in their last digits with the batch a request shares (`_same`)."""
    outs = [o async for o in stream]
    return [
        ("".join(o.new_text for o in outs), [t for o in outs for t in o.new_token_ids]),
        outs[-1].finish_reason,
        [[t for t, _ in lp.top] for o in outs for lp in o.new_logprobs],
        outs[-1].usage,
        [lp.logprob for o in outs for lp in o.new_logprobs],
    ]


def _same(got: list[list[object]], expected: list[list[object]]) -> None:
    assert [g[:-1] for g in got] == [e[:-1] for e in expected]
    for g, e in zip(got, expected, strict=True):
        assert g[-1] == pytest.approx(e[-1], rel=1e-4)


async def _until(condition: object, timeout_s: float = 20.0) -> None:
    assert callable(condition)
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "timed out"
        await asyncio.sleep(0.02)  # a report from another process: nothing here to wait on


CASES = [
    ("Hello there", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
    ("The cat", SamplingParams(max_tokens=32, temperature=0.0, stop=("e",))),
    ("A story", SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)),
    ("Seeded", SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)),
    ("Once upon a time there was a cat", SamplingParams(max_tokens=20, temperature=0.0)),
    ("Hello there, how", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)),
]


async def test_same_tokens_as_the_thread_spread_over_both_and_stopped_cleanly(
    version_dir: Path, started: list[AsyncLLMEngine]
) -> None:
    thread = AsyncLLMEngine(
        LLMEngine(load_checkpoint(version_dir), EngineParams(num_kv_blocks=64, num_threads=1)),
        model_name="t",
    )
    await thread.start()
    expected = await asyncio.gather(*(_collect(thread.generate(p, s)) for p, s in CASES))
    await thread.stop()
    registry = CollectorRegistry()
    engine, client = await _group(version_dir, registry, started)
    pids = client.pids
    assert len(set(pids)) == 2 and os.getpid() not in pids and engine.child_pids == pids
    ids = [f"r{i}" for i in range(len(CASES))]
    streams = [engine.generate(p, s, request_id=i) for i, (p, s) in zip(ids, CASES, strict=True)]
    assert {client.owner(i) for i in ids} == {0, 1}  # least loaded: both take requests
    _same(await asyncio.gather(*(_collect(s) for s in streams)), expected)
    assert [load.num_requests for load in client.loads() if load] == [0, 0]
    value = registry.get_sample_value
    num_tokens = sum(len(e[0][1]) for e in expected)  # type: ignore[index]
    assert value("fulcrum_llm_generation_tokens_total", LABELS) == num_tokens  # both relayed
    assert value("fulcrum_llm_time_to_first_token_seconds_count", LABELS) == len(CASES)
    assert value("fulcrum_llm_num_requests_running", LABELS) == 0.0
    await engine.stop()
    assert [child._gen.process.exitcode for child in client.children] == [0, 0]
    assert all(pid_gone(pid) for pid in pids)


async def test_an_abort_goes_to_the_process_holding_the_request(
    version_dir: Path, started: list[AsyncLLMEngine]
) -> None:
    registry = CollectorRegistry()
    engine, client = await _group(version_dir, registry, started)
    first, second = engine.generate("Hello", LONG), engine.generate("Hello", LONG)
    await anext(first)
    await anext(second)
    owners = [client.owner(rid) for rid in list(engine._streams)]
    assert sorted(owners) == [0, 1]  # type: ignore[type-var]
    await second.aclose()  # type: ignore[attr-defined]
    aborted = {**LABELS, "finished_reason": "abort"}
    await _until(lambda: registry.get_sample_value("fulcrum_llm_request_success_total", aborted))
    loads = client.loads()
    assert sorted(load.num_requests for load in loads if load) == [0, 1]
    assert (await _collect(first))[1] == "length"  # the other request runs on to its end
    await engine.stop()


async def test_a_killed_process_fails_only_its_requests_and_restarts(
    version_dir: Path, started: list[AsyncLLMEngine]
) -> None:
    registry = CollectorRegistry()
    engine, client = await _group(version_dir, registry, started)
    streams = {rid: engine.generate("Hello", LONG, request_id=rid) for rid in ("a", "b")}
    for stream in streams.values():
        await anext(stream)
    victim = client.owner("a")
    assert victim is not None and client.owner("b") == 1 - victim
    dead_pid = client.children[victim].pid
    os.kill(dead_pid, signal.SIGKILL)
    with pytest.raises(Unavailable, match=rf"engine process \(pid {dead_pid}\).*SIGKILL"):
        async for _ in streams["a"]:
            pass
    # The other process's request runs to its end; readiness stays up throughout.
    rest = [o async for o in streams["b"]]
    assert engine.is_healthy and rest[-1].finish_reason == "length"
    await _until(lambda: client.children[victim].is_alive)  # restarted by the group
    assert client.children[victim].pid != dead_pid and wait_gone(dead_pid, 5.0)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = await asyncio.gather(*(_collect(engine.generate("Hi", short)) for _ in range(4)))
    assert all(out[1] == "length" for out in outs)
    value = registry.get_sample_value
    assert value("fulcrum_llm_request_success_total", {**LABELS, "finished_reason": "error"}) == 1
    assert value("fulcrum_llm_engine_restarts_total", LABELS) == 1
    assert engine.num_restarts == 1 and engine.is_healthy  # the model itself never went down
    await engine.stop()


async def test_with_every_process_dead_the_model_goes_down_and_comes_back(
    version_dir: Path, started: list[AsyncLLMEngine]
) -> None:
    registry = CollectorRegistry()
    engine, client = await _group(version_dir, registry, started, NOW)
    streams = [engine.generate("Hello", LONG) for _ in range(2)]
    for stream in streams:
        await anext(stream)
    old = client.pids
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    for stream in streams:
        with pytest.raises(Unavailable, match=r"SIGKILL.*being restarted"):
            async for _ in stream:
                pass
    # The second death left none: the model is down until its supervisor restarts the group.
    assert not engine.is_healthy
    with pytest.raises(Unavailable, match="restarting after a crash"):
        engine.generate("Hello", LONG)
    assert engine._restart_task is not None
    await engine._restart_task
    # The model's restart, plus the first dead process's own if it restarted before the second
    # died: every restart counted once, in num_restarts as in the metric.
    restarts = registry.get_sample_value("fulcrum_llm_engine_restarts_total", LABELS)
    assert engine.is_healthy and engine.num_restarts == restarts and restarts in (1, 2)
    assert all(child.is_alive for child in client.children)
    assert set(client.pids).isdisjoint(old)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert (await _collect(engine.generate("Hi", short)))[1] == "length"
    await engine.stop()


def test_a_load_the_machine_cannot_hold_is_refused_naming_the_key(version_dir: Path) -> None:
    metrics = LLMMetrics(CollectorRegistry(), "tiny", 1)
    with pytest.raises(ConfigError, match=r"num_engine_processes' = 2: .* 1 CPU cores"):
        EngineGroupClient(version_dir, PARAMS, "tiny", metrics, num_cores=1)
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ConfigError, match=r"num_engine_processes' = 2: .*MiB available"):
        EngineGroupClient(version_dir, PARAMS, "tiny", metrics, available_bytes=lambda: 0)
    assert {p.pid for p in multiprocessing.active_children()} == before  # the first stopped


def test_from_config_builds_the_group(version_dir: Path) -> None:
    config_path = version_dir.parent / "config.toml"
    text = config_path.read_text()
    config_path.write_text(text + "num_engine_processes = 2\nnum_threads = 1\n")
    try:
        config = load_model_config(config_path, dir_name="tiny")
    finally:
        config_path.write_text(text)
    engine = AsyncLLMEngine.from_config(config, version_dir)
    client = engine._client
    assert isinstance(client, EngineGroupClient) and len(engine.child_pids) == 2
    client.stop(5.0)
    assert all(wait_gone(pid, 5.0) for pid in engine.child_pids)


_ORPHAN_SCRIPT = """
import sys
from pathlib import Path
from prometheus_client import CollectorRegistry
from fulcrum.llm.engine_group import EngineGroupClient
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.params import EngineParams

if __name__ == "__main__":
    metrics = LLMMetrics(CollectorRegistry(), "tiny", 1)
    params = EngineParams(num_kv_blocks=64, num_engine_processes=2, num_threads=1)
    client = EngineGroupClient(Path(sys.argv[1]), params, "t", metrics)
    print(*client.pids, flush=True)
    sys.stdin.read()  # until killed
"""


def test_the_engine_processes_exit_when_the_server_dies(tmp_path: Path, version_dir: Path) -> None:
    script = tmp_path / "server.py"
    script.write_text(_ORPHAN_SCRIPT)
    server = subprocess.Popen(
        [sys.executable, str(script), str(version_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        pids = [int(pid) for pid in server.stdout.readline().split()]
        assert len(pids) == 2 and not any(pid_gone(pid) for pid in pids)
        server.kill()  # SIGKILL: no cleanup of its own
        server.wait()
        assert all(wait_gone(pid, 10.0) for pid in pids)
    finally:
        server.kill()
        server.wait()
        for pipe in (server.stdin, server.stdout):
            if pipe is not None:
                pipe.close()
