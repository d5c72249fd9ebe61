"""Tiny offline LLMs for the example repository: seeded random weights written as a Hugging Face
checkpoint (config.json, model.safetensors, tokenizer.json, tokenizer_config.json). Needs only
torch, safetensors and tokenizers: transformers is not required to build them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fulcrum.llm.example_corpus import CORPUS

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ENGINE_PARAMETERS = """\
[parameters]
block_size = 16
kv_cache_memory_mb = 64
max_num_seqs = 64
# The latency/throughput dial: tokens computed per engine step (see fulcrum.llm.params).
max_num_batched_tokens = 512
max_num_waiting = 512
enable_prefix_caching = true
dtype = "float32"
"""

# Served on a 2-core machine under 16-64 concurrent streams, the engine in its own process gave
# more tokens/s and a lower ITL than the engine thread (benchmarks/llm_served.py, README).
ENGINE_PROCESS = """\
# Step the engine in a process of its own, beside the HTTP server (see fulcrum.llm.params).
engine_process = true
"""


def build_tokenizer(special_tokens: list[str], vocab_size: int = 512) -> Any:
    """A byte-level BPE trained on the shipped corpus; any text encodes, none is unknown."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tokenizer


def write_tokenizer(
    version_dir: Path, *, bos: str, eos: str, extra: list[str] | None = None
) -> int:
    """tokenizer.json + tokenizer_config.json (with a chat template); returns the vocab size."""
    specials = list(dict.fromkeys([bos, eos, *(extra or [])]))
    tokenizer = build_tokenizer(specials)
    tokenizer.save(str(version_dir / "tokenizer.json"))
    tok_config = {"bos_token": bos, "eos_token": eos, "chat_template": CHAT_TEMPLATE}
    (version_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return int(tokenizer.get_vocab_size())


def build_tiny_gpt2(directory: Path, *, name: str = "tiny-gpt2", seed: int = 0) -> str:
    """Write `<directory>/<name>/` (config.toml + 1/ checkpoint); returns the model name."""
    version_dir = _model_dir(directory, name)
    vocab_size = write_tokenizer(version_dir, bos="<|endoftext|>", eos="<|endoftext|>")
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": vocab_size,
        "n_positions": 512,
        "n_ctx": 512,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    _write_checkpoint(version_dir, config, seed)
    return name


def build_tiny_llama(
    directory: Path, *, name: str = "tiny-llama", seed: int = 0, engine_process: bool = False
) -> str:
    """Write `<directory>/<name>/` (config.toml + 1/ checkpoint); returns the model name.
    engine_process: the config steps the engine in a process of its own (the example
    repository's choice: see ENGINE_PROCESS)."""
    version_dir = _model_dir(directory, name, ENGINE_PROCESS if engine_process else "")
    vocab_size = write_tokenizer(version_dir, bos="<s>", eos="</s>")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }
    _write_checkpoint(version_dir, config, seed)
    return name


def _model_dir(directory: Path, name: str, extra: str = "") -> Path:
    version_dir = directory / name / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    config = f'platform = "llm"\n\n{ENGINE_PARAMETERS}{extra}'
    (directory / name / "config.toml").write_text(config)
    return version_dir


def _write_checkpoint(version_dir: Path, config: dict[str, Any], seed: int) -> None:
    from safetensors.torch import save_file

    from fulcrum.llm.models import build_model

    (version_dir / "config.json").write_text(json.dumps(config, indent=2))
    (version_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    )
    model = build_model(config)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, param in model.named_parameters():  # a tied head is listed once
            if key.endswith("norm.weight") or ".ln_" in key:
                param.fill_(1.0) if key.endswith("weight") else param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
            tensors[key] = param.detach().clone()
            if any(key.endswith(s) for s in getattr(model, "transposed_weights", ())):
                tensors[key] = tensors[key].t().contiguous()  # GPT-2 stores Conv1D (in, out)
    save_file(tensors, str(version_dir / "model.safetensors"), metadata={"format": "pt"})
