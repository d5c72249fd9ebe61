"""A real `fulcrum serve` process over echo models: SIGTERM under load, and clients that leave."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.demo import free_port, serve, wait_ready

pytestmark = pytest.mark.e2e

ECHO = """platform = "echo"
max_batch_size = {max_batch_size}
inputs = [{{name = "x", datatype = "FP32", shape = [4]}}]
outputs = [{{name = "y", datatype = "FP32", shape = [4]}}]
instances = {{count = {num_instances}}}
parameters = {{latency_a_ms = {latency_a_ms}, latency_b_ms = {latency_b_ms}}}
dynamic_batching = {{max_queue_delay_ms = 0}}
"""
NUM_INSTANCES = 2
NUM_SHUTDOWN_REQUESTS = 6  # 2 run at once (500 ms each), the others wait in the queue
DRAIN_TIMEOUT_S = 20.0
NUM_LEAVERS = 10
STUCK_LATENCY_MS = 5000  # outlives a 1 s drain timeout by far
REFUSED = "refused"  # no HTTP answer at all: connection refused, reset or closed
Answer = tuple[int | str, object]


def write_repo(root: Path) -> Path:
    models = {  # name: (max_batch_size, instances, latency_a_ms, latency_b_ms)
        "slow": (1, NUM_INSTANCES, 500, 0),
        "single": (8, 1, 0, 250),  # 250 ms a row: a full batch of 8 holds it for 2 s
        "stuck": (1, 1, STUCK_LATENCY_MS, 0),
    }
    for name, (max_batch_size, num_instances, latency_a_ms, latency_b_ms) in models.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.toml").write_text(
            ECHO.format(max_batch_size=max_batch_size, num_instances=num_instances,
                        latency_a_ms=latency_a_ms, latency_b_ms=latency_b_ms)
        )  # fmt: skip
    return root


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repo(tmp_path_factory.mktemp("models"))


def rows_of(i: int, num_rows: int = 1) -> list[list[float]]:
    return [[i, i + 0.25, i + 0.5, row] for row in range(num_rows)]


def infer_body(rows: list[list[float]]) -> bytes:
    tensor = {"name": "x", "datatype": "FP32", "shape": [len(rows), 4], "data": rows}
    return msgspec.json.encode({"inputs": [tensor]})


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One client for all threads; no keep-alive, so every request opens a new connection."""
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(timeout=60, limits=limits) as client:
        yield client


def infer(http: httpx.Client, url: str, model: str, rows: list[list[float]]) -> Answer:
    """(status, output rows or error text); (REFUSED, None) when no answer came."""
    try:
        r = http.post(f"{url}/v2/models/{model}/infer", content=infer_body(rows))
    except httpx.TransportError:
        return REFUSED, None
    if r.status_code != 200:
        return r.status_code, r.text
    out = r.json()["outputs"][0]
    return 200, [out["data"][i : i + 4] for i in range(0, len(out["data"]), 4)]


def ready_status(http: httpx.Client, url: str) -> int | str:
    try:
        return http.get(f"{url}/v2/health/ready").status_code
    except httpx.TransportError:
        return REFUSED


def metric(http: httpx.Client, url: str, name: str, model: str, outcome: str = "") -> float:
    """One sample of `name` for `model` (and `outcome`, for the request counter)."""
    for family in text_string_to_metric_families(http.get(f"{url}/metrics").text):
        for sample in family.samples:
            labels = sample.labels
            if (sample.name, labels.get("model"), labels.get("outcome", "")) == (
                name,
                model,
                outcome,
            ):
                return sample.value
    raise AssertionError(f"no {name} for {model} on /metrics")


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    """Poll a server-side condition (e2e: there is no event to wait on across processes)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@dataclass
class ShutdownRun:
    """What clients saw around one SIGTERM."""

    results: list[Answer]  # the requests running or queued at the signal
    ready_after_signal: list[int | str]
    infer_after_signal: Answer
    after_drain: tuple[Answer, int | str]  # an infer and a readiness probe, on new connections
    returncode: int | None  # None: still running DRAIN_TIMEOUT_S after the signal


@contextlib.contextmanager
def server_process(
    repo: Path, log_path: Path, *extra_args: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fulcrum.cli", "serve", "--repository", str(repo),
             "--port", str(port), "--drain-timeout", str(DRAIN_TIMEOUT_S), *extra_args],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc, timeout_s=120)
            yield url, proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def shutdown(
    repo: Path, http: httpx.Client, tmp_path_factory: pytest.TempPathFactory
) -> ShutdownRun:
    """Load the slow model, SIGTERM the server while requests run and wait, record answers."""
    log_path = tmp_path_factory.mktemp("shutdown") / "server.log"
    with server_process(repo, log_path) as (url, proc):

        def admitted_and_queued() -> bool:
            num_answered = metric(http, url, "fulcrum_requests_total", "slow", "success")
            num_admitted = metric(http, url, "fulcrum_inflight_requests", "slow")
            num_queued = metric(http, url, "fulcrum_queue_depth", "slow")
            return num_answered + num_admitted == NUM_SHUTDOWN_REQUESTS and num_queued >= 1

        with ThreadPoolExecutor(NUM_SHUTDOWN_REQUESTS) as pool:
            pending: list[Future[Answer]] = [
                pool.submit(infer, http, url, "slow", rows_of(i))
                for i in range(NUM_SHUTDOWN_REQUESTS)
            ]
            wait_for(admitted_and_queued, "every request admitted, some still queued")
            proc.send_signal(signal.SIGTERM)
            infer_after = infer(http, url, "slow", rows_of(99))
            ready_after = [ready_status(http, url) for _ in range(3)]
            results = [f.result() for f in pending]
        after_drain = infer(http, url, "slow", rows_of(100)), ready_status(http, url)
        try:
            returncode: int | None = proc.wait(timeout=DRAIN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            returncode = None
        log = log_path.read_text()
    assert "Traceback" not in log, log
    return ShutdownRun(results, ready_after, infer_after, after_drain, returncode)


def test_sigterm_lets_in_flight_and_queued_requests_finish(shutdown: ShutdownRun) -> None:
    expected = [(200, rows_of(i)) for i in range(NUM_SHUTDOWN_REQUESTS)]
    assert shutdown.results == expected


def test_sigterm_turns_readiness_off(shutdown: ShutdownRun) -> None:
    assert set(shutdown.ready_after_signal) <= {503, REFUSED}, shutdown.ready_after_signal


def test_new_connections_refused_once_drained(shutdown: ShutdownRun) -> None:
    assert shutdown.after_drain == ((REFUSED, None), REFUSED)


def test_sigterm_refuses_new_work(shutdown: ShutdownRun) -> None:
    assert shutdown.infer_after_signal[0] in (503, REFUSED), shutdown.infer_after_signal


def test_sigterm_exits_within_the_drain_timeout(shutdown: ShutdownRun) -> None:
    assert shutdown.returncode is not None


def test_sigterm_exit_status_is_0(shutdown: ShutdownRun) -> None:
    assert shutdown.returncode == 0


def send_and_leave(port: int, rows: list[list[float]]) -> socket.socket:
    """A raw client that sends a whole infer request; the caller closes it without reading."""
    body = infer_body(rows)
    head = (
        f"POST /v2/models/single/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(head.encode() + body)
    return sock


def test_queued_request_of_a_departed_client_never_runs(
    repo: Path, http: httpx.Client, tmp_path: Path
) -> None:
    with serve(repo, free_port(), log_path=tmp_path / "server.log") as url:
        port = int(url.rsplit(":", 1)[1])

        def depth() -> float:
            return metric(http, url, "fulcrum_queue_depth", "single")

        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(infer, http, url, "single", rows_of(0, num_rows=8))
            wait_for(lambda: metric(http, url, "fulcrum_inflight_requests", "single") == 1,
                     "the long request to be admitted")  # fmt: skip
            wait_for(lambda: depth() == 0, "the long request to run")
            leavers = [send_and_leave(port, rows_of(i + 1)) for i in range(NUM_LEAVERS)]
            wait_for(lambda: depth() == NUM_LEAVERS, "the leavers' requests to queue behind it")
            for sock in leavers:
                sock.close()
            wait_for(lambda: depth() == 0, "the server to drop the leavers' requests")
            assert long.result() == (200, rows_of(0, num_rows=8))
        assert infer(http, url, "single", rows_of(42)) == (200, rows_of(42))  # still serving
        stats = http.get(f"{url}/v2/models/single/stats").json()["model_stats"][0]
        # the long request (8 rows) and the last one ran; none of the leavers' requests did
        # (Triton counts rows in inference_count, batches in execution_count)
        assert (stats["execution_count"], stats["inference_count"]) == (2, 9)
        assert metric(http, url, "fulcrum_inflight_requests", "single") == 0


def post_infer(http: httpx.Client, url: str, model: str, rows: list[list[float]]) -> httpx.Response:
    return http.post(f"{url}/v2/models/{model}/infer", content=infer_body(rows))


def test_request_cut_off_by_the_drain_timeout_gets_503(
    repo: Path, http: httpx.Client, tmp_path: Path
) -> None:
    """Triton and vLLM: a server that goes away is unavailable (503, retry), not broken (500)."""
    log_path = tmp_path / "server.log"
    with server_process(repo, log_path, "--drain-timeout", "1") as (url, proc):
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post_infer, http, url, "stuck", rows_of(1))
            wait_for(lambda: metric(http, url, "fulcrum_inflight_requests", "stuck") == 1,
                     "the stuck request to be admitted")  # fmt: skip
            proc.send_signal(signal.SIGTERM)
            response = pending.result()
        returncode = proc.wait(timeout=DRAIN_TIMEOUT_S)
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    assert "shutting down" in response.json()["error"]
    assert returncode == 0
    assert "Traceback" not in log_path.read_text()


def test_second_signal_during_the_drain_exits_at_once(
    repo: Path, http: httpx.Client, tmp_path: Path
) -> None:
    log_path = tmp_path / "server.log"
    with (
        server_process(repo, log_path, "--drain-timeout", "60") as (url, proc),
        ThreadPoolExecutor(1) as pool,
    ):
        pending = pool.submit(infer, http, url, "stuck", rows_of(1))
        wait_for(lambda: metric(http, url, "fulcrum_inflight_requests", "stuck") == 1,
                 "the stuck request to be admitted")  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: ready_status(http, url) != 200, "the first SIGTERM to be handled")
        proc.send_signal(signal.SIGTERM)
        # well before the stuck request (5 s) or the drain (60 s) could end on their own
        returncode = proc.wait(timeout=STUCK_LATENCY_MS / 1000 / 2)
        assert pending.result() == (REFUSED, None)
    assert returncode == 128 + signal.SIGTERM
