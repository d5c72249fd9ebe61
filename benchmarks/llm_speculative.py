"""Speculative decoding (n-gram prompt lookup) on vs off, in one run, on the CPU.

    .venv/bin/python benchmarks/llm_speculative.py [--model tiny|small] [--repeats 2]

Workloads (both greedy, ignore_eos, 64 output tokens, random weights built offline):
  "repetitive": 16 random ids followed by the model's own greedy continuation of them, to 96
      tokens. A random model has no notion of copying, but greedy decoding on it falls into a
      cycle within a few dozen tokens, so these prompts end in text the answer repeats (the
      n-gram proposer finds it as it finds a repeated span of code or an extracted field).
  "random": prompts of ~96 random ids, sampled at temperature 1.0: almost no n-gram recurs,
      so drafts are rare and nearly all rejected (the cost of speculation when it cannot help).
At each concurrency (1, 4, 32) `concurrency * waves` requests run in closed loop (a new request
replaces each finished one), three ways: speculation off; on with disable_by_batch_size so high
that every step speculates ("always"); on with the default rule. Reports output tokens/s, the
ratio to off, the acceptance rate and the mean acceptance length, and the proposer's cost per
call. --model small: a 512-wide 8-layer Llama (weights ~30 MB) instead of the 64-wide tiny one.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
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


def prompts(kind: str, num: int, loaded: LoadedLLM, seed: int) -> list[list[int]]:
    """Random ids; "repetitive": each followed by the model's own greedy continuation of it."""
    rng = random.Random(seed)
    vocab = loaded.model.vocab_size
    lead = PROMPT_LEN if kind == "random" else 16
    out = [[rng.randrange(2, vocab) for _ in range(lead)] for _ in range(num)]
    if kind == "random":
        return out
    engine = LLMEngine(loaded, EngineParams(num_kv_blocks=1024, max_num_seqs=64))
    grown = SamplingParams(max_tokens=PROMPT_LEN - lead, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(out):
        engine.add_request(str(i), prompt, grown)
    while engine.has_unfinished():
        for output in engine.step():
            out[int(output.request_id)] += output.new_token_ids
    return out


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


def step_cost_ratio(loaded: LoadedLLM, conc: int, k: int, rounds: int = 30) -> float:
    """Median time of a step verifying k drafts for each of `conc` sequences over the median
    time of a plain decode step of the same sequences, alternated in one loop (load drift hits
    both alike)."""
    runner = ModelRunner(loaded.model, block_size=16, num_kv_blocks=conc * 8, device=CPU)
    seqs = []
    for i in range(conc):
        seq = Sequence(i, list(range(2, 2 + PROMPT_LEN + 1)), GREEDY, arrival_s=0.0)
        seq.block_table = list(range(i * 8, i * 8 + 8))
        seq.num_computed_tokens = PROMPT_LEN
        seqs.append(seq)
    plain = ScheduledBatch(seqs=seqs, num_new_tokens=[1] * conc)
    verify = ScheduledBatch(seqs=seqs, num_new_tokens=[1 + k] * conc)
    times: dict[str, list[float]] = {"plain": [], "verify": []}
    for _ in range(rounds):
        for name, batch, drafts in (("plain", plain, []), ("verify", verify, [7] * k)):
            for seq in seqs:
                seq.spec_token_ids = list(drafts)
            start = time.perf_counter()
            runner.run(batch)
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["verify"]) / statistics.median(times["plain"])


def proposer_cost_us(loaded: LoadedLLM) -> float:
    rng = random.Random(0)
    tokens = [rng.randrange(2, 500) for _ in range(PROMPT_LEN + NUM_OUTPUT)]
    start = time.perf_counter()
    for _ in range(2000):
        propose_ngram(tokens, min_n=2, max_n=4, k=4)
    return (time.perf_counter() - start) / 2000 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--waves", type=int, default=2)
    parser.add_argument("--concurrency", default="1,4,32")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: default")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp())
    name = build_tiny_llama(directory) if args.model == "tiny" else build_small_llama(directory)
    loaded = load_checkpoint(directory / name / "1")
    print(f"model {args.model}; proposer {proposer_cost_us(loaded):.1f} us/call (160 tokens)")
    modes = {
        "off": None,
        "always": SpeculativeConfig(args.k, 2, 4, disable_by_batch_size=10_000),
        "default": SpeculativeConfig(args.k, 2, 4),
    }
    samplings = {
        "repetitive": SamplingParams(max_tokens=NUM_OUTPUT, temperature=0.0, ignore_eos=True),
        "random": SamplingParams(max_tokens=NUM_OUTPUT, temperature=1.0, ignore_eos=True),
    }
    if args.threads:
        torch.set_num_threads(args.threads)
    for conc in [int(c) for c in args.concurrency.split(",")]:
        ratios = [step_cost_ratio(loaded, conc, args.k) for _ in range(args.repeats)]
        print(f"c={conc:<3} verify-step / decode-step time, k={args.k}: "
              + " ".join(f"{r:.2f}" for r in ratios))  # fmt: skip
        for kind, sampling in samplings.items():
            work = prompts(kind, conc * args.waves, loaded, seed=conc)
            figures: dict[str, list[float]] = {m: [] for m in modes}
            per_step: dict[str, float] = {}
            rates: dict[str, str] = {}
            for _ in range(args.repeats):  # modes interleaved: load drift hits all alike
                for mode, spec in modes.items():
                    params = EngineParams(
                        num_kv_blocks=1024,
                        max_num_seqs=64,
                        speculative=spec,
                        num_threads=args.threads,
                    )
                    engine = LLMEngine(loaded, params)
                    run(engine, work[:1], sampling, 1)  # warm-up, not timed
                    if engine.speculation is not None:
                        engine.speculation.stats = SpecStats()
                    tokens_per_s, per_step[mode] = run(engine, work, sampling, conc)
                    figures[mode].append(tokens_per_s)
                    if engine.speculation is not None:
                        s = engine.speculation.stats
                        rates[mode] = (
                            f"accept {s.acceptance_rate:.2f} len {s.mean_acceptance_length:.2f}"
                        )
            base = statistics.mean(figures["off"])
            for mode, values in figures.items():
                ratio = [v / b for v, b in zip(values, figures["off"], strict=True)]
                print(
                    f"c={conc:<3} {kind:<10} {mode:<8} tok/s "
                    + " ".join(f"{v:7.1f}" for v in values)
                    + f"  ratio vs off {' '.join(f'{r:.2f}' for r in ratio)}"
                    + f"  mean {statistics.mean(values) / base:.2f}"
                    + f"  tok/seq-step {per_step[mode]:.2f}  {rates.get(mode, '')}"
                )


if __name__ == "__main__":
    main()
