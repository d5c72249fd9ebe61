"""Float32 vs int8 vs int4 weight-only LLM on this CPU, all three in one run: decode tokens/s at
1 and 8 sequences, prefill tokens/s, teacher-forced greedy agreement and the perplexity ratio.

    .venv/bin/python benchmarks/llm_quant.py [--layers 16] [--rounds 2] [--trained-steps 300]

The model is a seeded random checkpoint of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32
heads, 8 KV heads, intermediate 8192, vocab 128256, tied head; `--layers` cuts it), written in
shards to a temporary folder, with its `model.int8.safetensors` and `model.int4.safetensors`
(groups of 128, asymmetric) made by `fulcrum.llm.quant`. Random weights make perplexity
meaningless in absolute terms and the agreement a property of random logits, so the fidelity is
also measured on tiny-llama after `--trained-steps` steps of training on the shipped corpus
(peaked logits, as a trained model has). Speeds: the engines run interleaved rounds (a
neighbour's load hits all three alike); each figure is the best round, and every round is
printed. Prompts are random and the prefix cache is off, so no step is a cache hit.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fulcrum.llm import quant
from fulcrum.llm.example_corpus import CORPUS
from fulcrum.llm.examples import build_tiny_llama, write_tokenizer
from fulcrum.llm.loader import LoadedLLM, load_checkpoint
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.sync_engine import LLMEngine
from fulcrum.tuning.llm_fidelity import LlmFidelity, compare_llms, text_chunks
from fulcrum.tuning.quantize_llm import INT4_FILE, INT8_FILE

FILES = {"float32": "", "int8": INT8_FILE, "int4": INT4_FILE}
LLAMA_1B = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def build(version_dir: Path, layers: int) -> dict[str, Any]:
    """The random checkpoint (one shard per layer, N(0, 0.02) weights, unit norms) and its
    quantized twins."""
    from safetensors.torch import save_file

    from fulcrum.llm.models import build_model

    write_tokenizer(version_dir, bos="<s>", eos="</s>")
    config = {**LLAMA_1B, "num_hidden_layers": layers}
    (version_dir / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        shapes = {k: p.shape for k, p in build_model(config).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for key, shape in shapes.items():
        shard = key.split(".")[2] if key.startswith("model.layers.") else "rest"
        value = (
            torch.ones(shape)
            if key.endswith("norm.weight")
            else torch.randn(shape, generator=gen) * 0.02
        )
        shards.setdefault(shard, {})[key] = value
    for shard, tensors in shards.items():
        save_file(tensors, str(version_dir / f"model-{shard}.safetensors"), {"format": "pt"})
    del shards
    for precision, file in (("int8", INT8_FILE), ("int4", INT4_FILE)):
        module = load_checkpoint(version_dir).model
        names = quant.quantizable_linears(module)  # type: ignore[arg-type]
        quant.replace_linears(module, names, quantize=True, precision=precision)  # type: ignore[arg-type]
        quant.save_quantized(module, version_dir / file, source="model-*.safetensors")  # type: ignore[arg-type]
        del module
        gc.collect()
    return config


def decode_step_s(engine: LLMEngine, num_seqs: int, rng: random.Random, tokens: int) -> float:
    """The median decode step of `num_seqs` sequences generating `tokens` tokens each."""
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", [rng.randrange(2, 500) for _ in range(16)], sampling)
    engine.step()  # the prefill
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return statistics.median(steps)


def prefill_s(engine: LLMEngine, rng: random.Random, num_tokens: int) -> float:
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("p", [rng.randrange(2, 500) for _ in range(num_tokens)], sampling)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def speeds(version_dir: Path, args: argparse.Namespace) -> dict[str, list[tuple[float, ...]]]:
    """Per variant, per round: (decode tok/s at 1, decode tok/s at 8, prefill tok/s)."""
    rng = random.Random(0)
    engines = {}
    for name in ("int4", "int8", "float32"):  # the float one last: the largest load peak
        params = EngineParams(
            model_file=FILES[name],
            device="cpu",
            kv_cache_memory_mb=256,
            enable_prefix_caching=False,
            max_num_batched_tokens=max(512, args.prefill_tokens),
        )
        engines[name] = LLMEngine.from_checkpoint(version_dir, params)
        decode_step_s(engines[name], 1, rng, 4)  # warm-up (builds the int4 kernel copies)
    rounds: dict[str, list[tuple[float, ...]]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            one = 1 / decode_step_s(engine, 1, rng, args.decode_tokens)
            eight = 8 / decode_step_s(engine, 8, rng, args.decode_tokens)
            prefill = args.prefill_tokens / prefill_s(engine, rng, args.prefill_tokens)
            rounds[name].append((one, eight, prefill))
            print(
                f"  round {len(rounds[name])}: {name} decode@1 {one:.2f} "
                f"decode@8 {eight:.2f} prefill {prefill:.1f}"
            )
    return rounds


def fidelity(
    version_dir: Path, num_prompts: int, tokens: int, chunks: int
) -> dict[str, LlmFidelity]:
    """Teacher-forced agreement and perplexity ratio of int8 and int4 against float32."""
    reference = load_checkpoint(version_dir)
    prompts, text = samples(reference, num_prompts, chunks)
    params = EngineParams(device="cpu", kv_cache_memory_mb=256, enable_prefix_caching=False)
    found = {}
    for name in ("int8", "int4"):
        variant = load_checkpoint(version_dir, model_file=FILES[name])
        found[name] = compare_llms(reference, variant, params, prompts, text, num_tokens=tokens)
        del variant
        gc.collect()
    return found


def samples(
    loaded: LoadedLLM, num_prompts: int, chunks: int
) -> tuple[list[list[int]], list[list[int]]]:
    """As `fulcrum quantize`: the first 8 words of the corpus's lines, and the corpus itself."""
    lines = [line.split() for line in CORPUS.splitlines() if len(line.split()) > 1]
    prompts = [loaded.tokenizer.encode(" ".join(w[:8])).ids for w in lines[:num_prompts]]
    return prompts, text_chunks(list(loaded.tokenizer.encode(CORPUS).ids), 128, chunks)


def train_tiny(directory: Path, steps: int) -> Path:
    """tiny-llama trained `steps` AdamW steps on the corpus (next-token loss), saved in place."""
    from safetensors.torch import save_file

    from fulcrum.tuning.llm_fidelity import token_logits

    build_tiny_llama(directory)
    version_dir = directory / "tiny-llama" / "1"
    loaded = load_checkpoint(version_dir)
    module: torch.nn.Module = loaded.model  # type: ignore[assignment]
    ids = list(loaded.tokenizer.encode(CORPUS).ids)
    chunks = text_chunks(ids, 128, 64)
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)
    cpu = torch.device("cpu")
    for step in range(steps):
        chunk = chunks[step % len(chunks)]
        with torch.enable_grad():
            logits = token_logits.__wrapped__(loaded.model, chunk, cpu)  # type: ignore[attr-defined]
            loss = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(chunk[1:]))
            last_loss = float(loss.detach())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    print(f"  tiny-llama trained {steps} steps: last loss {last_loss:.3f}")
    tensors = {k: v.detach().contiguous() for k, v in module.named_parameters()}
    save_file(tensors, str(version_dir / "model.safetensors"), {"format": "pt"})
    for precision, file in (("int8", INT8_FILE), ("int4", INT4_FILE)):
        module = load_checkpoint(version_dir).model  # type: ignore[assignment]
        names = quant.quantizable_linears(module)
        quant.replace_linears(module, names, quantize=True, precision=precision)
        quant.save_quantized(module, version_dir / file, source="model.safetensors")
    return version_dir


def report(
    rounds: dict[str, list[tuple[float, ...]]], found: dict[str, dict[str, LlmFidelity]]
) -> None:
    print(
        "| variant | decode tok/s @1 | decode tok/s @8 | prefill tok/s | agreement (random 1B) "
        "| ppl ratio (random 1B) | agreement (trained tiny) | ppl ratio (trained tiny) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = [max(r[i] for r in rounds["float32"]) for i in range(3)]
    for name, runs in rounds.items():
        best = [max(r[i] for r in runs) for i in range(3)]
        cells = [f"{b:.2f} (x{b / f:.2f})" for b, f in zip(best, base, strict=True)]
        extra = [c for kind in ("random", "trained") for c in _fidelity_cells(found, kind, name)]
        print(f"| {name} | " + " | ".join(cells + extra) + " |")


def _fidelity_cells(found: dict[str, dict[str, LlmFidelity]], kind: str, name: str) -> list[str]:
    if kind not in found:
        return ["-", "-"]  # not measured in this run (--no-fidelity)
    f = found[kind].get(name)
    if f is None:
        return ["1 (reference)", "1"]
    return [f"{f.agreement:.3f} (worst {f.worst_prompt:.3f})", f"{f.perplexity_ratio:.4f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--agreement-tokens", type=int, default=32)
    parser.add_argument("--trained-steps", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=4, help="128-token chunks for perplexity")
    parser.add_argument("--no-fidelity", action="store_true", help="speeds only (a repeat)")
    args = parser.parse_args()
    torch.manual_seed(0)
    found: dict[str, dict[str, LlmFidelity]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        if not args.no_fidelity:
            tiny = train_tiny(Path(scratch) / "tiny", args.trained_steps)
            found["trained"] = fidelity(tiny, args.prompts, args.agreement_tokens, 8)
        version_dir = Path(scratch) / "1b" / "1"
        version_dir.mkdir(parents=True)
        start = time.perf_counter()
        config = build(version_dir, args.layers)
        print(
            f"  built {args.layers}-layer 1B-shape checkpoint "
            f"in {time.perf_counter() - start:.0f} s"
        )
        if not args.no_fidelity:
            found["random"] = fidelity(
                version_dir, args.prompts, args.agreement_tokens, args.chunks
            )
        gc.collect()
        rounds = speeds(version_dir, args)
        sizes = {
            n: sum(p.stat().st_size for p in version_dir.glob(f or "model-*.safetensors"))
            for n, f in FILES.items()
        }
    print(
        f"model: Llama-3.2-1B shape, {config['num_hidden_layers']} layers, random weights; "
        f"files (MB): " + ", ".join(f"{n} {s / 1e6:.0f}" for n, s in sizes.items())
    )
    report(rounds, found)


if __name__ == "__main__":
    main()
