"""Decode speed of the newer model families, each beside its natural baseline, in one run:
a Qwen3-MoE (8 experts top-2, and 16 experts top-4) against a dense Qwen3 of the same active MLP
width, and Gemma 2 with attention/final-logit soft-capping against the same weights uncapped.

Random checkpoints (hidden 512, 4 layers, 8 heads / 4 KV heads, vocab 512) are written to a
temporary folder with the engine's own module names. The figure is output tokens per CPU second
of this process (`time.process_time`), one torch thread, prefill step excluded: on a shared
machine wall time swings several-fold while CPU time stays comparable. Configs are interleaved
within each repeat.

    .venv/bin/python benchmarks/llm_families.py [--repeats 3] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from fulcrum.llm.examples import write_tokenizer
from fulcrum.llm.loader import load_checkpoint
from fulcrum.llm.models import build_model
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.sync_engine import LLMEngine

BASE = {
    "vocab_size": 512, "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}  # fmt: skip
MOE = {"moe_intermediate_size": 512, "num_experts": 8, "num_experts_per_tok": 2}
CONFIGS: dict[str, dict[str, object]] = {
    "qwen3-dense": {"model_type": "qwen3", "intermediate_size": 1024},
    "qwen3-moe8": {"model_type": "qwen3_moe", "intermediate_size": 1024, **MOE,
                   "norm_topk_prob": True},
    "qwen3-moe16": {"model_type": "qwen3_moe", "intermediate_size": 1024,
                    "moe_intermediate_size": 256, "num_experts": 16, "num_experts_per_tok": 4,
                    "norm_topk_prob": True},
    "gemma2-capped": {"model_type": "gemma2", "intermediate_size": 1024, "sliding_window": 4096,
                      "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma2-uncapped": {"model_type": "gemma2", "intermediate_size": 1024,
                        "sliding_window": 4096, "attn_logit_softcapping": None,
                        "final_logit_softcapping": None},
}  # fmt: skip
PAIRS = [("qwen3-moe8", "qwen3-dense"), ("qwen3-moe16", "qwen3-dense"),
         ("gemma2-capped", "gemma2-uncapped")]  # fmt: skip


def write_checkpoint(directory: Path, config: dict[str, object]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory, bos="<s>", eos="</s>")
    (directory / "config.json").write_text(json.dumps(config))
    model = build_model(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        tensors = {
            key: (torch.randn(p.shape, generator=gen) * 0.05).contiguous()
            for key, p in model.named_parameters()
        }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def decode_rate(directory: Path, num_seqs: int, num_new: int) -> float:
    """Output tokens per CPU second of `num_seqs` greedy sequences (16-token random prompts)."""
    params = EngineParams(num_kv_blocks=2048, max_num_seqs=256, num_threads=1)
    engine = LLMEngine(load_checkpoint(directory), params)
    gen = torch.Generator().manual_seed(0)
    sampling = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(str(i), torch.randint(2, 400, (16,), generator=gen).tolist(), sampling)
    engine.step()  # the prefill
    num_tokens = 0
    start = time.process_time()
    while engine.has_unfinished():
        num_tokens += sum(len(out.new_token_ids) for out in engine.step())
    return num_tokens / (time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in CONFIGS.items():
            write_checkpoint(Path(tmp) / name, {**BASE, **extra})
        print(f"output tokens per CPU second, {args.new_tokens} new tokens, 1 torch thread")
        print(f"{'seqs':>4} {'model':<16} {'tok/CPU-s':>10} {'baseline':<16} {'tok/CPU-s':>10} "
              f"{'ratio':>6}")  # fmt: skip
        for num_seqs in (1, 32):
            for _ in range(args.repeats):
                for name, base in PAIRS:
                    rate = decode_rate(Path(tmp) / name, num_seqs, args.new_tokens)
                    base_rate = decode_rate(Path(tmp) / base, num_seqs, args.new_tokens)
                    print(f"{num_seqs:>4} {name:<16} {rate:>10.0f} {base:<16} {base_rate:>10.0f} "
                          f"{rate / base_rate:>6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
