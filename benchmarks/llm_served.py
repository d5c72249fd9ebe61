"""The LLM engine in the server's thread vs in its own process (`engine_process`), served.

    .venv/bin/python benchmarks/llm_served.py [--concurrency 16,64,256] [--repeats 3]
        [--duration 10] [--max-tokens 64] [--num-threads 0] [--modes thread,process]
        [--stream-interval 1,4]

Builds tiny-llama (fulcrum.llm.examples) into one temporary repository per mode (max_num_seqs
raised to the largest concurrency), and per repeat, alternating the modes, starts `fulcrum serve`
on a free 127.0.0.1 port, runs `fulcrum bench tiny-llama --openai` (closed loop, streaming) at
each concurrency, and stops the server. Prints tok/s, TTFT and ITL P50/P99 per run, and each
mode's ratios to the first mode within each repeat (the modes of a repeat run back to back, their
order rotating between repeats). A mode may name its engine's torch threads: `process:1`;
`processN` runs N engine processes (`num_engine_processes = N`): `process2:1`. Also prints the
server process's CPU (its own threads: event loop, HTTP, pipe readers) and its engine
processes' over each point's bench call, in cores and in microseconds per output token
(approximate: the call's warm-up and start count, at the point's tok/s). --src runs the server
from another tree's src (a before/after comparison). --stream-interval serves each mode at each
`stream_interval` (`process@4`: tokens handed out every 4), and the ratios then compare each
interval with the first one of the same mode. ITL is the gap between streamed chunks (a chunk
holds N tokens), TPOT (end to end less TTFT, per further token) compares the intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fulcrum.llm.examples import build_tiny_llama

sys.path.insert(0, str(Path(__file__).parent))
from health_under_flood import serving
from llm_throughput import stream_intervals

SRC = Path(__file__).resolve().parents[1] / "src"
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

PYTHON = sys.executable


def build_repo(root: Path, label: str, max_num_seqs: int, num_threads: int) -> Path:
    repo = root / label.replace(":", "-").replace("@", "-si")
    build_tiny_llama(repo)
    label, _, interval = label.partition("@")
    mode, _, threads = label.partition(":")
    num_threads = int(threads) if threads else num_threads
    config = repo / "tiny-llama" / "config.toml"
    text = config.read_text().replace("max_num_seqs = 64", f"max_num_seqs = {max_num_seqs}")
    num_processes = mode.removeprefix("process")  # "process2": num_engine_processes = 2
    text += f"engine_process = {'true' if mode.startswith('process') else 'false'}\n"
    if num_processes.isdigit():
        text += f"num_engine_processes = {num_processes}\n"
    text += f"num_threads = {num_threads}\n"
    text += f"stream_interval = {interval or 1}\n"
    config.write_text(text)
    return repo


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process so far; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * TICK_S


def children(pid: int) -> list[int]:
    """Processes whose parent is pid (the server's engine processes; ours: the server)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def bench(base: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict[str, float]:
    (server,) = children(os.getpid())
    engines = children(server)
    server0, engines0, wall0 = cpu_s(server), sum(map(cpu_s, engines)), time.perf_counter()
    subprocess.run(
        [PYTHON, "-m", "fulcrum.cli", "bench", "tiny-llama", "--url", base, "--openai",
         "--concurrency", str(concurrency), "--max-tokens", str(args.max_tokens),
         "--duration", str(args.duration), "--warmup", str(args.warmup), "--no-progress",
         "--out", str(out)],
        check=True, stdout=subprocess.DEVNULL, timeout=600,
    )  # fmt: skip
    wall_s = time.perf_counter() - wall0
    server_s, engines_s = cpu_s(server) - server0, sum(map(cpu_s, engines)) - engines0
    point = json.loads((out / "results.json").read_text())["points"][0]
    llm = point["llm"]
    num_tokens = max(1.0, llm["output_tokens_per_s"] * wall_s)
    return {
        "server_cores": server_s / wall_s,
        "engine_cores": engines_s / wall_s,
        "server_us_per_token": server_s / num_tokens * 1e6,
        "tok_s": llm["output_tokens_per_s"],
        "ttft_p50": llm["ttft"]["p50_ms"],
        "ttft_p99": llm["ttft"]["p99_ms"],
        "itl_p50": llm["itl"]["p50_ms"],
        "itl_p99": llm["itl"]["p99_ms"],
        "tpot_p50": llm["tpot"]["p50_ms"],
        "errors": float(point["num_requests"] - point["num_ok"]),
    }


def serve_and_bench(repo: Path, args: argparse.Namespace, out: Path) -> dict[int, dict[str, float]]:
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "serve.log"
    with serving(repo, args.src, log_path, model="tiny-llama") as (base, _port):
        try:
            return {c: bench(base, c, args, out / f"c{c}") for c in args.concurrency}
        except BaseException:
            print(log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise


def row(label: str, m: dict[str, float]) -> str:
    return (
        f"{label:<22} {m['tok_s']:>8.0f} {m['ttft_p50']:>9.1f} {m['ttft_p99']:>9.1f} "
        f"{m['itl_p50']:>8.2f} {m['itl_p99']:>8.2f} {m['tpot_p50']:>8.2f} {m['errors']:>6.0f} "
        f"{m['server_cores']:>7.2f} {m['engine_cores']:>7.2f} {m['server_us_per_token']:>8.1f}"
    )


def spread(values: list[float]) -> str:
    ordered = sorted(values)
    return f"median {ordered[len(ordered) // 2]:.2f} (min {ordered[0]:.2f}, max {ordered[-1]:.2f})"


def main() -> int:
    args = parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}  load {os.getloadavg()}")
    modes = [
        f"{m}@{n}" if len(args.stream_interval) > 1 else m
        for m in args.modes
        for n in args.stream_interval
    ]
    results: dict[str, list[dict[int, dict[str, float]]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        max_num_seqs = max(64, *args.concurrency)
        repos = {m: build_repo(root, m, max_num_seqs, args.num_threads) for m in modes}
        for r in range(args.repeats):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]  # rotate who goes first
            for mode in order:
                out = root / f"{mode.replace(':', '-')}{r}"
                results[mode].append(serve_and_bench(repos[mode], args, out))
    print(f"\n{'run':<22} {'tok/s':>8} {'ttft p50':>9} {'ttft p99':>9} {'itl p50':>8} "
          f"{'itl p99':>8} {'tpot p50':>8} {'errors':>6} {'server':>7} {'engines':>7} "
          f"{'us/tok':>8}")  # fmt: skip
    for c in args.concurrency:
        for r in range(args.repeats):
            for mode in modes:
                print(row(f"c={c} {mode} #{r + 1}", results[mode][r][c]))
    repeats = range(args.repeats)
    print("\nratios within each repeat (tok/s; ITL, TPOT and TTFT P50: < 1 is better)")
    for mode in modes:
        base = _base(mode, modes, args.stream_interval)
        if base == mode:
            continue
        for c in args.concurrency:
            ratios = {
                key: [results[mode][r][c][key] / results[base][r][c][key] for r in repeats]
                for key in ("tok_s", "itl_p50", "tpot_p50", "ttft_p50")
            }
            print(
                f"{mode} / {base} c={c}: tok/s {spread(ratios['tok_s'])}; itl p50 "
                f"{spread(ratios['itl_p50'])}; tpot p50 {spread(ratios['tpot_p50'])}; "
                f"ttft p50 {spread(ratios['ttft_p50'])}"
            )
    print(f"load after: {os.getloadavg()}")
    return 0


def _base(mode: str, modes: list[str], intervals: list[int]) -> str:
    """What a mode's ratios are to: the same mode at the first interval, or the first mode."""
    if len(intervals) > 1:
        return f"{mode.partition('@')[0]}@{intervals[0]}"
    return modes[0]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="16,64,256",
                        type=lambda s: [int(x) for x in s.split(",")])  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0, help="max measured s per point")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads of the engine")
    parser.add_argument("--src", type=Path, default=SRC, help="the tree whose src is served")
    parser.add_argument("--modes", default="thread,process", type=lambda s: s.split(","),
                        help="thread / process / processN, each :num_threads or not")  # fmt: skip
    parser.add_argument("--stream-interval", default=[1], type=stream_intervals,
                        help="stream_interval values, comma-separated")  # fmt: skip
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
