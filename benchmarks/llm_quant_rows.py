"""What batch-invariant quantized layers cost: int8 and int4 engines on the Llama-3.2-1B-shaped
checkpoint of `llm_quant.py`, decode tokens/s at 1 and 8 sequences and prefill tokens/s, with
the fused kernel serving every row count (shipped: a row's bits never depend on the rows beside
it) against the previous split (fused up to 32 rows, a dequantized bf16 matmul above).

    .venv/bin/python benchmarks/llm_quant_rows.py [--layers 16] [--rounds 3] [--layer]

Both settings run in one process on the same engines, interleaved round by round (a
neighbour's load hits both alike); every round is printed with its ratio.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import llm_quant

from fulcrum.llm import quant, quant_int4
from fulcrum.llm.sync_engine import LLMEngine

SETTINGS = {"every row count (shipped)": None, "up to 32 rows (before)": 32}


def use(max_rows: int | None) -> None:
    quant.FUSED_MAX_ROWS = max_rows
    quant_int4.FUSED_MAX_ROWS = max_rows


def layer_times(rounds: int) -> None:
    """One 1B layer (8192x2048 and 2048x2048, int8 and int4 g128) at 1, 8 and 256 rows: the
    median of 5 calls per setting, settings interleaved, every round printed."""
    import statistics
    import time

    import torch

    for kind in ("int8", "int4"):
        for out_features, in_features in ((8192, 2048), (2048, 2048)):
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            layer: torch.nn.Module = (
                quant.Int8Linear.from_linear(linear)
                if kind == "int8"
                else quant_int4.Int4Linear.from_linear(linear, 128)
            )
            for num_rows in (1, 8, 256):
                x = torch.randn(num_rows, in_features)
                for round_num in range(1, rounds + 1):
                    found = {}
                    for label, max_rows in SETTINGS.items():
                        use(max_rows)
                        with torch.inference_mode():
                            layer(x)  # warm: the kernel's copy, the first dequantization
                            times = []
                            for _ in range(5):
                                start = time.perf_counter()
                                layer(x)
                                times.append(time.perf_counter() - start)
                        found[label] = statistics.median(times) * 1e3
                    shipped, before = found.values()
                    print(
                        f"  {kind} {out_features}x{in_features} rows {num_rows} round "
                        f"{round_num}: shipped {shipped:.2f} ms, before {before:.2f} ms, "
                        f"ratio {shipped / before:.2f}",
                        flush=True,
                    )
    use(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--variants", default="int8,int4")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/fulcrum-llm-quant"))
    parser.add_argument("--layer", action="store_true", help="one layer's matmul times only")
    args = parser.parse_args()
    if args.layer:
        layer_times(args.rounds)
        return
    version_dir = llm_quant.cached_checkpoint(args.cache, args.layers)
    rng = random.Random(0)
    engines: dict[str, LLMEngine] = {}
    for name in args.variants.split(","):
        params = llm_quant.engine_params(name, args.prefill_tokens)
        engines[name] = LLMEngine.from_checkpoint(version_dir, params)
        llm_quant.decode_step_s(engines[name], 1, rng, 4)  # warm-up: the kernels' copies
    for round_num in range(1, args.rounds + 1):
        for name, engine in engines.items():
            found = {}
            for label, max_rows in SETTINGS.items():
                use(max_rows)
                one = 1 / llm_quant.decode_step_s(engine, 1, rng, args.decode_tokens)
                eight = 8 / llm_quant.decode_step_s(engine, 8, rng, args.decode_tokens)
                prefill = args.prefill_tokens / llm_quant.prefill_s(
                    engine, rng, args.prefill_tokens
                )
                found[label] = (one, eight, prefill)
                print(
                    f"  round {round_num}: {name}, fused for {label}: decode@1 {one:.2f} "
                    f"decode@8 {eight:.2f} prefill {prefill:.1f} tok/s",
                    flush=True,
                )
            shipped, before = found.values()
            ratios = " / ".join(f"{s / b:.2f}" for s, b in zip(shipped, before, strict=True))
            print(f"  round {round_num}: {name} shipped/before (decode@1 / @8 / prefill) {ratios}")
    use(None)


if __name__ == "__main__":
    main()
