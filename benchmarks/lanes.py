"""Lanes on minilm: a `realtime` INT8 lane beside a `bulk` FP32 lane, against one lane, in one run.

    .venv/bin/python benchmarks/lanes.py [--repository DIR] [--repeats 2] [--seconds 15]
        [--rate 10] [--slo-ms 100] [--bulk-rows 32] [--bulk-concurrency 2] [--out FILE]

Builds the example repository (`fulcrum examples`, then `fulcrum quantize --precisions int8`
for the INT8 variant) unless --repository holds one, and starts one `fulcrum serve` per config
on a copy of it (model files hard-linked):

- `single fp32`: the shipped config (one batcher, FP32, 2 threads, batches up to 64);
- `single int8`: the same with the INT8 variant (the faster single config on this CPU);
- `lanes 1+1`: `realtime` = INT8, 1 instance x 1 thread, adaptive, no added wait, SLO --slo-ms;
  `bulk` = FP32, 1 instance x 1 thread, batches up to 64 (the cores split, no oversubscription);
- `lanes 1+2`: the same with the bulk lane on 2 threads (3 threads on 2 cores: oversubscribed);
- `lanes8 1+1`, `lanes8 1+2`: the same two with the bulk lane on the INT8 variant too.

Every config gets the same mix at once, measured for --seconds after a warm-up: interactive
requests (1 sentence, Poisson at --rate/s, open loop, X-Fulcrum-Timeout-Ms = --slo-ms) and bulk
requests (--bulk-rows sentences, closed loop of --bulk-concurrency, timeout 30 s). Nothing names a
lane: the router chooses by deadline. Configs are interleaved per repeat (same noise for all).
Reported per config and repeat: interactive P50/P99 (a failed request counts as late) and share
within the SLO, bulk rows/s; then each config's bulk rows/s over the best single config's in the
same repeat (and over the single config of the bulk lane's precision). Goal: lanes keep the
interactive P99 <= SLO with bulk rows/s >= 0.9 x the best single config's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from corpus import sentences
from health_under_flood import serving

from fulcrum.client import Endpoint, build_request
from fulcrum.loadgen.closed_loop import run_closed_loop
from fulcrum.loadgen.driver import PerfTimer
from fulcrum.loadgen.kserve import PreparedRequest, V2Target
from fulcrum.loadgen.open_loop import run_open_loop
from fulcrum.loadgen.records import RequestRecord
from fulcrum.loadgen.windows import MeasurePlan
from fulcrum.protocol import encode_infer_request

BULK_TIMEOUT_MS = 30_000
BULK_SLO_MS = 10_000  # the bulk lane's objective: loose, so only loose deadlines choose it


def lanes_config(text: str, slo_ms: float, bulk_threads: int, bulk_variant: str = "fp32") -> str:
    """The shipped config with the two lanes (top-level keys first, tables last: TOML)."""
    return (
        'default_lane = "bulk"\n'
        + text
        + f"""
[lanes.realtime]
variant = "int8"
threads = 1
instances = {{ count = 1 }}
[lanes.realtime.dynamic_batching]
profile = "realtime"
slo_p99_ms = {slo_ms}

[lanes.bulk]
variant = "{bulk_variant}"
threads = {bulk_threads}
instances = {{ count = 1 }}
[lanes.bulk.dynamic_batching]
max_queue_delay_ms = 0
slo_p99_ms = {BULK_SLO_MS}
"""
    )


def with_default_variant(text: str, variant: str) -> str:
    """The config with `default_variant = variant` (quantize writes one: replaced, not added)."""
    lines = [ln for ln in text.splitlines() if not ln.startswith("default_variant")]
    return f'default_variant = "{variant}"\n' + "\n".join(lines) + "\n"


def configs(slo_ms: float) -> dict[str, Callable[[str], str]]:
    return {
        "single fp32": lambda text: with_default_variant(text, "fp32"),
        "single int8": lambda text: with_default_variant(text, "int8"),
        "lanes 1+1": lambda text: lanes_config(text, slo_ms, 1),
        "lanes 1+2": lambda text: lanes_config(text, slo_ms, 2),
        "lanes8 1+1": lambda text: lanes_config(text, slo_ms, 1, "int8"),
        "lanes8 1+2": lambda text: lanes_config(text, slo_ms, 2, "int8"),
    }


def build_repository(root: Path) -> Path:
    """`fulcrum examples` + an INT8 variant by `fulcrum quantize` (skipped when present)."""
    repo = root / "repo"
    if (repo / "minilm" / "1" / "model.int8.onnx").is_file():
        return repo
    fulcrum = [sys.executable, "-m", "fulcrum.cli"]
    subprocess.run([*fulcrum, "examples", str(repo)], check=True)
    quantize = ["quantize", "minilm", "--repository", str(repo), "--precisions", "int8"]
    subprocess.run([*fulcrum, *quantize, "--no-measure", "--rows", "64"], check=True)
    return repo


def copy_with(repo: Path, dest: Path, edit: Callable[[str], str]) -> Path:
    """A copy of `repo` (model files hard-linked) whose minilm config is `edit(shipped)`."""
    shutil.copytree(repo, dest, copy_function=os.link)
    config = dest / "minilm" / "config.toml"
    text = config.read_text()
    config.unlink()  # a hard link: writing through it would change the original
    config.write_text(edit(text))
    return dest


def prepared(
    endpoint: Endpoint, num: int, num_rows: int, timeout_ms: int, seed: int
) -> list[PreparedRequest]:
    texts = sentences(num * num_rows, 12, seed=seed)
    out = []
    for i in range(num):
        rows = texts[i * num_rows : (i + 1) * num_rows]
        tensor = np.array([[t.encode()] for t in rows], dtype=object)  # (rows, 1)
        body, headers = encode_infer_request({"text": tensor}, binary=False)
        headers = {**headers, "Content-Type": "application/json",
                   "X-Fulcrum-Timeout-Ms": str(timeout_ms)}  # fmt: skip
        raw = build_request(endpoint, "POST", "/v2/models/minilm/infer", headers=headers,
                            body=body)  # fmt: skip
        out.append(PreparedRequest(raw, num_rows))
    return out


async def measure(url: str, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """The mix on one server: interactive open loop and bulk closed loop at once."""
    endpoint = Endpoint.from_url(url)
    interactive = V2Target(endpoint, prepared(endpoint, 64, 1, int(args.slo_ms), seed))
    bulk = V2Target(endpoint, prepared(endpoint, 8, args.bulk_rows, BULK_TIMEOUT_MS, seed + 1))
    plan = MeasurePlan(warmup_s=args.warmup_s, window_s=args.seconds,
                       max_duration_s=args.seconds, num_stable=1)  # fmt: skip
    fast, slow = await asyncio.gather(
        run_open_loop(interactive, args.rate, plan, PerfTimer(), seed=seed, timeout_s=5.0),
        run_closed_loop(bulk, args.bulk_concurrency, plan, PerfTimer(), timeout_s=60.0),
    )
    fast_records = fast.measurement.records + fast.measurement.drained
    bulk_ok = [r for r in slow.measurement.records if r.outcome.ok]
    duration_s = slow.measurement.duration_s
    return {
        **interactive_figures(fast_records, args.slo_ms),
        "bulk_rows_per_s": sum(r.outcome.num_rows for r in bulk_ok) / duration_s,
        "bulk_failed": float(sum(not r.outcome.ok for r in slow.measurement.records)),
    }


def interactive_figures(records: list[RequestRecord], slo_ms: float) -> dict[str, float]:
    """P50/P99 with a failed request counted as late (infinite), and the share within the SLO."""
    latencies_ms = np.array(
        [r.latency_s * 1e3 if r.outcome.ok else np.inf for r in records], dtype=float
    )
    if latencies_ms.size == 0:
        return {"n": 0.0, "p50_ms": np.nan, "p99_ms": np.nan, "within_slo": 0.0, "failed": 0.0}
    ordered = np.sort(latencies_ms)
    p99 = ordered[min(ordered.size - 1, int(np.ceil(0.99 * ordered.size)) - 1)]
    return {
        "n": float(ordered.size),
        "p50_ms": float(np.median(ordered)),
        "p99_ms": float(p99),
        "within_slo": float(np.mean(latencies_ms <= slo_ms)),
        "failed": float(np.sum(~np.isfinite(latencies_ms))),
    }


def report(results: dict[str, list[dict[str, float]]], slo_ms: float) -> None:
    print(f"\ninteractive SLO {slo_ms:g} ms; bulk ratio = rows/s over the best single config's "
          "rows/s in the same repeat")  # fmt: skip
    print(f"{'config':<12} {'rep':>3} {'int P50':>8} {'int P99':>8} {'in SLO':>7} {'fail':>5} "
          f"{'bulk r/s':>9} {'ratio':>6} {'same-prec':>9}")  # fmt: skip
    num_repeats = len(next(iter(results.values())))
    for rep in range(num_repeats):
        singles = {c: results[c][rep]["bulk_rows_per_s"] for c in results if c.startswith("single")}
        best = max(singles.values(), default=np.nan)
        for name, runs in results.items():
            r = runs[rep]
            r["bulk_ratio"] = r["bulk_rows_per_s"] / best if best else np.nan
            same = singles.get("single int8" if name.startswith("lanes8") else "single fp32")
            r["bulk_ratio_same_precision"] = r["bulk_rows_per_s"] / same if same else np.nan
            print(f"{name:<12} {rep + 1:>3} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
                  f"{r['within_slo']:>7.1%} {r['failed']:>5.0f} {r['bulk_rows_per_s']:>9.1f} "
                  f"{r['bulk_ratio']:>6.2f} {r['bulk_ratio_same_precision']:>9.2f}")  # fmt: skip


def plot(results: dict[str, list[dict[str, float]]], slo_ms: float, path: Path) -> None:
    """Two panels per config, one point per repeat: the interactive P99 against the SLO, and
    bulk rows/s over the best single config's (after `report` has computed the ratios)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (p99_ax, bulk_ax) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for x, name in enumerate(names):
        runs = results[name]
        p99 = [min(r["p99_ms"], 10 * slo_ms) for r in runs]  # "inf" (failures) drawn at the top
        p99_ax.scatter([x] * len(runs), p99, color="tab:blue")
        bulk_ax.scatter([x] * len(runs), [r["bulk_ratio"] for r in runs], color="tab:green")
    p99_ax.axhline(slo_ms, color="red", linewidth=0.8, label=f"SLO {slo_ms:g} ms")
    p99_ax.set_yscale("log")
    p99_ax.set_ylabel("interactive P99 (ms)")
    p99_ax.set_title("minilm lanes: interactive P99 and bulk throughput, each repeat")
    bulk_ax.axhline(0.9, color="red", linewidth=0.8, label="0.9 x best single config")
    bulk_ax.set_ylabel("bulk rows/s / best single")
    bulk_ax.set_xticks(range(len(names)), names, rotation=20)
    for ax in (p99_ax, bulk_ax):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--repository", type=Path, help="a repository with minilm and its int8 variant")
    add("--repeats", type=int, default=2)
    add("--seconds", type=float, default=15.0, help="measured seconds per config and repeat")
    add("--warmup-s", type=float, default=3.0)
    add("--rate", type=float, default=10.0, help="interactive requests/s (Poisson)")
    add("--slo-ms", type=float, default=100.0, help="interactive deadline and realtime SLO")
    add("--bulk-rows", type=int, default=32, help="sentences per bulk request")
    add("--bulk-concurrency", type=int, default=2)
    add("--only", action="append", default=[], help="configs to run (default: all)")
    add("--out", type=Path, help="write the figures here as JSON")
    add("--plot", type=Path, help="draw P99 and bulk ratio per config and repeat here (PNG)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lanes-bench-") as tmp:
        root = Path(tmp)
        repo = args.repository or build_repository(root)
        chosen = {k: v for k, v in configs(args.slo_ms).items() if not args.only or k in args.only}
        results: dict[str, list[dict[str, float]]] = {name: [] for name in chosen}
        src = Path(__file__).resolve().parents[1] / "src"
        with ExitStack() as stack:
            urls = {}
            for i, (name, edit) in enumerate(chosen.items()):
                copy = copy_with(repo, root / f"c{i}", edit)
                url, _ = stack.enter_context(serving(copy, src, root / f"c{i}.log"))
                urls[name] = url
            for rep in range(args.repeats):
                for name, url in urls.items():
                    figures = asyncio.run(measure(url, args, seed=rep))
                    results[name].append(figures)
                    print(f"  repeat {rep + 1} {name}: {json.dumps(figures)}", flush=True)
        report(results, args.slo_ms)
        if args.plot is not None:
            plot(results, args.slo_ms, args.plot)
        if args.out is not None:
            args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                            "results": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
