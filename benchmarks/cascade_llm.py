"""An LLM cascade's decision, measured over HTTP: escalation rate at three thresholds and the
latency of each path (time to first token and to the end), against each model alone.

    .venv/bin/python benchmarks/cascade.py --llm [--prompts 48] [--concurrency 2]
        [--max-tokens 16] [--repeats 3] [--quantiles 0.25,0.5,0.75] [--out FILE]

One `fulcrum serve` on a loopback port; every request is an OpenAI completion, greedy,
streamed (SSE), with a distinct prompt. `small` is a 2-layer, 64-wide GPT-2; `big` an 8-layer,
512-wide Llama with its own tokenizer (both random weights, built offline). First `small` alone
answers every prompt with logprobs, and the client computes each answer's mean token logprob;
the three thresholds sit at that score's quantiles (midway between two answers' scores), so
the expected escalation rate at each is known from the small model's own answers (greedy: the
same answers again), and the measured rate checks the decision. The cascades are then loaded
(`cascade-q<quantile>`, copies of `small` with `[routing.cascade] then = "big"`), and each
configuration runs the same prompts, closed loop, each repeat in a rotated order. Reported per
configuration and repeat: escalation rate (measured and expected), and per path (first /
escalated / alone) the count, P50 and mean of TTFT and end-to-end time in ms, and the mean of
each request's TTFT / end-to-end (a ratio within one request: what the buffering costs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from corpus import sentences

from fulcrum.demo import free_port, serve
from fulcrum.llm.examples import (
    ENGINE_PARAMETERS,
    _model_dir,
    _write_checkpoint,
    build_tiny_gpt2,
    write_tokenizer,
)

BIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
    "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0,
    "eos_token_id": 1, "torch_dtype": "float32",
}  # fmt: skip
CASCADE = '[routing.cascade]\nthen = "big"\nthreshold = {threshold!r}\nscore = "mean_logprob"\n'


def write_repository(root: Path) -> None:
    build_tiny_gpt2(root, name="small")
    version_dir = _model_dir(root, "big")
    vocab_size = write_tokenizer(version_dir, bos="<s>", eos="</s>")
    _write_checkpoint(version_dir, {**BIG, "vocab_size": vocab_size}, seed=1)


def add_cascade(root: Path, name: str, threshold: float) -> None:
    shutil.copytree(root / "small" / "1", root / name / "1")
    config = f'platform = "llm"\n\n{ENGINE_PARAMETERS}' + CASCADE.format(threshold=threshold)
    (root / name / "config.toml").write_text(config)


async def one(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, logprobs: bool
) -> dict[str, Any]:
    """One streamed completion: its route, TTFT, end-to-end time and token logprobs."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    if logprobs:
        body["logprobs"] = 0
    start = time.perf_counter()
    ttft_s = math.nan
    values: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        route = response.headers.get("Fulcrum-Route", "")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                if choice.get("text") and math.isnan(ttft_s):
                    ttft_s = time.perf_counter() - start
                if choice.get("logprobs"):
                    values.extend(choice["logprobs"]["token_logprobs"])
    return {"route": route, "ttft_s": ttft_s, "e2e_s": time.perf_counter() - start,
            "score": statistics.fmean(values) if values else math.nan}  # fmt: skip


async def run(
    client: httpx.AsyncClient, model: str, prompts: list[str], args: argparse.Namespace,
    logprobs: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    queue = list(enumerate(prompts))
    results: list[dict[str, Any]] = [{} for _ in prompts]

    async def worker() -> None:
        while queue:
            i, prompt = queue.pop()
            results[i] = await one(client, model, prompt, args.max_tokens, logprobs)

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return results


def path_of(route: str) -> str:
    if "escalated" in route:
        return "escalated"
    return "first" if "cascade=first" in route else "alone"


def summary(model: str, results: list[dict[str, Any]], repeat: int) -> dict[str, Any]:
    row: dict[str, Any] = {"model": model, "repeat": repeat, "requests": len(results)}
    paths = [path_of(r["route"]) for r in results]
    if model.startswith("cascade"):
        row["escalation_rate"] = round(paths.count("escalated") / len(results), 3)
    for path in ("alone", "first", "escalated"):
        mine = [r for r, p in zip(results, paths, strict=True) if p == path]
        if not mine:
            continue
        ttft = [1000 * r["ttft_s"] for r in mine]
        e2e = sorted(1000 * r["e2e_s"] for r in mine)
        row[path] = {"n": len(mine), "ttft_p50_ms": round(statistics.median(ttft), 1),
                     "ttft_mean_ms": round(statistics.fmean(ttft), 1),
                     "e2e_p50_ms": round(statistics.median(e2e), 1),
                     "e2e_mean_ms": round(statistics.fmean(e2e), 1),
                     "ttft_over_e2e": round(statistics.fmean(
                         r["ttft_s"] / r["e2e_s"] for r in mine), 3)}  # fmt: skip
    return row


async def measure(root: Path, url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    prompts = sentences(args.prompts, 12, seed=7)
    rows: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        # Warm-up: every prompt once on each model, so every measured run finds the same
        # prefix cache (a cold one would favour whichever configuration runs later).
        await run(client, "big", prompts, args)
        await run(client, "small", prompts, args)
        scored = await run(client, "small", prompts, args, logprobs=True)
        scores = sorted(r["score"] for r in scored)
        cascades: dict[str, float] = {}
        for q in (float(x) for x in args.quantiles.split(",")):
            # Midway between two answers' scores: batch-to-batch float noise flips neither.
            k = min(len(scores) - 1, max(1, round(q * len(scores))))
            threshold = (scores[k - 1] + scores[k]) / 2
            name = f"cascade-q{q:g}"
            cascades[name] = threshold
            add_cascade(root, name, threshold)
            response = await client.post(f"/v2/repository/models/{name}/load")
            assert response.status_code == 200, response.text
        models = ["small", "big", *cascades]
        for repeat in range(args.repeats):
            # Each repeat starts one configuration later: no configuration always runs first.
            for model in models[repeat % len(models) :] + models[: repeat % len(models)]:
                row = summary(model, await run(client, model, prompts, args), repeat)
                if model in cascades:
                    t = cascades[model]
                    row["threshold"] = round(t, 5)
                    row["expected_rate"] = round(sum(s < t for s in scores) / len(scores), 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantiles", default="0.25,0.5,0.75")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "repo"
        root.mkdir()
        write_repository(root)
        with serve(root, free_port(), log_path=Path(tmp) / "server.log") as url:
            rows = asyncio.run(measure(root, url, args))
    if args.out is not None:
        args.out.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


if __name__ == "__main__":
    main()
