"""An engine process client its owner never stopped (a script that returns, a test that forgets)
must not hold the interpreter's exit: multiprocessing joins daemon children after SIGTERMing
them, and the engine process ignores SIGTERM. Each case runs a script in a subprocess that
exits without stopping its client, and asserts it exits within a bound leaving no process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fulcrum.llm.examples import build_tiny_llama
from process_exit import pid_gone, wait_gone

EXIT_BOUND_S = 30.0  # loading done: exiting takes a couple of seconds at most

_PRELUDE = """
import asyncio
import sys
from pathlib import Path
from prometheus_client import CollectorRegistry
from fulcrum.llm.engine import AsyncLLMEngine
from fulcrum.llm.engine_group import EngineGroupClient
from fulcrum.llm.engine_process import ProcessEngineClient
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams

VERSION_DIR = Path(sys.argv[1])
"""

# Loaded, never started: no threads, only the process.
_NEVER_STARTED = """
if __name__ == "__main__":
    metrics = LLMMetrics(CollectorRegistry(), "tiny", 1)
    params = EngineParams(num_kv_blocks=64, engine_process=True, num_threads=1)
    client = ProcessEngineClient(VERSION_DIR, params, "t", metrics)
    print(client.pid, flush=True)
"""

# Two processes serving a request mid-stream when the event loop ends.
_MID_STREAM = """
async def main() -> None:
    metrics = LLMMetrics(CollectorRegistry(), "tiny", 1)
    params = EngineParams(num_kv_blocks=64, num_engine_processes=2, num_threads=1)
    client = await asyncio.to_thread(EngineGroupClient, VERSION_DIR, params, "t", metrics)
    engine = AsyncLLMEngine(client.front, model_name="t", client=client)
    await engine.start()
    sampling = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    stream = engine.generate("Hello", sampling)
    await anext(stream)
    print(*client.pids, flush=True)

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.fixture(scope="module")
def version_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models")
    build_tiny_llama(directory)
    return directory / "tiny-llama" / "1"


@pytest.mark.parametrize("body", [_NEVER_STARTED, _MID_STREAM], ids=["never_started", "streaming"])
def test_a_client_never_stopped_lets_the_interpreter_exit(
    tmp_path: Path, version_dir: Path, body: str
) -> None:
    script = tmp_path / "server.py"
    script.write_text(_PRELUDE + body)
    server = subprocess.Popen(
        [sys.executable, str(script), str(version_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        pids = [int(pid) for pid in server.stdout.readline().split()]
        assert pids and not any(pid_gone(pid) for pid in pids)
        try:
            code = server.wait(EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the interpreter did not exit within {EXIT_BOUND_S:g} s")
        assert server.stderr is not None
        assert code == 0, server.stderr.read()
        # Its engine processes went with it (exited, not orphaned to init).
        assert all(wait_gone(pid, 5.0) for pid in pids)
    finally:
        server.kill()
        server.wait()
        for pipe in (server.stdout, server.stderr):
            if pipe is not None:
                pipe.close()
