"""Speculative decoding (n-gram prompt lookup) on vs off, in one run, on the CPU.

    .venv/bin/python benchmarks/llm_speculative.py [--model tiny|small|1b] [--repeats 2]
    .venv/bin/python benchmarks/llm_speculative.py --model 1b --precision int8 \
        --concurrency 1,4 --waves 1 --output-tokens 32 --modes off,always

Workloads (ignore_eos, --output-tokens 64 by default, random weights built offline):
  "repetitive" (greedy): 16 random ids followed by the model's own greedy continuation of
      them, to 96 tokens. A random model has no notion of copying, but greedy decoding on the
      tiny one falls into a cycle within a few dozen tokens, so these prompts end in text the
      answer repeats (the n-gram proposer finds it as it finds a repeated span of code).
  "random": prompts of ~96 random ids, sampled at temperature 1.0: almost no n-gram recurs,
      so drafts are rare and nearly all rejected (the cost of speculation when it cannot help).
At each concurrency (1, 4, 32) `concurrency * waves` requests run in closed loop (a new request
replaces each finished one), three ways: speculation off; on with disable_by_batch_size so high
that every step speculates ("always"); on with the default rule. Reports output tokens/s, the
ratio to off, the acceptance rate and the mean acceptance length, and the proposer's cost per
call. --model small: a 512-wide 8-layer Llama (weights ~30 MB) instead of the 64-wide tiny one.
--model 1b: the Llama-3.2-1B-shaped random checkpoint of benchmarks/llm_quant.py (built there, or
reused from its --cache), in --precision float32, int8 or int4 (int8 LM head); its "repetitive"
prompts are P + C + P: P 32 random ids, C the model's own 32-token greedy continuation of P, so
the proposer drafts C after the second P and acceptance is high exactly when the greedy model
continues P + C + P as it continued P (the acceptance rate printed says how often).
--workloads oracle: random prompts, greedy, with the n-gram proposer replaced by the request's
own greedy answer (computed beforehand, untimed): every draft is accepted, so this is the most
speculation can gain at the measured step cost. --matmul-rows 1,2,5,8: only the time of one
1B-shape layer's float32 matmuls on that many token rows, torch (MKL) against a plain numba loop.
Before each workload, the step-cost ratio: the median time of a step in which every sequence
verifies k drafts over that of a plain decode step, alternated in one loop, with the verifying
rows attended in place by the decode kernel ("in place") and through the chunk path that gathers
their KV blocks ("gather", the engine before in-place verification).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fulcrum.llm.examples import _model_dir, _write_checkpoint, build_tiny_llama, write_tokenizer
from fulcrum.llm.loader import LoadedLLM, load_checkpoint
from fulcrum.llm.ngram import propose_ngram
from fulcrum.llm.params import EngineParams
from fulcrum.llm.runner import ModelRunner
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.scheduler import ScheduledBatch
from fulcrum.llm.sequence import Sequence
from fulcrum.llm.speculative import SpecStats, SpeculativeConfig
from fulcrum.llm.sync_engine import LLMEngine

NUM_OUTPUT = 64
PROMPT_LEN = 96
LEAD_1B = 32  # P of the 1b model's P + C + P prompts (C: as long)
CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=NUM_OUTPUT, temperature=0.0, ignore_eos=True)


def build_small_llama(directory: Path) -> str:
    version_dir = _model_dir(directory, "small-llama")
    vocab_size = write_tokenizer(version_dir, bos="<s>", eos="</s>")
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size,
        "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 1, "torch_dtype": "float32",
    }  # fmt: skip
    _write_checkpoint(version_dir, config, seed=0)
    return "small-llama"


def load_1b(cache: Path, layers: int, precision: str) -> LoadedLLM:
    """llm_quant's 1B-shape checkpoint: reused when its folder is complete, else built."""
    sys.path.insert(0, str(Path(__file__).parent))
    from llm_quant import MARKER, VARIANTS, cached_checkpoint

    version_dir = cache / f"llama-1b-{layers}l" / "1"
    if not (version_dir / MARKER).is_file():
        version_dir = cached_checkpoint(cache, layers)
    return load_checkpoint(version_dir, model_file=VARIANTS[precision][0])


def engine_params(spec: SpeculativeConfig | None, threads: int) -> EngineParams:
    # 256 MB: 256 blocks of the 1B shape (~1 MB each), 4 sequences of 1000 tokens.
    return EngineParams(
        kv_cache_memory_mb=256, max_num_seqs=64, speculative=spec, num_threads=threads
    )


def greedy_continuations(
    loaded: LoadedLLM, prompts: list[list[int]], num_tokens: int
) -> list[list[int]]:
    """Each prompt's greedy continuation of num_tokens tokens."""
    engine = LLMEngine(loaded, engine_params(None, 0))
    grown = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, grown)
    out: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished():
        for output in engine.step():
            out[int(output.request_id)] += output.new_token_ids
    return out


def prompts(kind: str, num: int, loaded: LoadedLLM, seed: int, model: str) -> list[list[int]]:
    """Random ids; "repetitive": each followed by the model's own greedy continuation of it
    (--model 1b: P + C + P, C the greedy continuation of P)."""
    rng = random.Random(seed)
    vocab = loaded.model.vocab_size
    lead = PROMPT_LEN if kind == "random" else (LEAD_1B if model == "1b" else 16)
    out = [[rng.randrange(2, vocab) for _ in range(lead)] for _ in range(num)]
    if kind == "random":
        return out
    if model == "1b":
        grown = greedy_continuations(loaded, out, LEAD_1B)
        for i, c in enumerate(grown):
            print(f"  prompt {i}: C has {len(set(c))} distinct tokens of {len(c)}")
        return [p + c + p for p, c in zip(out, grown, strict=True)]
    grown = greedy_continuations(loaded, out, PROMPT_LEN - lead)
    return [p + c for p, c in zip(out, grown, strict=True)]


def run(
    engine: LLMEngine, work: list[list[int]], sampling: SamplingParams, conc: int
) -> tuple[float, float]:
    """Closed loop at `conc` in flight; output tokens/s and output tokens per sequence-step."""
    pending = list(enumerate(work))
    in_flight = 0
    num_tokens = 0
    num_seq_steps = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < conc:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, sampling)
            in_flight += 1
        num_seq_steps += engine.scheduler.num_running
        for output in engine.step():
            num_tokens += len(output.new_token_ids)
            in_flight -= output.finished
    return num_tokens / (time.perf_counter() - start), num_tokens / max(num_seq_steps, 1)


def step_cost_ratios(loaded: LoadedLLM, conc: int, k: int, rounds: int) -> dict[str, float]:
    """Median time of a step verifying k drafts for each of `conc` sequences over the median
    time of a plain decode step of the same sequences, verifying in place and by gathering,
    all three alternated in one loop (load drift hits them alike; use an even `rounds`)."""
    runner = ModelRunner(loaded.model, block_size=16, num_kv_blocks=conc * 8, device=CPU)
    seqs = []
    for i in range(conc):
        seq = Sequence(i, list(range(2, 2 + PROMPT_LEN + 1)), GREEDY, arrival_s=0.0)
        seq.block_table = list(range(i * 8, i * 8 + 8))
        seq.num_computed_tokens = PROMPT_LEN
        seqs.append(seq)
    plain = ScheduledBatch(seqs=seqs, num_new_tokens=[1] * conc)
    verify = ScheduledBatch(seqs=seqs, num_new_tokens=[1 + k] * conc)
    steps = (("plain", plain, 0, True), ("in place", verify, k, True), ("gather", verify, k, False))
    times: dict[str, list[float]] = {name: [] for name, _, _, _ in steps}
    for round_index in range(rounds):
        # The two verifying steps swap places every round: neither always follows the decode.
        order = steps if round_index % 2 == 0 else (steps[0], steps[2], steps[1])
        for name, batch, num_drafts, in_place in order:
            for seq in seqs:
                seq.spec_token_ids = [7] * num_drafts
            runner.in_place_verify = in_place
            start = time.perf_counter()
            runner.run(batch)
            times[name].append(time.perf_counter() - start)
    plain_s = statistics.median(times["plain"])
    return {"decode ms": plain_s * 1e3} | {
        name: statistics.median(times[name]) / plain_s for name in ("in place", "gather")
    }


# One layer of the 1B shape: q, k, v, o, gate, up, down as (out, in) float32 weights.
LAYER_1B = ((2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048),
            (2048, 8192))  # fmt: skip


def matmul_scaling(rows: list[int], rounds: int) -> None:
    """Time of one 1B-shape layer's matmuls on `rows` token rows, torch (MKL) against a plain
    numba kernel that reads each weight row once for all token rows: whether verifying k + 1
    rows costs what one row costs is decided here (medians, rows alternated in one loop)."""
    import numba
    import numpy as np

    @numba.njit(fastmath=True, parallel=True, boundscheck=False, cache=True)
    def few_rows(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        for j in numba.prange(w.shape[0]):
            for r in range(x.shape[0]):
                acc = np.float32(0.0)
                for d in range(w.shape[1]):
                    acc += x[r, d] * w[j, d]
                out[r, j] = acc

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) * 0.02 for shape in LAYER_1B]
    inputs = {m: [torch.randn(m, w.shape[1], generator=gen) for w in weights] for m in rows}
    outs = {m: [np.empty((m, w.shape[0]), np.float32) for w in weights] for m in rows}
    kernels = {
        "torch": lambda m: [
            torch.nn.functional.linear(x, w) for x, w in zip(inputs[m], weights, strict=True)
        ],
        "numba": lambda m: [
            few_rows(x.numpy(), w.numpy(), o)
            for x, w, o in zip(inputs[m], weights, outs[m], strict=True)
        ],
    }
    times: dict[tuple[str, int], list[float]] = {(k, m): [] for k in kernels for m in rows}
    for _ in range(rounds + 1):  # the first round compiles and warms: dropped
        for (name, m), found in times.items():
            start = time.perf_counter()
            kernels[name](m)
            found.append(time.perf_counter() - start)
    base = statistics.median(times[("torch", 1)][1:])
    for (name, m), found in times.items():
        median = statistics.median(found[1:])
        print(f"{name:<6} {m:>2} rows: {median * 1e3:7.1f} ms per layer, x{median / base:.2f} "
              "torch's 1 row", flush=True)  # fmt: skip


def proposer_cost_us(loaded: LoadedLLM) -> float:
    rng = random.Random(0)
    tokens = [rng.randrange(2, 500) for _ in range(PROMPT_LEN + NUM_OUTPUT)]
    start = time.perf_counter()
    for _ in range(2000):
        propose_ngram(tokens, min_n=2, max_n=4, k=4)
    return (time.perf_counter() - start) / 2000 * 1e6


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("tiny", "small", "1b"), default="tiny")
    parser.add_argument("--precision", choices=("float32", "int8", "int4"), default="float32")
    parser.add_argument("--layers", type=int, default=16, help="1b: layers kept")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/fulcrum-llm-quant"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--concurrency", default="1,4,32")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=NUM_OUTPUT)
    parser.add_argument("--modes", default="off,always,default")
    parser.add_argument("--workloads", default="repetitive,random", help="and/or oracle")
    parser.add_argument("--ratio-rounds", type=int, default=30, help="0: no step-cost ratios")
    parser.add_argument("--ratio-only", action="store_true", help="only the step-cost ratios")
    parser.add_argument("--matmul-rows", default="", help="e.g. 1,2,5,8: only matmul scaling")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: default")
    return parser.parse_args()


def load(args: argparse.Namespace) -> LoadedLLM:
    if args.model == "1b":
        return load_1b(args.cache, args.layers, args.precision)
    directory = Path(tempfile.mkdtemp())
    name = build_tiny_llama(directory) if args.model == "tiny" else build_small_llama(directory)
    return load_checkpoint(directory / name / "1")


def oracle_drafts(
    answers: dict[tuple[int, ...], list[int]], k: int
) -> Callable[[Sequence, int], list[int]]:
    """In place of the n-gram proposer: the next k tokens of the request's known greedy answer,
    so every draft is accepted (the most speculation can gain at this step-cost ratio)."""

    def drafts(seq: Sequence, max_tokens: int) -> list[int]:
        done = seq.num_output_tokens
        left = seq.sampling.max_tokens - done - 1
        answer = answers.get(tuple(seq.token_ids[: seq.num_prompt_tokens]), [])  # [] warm-up
        return answer[done : done + min(k, max_tokens, left)]

    return drafts


def compare(
    loaded: LoadedLLM,
    args: argparse.Namespace,
    conc: int,
    kind: str,
    modes: dict[str, SpeculativeConfig | None],
) -> None:
    """Tokens/s of each mode on one workload, modes interleaved in each repeat."""
    temperature = 1.0 if kind == "random" else 0.0
    sampling = SamplingParams(
        max_tokens=args.output_tokens, temperature=temperature, ignore_eos=True
    )
    warm = SamplingParams(max_tokens=4, temperature=temperature, ignore_eos=True)
    work = prompts(
        "random" if kind == "oracle" else kind, conc * args.waves, loaded, conc, args.model
    )
    answers = {}
    if kind == "oracle":  # each prompt's greedy answer, computed once beforehand (not timed)
        found = greedy_continuations(loaded, work, args.output_tokens)
        answers = {tuple(p): a for p, a in zip(work, found, strict=True)}
    figures: dict[str, list[float]] = {m: [] for m in modes}
    per_step: dict[str, float] = {}
    rates: dict[str, str] = {}
    for _ in range(args.repeats):  # modes interleaved: load drift hits all alike
        for mode, spec in modes.items():
            engine = LLMEngine(loaded, engine_params(spec, args.threads))
            if answers and engine.speculation is not None:
                engine.speculation.drafts = oracle_drafts(answers, args.k)  # type: ignore[method-assign]
            # Warm-up, not timed, on a prompt of its own: a workload prompt would then be a
            # prefix-cache hit, computed along another path than in the oracle's answers.
            run(engine, [list(range(2, 18))], warm, 1)
            if engine.speculation is not None:
                engine.speculation.stats = SpecStats()
            tokens_per_s, per_step[mode] = run(engine, work, sampling, conc)
            figures[mode].append(tokens_per_s)
            if engine.speculation is not None:
                s = engine.speculation.stats
                rates[mode] = f"accept {s.acceptance_rate:.2f} len {s.mean_acceptance_length:.2f}"
    for mode, values in figures.items():
        ratio = [v / b for v, b in zip(values, figures["off"], strict=True)]
        print(
            f"c={conc:<3} {kind:<10} {mode:<8} tok/s "
            + " ".join(f"{v:7.2f}" for v in values)
            + f"  ratio vs off {' '.join(f'{r:.2f}' for r in ratio)}"
            + f"  mean {statistics.mean(values) / statistics.mean(figures['off']):.2f}"
            + f"  tok/seq-step {per_step[mode]:.2f}  {rates.get(mode, '')}",
            flush=True,
        )


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.matmul_rows:
        matmul_scaling([int(m) for m in args.matmul_rows.split(",")], args.ratio_rounds)
        return
    loaded = load(args)
    label = args.model + (f" {args.precision}" if args.model == "1b" else "")
    print(f"model {label}; proposer {proposer_cost_us(loaded):.1f} us/call (160 tokens)")
    every = {
        "off": None,
        "always": SpeculativeConfig(args.k, 2, 4, disable_by_batch_size=10_000),
        "default": SpeculativeConfig(args.k, 2, 4),
    }
    modes = {m: every[m] for m in ["off", *args.modes.split(",")] if m in every}
    for conc in [int(c) for c in args.concurrency.split(",")]:
        for _ in range(args.repeats if args.ratio_rounds else 0):
            found = step_cost_ratios(loaded, conc, args.k, args.ratio_rounds)
            print(
                f"c={conc:<3} decode step {found['decode ms']:.1f} ms; verify(k={args.k}) / "
                f"decode: in place {found['in place']:.2f}, gather {found['gather']:.2f}",
                flush=True,
            )
        if not args.ratio_only:
            for kind in args.workloads.split(","):
                compare(loaded, args, conc, kind, modes)


if __name__ == "__main__":
    main()
