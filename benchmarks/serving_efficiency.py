"""Served vs raw: MiniLM's throughput through `fulcrum serve` over HTTP under saturating load,
against ONNX Runtime in process at its best batch size, for ~32-token and ~128-token inputs.

    .venv/bin/python benchmarks/serving_efficiency.py [--duration 10] [--concurrency 64]

The load generator runs in this process (one core's worth of asyncio on raw sockets) while the
server runs in a child process: both share the machine's cores, as a real deployment would not.
Prints a table and appends the figures to benchmarks/RESULTS.md with --record.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from corpus import sentences

from fulcrum.backends import create_backend
from fulcrum.client import Connection, Endpoint, build_request
from fulcrum.config import load_model_config
from fulcrum.demo import free_port, serve
from fulcrum.examples import build_examples
from fulcrum.protocol import RequestedOutput, encode_infer_request

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
WORKLOADS = {"short (~32 tokens)": 24, "long (~128 tokens)": 100}


def raw_throughput(repo: Path, texts: list[str], seconds_per_size: float) -> dict[int, float]:
    """Sequences/s of the backend in process (tokenise + ONNX Runtime) at each batch size."""
    config = load_model_config(repo / "minilm" / "config.toml", dir_name="minilm")
    backend = create_backend(config, repo / "minilm" / "1")
    rates: dict[int, float] = {}
    for size in BATCH_SIZES:
        batches = [
            np.array([[t.encode()] for t in texts[i : i + size]], dtype=object)
            for i in range(0, len(texts) - size, size)
        ]
        backend.execute({"text": batches[0]})  # warm-up
        done, start, i = 0, time.perf_counter(), 0
        while time.perf_counter() - start < seconds_per_size:
            backend.execute({"text": batches[i % len(batches)]})
            done += size
            i += 1
        rates[size] = done / (time.perf_counter() - start)
    backend.close()
    return rates


def prebuilt_requests(endpoint: Endpoint, texts: list[str]) -> list[bytes]:
    """One binary-tensor request per sentence, as tritonclient sends them."""
    out = []
    for text in texts:
        body, headers = encode_infer_request(
            {"text": np.array([[text.encode()]], dtype=object)},
            binary=True,
            outputs=(RequestedOutput("embedding", True),),
        )
        out.append(build_request(endpoint, "POST", "/v2/models/minilm/infer", headers=headers,
                                 body=body))  # fmt: skip
    return out


async def served_throughput(
    url: str, texts: list[str], concurrency: int, warmup_s: float, duration_s: float
) -> tuple[float, float, Counter[int]]:
    """(requests/s, P50 latency ms, non-200 answers by status) of a closed loop of `concurrency`
    clients; a refusal (503) comes back at once, so a client refused sends its next sooner."""
    endpoint = Endpoint.from_url(url)
    requests = prebuilt_requests(endpoint, texts)
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s
    latencies: list[float] = []
    errors: Counter[int] = Counter()

    async def worker(k: int) -> None:
        connection = Connection(endpoint)
        i = k
        while (now := time.perf_counter()) < stop_at:
            response = await connection.request(requests[i % len(requests)], timeout_s=30)
            i += concurrency
            if now >= measure_from:
                if response.status == 200:
                    latencies.append(time.perf_counter() - now)
                else:
                    errors[response.status] += 1
        connection.close()

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    p50_ms = statistics.median(latencies) * 1e3 if latencies else float("nan")
    return len(latencies) / duration_s, p50_ms, errors


def apply_overrides(path: Path, assignments: list[str]) -> None:
    """Rewrite a config.toml with dotted `key=value` assignments (values in TOML syntax)."""
    config = msgspec.toml.decode(path.read_bytes())
    for assignment in assignments:
        key, _, value = assignment.partition("=")
        *parents, leaf = key.strip().split(".")
        table = config
        for part in parents:
            table = table.setdefault(part, {})
        table[leaf] = msgspec.toml.decode(f"v = {value}".encode())["v"]
    path.write_bytes(msgspec.toml.encode(config))


def token_count(repo: Path, texts: list[str]) -> float:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(repo / "minilm" / "1" / "tokenizer.json"))
    tok.no_padding()
    return float(np.mean([len(e.ids) for e in tok.encode_batch(texts)]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per load")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--raw-seconds", type=float, default=2.0, help="per batch size")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--workload", choices=["short", "long"], action="append",
                        help="run only these workloads (default: both)")  # fmt: skip
    parser.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override minilm's config.toml, e.g. --set instances.count=2 (TOML values)",
    )  # fmt: skip
    args = parser.parse_args()
    import uvloop

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        build_examples(repo)
        apply_overrides(repo / "minilm" / "config.toml", args.set)
        for label, num_words in WORKLOADS.items():
            if args.workload and label.split()[0] not in args.workload:
                continue
            texts = sentences(2048, num_words, seed=1)
            tokens = token_count(repo, texts)
            rates = raw_throughput(repo, texts, args.raw_seconds)
            best_size = max(rates, key=lambda s: rates[s])
            with serve(repo, free_port(), log_path=repo / "server.log") as url:
                served, p50_ms, errors = uvloop.run(
                    served_throughput(url, texts, args.concurrency, args.warmup, args.duration)
                )
            rows.append((label, tokens, rates, best_size, served, p50_ms, errors))
    report = render(rows, args)
    print(report)
    if args.record:
        with (Path(__file__).parent / "RESULTS.md").open("a") as f:
            f.write(report + "\n")
    return 0


def render(rows: list[tuple[str, float, dict[int, float], int, float, float, Counter[int]]],
           args: argparse.Namespace) -> str:  # fmt: skip
    lines = [
        f"### serving_efficiency — {datetime.date.today()} — {platform.machine()}, "
        f"{_cpu_name()}, {_num_cpus()} CPUs",
        "",
        f"Command: `.venv/bin/python benchmarks/serving_efficiency.py --duration {args.duration:g}"
        f" --concurrency {args.concurrency}{''.join(f' --set {a}' for a in args.set)}`",
        "",
        "| workload | mean tokens | raw seq/s by batch size | raw best | served req/s (P50 ms) "
        "| non-200 answers | served / raw |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, tokens, rates, best, served, p50_ms, errors in rows:
        by_size = ", ".join(f"{s}: {r:.0f}" for s, r in rates.items())
        refused = ", ".join(f"{n} x {status}" for status, n in sorted(errors.items())) or "0"
        lines.append(
            f"| {label} | {tokens:.0f} | {by_size} | {rates[best]:.0f} (batch {best}) | "
            f"{served:.0f} ({p50_ms:.0f}) | {refused} | **{served / rates[best]:.2f}** |"
        )
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _num_cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    sys.exit(main())
