"""Chat-template controls rendered as transformers' apply_chat_template renders them
(add_generation_prompt, continue_final_message, chat_template_kwargs, documents), and request
templates: refused unless trusted, and bounded in size and render time when trusted."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from fulcrum.errors import InvalidInput
from fulcrum.llm import chat as chat_module
from fulcrum.llm.chat import ChatOptions, ChatTemplate
from fulcrum.llm.examples import CHAT_TEMPLATE, build_tiny_gpt2

transformers = pytest.importorskip("transformers")

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
# ChatML with a RAG section and a template variable, the shapes real checkpoints use.
RAG_TEMPLATE = (
    "{{ bos_token }}{% if documents %}<|documents|>\n{% for d in documents %}"
    "[{{ loop.index }}] {{ d['title'] }}: {{ d['text'] }}\n{% endfor %}{% endif %}"
    "{% if persona is defined %}<|persona|>{{ persona }}\n{% endif %}"
    "{% if tools is not none %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama-3 style: trims content, so a continued message loses its trailing space.
TRIMMING_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|sep|>{{ m['content'] | trim }}<|eot|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|sep|>{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour <&> quickly."},
    {"role": "assistant", "content": "The colour is "},
]
DOCUMENTS = [{"title": "Sky", "text": "The sky is blue."}, {"title": "Sea", "text": "Wet."}]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = tmp_path_factory.mktemp("models")
    build_tiny_gpt2(directory, name="tiny")
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(Path(directory, "tiny", "1")))


def _hf(tokenizer: Any, template: str, messages: list[dict[str, str]], **kwargs: Any) -> str:
    text: str = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, **SPECIAL, **kwargs
    )
    return text


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, RAG_TEMPLATE, TRIMMING_TEMPLATE])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_add_generation_prompt_renders_as_transformers(
    hf_tokenizer: Any, template: str, add_generation_prompt: bool
) -> None:
    chat = ChatTemplate(template, SPECIAL)
    options = ChatOptions(add_generation_prompt=add_generation_prompt)
    expected = _hf(hf_tokenizer, template, MESSAGES, add_generation_prompt=add_generation_prompt)
    assert chat.render(MESSAGES, options) == expected


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, RAG_TEMPLATE, TRIMMING_TEMPLATE])
def test_continue_final_message_leaves_the_last_message_open_as_transformers(
    hf_tokenizer: Any, template: str
) -> None:
    chat = ChatTemplate(template, SPECIAL)
    options = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    rendered = chat.render(MESSAGES, options)
    expected = _hf(
        hf_tokenizer, template, MESSAGES, add_generation_prompt=False, continue_final_message=True
    )
    assert rendered == expected
    assert rendered.rstrip().endswith("The colour is")  # open: no end-of-turn after it


def test_continue_final_message_and_add_generation_prompt_exclude_each_other() -> None:
    with pytest.raises(InvalidInput) as caught:
        ChatOptions(add_generation_prompt=True, continue_final_message=True)
    assert caught.value.param == "continue_final_message"


def test_documents_and_template_kwargs_reach_the_template_as_in_transformers(
    hf_tokenizer: Any,
) -> None:
    chat = ChatTemplate(RAG_TEMPLATE, SPECIAL)
    kwargs = {"persona": "a pirate", "bos_token": "<BOS>"}  # kwargs override special tokens
    options = ChatOptions(documents=DOCUMENTS, chat_template_kwargs=kwargs)
    rendered = chat.render(MESSAGES, options)
    expected: str = hf_tokenizer.apply_chat_template(
        MESSAGES, chat_template=RAG_TEMPLATE, tokenize=False, add_generation_prompt=True,
        documents=DOCUMENTS, eos_token="</s>", **kwargs,
    )  # fmt: skip
    assert rendered == expected
    assert rendered.startswith("<BOS><|documents|>\n[1] Sky: The sky is blue.")
    assert "<|persona|>a pirate" in rendered
    assert "<|tools|>" not in rendered  # tools is none, not undefined, as transformers passes it


def test_template_kwargs_may_not_replace_what_the_renderer_passes() -> None:
    with pytest.raises(InvalidInput) as caught:
        ChatOptions(chat_template_kwargs={"messages": []})
    assert caught.value.param == "chat_template_kwargs"


def test_the_default_template_honours_the_controls() -> None:
    chat = ChatTemplate(None, {})
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hel"}]
    assert chat.render(messages) == "user: hi\nassistant: hel\nassistant:"
    no_prompt = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    assert chat.render(messages, no_prompt) == "user: hi\nassistant: hel"


def test_a_request_template_is_refused_unless_the_model_trusts_them() -> None:
    untrusted = ChatTemplate(CHAT_TEMPLATE, SPECIAL)
    for options in (
        ChatOptions(chat_template="{{ messages[0]['content'] }}"),
        ChatOptions(chat_template_kwargs={"chat_template": "{{ messages[0]['content'] }}"}),
    ):
        with pytest.raises(InvalidInput) as caught:
            untrusted.render(MESSAGES, options)
        assert caught.value.param == "chat_template"
    trusted = ChatTemplate(CHAT_TEMPLATE, SPECIAL, trust_request_templates=True)
    options = ChatOptions(chat_template="[{{ messages[1]['content'] }}]")
    assert trusted.render(MESSAGES, options) == "[Name a colour <&> quickly.]"


def test_a_request_template_matches_transformers(hf_tokenizer: Any) -> None:
    trusted = ChatTemplate(CHAT_TEMPLATE, SPECIAL, trust_request_templates=True)
    options = ChatOptions(chat_template=RAG_TEMPLATE, documents=DOCUMENTS)
    expected = _hf(hf_tokenizer, RAG_TEMPLATE, MESSAGES, add_generation_prompt=True,
                   documents=DOCUMENTS)  # fmt: skip
    assert trusted.render(MESSAGES, options) == expected


def test_an_oversized_or_broken_request_template_is_a_400() -> None:
    trusted = ChatTemplate(None, {}, trust_request_templates=True)
    big = "x" * (chat_module.MAX_REQUEST_TEMPLATE_CHARS + 1)
    for template in (big, "{% for %}"):
        with pytest.raises(InvalidInput) as caught:
            trusted.render(MESSAGES, ChatOptions(chat_template=template))
        assert caught.value.param == "chat_template"


HOSTILE = {
    "nested loops past the deadline": (
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        "longer than",
    ),
    "string doubling in a namespace": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
        "exceed",
    ),
    "string doubling with +": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}",
        "exceed",
    ),
    "repetition": ("{{ 'a' * 1000000000 }}", "exceed"),
    "list repetition then join": ("{{ (['abcdef' * 1000] * 100000) | join }}", "exceed"),
    "huge power": ("{{ 7 ** 1000000000 }}", "too large"),
    "huge width in format": ("{{ '{:>999999999}'.format(1) }}", "too large"),
    "huge width in a filter": ("{{ 'x' | center(999999999) }}", "too large"),
    "replace growth": (
        "{% set ns = namespace(s='a' * 4000) %}{% for i in range(9) %}"
        "{% set ns.s = ns.s | replace('a', 'aaaaaaaaaa') %}{% endfor %}",
        "exceed",
    ),
    "huge output": ("{% for i in range(100000) %}{{ 'a' * 1000 }}{% endfor %}", "output exceeds"),
    "underscore namespace attribute": ("{% set ns = namespace(_x=1) %}", "cannot store"),
    "sandbox escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "chat template"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_request_template_fails_only_its_request(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chat_module, "REQUEST_TEMPLATE_BUDGET_S", 0.2)
    template, needle = HOSTILE[name]
    trusted = ChatTemplate(CHAT_TEMPLATE, SPECIAL, trust_request_templates=True)
    tracer = sys.gettrace()
    with pytest.raises(InvalidInput, match=needle) as caught:
        trusted.render(MESSAGES, ChatOptions(chat_template=template))
    assert caught.value.param == "chat_template"
    assert sys.gettrace() is tracer  # the deadline hook is removed again
    # The model's own template still renders for the next request.
    assert trusted.render(MESSAGES).endswith("<|assistant|>\n")


def test_transformers_globals_are_there() -> None:
    template = "{{ strftime_now('%Y') | length }} {{ {'a': '<b>'} | tojson }} {{ dict(x=1).x }}"
    assert ChatTemplate(template, {}).render(MESSAGES) == '4 {"a": "<b>"} 1'
