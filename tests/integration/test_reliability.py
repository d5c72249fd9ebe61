"""RELIABILITY.md's promises in process (httpx.ASGITransport) over echo models: reload under
load, overload, isolation, bad input, fuzz, metrics cardinality and readiness while draining."""

from __future__ import annotations

import asyncio
import json
import math
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from fulcrum.batcher import DynamicBatcher
from fulcrum.servable import BatchServable
from fulcrum.server.app import create_app
from fulcrum.service import Service

ECHO = """platform = "echo"
max_batch_size = {max_batch_size}
inputs = [{{name = "{input}", datatype = "{datatype}", shape = [{row}]}}]
outputs = [{{name = "y", datatype = "{datatype}", shape = [{row}]}}]
parameters = {{latency_a_ms = {latency_ms}}}
[dynamic_batching]
max_queue_delay_ms = 1
default_queue_policy = {{max_queue_size = {max_queue_size}}}
"""
# name: (max_batch_size, max_queue_size (0: unbounded), latency_ms, datatype)
MODELS = {
    "echo": (8, 0, 1.0, "FP32"),
    "words": (8, 0, 0.0, "BYTES"),
    "bounded": (4, 4, 50.0, "FP32"),
    "slow": (1, 0, 500.0, "FP32"),
    "fast": (8, 0, 0.0, "FP32"),
}
BOUNDED_CAPACITY = 4 + 4  # max_queue_size waiting + max_batch_size running


def write_model(root: Path, name: str) -> None:
    max_batch_size, max_queue_size, latency_ms, datatype = MODELS[name]
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    is_bytes = datatype == "BYTES"
    (root / name / "config.toml").write_text(
        ECHO.format(max_batch_size=max_batch_size, max_queue_size=max_queue_size,
                    latency_ms=latency_ms, datatype=datatype, input="text" if is_bytes else "x",
                    row=1 if is_bytes else 4)
    )  # fmt: skip


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    for name in MODELS:
        write_model(tmp_path, name)
    svc = Service.from_repository(tmp_path)
    await svc.start()
    yield svc
    await svc.stop()


@pytest.fixture
async def client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def row_body(values: list[float]) -> dict[str, object]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": values}]}


def distinct_row(i: int) -> list[float]:
    return [i, i + 0.25, i + 0.5, i + 0.75]


def batcher_of(service: Service, name: str) -> DynamicBatcher:
    servable = service._repository.get(name)[2]
    assert isinstance(servable, BatchServable)
    return servable.batcher


def length_header(value: object) -> dict[str, str]:
    """Inference-Header-Content-Length set to `value`, or no header for None and ""."""
    return {} if value is None or value == "" else {"Inference-Header-Content-Length": str(value)}


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the event loop (no timed sleep) until `condition` holds; 10 s at most."""
    async with asyncio.timeout(10):
        while not condition():
            await asyncio.sleep(0)


async def test_reload_under_load_fails_nothing(client: httpx.AsyncClient, tmp_path: Path) -> None:
    answered = asyncio.Condition()
    num_answers, num_during_loads, stop, v2_loaded, loading = 0, 0, False, False, False
    failures: list[str] = []
    served_after_v2: list[str] = []

    async def worker(i: int) -> None:
        nonlocal num_answers, num_during_loads
        while not stop:
            after_v2 = v2_loaded
            r = await client.post("/v2/models/echo/infer", json=row_body(distinct_row(i)))
            if r.status_code != 200 or r.json()["outputs"][0]["data"] != distinct_row(i):
                failures.append(f"{r.status_code} {r.text}")
            elif after_v2:
                served_after_v2.append(r.json()["model_version"])
            if (await client.get("/v2/health/ready")).status_code != 200:
                failures.append("not ready")
            num_during_loads += loading
            async with answered:
                num_answers += 1
                answered.notify_all()

    async def more_answers(count: int) -> None:
        target = num_answers + count
        async with answered:
            await answered.wait_for(lambda: num_answers >= target)

    workers = [asyncio.create_task(worker(i)) for i in range(8)]
    await more_answers(20)
    for step in range(4):
        if step == 2:
            (tmp_path / "echo" / "2").mkdir()
        loading = True
        response = await client.post("/v2/repository/models/echo/load")
        loading, v2_loaded = False, step >= 2
        assert response.status_code == 200, response.text
        await more_answers(20)
    # A broken config.toml: the reload answers an error and version 2 keeps serving.
    (tmp_path / "echo" / "config.toml").write_text("platform = [nonsense\n")
    response = await client.post("/v2/repository/models/echo/load")
    assert response.status_code >= 400 and "config.toml" in response.json()["error"]
    num_before = len(served_after_v2)
    await more_answers(20)
    stop = True
    await asyncio.gather(*workers)
    assert failures == [] and num_during_loads > 0  # requests were answered mid-reload
    assert len(served_after_v2) > num_before and set(served_after_v2) == {"2"}
    index = (await client.post("/v2/repository/index", json={})).json()
    rows = [(r.get("version"), r["state"]) for r in index if r["name"] == "echo"]
    assert rows == [("2", "READY")]


async def test_overload_answers_each_request_exactly_once(
    client: httpx.AsyncClient, service: Service
) -> None:
    num_sent = 20 * BOUNDED_CAPACITY
    responses = await asyncio.gather(
        *(client.post("/v2/models/bounded/infer", json=row_body(distinct_row(i)))
          for i in range(num_sent))
    )  # fmt: skip
    ok = [i for i, r in enumerate(responses) if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(rejected) == num_sent, {r.status_code for r in responses}
    assert ok and len(rejected) >= num_sent // 2
    assert all(r.headers["retry-after"].isdigit() and r.json()["error"] for r in rejected)
    for i in ok:  # each client got its own row back, not a neighbour's
        assert responses[i].json()["outputs"][0]["data"] == distinct_row(i)
    stats = (await client.get("/v2/models/bounded/stats")).json()["model_stats"][0]
    executed_rows = sum(b["batch_size"] * b["compute_infer"]["count"] for b in stats["batch_stats"])
    assert executed_rows == stats["inference_count"] == len(ok)  # none ran twice, none lost
    assert stats["inference_stats"]["fail"]["count"] == len(rejected)
    assert batcher_of(service, "bounded").queue_depth == 0


async def test_fast_model_answers_while_slow_model_is_saturated(
    client: httpx.AsyncClient, service: Service
) -> None:
    num_slow = 5
    finished: list[str] = []

    async def call(model: str, i: int) -> None:
        r = await client.post(f"/v2/models/{model}/infer", json=row_body(distinct_row(i)))
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == distinct_row(i)
        finished.append(model)

    slow = [asyncio.create_task(call("slow", i)) for i in range(num_slow)]
    slow_batcher = batcher_of(service, "slow")
    await until(lambda: slow_batcher.queue_depth == num_slow - 1)  # one runs, the rest wait
    for round_ in range(3):
        await asyncio.gather(*(call("fast", 10 * round_ + i) for i in range(10)))
    assert finished.count("fast") == 30
    assert finished.count("slow") < num_slow and slow_batcher.queue_depth > 0
    await asyncio.gather(*slow)
    assert finished[-1] == "slow"


def binary_body(datatype: str, shape: list[int], size: int, tail: bytes) -> tuple[bytes, int]:
    """A binary-extension body and its Inference-Header-Content-Length."""
    tensor = {"name": "x", "datatype": datatype, "shape": shape,
              "parameters": {"binary_data_size": size}}  # fmt: skip
    head = json.dumps({"inputs": [tensor]}).encode()
    return head + tail, len(head)


def json_body(shape: list[int], data: list[float]) -> tuple[bytes, None]:
    tensor = {"name": "x", "datatype": "FP32", "shape": shape, "data": data}
    return json.dumps({"inputs": [tensor]}).encode(), None


ROW = struct.pack("<4f", 1, 2, 3, 4)
# case: (body, Inference-Header-Content-Length or None, a fragment of the error)
BAD_BODIES = {
    "wrong dtype in binary body": (*binary_body("INT32", [1, 4], 16, ROW), "INT32"),
    "truncated binary body": (*binary_body("FP32", [1, 4], 16, ROW[:9]), "exceeds"),
    "binary size not the shape's": (*binary_body("FP32", [1, 4], 12, ROW[:12]), "needs 16"),
    "header length beyond body": (binary_body("FP32", [1, 4], 16, ROW)[0], 10**5, "100000"),
    "negative shape": (*json_body([-1, 4], [1, 2, 3, 4]), "-1"),
    "negative binary shape": (*binary_body("FP32", [-1, -4], 16, ROW), "-1"),
    "huge binary shape, tiny data": (*binary_body("FP32", [1 << 20, 4], 16, ROW), "needs"),
    "huge JSON shape, tiny data": (*json_body([1 << 20, 4], [1, 2, 3, 4]), "holds 4"),
    "shape past 2**31 elements": (*json_body([1 << 30, 4], [1, 2, 3, 4]), "2**31"),
    "overflowing shape": (*binary_body("FP32", [1 << 31, 1 << 31, 4], 16, ROW), "2**31"),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
async def test_one_bad_body_among_32_fails_alone(client: httpx.AsyncClient, case: str) -> None:
    body, header_length, fragment = BAD_BODIES[case]
    bad_index = 13

    async def send(i: int) -> httpx.Response:
        if i == bad_index:
            return await client.post(
                "/v2/models/echo/infer", content=body, headers=length_header(header_length)
            )
        return await client.post("/v2/models/echo/infer", json=row_body(distinct_row(i)))

    responses = await asyncio.gather(*(send(i) for i in range(32)))
    bad = responses.pop(bad_index)
    assert bad.status_code == 400 and fragment in bad.json()["error"], bad.text
    rows = [distinct_row(i) for i in range(32) if i != bad_index]
    assert [r.status_code for r in responses] == [200] * 31
    assert [r.json()["outputs"][0]["data"] for r in responses] == rows


def metric_series(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every (sample name, labels) on a /metrics page; values left out."""
    families = text_string_to_metric_families(text)
    return {(s.name, tuple(sorted(s.labels.items()))) for f in families for s in f.samples}


async def test_junk_names_and_paths_add_no_metric_series(client: httpx.AsyncClient) -> None:
    body = row_body([1, 2, 3, 4])
    await client.post("/v2/models/echo/infer", json=body)
    before = (await client.get("/metrics")).text
    for i in range(50):
        junk = f"junk-{i}"
        for path in (f"/v2/models/{junk}/infer", f"/v2/models/{junk}/versions/{i}/infer",
                     f"/v2/models/echo/versions/{i + 2}/infer", f"/v1/{junk}"):  # fmt: skip
            await client.post(path, json=body)
        for path in (f"/v2/models/{junk}/ready", f"/v2/models/{junk}/stats", f"/{junk}?q={i}"):
            await client.get(path)
        await client.delete(f"/v2/models/{junk}")
    after = (await client.get("/metrics")).text
    assert metric_series(after) == metric_series(before)
    assert "junk" not in after


async def test_begin_shutdown_turns_readiness_off_while_requests_finish(
    client: httpx.AsyncClient, service: Service
) -> None:
    batcher = batcher_of(service, "slow")
    pending = [
        asyncio.create_task(client.post("/v2/models/slow/infer", json=row_body(distinct_row(i))))
        for i in range(3)
    ]
    await until(lambda: batcher.num_in_flight == 1 and batcher.queue_depth == 2)
    service.begin_shutdown()
    assert (await client.get("/v2/health/ready")).status_code == 503
    assert (await client.get("/v2/health/live")).status_code == 200
    drain = asyncio.create_task(service.drain())
    rows = [(r.status_code, r.json()["outputs"][0]["data"]) for r in await asyncio.gather(*pending)]
    assert rows == [(200, distinct_row(i)) for i in range(3)]
    await drain
    assert (await client.get("/v2/health/ready")).status_code == 503


async def test_request_after_begin_shutdown_is_503(
    client: httpx.AsyncClient, service: Service
) -> None:
    service.begin_shutdown()
    response = await client.post("/v2/models/echo/infer", json=row_body([1, 2, 3, 4]))
    assert response.status_code == 503 and "retry-after" in response.headers


JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
JSON_VALUES = st.recursive(
    JSON_LEAVES, lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=12
)
AsIs = st.SearchStrategy[Any]


def often(likely: AsIs, *others: AsIs) -> AsIs:
    """`likely` about seven times in eight, else one of `others`."""
    chosen = st.sampled_from([True] * 7 + [False])
    return chosen.flatmap(lambda ok: likely if ok else st.one_of(*others))


# The structured fuzz aims near each model's input, so most bodies get past the decoder.
FUZZED = {"echo": ("x", "FP32", [4]), "words": ("text", "BYTES", [1])}
ELEMENTS = {"FP32": st.floats(width=32, allow_nan=False, allow_infinity=False),
            "BYTES": st.text(max_size=4)}  # fmt: skip
ODD_ELEMENTS = st.integers(-300, 70_000) | JSON_LEAVES
ODD_ELEMENT_KIND = st.just(ODD_ELEMENTS)  # a strategy of strategies, for often()
ODD_SHAPES = st.lists(st.integers(-2, 6) | st.sampled_from([1 << 31, 1 << 62, 1 << 64]), max_size=4)
ODD_TYPES = st.sampled_from(["INT32", "BOOL", "FP16", "BYTES", "fp32"])
PARAMETERS = st.fixed_dictionaries({}, optional={
    "priority": often(st.integers(0, 1), JSON_LEAVES), "binary_data_output": often(st.booleans(),
    JSON_LEAVES), "timeout": often(st.sampled_from([0, 10**7]), JSON_LEAVES),
})  # fmt: skip
OUTPUTS = st.lists(st.fixed_dictionaries({"name": often(st.just("y"), st.text())}, optional={
    "parameters": st.fixed_dictionaries({}, optional={"binary_data": often(st.booleans(),
    JSON_LEAVES), "classification": st.integers(0, 2), "shared_memory_region": JSON_LEAVES}),
}), max_size=2)  # fmt: skip
# None: no header; "": the exact JSON length; else a visible-ASCII value, as HTTP allows.
VISIBLE_ASCII = st.characters(min_codepoint=33, max_codepoint=126)
HEADER_LENGTHS = often(
    st.sampled_from([None, ""]), st.integers(0, 400).map(str), st.text(VISIBLE_ASCII)
)
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


@st.composite
def binary_tensor(draw: st.DrawFn, datatype: str, num_elements: int) -> bytes:
    """Bytes of the right size for the tensor, most of the time."""
    if datatype == "BYTES" and draw(st.integers(0, 3)):
        items = draw(st.lists(st.binary(max_size=4), min_size=num_elements, max_size=num_elements))
        return b"".join(struct.pack("<I", len(item)) + item for item in items)
    size = draw(often(st.just(4 * num_elements), st.integers(0, 40)))
    return bytes(draw(st.binary(min_size=size, max_size=size)))


@st.composite
def infer_bodies(draw: st.DrawFn, model: str) -> tuple[dict[str, object], bytes]:
    """Mostly well-formed v2 bodies for `model`, with a fault here and there, and their tail."""
    name, datatype, row = FUZZED[model]
    inputs, tail = [], b""
    for _ in range(draw(st.sampled_from([1] * 6 + [0, 2]))):
        shape = draw(often(st.integers(1, 3).map(lambda n: [n, *row]), ODD_SHAPES))
        num_elements = math.prod(shape) if all(0 <= d <= 8 for d in shape) else 3
        num_elements = max(0, num_elements + draw(st.sampled_from([0] * 6 + [-1, 1])))
        wire_type = draw(often(st.just(datatype), ODD_TYPES))
        tensor: dict[str, object] = {"name": draw(often(st.just(name), st.text(max_size=3))),
                                     "datatype": wire_type, "shape": shape}  # fmt: skip
        if draw(st.booleans()):
            chunk = draw(binary_tensor(wire_type, num_elements))
            size = len(chunk) + draw(st.sampled_from([0, 0, 1]))
            tensor["parameters"] = {"binary_data_size": size}
            tail += chunk
        else:
            element = draw(often(st.just(ELEMENTS.get(wire_type, ODD_ELEMENTS)), ODD_ELEMENT_KIND))
            tensor["data"] = draw(st.lists(element, min_size=num_elements, max_size=num_elements))
        inputs.append(tensor)
    return {"inputs": inputs, "parameters": draw(PARAMETERS), "outputs": draw(OUTPUTS)}, tail


def test_fuzzed_infer_bodies_never_get_a_5xx(tmp_path: Path) -> None:
    for name in FUZZED:
        write_model(tmp_path, name)
    service = Service.from_repository(tmp_path)
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    client = httpx.AsyncClient(transport=transport, base_url="http://test")
    models = st.sampled_from(sorted(FUZZED))

    def post(model: str, content: bytes, header_length: str | None) -> httpx.Response:
        url, headers = f"/v2/models/{model}/infer", length_header(header_length)
        return runner.run(client.post(url, content=content, headers=headers))

    def check(response: httpx.Response, body: object = None) -> None:
        status = response.status_code
        # 504: a request that set its own `timeout` and expired in the queue; it never ran
        assert status < 500 or (status == 504 and "timeout" in json.dumps(body)), response.text
        assert "Traceback" not in response.text
        if status >= 400:
            assert isinstance(response.json()["error"], str), response.text

    @FUZZ
    @given(data=st.data(), model=models, header_length=HEADER_LENGTHS)
    def structured(data: st.DataObject, model: str, header_length: str | None) -> None:
        body, tail = data.draw(infer_bodies(model))
        head = json.dumps(body).encode()
        exact = str(len(head)) if tail else None
        check(post(model, head + tail, exact if header_length == "" else header_length), body)

    @FUZZ
    @given(model=models, body=JSON_VALUES)
    def any_json(model: str, body: object) -> None:
        check(post(model, json.dumps(body).encode(), None), body)

    @FUZZ
    @given(model=models, content=st.binary(max_size=200), header_length=HEADER_LENGTHS)
    def any_bytes(model: str, content: bytes, header_length: str | None) -> None:
        check(post(model, content, header_length))

    with asyncio.Runner() as runner:
        runner.run(service.start())
        try:
            structured()
            any_json()
            any_bytes()
            good = post("echo", json.dumps(row_body([1, 2, 3, 4])).encode(), None)
            assert good.status_code == 200 and good.json()["outputs"][0]["data"] == [1, 2, 3, 4]
        finally:
            runner.run(client.aclose())
            runner.run(service.stop())
