"""Schema-aware fuzzing of every endpoint, both APIs: bodies generated around the wire structs
with hostile values (huge and tiny numbers, nulls, wrong types, deep nesting, odd Unicode).
Whatever arrives, the answer is never a 5xx, never a stack trace, never a server path, and the
server stays ready. Derandomized, so CI runs the same bodies every time; FULCRUM_FUZZ_EXAMPLES
sets the number of bodies per endpoint (default 1000)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from fulcrum.datatypes import DATATYPES
from fulcrum.llm.examples import build_tiny_gpt2
from fulcrum.server.app import create_app
from fulcrum.service import Service, ServiceSettings

NUM_EXAMPLES = int(os.environ.get("FULCRUM_FUZZ_EXAMPLES", "1000"))
FUZZ = settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
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
[dynamic_batching]
max_queue_delay_ms = 0
"""
TINY_LLM = """platform = "llm"
[parameters]
num_kv_blocks = 64
block_size = 4
max_model_len = 48
"""
MODELS = ("echo", "minilm", "tiny", "scratch", "nope")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, example_repo: Path) -> Path:
    root: Path = tmp_path_factory.mktemp("fuzz")
    for name in ("echo", "scratch"):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.toml").write_text(ECHO)
    (root / "minilm").symlink_to(example_repo / "minilm", target_is_directory=True)
    build_tiny_gpt2(root, name="tiny")
    (root / "tiny" / "config.toml").write_text(TINY_LLM)
    return root


@pytest.fixture(scope="module")
def client(repo: Path) -> Iterator[TestClient]:
    service = Service(repo, ServiceSettings(max_body_bytes=1 << 20))
    with TestClient(create_app(service), raise_server_exceptions=False) as c:
        yield c


# --- strategies -------------------------------------------------------------------------------

NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**63, 2**64, -(2**63) - 1, 1e-308, 5e-324, 1e-300, 1e308]),
    st.floats(allow_nan=False, allow_infinity=False),
)
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "²", "①", "\x00", "../..", "\ud7ff"]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON: st.SearchStrategy[Any] = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The field's own kind of value most of the time, any JSON value sometimes."""
    return st.one_of(strategy, strategy, strategy, JSON)


def body(required: dict[str, Any], optional: dict[str, Any]) -> st.SearchStrategy[Any]:
    structured = st.fixed_dictionaries(
        {k: maybe(v) for k, v in required.items()},
        optional={k: maybe(v) for k, v in optional.items()},
    )
    return st.one_of(structured, structured, structured, JSON)


TENSOR = st.fixed_dictionaries(
    {
        "name": st.one_of(st.sampled_from(["x", "text", "input_ids"]), TEXT),
        "datatype": st.one_of(st.sampled_from(sorted(DATATYPES)), TEXT),
        "shape": st.lists(st.integers(min_value=-3, max_value=2**40), max_size=4),
    },
    optional={
        "data": st.one_of(st.lists(NUMBERS, max_size=8), st.lists(TEXT, max_size=4), JSON),
        "parameters": st.fixed_dictionaries({}, optional={"binary_data_size": NUMBERS}),
    },
)
V2_INFER = body(
    {"inputs": st.lists(TENSOR, max_size=3)},
    {
        "id": TEXT,
        "outputs": st.lists(
            st.fixed_dictionaries(
                {"name": TEXT},
                optional={
                    "parameters": st.dictionaries(
                        st.sampled_from(["binary_data", "classification", "shared_memory_region"]),
                        SCALARS,
                    )
                },
            ),
            max_size=2,
        ),
        "parameters": st.dictionaries(
            st.sampled_from(["priority", "timeout", "binary_data_output", "x"]), SCALARS
        ),
    },
)
SAMPLING = {
    "max_tokens": st.one_of(st.none(), st.integers(min_value=-5, max_value=2**70)),
    "temperature": st.one_of(st.none(), NUMBERS),
    "top_p": st.one_of(st.none(), NUMBERS),
    "top_k": st.one_of(st.none(), NUMBERS),
    "n": NUMBERS,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5)),
    "stop_token_ids": st.lists(NUMBERS, max_size=4),
    "seed": NUMBERS,
    "ignore_eos": st.booleans(),
    "presence_penalty": NUMBERS,
    "priority": NUMBERS,
    "cache_salt": TEXT,
    "logprobs": SCALARS,
}
MODEL = st.one_of(st.sampled_from(MODELS), TEXT)
PROMPT = st.one_of(TEXT, st.lists(st.integers(min_value=-5, max_value=2**64), max_size=8))
COMPLETION = body({"model": MODEL, "prompt": PROMPT}, {**SAMPLING, "echo": SCALARS})
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), TEXT)},
    optional={
        "content": st.one_of(
            TEXT, st.lists(st.fixed_dictionaries({"type": TEXT, "text": TEXT}), max_size=2)
        )
    },
)
CHAT = body(
    {"model": MODEL, "messages": st.lists(MESSAGE, max_size=3)},
    {**SAMPLING, "max_completion_tokens": NUMBERS},
)
EMBEDDINGS = body(
    {"model": MODEL, "input": st.one_of(TEXT, st.lists(TEXT, max_size=5))},
    {"encoding_format": st.one_of(st.sampled_from(["float", "base64"]), TEXT),
     "dimensions": NUMBERS, "user": TEXT},
)  # fmt: skip
LOAD = body(
    {},
    {"parameters": st.fixed_dictionaries({}, optional={
        "config": st.one_of(TEXT, JSON, st.dictionaries(st.sampled_from(
            ["max_batch_size", "platform", "instances", "dynamic_batching", "inputs"]), JSON))})},
)  # fmt: skip


def check(client: TestClient, method: str, path: str, **kwargs: Any) -> None:
    response = client.request(method, path, **kwargs)
    text = response.text
    assert response.status_code < 500, (path, kwargs, response.status_code, text)
    assert "Traceback" not in text and 'File "' not in text, text
    assert str(Path(__file__).parents[2]) not in text and "pytest-of-" not in text, text


# --- the fuzz tests ---------------------------------------------------------------------------


@FUZZ
@given(payload=V2_INFER, model=st.sampled_from(MODELS), version=st.sampled_from(["", "1", "²"]))
def test_v2_infer(client: TestClient, payload: Any, model: str, version: str) -> None:
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    check(client, "POST", path, json=payload)


@FUZZ
@given(payload=COMPLETION)
def test_openai_completions(client: TestClient, payload: Any) -> None:
    check(client, "POST", "/v1/completions", json=payload)


@FUZZ
@given(payload=CHAT)
def test_openai_chat(client: TestClient, payload: Any) -> None:
    check(client, "POST", "/v1/chat/completions", json=payload)


@FUZZ
@given(payload=EMBEDDINGS)
def test_openai_embeddings(client: TestClient, payload: Any) -> None:
    check(client, "POST", "/v1/embeddings", json=payload)


@FUZZ
@given(payload=LOAD, name=st.one_of(st.just("scratch"), TEXT), index=JSON)
def test_management(client: TestClient, payload: Any, name: str, index: Any) -> None:
    check(client, "POST", "/v2/repository/index", json=index)
    check(client, "POST", f"/v2/repository/models/{quote(name, safe='')}/load", json=payload)


@FUZZ
@given(raw=st.binary(max_size=64), path=st.sampled_from([
    "/v2/models/echo/infer", "/v1/completions", "/v1/chat/completions", "/v1/embeddings",
    "/v2/repository/index"]))  # fmt: skip
def test_raw_bytes(client: TestClient, raw: bytes, path: str) -> None:
    check(client, "POST", path, content=raw)


def test_the_server_is_still_ready_after_the_fuzz(client: TestClient) -> None:
    assert client.get("/v2/health/ready").status_code == 200
    for model in ("echo", "minilm", "tiny"):
        assert client.get(f"/v2/models/{model}/ready").status_code == 200
