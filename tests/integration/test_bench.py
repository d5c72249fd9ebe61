"""`fulcrum bench` against a real uvicorn server over the echo backend with a known latency model.

The echo model sleeps `a + b * batch_rows` ms per batch: the compute time and batch sizes the
generator reads back (Server-Timing headers and the statistics API) must agree with that model.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from fulcrum.client import ClientError, Connection, Endpoint
from fulcrum.loadgen.bench import BenchOptions, run_bench_async
from fulcrum.loadgen.cli import EXIT_UNREACHABLE, register
from fulcrum.loadgen.kserve import V2Inputs
from fulcrum.loadgen.llm import LlmInputs
from fulcrum.loadgen.windows import MeasurePlan
from fulcrum.server.app import create_app
from fulcrum.service import Service

A_MS, B_MS = 4.0, 1.0
ECHO = f"""
platform = "echo"
max_batch_size = 32
[[inputs]]
name = "x"
datatype = "FP32"
shape = [4]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [4]
[dynamic_batching]
max_queue_delay_ms = 2.0
[parameters]
latency_a_ms = {A_MS}
latency_b_ms = {B_MS}
"""
# Short points: correctness, not speed, is checked here.
PLAN = MeasurePlan(warmup_s=0.3, window_s=0.5, max_duration_s=1.5)
# time.sleep never returns early, but may overshoot on a shared 2-core machine.
OVERSHOOT_MS = 25.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ThreadServer:
    """uvicorn on a free loopback port, in a thread with its own event loop."""

    def __init__(self, app: Starlette) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:  # startup takes a few ms; no fixed sleep
            if not self.thread.is_alive():
                raise RuntimeError("server thread died")
            threading.Event().wait(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def echo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("repo")
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "config.toml").write_text(ECHO)
    with ThreadServer(create_app(Service.from_repository(root))) as url:
        yield url


def model_ms(batch_rows: float) -> float:
    return A_MS + B_MS * batch_rows


async def test_one_request_per_batch_matches_the_latency_model(echo_url: str) -> None:
    options = BenchOptions(
        model="echo", url=echo_url, concurrency=(1,), plan=PLAN, v2=V2Inputs(batch_size=4)
    )
    run = await run_bench_async(options)
    [point] = run.points
    assert point.num_ok > 0 and not point.errors
    assert point.rows_per_s == pytest.approx(4 * point.throughput_rps)
    # Alone, every batch is this request's 4 rows; both server views say so.
    assert point.header_batch_size == 4.0
    assert point.server.mean_batch_size == 4.0
    compute_ms = point.header_compute_ms
    assert compute_ms is not None and point.server.compute_ms is not None
    assert model_ms(4) <= compute_ms <= model_ms(4) + OVERSHOOT_MS
    assert point.server.compute_ms == pytest.approx(compute_ms, rel=0.2)
    # The client sees at least what the server spent.
    queue_ms = point.header_queue_ms or 0.0
    assert point.latency.mean_ms >= compute_ms + queue_ms


async def test_dynamic_batching_under_concurrency_matches_the_model(echo_url: str) -> None:
    options = BenchOptions(
        model="echo", url=echo_url, concurrency=(8,), plan=PLAN, v2=V2Inputs(batch_size=1)
    )
    [point] = (await run_bench_async(options)).points
    batch = point.header_batch_size
    compute_ms = point.header_compute_ms
    assert batch is not None and compute_ms is not None
    assert 1.0 < batch <= 8.0  # queued requests were batched; never more than in flight
    assert point.server.mean_batch_size is not None and 1.0 < point.server.mean_batch_size <= 8
    # Linear model: the mean over requests of a + b * batch is a + b * mean batch.
    assert model_ms(batch) <= compute_ms <= model_ms(batch) + OVERSHOOT_MS


async def test_open_loop_rate_with_slo_and_goodput(echo_url: str) -> None:
    options = BenchOptions(
        model="echo", url=echo_url, rates=(40.0,), arrivals="poisson", plan=PLAN,
        slos=("p99=10s", "latency<=10s"),
    )  # fmt: skip
    [point] = (await run_bench_async(options)).points
    assert point.mode == "rate" and point.num_ok > 0
    assert point.slo_met is True and point.goodput_rps == pytest.approx(point.throughput_rps)
    assert point.latency.p50_ms >= model_ms(1)


async def test_unknown_model_and_dead_server_are_clear_errors(echo_url: str) -> None:
    with pytest.raises(ClientError, match="404"):
        await run_bench_async(BenchOptions(model="nope", url=echo_url, plan=PLAN))
    connection = Connection(Endpoint("127.0.0.1", free_port()))  # nothing listens there
    with pytest.raises(ClientError, match="cannot connect"):
        await connection.request(b"GET / HTTP/1.1\r\n\r\n")


def test_cli_exit_code_when_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["bench", "m", "--url", f"http://127.0.0.1:{free_port()}"])
    assert args.func(args) == EXIT_UNREACHABLE
    assert "cannot connect" in capsys.readouterr().err


def test_cli_writes_results_and_plots(echo_url: str, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    out = tmp_path / "run"
    args = parser.parse_args(
        ["bench", "echo", "--url", echo_url, "--concurrency", "2", "--duration", "0.6",
         "--window", "0.3", "--warmup", "0.2", "--out", str(out), "--no-progress"]
    )  # fmt: skip
    assert args.func(args) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["latency_cdf.png", "latency_throughput.png", "results.csv", "results.json"]


TOKEN_GAP_S = 0.02
NUM_TOKENS = 5


async def fake_completions(request: Request) -> StreamingResponse:
    """An OpenAI-style SSE stream: a token every TOKEN_GAP_S, then usage and [DONE]."""

    async def events() -> AsyncIterator[bytes]:
        for _ in range(NUM_TOKENS):
            await asyncio.sleep(TOKEN_GAP_S)
            yield b'data: {"choices": [{"text": "tok"}]}\n\n'
        yield b'data: {"choices": [], "usage": {"completion_tokens": 5}}\n\n'
        yield b"data: [DONE]\n\n"

    await request.body()
    return StreamingResponse(events(), media_type="text/event-stream")


async def test_llm_mode_measures_ttft_and_itl_over_real_chunked_streams() -> None:
    app = Starlette(routes=[Route("/v1/completions", fake_completions, methods=["POST"])])
    with ThreadServer(app) as url:
        options = BenchOptions(
            model="fake", url=url, openai=True, concurrency=(2,), plan=PLAN,
            llm=LlmInputs(max_tokens=5), slos=("ttft<=5s",),
        )  # fmt: skip
        [point] = (await run_bench_async(options)).points
    figures = point.llm
    assert figures is not None and point.num_ok > 0
    assert figures.mean_output_tokens == NUM_TOKENS
    assert figures.ttft.p50_ms >= TOKEN_GAP_S * 1000  # the first token comes after one gap
    assert figures.itl.p50_ms >= TOKEN_GAP_S * 1000 * 0.5
    assert figures.tpot.count == point.num_ok
    assert point.latency.p50_ms >= NUM_TOKENS * TOKEN_GAP_S * 1000


async def hanging_completions(request: Request) -> StreamingResponse:
    """One token, then silence for longer than the client's timeout."""

    async def events() -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": "tok"}]}\n\n'
        await asyncio.sleep(1.0)
        yield b"data: [DONE]\n\n"

    await request.body()
    return StreamingResponse(events(), media_type="text/event-stream")


async def test_llm_stream_that_stalls_is_counted_as_a_timeout() -> None:
    app = Starlette(routes=[Route("/v1/completions", hanging_completions, methods=["POST"])])
    plan = MeasurePlan(warmup_s=0.0, window_s=0.5, max_duration_s=0.5)
    with ThreadServer(app) as url:
        options = BenchOptions(
            model="fake", url=url, openai=True, concurrency=(2,), plan=plan, timeout_s=0.2
        )
        [point] = (await run_bench_async(options)).points
    assert point.num_ok == 0 and point.errors.get("timeout", 0) >= 2
