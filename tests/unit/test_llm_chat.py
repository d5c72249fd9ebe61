"""Chat prompts tokenised as transformers' apply_chat_template(tokenize=True) does, for tokenizers
whose post-processor adds special tokens (built offline with `tokenizers`); templates compiled once
per model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, processors

from fulcrum.errors import ConfigError, InvalidInput
from fulcrum.llm.chat import ChatTemplate
from fulcrum.llm.chat_sandbox import BoundedEnvironment
from fulcrum.llm.examples import CHAT_TEMPLATE, build_tiny_gpt2, build_tiny_llama
from fulcrum.llm.loader import load_checkpoint
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sync_engine import LLMEngine

transformers = pytest.importorskip("transformers")

# Llama-2's template shape: it renders bos_token itself.
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% else %} {{ message['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
)
MESSAGES = [
    {"role": "user", "content": "The quick brown fox?"},
    {"role": "assistant", "content": "Jumps over the lazy dog."},
    {"role": "user", "content": "And then?"},
]


def _with_post_processor(version_dir: Path, single: str, token: str, template: str) -> int:
    """Give the checkpoint's tokenizer a post-processor that adds `token`; its id."""
    tokenizer = Tokenizer.from_file(str(version_dir / "tokenizer.json"))
    token_id = tokenizer.token_to_id(token)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single} $B:1", special_tokens=[(token, token_id)]
    )
    tokenizer.save(str(version_dir / "tokenizer.json"))
    config_path = version_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return int(token_id)


def _hf_chat_ids(version_dir: Path) -> list[int]:
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(version_dir))
    out: Any = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = out if isinstance(out, list) else out["input_ids"]
    return [int(i) for i in ids]


def _engine(version_dir: Path) -> LLMEngine:
    return LLMEngine(load_checkpoint(version_dir), EngineParams(num_kv_blocks=8))


def test_llama_style_bos_adding_tokenizer_gets_one_bos(tmp_path: Path) -> None:
    build_tiny_llama(tmp_path)
    version_dir = tmp_path / "tiny-llama" / "1"
    bos_id = _with_post_processor(version_dir, "<s> $A:0", "<s>", LLAMA_TEMPLATE)
    engine = _engine(version_dir)
    assert engine.encode("hello")[0] == bos_id  # the post-processor is in effect
    expected = _hf_chat_ids(version_dir)
    assert expected[0] == bos_id and expected[1] != bos_id
    assert engine.encode_chat(MESSAGES) == expected
    # What the server did before: render, then encode with the post-processor: BOS twice.
    assert engine.encode(engine.apply_chat_template(MESSAGES))[:2] == [bos_id, bos_id]


def test_gpt2_style_template_without_bos_gets_none_added(tmp_path: Path) -> None:
    build_tiny_gpt2(tmp_path)
    version_dir = tmp_path / "tiny-gpt2" / "1"
    bos_id = _with_post_processor(version_dir, "<|endoftext|> $A:0", "<|endoftext|>", CHAT_TEMPLATE)
    engine = _engine(version_dir)
    expected = _hf_chat_ids(version_dir)
    assert expected[0] != bos_id
    assert engine.encode_chat(MESSAGES) == expected


class CountingEnvironment(BoundedEnvironment):
    """The sandboxed environment, counting template compilations."""

    num_compiled = 0

    def from_string(self, *args: Any, **kwargs: Any) -> Any:
        CountingEnvironment.num_compiled += 1
        return super().from_string(*args, **kwargs)


def test_a_template_is_compiled_once_and_rendered_per_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("fulcrum.llm.chat_sandbox.BoundedEnvironment", CountingEnvironment)
    CountingEnvironment.num_compiled = 0
    chat = ChatTemplate(LLAMA_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    prompts = {chat.render(MESSAGES) for _ in range(5)}
    assert CountingEnvironment.num_compiled == 1
    assert prompts == {"<s>[INST] The quick brown fox? [/INST] Jumps over the lazy dog. </s>"
                       "[INST] And then? [/INST]"}  # fmt: skip


def test_template_errors_fail_the_load_or_only_the_request() -> None:
    with pytest.raises(ConfigError, match="chat_template does not compile"):
        ChatTemplate("{% for %}", {})
    chat = ChatTemplate("{{ raise_exception('roles must alternate') }}", {})
    with pytest.raises(InvalidInput, match="roles must alternate"):
        chat.render(MESSAGES)


def test_without_a_template_the_default_keeps_the_tokenizers_special_tokens() -> None:
    chat = ChatTemplate(None, {})
    assert chat.is_default
    assert chat.render([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
