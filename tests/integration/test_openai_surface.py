"""The OpenAI surface vLLM users expect, with the official `openai` client in process: every
known field is implemented or refused with a 400 naming it, errors under /v1 have OpenAI's shape,
the request id is echoed, chat-template controls take effect, and vLLM's extra routes answer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer, processors

from fulcrum import __version__
from fulcrum.llm.engine import AsyncLLMEngine
from fulcrum.llm.examples import build_tiny_gpt2
from fulcrum.server.app import create_app
from fulcrum.service import Service
from fulcrum.service_llm import LLMServable

CONFIG = """platform = "llm"
[parameters]
num_kv_blocks = 64
block_size = 4
max_model_len = 128
"""
# The "rag" model's template reads documents and a template variable, as RAG checkpoints do.
RAG_TEMPLATE = (
    "{% if documents %}{% for d in documents %}<doc>{{ d['text'] }}</doc>{% endfor %}{% endif %}"
    "{% if persona is defined %}<persona>{{ persona }}</persona>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
USER = [{"role": "user", "content": "Tell me a story"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 4}
IGNORE_EOS = {"ignore_eos": True}


def _add_bos_post_processor(version_dir: Path) -> None:
    """A tokenizer that adds BOS itself, so add_special_tokens has something to switch."""
    tokenizer = Tokenizer.from_file(str(version_dir / "tokenizer.json"))
    bos = "<|endoftext|>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A $B:1",
        special_tokens=[(bos, tokenizer.token_to_id(bos))],
    )
    tokenizer.save(str(version_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory: Path = tmp_path_factory.mktemp("models")
    build_tiny_gpt2(directory, name="tiny")
    (directory / "tiny" / "config.toml").write_text(CONFIG)
    build_tiny_gpt2(directory, name="rag")
    (directory / "rag" / "config.toml").write_text(CONFIG + "trust_request_chat_template = true\n")
    tok_config = directory / "rag" / "1" / "tokenizer_config.json"
    tok_config.write_text(json.dumps({**json.loads(tok_config.read_text()),
                                      "chat_template": RAG_TEMPLATE}))  # fmt: skip
    _add_bos_post_processor(directory / "rag" / "1")
    return directory


def _engine(service: Service, name: str) -> AsyncLLMEngine:
    servable = service._repository.get(name)[2]
    assert isinstance(servable, LLMServable)
    return servable.engine


@pytest.fixture
async def http(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(service, manage_lifespan=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


@pytest.fixture
def client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://test/v1", api_key="unused", max_retries=0, http_client=http
    )


async def _prompt_tokens(client: openai.AsyncOpenAI, model: str, **kwargs: Any) -> int:
    done = await client.chat.completions.create(model=model, messages=kwargs.pop("messages", USER),
                                                **GREEDY, **kwargs)  # fmt: skip
    assert done.usage is not None
    return done.usage.prompt_tokens


# --- no silent drops -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"extra_body": {"structural_tag": {"type": "structural_tag"}}}, "structural_tag"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
        ({"extra_body": {"mm_processor_kwargs": {"size": 3}}}, "mm_processor_kwargs"),
    ],
)
async def test_a_known_unimplemented_chat_field_is_a_400_naming_it(
    client: openai.AsyncOpenAI, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="tiny", messages=USER, **GREEDY, **kwargs)
    assert caught.value.param == param
    assert caught.value.type == "invalid_request_error"
    assert param in caught.value.message


async def test_a_known_unimplemented_completion_field_is_a_400_naming_it(
    client: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model="tiny", prompt="Hi", **GREEDY,
                                        extra_body={"structural_tag": "{}"})  # fmt: skip
    assert caught.value.param == "structural_tag"


async def test_a_message_field_that_would_be_dropped_is_a_400(client: openai.AsyncOpenAI) -> None:
    # The deprecated function_call (tool_calls replaced it, and those are rendered).
    called: list[Any] = [{"role": "assistant", "content": "",
                          "function_call": {"name": "f", "arguments": "{}"}}]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="tiny", messages=called, **GREEDY)
    assert caught.value.param == "messages[0].function_call"


async def test_a_message_name_is_accepted(client: openai.AsyncOpenAI) -> None:
    # Multi-agent clients (AutoGen and the like) name their speakers; vLLM passes it on.
    named: list[Any] = [{"role": "user", "content": "Tell me a story", "name": "alice"}]
    answer = await client.chat.completions.create(model="tiny", messages=named, **GREEDY)
    assert answer.choices[0].message.content is not None


async def test_null_defaults_metadata_and_unknown_extras_are_accepted(
    client: openai.AsyncOpenAI,
) -> None:
    plain = await client.chat.completions.create(model="tiny", messages=USER, **GREEDY)
    extra = {"request_id": None, "chat_template": None, "documents": None, "guided_json": None,
             "chat_template_kwargs": None, "add_generation_prompt": None, "use_beam_search": False,
             "x_vendor_extension": {"anything": [1, 2]}}  # fmt: skip
    padded = await client.chat.completions.create(
        model="tiny", messages=USER, **GREEDY, response_format=None, tools=None, seed=None,
        user="u-1", metadata={"trace": "t"}, store=False, service_tier="auto", n=1,
        extra_body=extra,
    )  # fmt: skip
    assert padded.choices[0].message.content == plain.choices[0].message.content


# --- errors --------------------------------------------------------------------------------


def _openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    return error


async def test_every_error_under_v1_has_openais_shape(http: httpx.AsyncClient) -> None:
    assert _openai_error(await http.get("/v1/nowhere"), 404)["param"] is None
    assert _openai_error(await http.get("/v1/completions"), 405)["type"] == "invalid_request_error"
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": "many"}
    assert _openai_error(await http.post("/v1/completions", json=body), 400)["param"] == (
        "max_tokens"
    )
    missing = await http.post("/v1/chat/completions", json={"messages": USER})
    assert _openai_error(missing, 400)["param"] == "model"
    bad_json = await http.post("/v1/completions", content=b"{nope",
                               headers={"content-type": "application/json"})  # fmt: skip
    _openai_error(bad_json, 400)
    huge = b" " * (8 * 1024 * 1024 + 1)
    _openai_error(await http.post("/v1/completions", content=huge), 413)
    unknown_model = await http.post("/v1/completions", json={"model": "nope", "prompt": "Hi"})
    assert _openai_error(unknown_model, 404)["type"] == "not_found_error"


async def test_the_official_client_reads_the_error_fields(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.models.retrieve("nope")
    assert caught.value.type == "not_found_error"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model="tiny", prompt="Hi", extra_body={"top_k": "x"})
    assert bad.value.param == "top_k"


# --- request id ----------------------------------------------------------------------------


async def test_the_body_request_id_names_the_response(client: openai.AsyncOpenAI) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=USER, **GREEDY, extra_body={"request_id": "job-42"}
    )
    assert raw.headers["x-request-id"] == "job-42"
    assert raw.parse().id == "chatcmpl-job-42"
    done = await client.completions.create(model="tiny", prompt="Hi", **GREEDY,
                                           extra_body={"request_id": "job-43"})  # fmt: skip
    assert done.id == "cmpl-job-43"
    stream = await client.chat.completions.create(
        model="tiny", messages=USER, **GREEDY, stream=True, extra_body={"request_id": "job-44"}
    )
    assert {chunk.id async for chunk in stream} == {"chatcmpl-job-44"}


async def test_the_x_request_id_header_names_the_response(client: openai.AsyncOpenAI) -> None:
    raw = await client.completions.with_raw_response.create(
        model="tiny", prompt="Hi", **GREEDY, extra_headers={"X-Request-Id": "hdr-1"}
    )
    assert raw.headers["x-request-id"] == "hdr-1"
    assert raw.parse().id == "cmpl-hdr-1"
    generated = await client.completions.with_raw_response.create(model="tiny", prompt="Hi",
                                                                  **GREEDY)  # fmt: skip
    assert generated.parse().id == f"cmpl-{generated.headers['x-request-id']}"


async def test_a_request_id_that_cannot_be_a_header_is_a_400(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model="tiny", prompt="Hi", **GREEDY,
                                        extra_body={"request_id": "a\r\nb"})  # fmt: skip
    assert caught.value.param == "request_id"


# --- chat-template controls ----------------------------------------------------------------


async def _tokenize(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def test_add_generation_prompt_false_leaves_the_assistant_tag_out(
    client: openai.AsyncOpenAI, service: Service
) -> None:
    engine = _engine(service, "tiny")
    with_prompt = await _prompt_tokens(client, "tiny")
    without = await _prompt_tokens(client, "tiny", extra_body={"add_generation_prompt": False})
    tag = len(engine.encode("<|assistant|>\n", add_special_tokens=False))
    assert with_prompt - without == tag > 0


async def test_continue_final_message_extends_the_last_message(
    client: openai.AsyncOpenAI, service: Service
) -> None:
    messages = [*USER, {"role": "assistant", "content": "Once upon"}]
    count = await _prompt_tokens(client, "tiny", messages=messages,
                                 extra_body={"continue_final_message": True})  # fmt: skip
    expected = "<|user|>\nTell me a story<|endoftext|>\n<|assistant|>\nOnce upon"
    assert count == len(_engine(service, "tiny").encode(expected, add_special_tokens=False))
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model="tiny", messages=messages, **GREEDY,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )  # fmt: skip
    assert caught.value.param == "continue_final_message"


async def test_documents_and_template_kwargs_reach_the_template(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, service: Service
) -> None:
    extra = {"documents": [{"title": "t", "text": "The sky is blue"}],
             "chat_template_kwargs": {"persona": "pirate"}}  # fmt: skip
    count = await _prompt_tokens(client, "rag", extra_body=extra)
    text = ("<doc>The sky is blue</doc><persona>pirate</persona>"
            "<|user|>Tell me a story<|endoftext|><|assistant|>")  # fmt: skip
    assert count == len(_engine(service, "rag").encode(text, add_special_tokens=False))
    assert count > await _prompt_tokens(client, "rag")
    tokenized = await _tokenize(http, model="rag", messages=USER, **extra)
    assert tokenized["count"] == count


async def test_a_request_template_needs_a_model_that_trusts_them(
    client: openai.AsyncOpenAI, service: Service
) -> None:
    template = "[{% for m in messages %}{{ m['content'] }}{% endfor %}]"
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="tiny", messages=USER, **GREEDY,
                                             extra_body={"chat_template": template})  # fmt: skip
    assert caught.value.param == "chat_template"
    count = await _prompt_tokens(client, "rag", extra_body={"chat_template": template})
    assert count == len(
        _engine(service, "rag").encode("[Tell me a story]", add_special_tokens=False)
    )


async def test_add_special_tokens_adds_the_tokenizers_bos(
    client: openai.AsyncOpenAI, service: Service
) -> None:
    engine = _engine(service, "rag")
    bos = engine.encode("", add_special_tokens=True)
    assert len(bos) == 1  # the post-processor adds it
    plain = await _prompt_tokens(client, "rag")
    assert await _prompt_tokens(client, "rag", extra_body={"add_special_tokens": True}) == plain + 1
    with_bos = await client.completions.create(model="rag", prompt="Hi there", **GREEDY)
    without = await client.completions.create(model="rag", prompt="Hi there", **GREEDY,
                                              extra_body={"add_special_tokens": False})  # fmt: skip
    assert with_bos.usage is not None and without.usage is not None
    assert with_bos.usage.prompt_tokens == without.usage.prompt_tokens + 1


# --- vLLM's extra routes -------------------------------------------------------------------


async def test_tokenize_and_detokenize_round_trip(
    http: httpx.AsyncClient, service: Service
) -> None:
    engine = _engine(service, "rag")
    text = "The quick brown fox"
    result = await _tokenize(http, model="rag", prompt=text, return_token_strs=True)
    assert result["tokens"] == engine.encode(text)
    assert result["count"] == len(result["tokens"]) and result["max_model_len"] == 128
    assert result["token_strs"][0] == "<|endoftext|>"
    bare = await _tokenize(http, model="rag", prompt=text, add_special_tokens=False)
    assert bare["tokens"] == result["tokens"][1:]
    back = await http.post("/detokenize", json={"model": "rag", "tokens": bare["tokens"]})
    assert back.json() == {"prompt": text}
    chat = await _tokenize(http, model="rag", messages=USER, add_generation_prompt=False)
    assert chat["tokens"] == engine.encode_chat(USER, _no_generation_prompt())
    assert chat["token_strs"] is None


def _no_generation_prompt() -> Any:
    from fulcrum.llm.chat import ChatOptions

    return ChatOptions(add_generation_prompt=False)


async def test_tokenize_errors_name_their_field(http: httpx.AsyncClient) -> None:
    kwargs = {"size": 3}
    refused = await http.post(
        "/tokenize", json={"model": "tiny", "messages": USER, "mm_processor_kwargs": kwargs}
    )
    assert _openai_error(refused, 400)["param"] == "mm_processor_kwargs"
    both = await http.post("/tokenize", json={"model": "tiny", "prompt": "a", "messages": USER})
    assert _openai_error(both, 400)["param"] == "prompt"
    outside = await http.post("/detokenize", json={"model": "tiny", "tokens": [10**6]})
    assert _openai_error(outside, 400)["param"] == "tokens"
    ambiguous = await http.post("/detokenize", json={"tokens": [1]})  # two models are served
    assert _openai_error(ambiguous, 400)["param"] == "model"


async def test_health_and_version(http: httpx.AsyncClient) -> None:
    health = await http.get("/health")
    assert health.status_code == 200 and health.content == b""
    assert (await http.get("/version")).json() == {"version": __version__}


async def test_model_cards_carry_vllms_fields(client: openai.AsyncOpenAI) -> None:
    cards = {m.id: m for m in (await client.models.list()).data}
    assert set(cards) == {"tiny", "rag"}
    card = (await client.models.retrieve("tiny")).model_dump()
    assert card["object"] == "model" and card["owned_by"] == "fulcrum" and card["created"] > 0
    assert card["root"] == "tiny" and card["parent"] is None and card["max_model_len"] == 128
    assert card["permission"][0]["object"] == "model_permission"
    assert cards["tiny"].model_dump()["root"] == "tiny"


async def test_documents_count_toward_the_prompt_size_limit(client: openai.AsyncOpenAI) -> None:
    # tiny's context is 128 tokens: at 32 bytes a token, 4096 bytes of text cannot fit.
    documents = [{"title": "big", "text": "word " * 1000}]
    with pytest.raises(openai.APIStatusError) as caught:
        await client.chat.completions.create(model="rag", messages=USER, **GREEDY,
                                             extra_body={"documents": documents})  # fmt: skip
    assert caught.value.status_code == 413
