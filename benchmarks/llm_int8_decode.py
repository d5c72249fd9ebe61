"""Int8 weight-only vs float LLM steps on this CPU: one decode step of 1 and of 8 sequences and a
256-token prefill, for float32 and bfloat16 activations.

    .venv/bin/python benchmarks/llm_int8_decode.py [--hidden 1024] [--intermediate 2816]
        [--layers 4] [--rounds 3] [--num-threads 0]

Builds a seeded random Llama checkpoint of the given shape in a temporary folder (and its
`model.int8.safetensors` with `fulcrum.llm.quant`), loads the four engines once, then measures
them in interleaved rounds (so a neighbour's load hits all four alike) and prints each one's
minimum over the rounds: the median decode step of a 32-token greedy run, and the prefill time.
Prompts are random and the prefix cache is off, so no step is a cache hit.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from fulcrum.llm import quant
from fulcrum.llm.examples import _write_checkpoint, write_tokenizer
from fulcrum.llm.loader import load_checkpoint
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.sync_engine import LLMEngine
from fulcrum.tuning.quantize_llm import INT8_FILE


def build(version_dir: Path, hidden: int, intermediate: int, layers: int) -> None:
    vocab = write_tokenizer(version_dir, bos="<s>", eos="</s>")
    heads = max(1, hidden // 64)
    config = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    _write_checkpoint(version_dir, config, 0)
    module = load_checkpoint(version_dir).model
    quant.replace_linears(module, quant.quantizable_linears(module), quantize=True)  # type: ignore[arg-type]
    quant.save_quantized(module, version_dir / INT8_FILE, source="model.safetensors")  # type: ignore[arg-type]


def decode_ms(engine: LLMEngine, num_seqs: int, rng: random.Random) -> float:
    sampling = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", [rng.randrange(2, 500) for _ in range(16)], sampling)
    engine.step()  # the prefill
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return statistics.median(steps) * 1000


def prefill_ms(engine: LLMEngine, rng: random.Random, num_tokens: int = 256) -> float:
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("p", [rng.randrange(2, 500) for _ in range(num_tokens)], sampling)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as scratch:
        version_dir = Path(scratch) / "1"
        version_dir.mkdir()
        build(version_dir, args.hidden, args.intermediate, args.layers)
        engines = {}
        for dtype in ("float32", "bfloat16"):
            for kind, model_file in (("float", "model.safetensors"), ("int8", INT8_FILE)):
                params = EngineParams(
                    dtype=dtype,
                    model_file=model_file,
                    device="cpu",
                    kv_cache_memory_mb=64,
                    enable_prefix_caching=False,
                    num_threads=args.num_threads,
                )
                engines[(dtype, kind)] = engine = LLMEngine.from_checkpoint(version_dir, params)
                decode_ms(engine, 1, rng)  # warm-up
        figures: dict[tuple[str, str], list[list[float]]] = {k: [[], [], []] for k in engines}
        for _ in range(args.rounds):
            for key, engine in engines.items():
                figures[key][0].append(decode_ms(engine, 1, rng))
                figures[key][1].append(decode_ms(engine, 8, rng))
                figures[key][2].append(prefill_ms(engine, rng))
    shape = f"{args.hidden}x{args.intermediate}x{args.layers}"
    print(f"| model {shape} | decode 1 seq ms | decode 8 seqs ms (tok/s) | prefill 256 ms |")
    print("| --- | --- | --- | --- |")
    for (dtype, kind), (one, eight, prefill) in figures.items():
        print(
            f"| {dtype} {kind} | {min(one):.2f} | {min(eight):.2f} ({8000 / min(eight):.0f}) "
            f"| {min(prefill):.1f} |"
        )


if __name__ == "__main__":
    main()
