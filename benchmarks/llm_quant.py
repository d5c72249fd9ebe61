"""Float32 vs int8 vs int4 weight-only LLM on this CPU, LM head quantized or not, every variant
in one run: decode tokens/s at 1 and 8 sequences, prefill tokens/s, resident memory,
teacher-forced greedy agreement and the perplexity ratio.

    .venv/bin/python benchmarks/llm_quant.py [--layers 16] [--rounds 2] [--no-fidelity]

The model is a seeded random checkpoint of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32
heads, 8 KV heads, intermediate 8192, vocab 128256, tied head; `--layers` cuts it), written in
shards to `--cache` with its quantized files made by `fulcrum.llm.quant` (int4: groups of 128,
asymmetric), and reused by later runs (a marker file lists what was built). Variants: int8 and
int4 with the LM head int8 (what `fulcrum quantize` writes), float ("float head": the previous
files), and int4 (int4 head: all 4-bit). Random weights make perplexity meaningless in absolute
terms and the agreement a property of random logits, so the fidelity is also measured on
tiny-llama after `--trained-steps` steps of training on the shipped corpus (peaked logits, as a
trained model has). Speeds: the engines run interleaved rounds (a neighbour's load hits all
alike); each figure is the best round, and every round is printed with its ratios to float32 in
the same round. Resident memory: each variant loaded alone in a child process after a short
decode (steady VmRSS, and the peak VmHWM of loading). Prompts are random and the prefix cache
is off, so no step is a cache hit.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
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
from fulcrum.tuning.llm_fidelity import (
    LlmFidelity,
    greedy_continuations,
    perplexity,
    text_chunks,
    token_logits,
)
from fulcrum.tuning.quantize_llm import INT4_FILE, INT8_FILE

FLOAT = "float32"
# name -> (file, projections' precision, LM head's precision); "" is every float shard.
VARIANTS: dict[str, tuple[str, str, str]] = {
    FLOAT: ("", quant.NONE, quant.NONE),
    "int8 (float head)": ("model.int8-float-head.safetensors", quant.INT8, quant.NONE),
    "int8": (INT8_FILE, quant.INT8, quant.INT8),
    "int4 (float head)": ("model.int4-float-head.safetensors", quant.INT4, quant.NONE),
    "int4": (INT4_FILE, quant.INT4, quant.INT8),
    "int4 (int4 head)": ("model.int4-int4-head.safetensors", quant.INT4, quant.INT4),
}
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
MARKER = "built.json"
KV_CACHE_MB = 128  # 8 sequences of 32 tokens or one 256-token prefill: ~20 MB of the 1B's KV


def cached_checkpoint(cache: Path, layers: int) -> Path:
    """The version folder of the 1B-shape checkpoint with every variant's file: built once into
    `cache`, reused while its marker lists the same config and files."""
    version_dir = cache / f"llama-1b-{layers}l" / "1"
    config = {**LLAMA_1B, "num_hidden_layers": layers}
    wanted = {"config": config, "files": sorted(f for f, _, _ in VARIANTS.values() if f)}
    marker = version_dir / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        print(f"  reusing the {layers}-layer checkpoint in {version_dir}")
        return version_dir
    version_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    start = time.perf_counter()
    write_float(version_dir, config)
    write_variants(version_dir, "model-*.safetensors")
    marker.write_text(json.dumps(wanted))
    print(f"  built the {layers}-layer checkpoint in {time.perf_counter() - start:.0f} s")
    return version_dir


def write_float(version_dir: Path, config: dict[str, Any]) -> None:
    """The random float checkpoint: one shard per layer, N(0, 0.02) weights, unit norms (drawn
    in parameter order from one seeded generator; a shard is written once it is complete)."""
    from safetensors.torch import save_file

    from fulcrum.llm.models import build_model

    write_tokenizer(version_dir, bos="<s>", eos="</s>")
    (version_dir / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        shapes = {k: p.shape for k, p in build_model(config).named_parameters()}
    shard_of = {k: k.split(".")[2] if k.startswith("model.layers.") else "rest" for k in shapes}
    remaining = {
        shard: sum(1 for s in shard_of.values() if s == shard) for shard in shard_of.values()
    }
    gen = torch.Generator().manual_seed(0)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for key, shape in shapes.items():
        shard = shard_of[key]
        value = (
            torch.ones(shape)
            if key.endswith("norm.weight")
            else torch.randn(shape, generator=gen) * 0.02
        )
        shards.setdefault(shard, {})[key] = value
        remaining[shard] -= 1
        if not remaining[shard]:
            path = version_dir / f"model-{shard}.safetensors"
            save_file(shards.pop(shard), str(path), {"format": "pt"})


def write_variants(version_dir: Path, source: str) -> None:
    """Every quantized variant's file, each from a fresh load of the float weights."""
    for file, precision, head in VARIANTS.values():
        if not file:
            continue
        module = load_checkpoint(version_dir).model
        quant.quantize_model(module, precision, lm_head=head)
        quant.save_quantized(module, version_dir / file, source=source)
        del module
        gc.collect()


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


def engine_params(name: str, prefill_tokens: int) -> EngineParams:
    return EngineParams(
        model_file=VARIANTS[name][0],
        device="cpu",
        kv_cache_memory_mb=KV_CACHE_MB,
        enable_prefix_caching=False,
        max_num_batched_tokens=max(512, prefill_tokens),
    )


def speeds(version_dir: Path, args: argparse.Namespace) -> dict[str, list[tuple[float, ...]]]:
    """Per variant, per round: (decode tok/s at 1, decode tok/s at 8, prefill tok/s)."""
    rng = random.Random(0)
    engines = {}
    for name in reversed(VARIANTS):  # the float one last: the largest load peak
        engines[name] = LLMEngine.from_checkpoint(
            version_dir, engine_params(name, args.prefill_tokens)
        )
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
                f"decode@8 {eight:.2f} prefill {prefill:.1f}",
                flush=True,
            )
    return rounds


def resident_mb(version_dir: Path, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Per variant, loaded alone in a child process: (steady RSS, peak RSS) in MB."""
    found = {}
    for name in VARIANTS:
        command = [sys.executable, __file__, "--rss-child", name, "--dir", str(version_dir)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rss = json.loads(out.strip().splitlines()[-1])
        found[name] = (rss["rss_mb"], rss["peak_mb"])
        print(f"  {name}: RSS {rss['rss_mb']:.0f} MB (peak {rss['peak_mb']:.0f} MB)", flush=True)
    return found


def rss_child(name: str, version_dir: Path) -> None:
    """Load one variant, decode a few tokens, print its RSS figures as JSON (the child side)."""
    engine = LLMEngine.from_checkpoint(version_dir, engine_params(name, 256))
    decode_step_s(engine, 1, random.Random(0), 4)
    gc.collect()
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    kb = {key: float(status[key].split()[0]) for key in ("VmRSS", "VmHWM")}
    print(json.dumps({"rss_mb": kb["VmRSS"] / 1024, "peak_mb": kb["VmHWM"] / 1024}))


def fidelity(
    version_dir: Path, num_prompts: int, tokens: int, chunks: int
) -> dict[str, LlmFidelity]:
    """Teacher-forced agreement and perplexity ratio of each quantized variant against float
    (as `compare_llms`, with the reference's continuations, picks and perplexity computed once
    for all variants)."""
    cpu = torch.device("cpu")
    reference = load_checkpoint(version_dir)
    prompts, text = samples(reference, num_prompts, chunks)
    params = EngineParams(device="cpu", kv_cache_memory_mb=256, enable_prefix_caching=False)
    continuations = greedy_continuations(reference, params, prompts, tokens)
    sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
    starts = [len(p) - 1 for p in prompts]  # the row that predicts each first new token
    want = greedy_picks(reference.model, sequences, starts)
    ppl_reference = perplexity(reference.model, text, cpu)
    del reference
    gc.collect()
    found = {}
    for name, (file, _, _) in VARIANTS.items():
        if not file:
            continue
        variant = load_checkpoint(version_dir, model_file=file).model
        same = [g == w for g, w in zip(greedy_picks(variant, sequences, starts), want, strict=True)]
        per_prompt = [float(m.float().mean()) for m in same]
        num_tokens = sum(len(c) for c in continuations)
        found[name] = LlmFidelity(
            agreement=sum(int(m.sum()) for m in same) / num_tokens,
            worst_prompt=min(per_prompt),
            num_tokens=num_tokens,
            perplexity_reference=ppl_reference,
            perplexity_variant=perplexity(variant, text, cpu),
            num_text_tokens=sum(len(c) - 1 for c in text),
        )
        print(f"  {name}: agreement {found[name].agreement:.3f}", flush=True)
        del variant
        gc.collect()
    return found


def greedy_picks(model: Any, sequences: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
    """Per sequence, the argmax token at each position from `start` to the last but one."""
    cpu = torch.device("cpu")
    return [
        token_logits(model, ids, cpu)[start : len(ids) - 1].argmax(-1)
        for ids, start in zip(sequences, starts, strict=True)
    ]


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
    write_variants(version_dir, "model.safetensors")
    return version_dir


def report(
    rounds: dict[str, list[tuple[float, ...]]],
    found: dict[str, dict[str, LlmFidelity]],
    rss: dict[str, tuple[float, float]],
) -> None:
    print("\nratios to float32 in the same round (decode @1 / decode @8 / prefill):")
    for name, runs in rounds.items():
        ratios = [
            " / ".join(f"{v / f:.2f}" for v, f in zip(run, ref, strict=True))
            for run, ref in zip(runs, rounds[FLOAT], strict=True)
        ]
        print(f"  {name}: " + "; ".join(ratios))
    print(
        "\n| variant | RSS MB (peak) | decode tok/s @1 | decode tok/s @8 | prefill tok/s "
        "| agreement (random 1B) | ppl ratio (random 1B) | agreement (trained tiny) "
        "| ppl ratio (trained tiny) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = [max(r[i] for r in rounds[FLOAT]) for i in range(3)]
    for name in VARIANTS:
        best = [max(r[i] for r in rounds[name]) for i in range(3)]
        cells = [f"{b:.2f} (x{b / f:.2f})" for b, f in zip(best, base, strict=True)]
        memory = [f"{rss[name][0]:.0f} ({rss[name][1]:.0f})" if name in rss else "-"]
        extra = [c for kind in ("random", "trained") for c in _fidelity_cells(found, kind, name)]
        print(f"| {name} | " + " | ".join(memory + cells + extra) + " |")


def _fidelity_cells(found: dict[str, dict[str, LlmFidelity]], kind: str, name: str) -> list[str]:
    if kind not in found:
        return ["-", "-"]  # not measured in this run (--no-fidelity)
    f = found[kind].get(name)
    if f is None:
        return ["1 (reference)", "1"]
    return [f"{f.agreement:.3f} (worst {f.worst_prompt:.3f})", f"{f.perplexity_ratio:.4f}"]


def parse_args() -> argparse.Namespace:
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
    parser.add_argument("--no-rss", action="store_true", help="skip the resident-memory children")
    parser.add_argument(
        "--cache", type=Path, default=Path("/tmp/fulcrum-llm-quant"), help="checkpoint folder"
    )
    parser.add_argument("--rss-child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.rss_child:
        rss_child(args.rss_child, args.dir)
        return
    torch.manual_seed(0)
    found: dict[str, dict[str, LlmFidelity]] = {}
    if not args.no_fidelity:
        with tempfile.TemporaryDirectory() as scratch:
            tiny = train_tiny(Path(scratch) / "tiny", args.trained_steps)
            found["trained"] = fidelity(tiny, args.prompts, args.agreement_tokens, 8)
    version_dir = cached_checkpoint(args.cache, args.layers)
    if not args.no_fidelity:
        found["random"] = fidelity(version_dir, args.prompts, args.agreement_tokens, args.chunks)
    gc.collect()
    rss = {} if args.no_rss else resident_mb(version_dir, args)
    rounds = speeds(version_dir, args)
    sizes = {
        n: sum(p.stat().st_size for p in version_dir.glob(f or "model-*.safetensors"))
        for n, (f, _, _) in VARIANTS.items()
    }
    print(
        f"\nmodel: Llama-3.2-1B shape, {args.layers} layers, random weights; files (MB): "
        + ", ".join(f"{n} {s / 1e6:.0f}" for n, s in sizes.items())
    )
    report(rounds, found, rss)


if __name__ == "__main__":
    main()
