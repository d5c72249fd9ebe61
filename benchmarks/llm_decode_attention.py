"""The in-place paged decode attention alone (`decode_kernel.paged_decode`), at the engine's shapes.

    .venv/bin/python benchmarks/llm_decode_attention.py [--seqs 256] [--contexts 16-384]
        [--shapes 2x2x16,8x4x64] [--layouts engine,scattered] [--block-size 16] [--layers 2]
        [--rounds 30] [--threads 1]
        [--baseline OTHER/decode_kernel.py]

Each shape is KV heads x query heads per KV head x head dim: 2x2x16 is tiny-llama's, 8x4x64 a
1B-class model's (Llama 3.2 1B). Each sequence gets a context drawn uniformly from --contexts, in
blocks laid out as --layouts says (`_tables`); --layers pools are read in turn, as a step's
layers do (so one layer's keys are not still in cache for the next). A call's cost is the
calling thread's CPU time (`time.thread_time`), which a neighbour's load on a shared machine
moves less than wall time. --baseline loads another copy of decode_kernel.py (the tree before a
change) under its own module name and runs it interleaved with this one, call by call: the
printed ratio is the median over rounds of this / baseline (below 1: this is cheaper), and
the two outputs are compared.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from fulcrum.llm.models import decode_kernel


@dataclass(frozen=True)
class Case:
    """One layer's decode attention inputs."""

    q: torch.Tensor  # (B, Hkv, G, D)
    k_cache: torch.Tensor  # (Hkv, num_blocks, block_size, D)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (B, max_blocks)
    context_lens: torch.Tensor  # (B,)


def build_cases(
    shape: tuple[int, int, int], args: argparse.Namespace, gen: torch.Generator
) -> list[Case]:
    """A case per layer: the same tables and lengths, each layer its own pool and queries."""
    num_kv_heads, group, head_dim = shape
    low, high = args.context_range
    lens = torch.randint(low, high + 1, (args.seqs,), generator=gen)
    tables = _tables(lens, args.block_size, args.layout, gen)
    pool = (num_kv_heads, int(tables.max()) + 1, args.block_size, head_dim)
    return [
        Case(
            torch.randn(args.seqs, num_kv_heads, group, head_dim, generator=gen),
            torch.randn(pool, generator=gen),
            torch.randn(pool, generator=gen),
            tables,
            lens,
        )
        for _ in range(args.layers)
    ]


def _tables(lens: torch.Tensor, block_size: int, layout: str, gen: torch.Generator) -> torch.Tensor:
    """(B, max_blocks) block tables. "scattered": every block anywhere in the pool (a long-running
    server's free list). "engine": as this workload leaves them when all requests arrive at once:
    each prompt's blocks in a row (a prompt of 16-256 tokens, prefilled in one piece), then one
    block per sequence in turn as the decodes grow."""
    num_blocks = ((lens + block_size - 1) // block_size).tolist()
    if layout == "scattered":
        order = torch.randperm(sum(num_blocks), generator=gen).tolist()
        rows = [[order.pop() for _ in range(n)] for n in num_blocks]
    else:
        prompt_lens = torch.minimum(lens, torch.randint(16, 257, lens.shape, generator=gen))
        rows = [[] for _ in num_blocks]
        for i in torch.randperm(len(rows), generator=gen).tolist():
            first = sum(map(len, rows))
            rows[i] = list(range(first, first + -(-int(prompt_lens[i]) // block_size)))
        next_block = sum(map(len, rows))
        while any(len(row) < n for row, n in zip(rows, num_blocks, strict=True)):
            for row, n in zip(rows, num_blocks, strict=True):
                if len(row) < n:
                    row.append(next_block)
                    next_block += 1
    tables = torch.zeros(len(rows), max(num_blocks), dtype=torch.int64)
    for i, row in enumerate(rows):
        tables[i, : len(row)] = torch.tensor(row)
    return tables


def load_baseline(path: Path) -> ModuleType:
    """Another decode_kernel.py, imported as `baseline_decode_kernel` from a copy in a temporary
    folder: numba's disk cache sits beside the file and names its module, so the copy keeps the
    other tree's own cache (for its own module name) intact."""
    if not path.is_file():
        raise SystemExit(f"--baseline {path}: no such file")
    folder = Path(tempfile.mkdtemp())
    shutil.copy(path, folder / "baseline_decode_kernel.py")
    sys.path.insert(0, str(folder))
    return importlib.import_module("baseline_decode_kernel")


def one_step(kernel: ModuleType, cases: list[Case], scale: float) -> tuple[float, torch.Tensor]:
    """CPU seconds per layer of running every layer's case once, and the last layer's output."""
    started = time.thread_time()
    for case in cases:
        out: torch.Tensor = kernel.paged_decode(
            case.q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, scale
        )
    return (time.thread_time() - started) / len(cases), out


def measure(
    kernels: dict[str, ModuleType], cases: list[Case], rounds: int
) -> dict[str, list[float]]:
    """Per kernel, the per-layer CPU ms of each round; kernels alternate within a round."""
    scale = cases[0].q.shape[-1] ** -0.5
    outs: dict[str, torch.Tensor] = {}
    for name, kernel in kernels.items():  # compile (or load) and warm each once
        outs[name] = one_step(kernel, cases, scale)[1]
    first = next(iter(outs.values()))
    for name, out in outs.items():
        difference = (out - first).abs().max().item()
        print(f"  {name}: max |output - {next(iter(outs))}'s| = {difference:.2e}")
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, kernel in kernels.items():
            times[name].append(one_step(kernel, cases, scale)[0] * 1e3)
    return times


def _report(times: dict[str, list[float]]) -> None:
    names = list(times)
    for name in names:
        ms = times[name]
        print(f"  {name:9s} ms per layer: min {min(ms):.3f}  median {statistics.median(ms):.3f}")
    if len(names) == 2:
        ratios = [a / b for a, b in zip(times[names[1]], times[names[0]], strict=True)]
        quartiles = statistics.quantiles(ratios, n=4)
        print(
            f"  {names[1]} / {names[0]}: median {statistics.median(ratios):.3f} "
            f"(quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}) over {len(ratios)} rounds"
        )


def _parse_shape(text: str) -> tuple[int, int, int]:
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected KVHEADSxGROUPxHEADDIM")
    return int(parts[0]), int(parts[1]), int(parts[2])


def _parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        raise argparse.ArgumentTypeError(f"contexts {text!r}: expected LOW-HIGH, 1 <= LOW <= HIGH")
    return int(low), int(high)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--contexts", dest="context_range", type=_parse_range, default="16-384")
    parser.add_argument(
        "--shapes",
        default="2x2x16,8x4x64",
        help="comma-separated KVHEADSxGROUPxHEADDIM (tiny-llama's; a 1B-class model's)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layouts", default="engine,scattered", help="block layouts to run")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", type=Path, help="another decode_kernel.py to pair with")
    args = parser.parse_args(argv)
    try:
        shapes = [_parse_shape(text) for text in args.shapes.split(",")]
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--shapes: {exc}")
    torch.set_num_threads(args.threads)
    kernels = {"this": decode_kernel}
    if args.baseline is not None:
        kernels = {"baseline": load_baseline(args.baseline), "this": decode_kernel}
    for shape, layout in itertools.product(shapes, args.layouts.split(",")):
        if layout not in ("engine", "scattered"):
            parser.error(f"--layouts {layout!r}: expected engine or scattered")
        args.layout = layout
        low, high = args.context_range
        print(
            f"{args.seqs} seqs, contexts {low}-{high}, KV heads {shape[0]} x group {shape[1]}, "
            f"head dim {shape[2]}, block {args.block_size}, {layout} blocks, {args.layers} "
            f"layers, {args.threads} thread(s)"
        )
        cases = build_cases(shape, args, torch.Generator().manual_seed(args.seed))
        _report(measure(kernels, cases, args.rounds))


if __name__ == "__main__":
    main()
