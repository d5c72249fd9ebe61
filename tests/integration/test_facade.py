"""Every request, both APIs, passes through `Service` with a request context: headers, the router
and cache hooks, one error shape per API, malformed input answered 400."""

from __future__ import annotations

import asyncio
import base64
import gc
import shutil
import threading
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from fulcrum.batcher import InferResult
from fulcrum.context import RequestContext
from fulcrum.llm.examples import build_tiny_gpt2
from fulcrum.protocol import decode_infer_response, encode_infer_request
from fulcrum.router import Route
from fulcrum.server.app import create_app
from fulcrum.service import Service, ServiceSettings
from fulcrum.types import TensorMap

ECHO = """platform = "echo"
max_batch_size = 8
[[inputs]]
name = "x"
datatype = "FP32"
shape = [2]
[[outputs]]
name = "x"
datatype = "FP32"
shape = [2]
[parameters]
latency_a_ms = {latency_ms}
"""
TINY_LLM = """platform = "llm"
[parameters]
num_kv_blocks = 32
block_size = 4
max_model_len = 64
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root: Path = tmp_path_factory.mktemp("facade")
    for name, latency_ms in (("echo", 0), ("slow", 300)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.toml").write_text(ECHO.format(latency_ms=latency_ms))
    build_tiny_gpt2(root, name="tiny")
    (root / "tiny" / "config.toml").write_text(TINY_LLM)
    return root


class RecordingRouter:
    """Serves what was asked, remembering every context it saw; `alias` names `echo`."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    def route(self, ctx: RequestContext, model: str, version: int | None) -> Route:
        self.seen.append((ctx.api, ctx.tenant, model))
        return Route("echo" if model == "alias" else model, version, ctx.lane)


class OneEntryCache:
    """Answers inputs equal to `key` with `value`; records what it was told."""

    def __init__(self, key: np.ndarray, value: np.ndarray) -> None:
        self.key, self.value = key, value
        self.puts: list[str] = []

    async def get(
        self, ctx: RequestContext, route: Route, version: int, inputs: TensorMap
    ) -> InferResult | None:
        if np.array_equal(inputs["x"], self.key):
            return InferResult({"x": self.value}, 0.0, 0.0, 0)
        return None

    async def put(
        self, ctx: RequestContext, route: Route, version: int, inputs: TensorMap,
        result: InferResult,
    ) -> None:  # fmt: skip
        self.puts.append(ctx.request_id)


@pytest.fixture
async def router() -> RecordingRouter:
    return RecordingRouter()


@pytest.fixture
async def service(repo: Path, router: RecordingRouter) -> AsyncIterator[Service]:
    cache = OneEntryCache(np.array([[7, 7]], np.float32), np.array([[1, 2]], np.float32))
    svc = Service(repo, router=router, cache=cache)
    await svc.start()
    yield svc
    await svc.stop()


@pytest.fixture
async def client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def rows(*values: float) -> dict[str, object]:
    data = [v for v in values for _ in range(2)]
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [len(values), 2], "data": data}]}


COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}


async def test_both_apis_pass_the_router_with_their_context(
    client: httpx.AsyncClient, router: RecordingRouter
) -> None:
    v2 = await client.post(
        "/v2/models/alias/infer", json=rows(3), headers={"X-Fulcrum-Tenant": "acme"}
    )
    assert v2.status_code == 200, v2.text
    assert v2.json()["outputs"][0]["data"] == [3, 3]
    llm = await client.post(
        "/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer sk-secret"}
    )
    assert llm.status_code == 200, llm.text
    (v2_api, v2_tenant, v2_model), (llm_api, llm_tenant, llm_model) = router.seen
    assert (v2_api, v2_tenant, v2_model) == ("v2", "acme", "alias")
    assert (llm_api, llm_model) == ("openai", "tiny")
    assert llm_tenant.startswith("key-") and "secret" not in llm_tenant


async def test_the_cache_hook_answers_before_the_queue(
    client: httpx.AsyncClient, service: Service
) -> None:
    hit = await client.post("/v2/models/echo/infer", json=rows(7))
    assert hit.json()["outputs"][0]["data"] == [1, 2]  # the cached value, not the echo
    miss = await client.post("/v2/models/echo/infer", json=rows(5), headers={"X-Request-Id": "r1"})
    assert miss.json()["outputs"][0]["data"] == [5, 5]
    assert miss.headers["x-request-id"] == "r1"
    assert isinstance(service.cache, OneEntryCache) and service.cache.puts == ["r1"]


async def test_a_deadline_header_bounds_the_request(client: httpx.AsyncClient) -> None:
    # The slow model holds its only instance for 300 ms: a second request with a 50 ms deadline
    # times out in the queue (504) and never runs.
    first = client.post("/v2/models/slow/infer", json=rows(1))
    second = client.post(
        "/v2/models/slow/infer", json=rows(2), headers={"X-Fulcrum-Timeout-Ms": "50"}
    )
    answers = await asyncio.gather(first, second)
    assert [a.status_code for a in answers] == [200, 504]


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("X-Fulcrum-Timeout-Ms", "①"),
        ("X-Fulcrum-Timeout-Ms", "-5"),
        ("X-Fulcrum-Priority", "²"),
        ("X-Fulcrum-Tenant", "t" * 200),
    ],
)
async def test_bad_context_headers_are_400_naming_the_header(
    client: httpx.AsyncClient, header: str, value: str
) -> None:
    response = await client.post(
        "/v2/models/echo/infer", json=rows(1), headers={header: value.encode()}
    )
    assert response.status_code == 400
    assert header.lower() in response.json()["error"]


async def test_errors_take_each_apis_shape_outside_the_handlers(client: httpx.AsyncClient) -> None:
    missing = await client.get("/v1/nothing")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    wrong_method = await client.get("/v1/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == 405
    v2_missing = await client.get("/v2/nothing")
    assert isinstance(v2_missing.json()["error"], str)


DEEP = b"[" * 5000 + b"]" * 5000


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b'{"model": "tiny", "prompt": ' + DEEP + b"}"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": ' + DEEP + b"}"),
        ("/v1/embeddings", b'{"model": "echo", "input": ' + DEEP + b"}"),
        ("/v2/repository/index", DEEP),
        ("/v2/repository/models/echo/load", b'{"parameters": ' + DEEP + b"}"),
        ("/v2/models/echo/infer", b'{"inputs": ' + DEEP + b"}"),
    ],
)
async def test_deeply_nested_json_is_400(client: httpx.AsyncClient, path: str, body: bytes) -> None:
    response = await client.post(path, content=body)
    assert response.status_code == 400, response.text
    assert "Traceback" not in response.text


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/v2/models/echo/versions/²/infer", {}),
        ("/v2/models/echo/versions/①/ready", {}),
        ("/v2/models/echo/infer", {"Inference-Header-Content-Length": "①"}),
    ],
)
async def test_unicode_digits_are_400(
    client: httpx.AsyncClient, path: str, headers: dict[str, str]
) -> None:
    encoded = {k: v.encode() for k, v in headers.items()}
    response = await client.post(path, json=rows(1), headers=encoded)
    if path.endswith("/ready"):
        response = await client.get(path)
    assert response.status_code == 400, response.text


async def test_embeddings_refuse_models_that_cannot_serve_them(client: httpx.AsyncClient) -> None:
    for model, needle in (("tiny", "generative"), ("echo", "text"), ("nope", "nope")):
        response = await client.post("/v1/embeddings", json={"model": model, "input": "hi"})
        assert response.status_code in (400, 404)
        assert needle in response.json()["error"]["message"]


async def test_empty_admin_token_is_no_token(service: Service) -> None:
    app = create_app(service, admin_token="", admin_open=False, manage_lifespan=False)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        response = await c.post("/v2/repository/index", headers={"Authorization": "Bearer "})
    assert response.status_code == 403


@pytest.fixture
async def minilm(example_repo: Path) -> AsyncIterator[httpx.AsyncClient]:
    svc = Service(example_repo, ServiceSettings(load_models=("minilm",)))
    await svc.start()
    transport = httpx.ASGITransport(app=create_app(svc, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c
    await svc.stop()


async def test_embeddings_equal_the_v2_answer(minilm: httpx.AsyncClient) -> None:
    texts = ["hello world", "good morning", "a third, longer sentence about servers"]
    v2 = await minilm.post(
        "/v2/models/minilm/infer",
        json={"inputs": [{"name": "text", "datatype": "BYTES", "shape": [3, 1], "data": texts}]},
    )
    expected = np.array(v2.json()["outputs"][0]["data"], np.float32).reshape(3, -1)
    floats = (await minilm.post("/v1/embeddings", json={"model": "minilm", "input": texts})).json()
    got = np.array([d["embedding"] for d in floats["data"]], np.float32)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert [d["index"] for d in floats["data"]] == [0, 1, 2]
    assert floats["usage"]["prompt_tokens"] == 2 + 2 + 7 + 3 * 2  # words + [CLS], [SEP]
    packed = await minilm.post(
        "/v1/embeddings", json={"model": "minilm", "input": texts, "encoding_format": "base64"}
    )
    decoded = [
        np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in packed.json()["data"]
    ]
    np.testing.assert_allclose(np.stack(decoded), expected, atol=1e-6)
    wrong = await minilm.post(
        "/v1/embeddings", json={"model": "minilm", "input": "x", "dimensions": 10}
    )
    assert wrong.status_code == 400 and "384" in wrong.json()["error"]["message"]


async def test_an_llm_loads_off_the_event_loop(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights, KV pool and kernels are built on a worker thread; meanwhile the loop serves."""
    from fulcrum.llm.engine import AsyncLLMEngine

    build = AsyncLLMEngine.from_config
    loop_thread = threading.get_ident()
    seen: list[tuple[int, int]] = []
    three_served = threading.Event()

    def recording(*args: object, **kwargs: object) -> AsyncLLMEngine:
        served_before = len(answers)
        engine = build(*args, **kwargs)  # type: ignore[arg-type]
        # A build can be quicker than one v2 request: it waits for three to be answered, which
        # can only happen if the loop is free meanwhile (bounded: on the loop, it never would).
        three_served.wait(timeout=30)
        seen.append((threading.get_ident(), len(answers) - served_before))
        return engine

    monkeypatch.setattr(AsyncLLMEngine, "from_config", recording)
    service = Service(repo, ServiceSettings(load_models=("echo",)))
    await service.start()
    answers: list[int] = []
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:

        async def traffic() -> None:
            while not seen:
                answers.append((await c.post("/v2/models/echo/infer", json=rows(1))).status_code)
                if len(answers) >= 3:
                    three_served.set()

        load = c.post("/v2/repository/models/tiny/load")
        loaded, _ = await asyncio.gather(load, traffic())
    await service.stop()
    assert loaded.status_code == 200, loaded.text
    [(thread, served_during_load)] = seen
    assert thread != loop_thread
    assert served_during_load > 0  # v2 requests were answered while the engine was built
    assert set(answers) == {200}


async def test_load_unload_cycles_leave_metrics_and_models_released(
    repo: Path, tmp_path: Path
) -> None:
    """New versions and load/unload cycles of a batch model and an LLM: /metrics comes back to
    the same size and no unloaded version is kept alive."""
    root = tmp_path / "repo"
    shutil.copytree(repo / "echo", root / "echo")
    shutil.copytree(repo / "tiny", root / "tiny")
    service = Service(root, ServiceSettings(load_models=()))
    await service.start()
    released: list[weakref.ref[object]] = []
    sizes: list[int] = []
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        empty = len((await c.get("/metrics")).text)
        for cycle in range(4):
            (root / "echo" / str(cycle + 2)).mkdir()  # a new version each cycle
            for name in ("echo", "tiny"):
                assert (await c.post(f"/v2/repository/models/{name}/load")).status_code == 200
                released.append(weakref.ref(service._repository.get(name)[2]))
            assert (await c.post("/v2/models/echo/infer", json=rows(1))).status_code == 200
            assert (await c.post("/v1/completions", json=COMPLETION)).status_code == 200
            loaded = len((await c.get("/metrics")).text)
            for name in ("echo", "tiny"):
                assert (await c.post(f"/v2/repository/models/{name}/unload")).status_code == 200
            text = (await c.get("/metrics")).text
            sizes.append(len(text))
            assert 'model="echo"' not in text and 'model="tiny"' not in text
    await service.stop()
    assert loaded > empty
    assert sizes == [sizes[0]] * 4  # the LLM families' HELP lines stay once created; no series
    gc.collect()
    assert [ref() for ref in released] == [None] * len(released)


async def test_one_invalid_utf8_row_among_32_binary_requests_fails_alone(
    minilm: httpx.AsyncClient,
) -> None:
    """The official Triton client sends BYTES in binary: one request with an invalid UTF-8 row
    among 32 concurrent ones gets a 400 naming its own row; the 31 others get their own answers."""

    async def infer(rows: list[bytes]) -> httpx.Response:
        text = np.array(rows, dtype=object).reshape(len(rows), 1)
        body, headers = encode_infer_request({"text": text}, binary=True)
        return await minilm.post("/v2/models/minilm/infer", content=body, headers=headers)

    def embedding(response: httpx.Response) -> np.ndarray:
        length = response.headers.get("inference-header-content-length")
        _, outputs = decode_infer_response(response.content, int(length) if length else None)
        return outputs["embedding"]

    requests = [[f"sentence number {i}".encode()] for i in range(32)]
    requests[13] = [b"fine", b"\xff\xfe broken"]
    answers = await asyncio.gather(*(infer(rows) for rows in requests))
    assert answers[13].status_code == 400
    assert "row 1" in answers[13].json()["error"] and "UTF-8" in answers[13].json()["error"]
    for i, answer in enumerate(answers):
        if i != 13:
            assert answer.status_code == 200, answer.text
            alone = embedding(await infer(requests[i]))
            np.testing.assert_allclose(embedding(answer), alone, atol=1e-5)


async def test_a_huge_chat_message_is_refused_before_tokenising(client: httpx.AsyncClient) -> None:
    """1 MB of chat content for a model with a 64-token context: 413 at once, naming the bound
    (it would take the tokenizer seconds, holding the GIL)."""
    message = {"role": "user", "content": "word " * 200_000}
    response = await client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": [message], "max_tokens": 1}
    )
    assert response.status_code == 413
    assert "prompt of more than 2048 bytes" in response.json()["error"]["message"]
    prompt = await client.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 3000})
    assert prompt.status_code == 413


async def test_a_client_leaving_during_its_body_logs_no_traceback(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(service, manage_lifespan=False)
    sent: list[dict[str, object]] = []
    messages = iter(
        [{"type": "http.request", "body": b'{"inputs": [', "more_body": True},
         {"type": "http.disconnect"}]
    )  # fmt: skip

    async def receive() -> dict[str, object]:
        return next(messages)

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "method": "POST", "path": "/v2/models/echo/infer", "raw_path": b"",
        "query_string": b"", "headers": [(b"content-type", b"application/json")],
        "http_version": "1.1", "scheme": "http", "server": ("test", 80), "client": ("c", 1),
        "root_path": "",
    }  # fmt: skip
    with caplog.at_level("DEBUG"):
        await app(scope, receive, send)  # type: ignore[arg-type]
    assert sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING") or r.exc_info]


async def test_the_statistics_say_which_session_lone_requests_take(
    minilm: httpx.AsyncClient,
) -> None:
    """minilm's two instances share one backend with a `spin_when_idle` session: one entry
    under `lone_session`, counting the requests sent one at a time."""
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": ["hi"]}]}
    for _ in range(6):
        assert (await minilm.post("/v2/models/minilm/infer", json=body)).status_code == 200
        await asyncio.sleep(0.06)  # idle longer than spin_idle_gap_ms: runs are sparse
    row = (await minilm.get("/v2/models/minilm/stats")).json()["model_stats"][0]
    [state] = row["lone_session"]
    assert state["runs"]["spinning"] + state["runs"]["instance"] == 6
    assert state["favourite"] in ("spinning", "instance")
    assert state["sparse"] is True and state["mean_idle_gap_ms"] >= 50
    measured = [v for v in state["ms_per_row"].values() if v is not None]
    assert measured and all(v > 0 for v in measured)
    means = state["mean_ms_per_row"]
    assert means.keys() == state["ms_per_row"].keys()
    assert [v is None for v in means.values()] == [v is None for v in state["ms_per_row"].values()]
    assert all(v > 0 for v in means.values() if v is not None)
    assert state["explore_every"] >= 8
