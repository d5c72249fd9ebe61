"""Cold start of the example models: from parked (unloaded for being idle) to the first answer.

Serves a copy of the example repository (`fulcrum examples`) with `[lifecycle] idle_unload_s`
set, on a real `fulcrum serve`; per model and run: a warm request, a wait until the server has
unloaded the model, then the first request timed end to end. Prints, per run, the cold first
answer, the server's own cold-start figure (fulcrum_model_cold_start_seconds: the load alone),
the memory measured at the load, and the warm latency beside it (the ratio is within one run).

    python benchmarks/cold_start.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REQUESTS = {
    "minilm": ("/v2/models/minilm/infer", {"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": ["a cold start"]}]}),
    "tiny-llama": ("/v1/completions", {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 1,
                                       "temperature": 0}),
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=1.0, help="idle_unload_s of each model")
    parser.add_argument("--models", nargs="+", default=list(REQUESTS))
    parser.add_argument("--out", type=Path, help="write the runs as JSON here")
    return parser.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric(client: httpx.Client, name: str, model: str) -> float:
    pattern = re.compile(rf'^{name}\{{model="{re.escape(model)}"\}} (\S+)$', re.M)
    found = pattern.search(client.get("/metrics").text)
    return float(found.group(1)) if found else 0.0


def wait_until(check: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise TimeoutError(what)


def parked(client: httpx.Client, model: str) -> bool:
    rows = client.post("/v2/repository/index", json={}).json()
    return any(r["name"] == model and r.get("reason") == "unloaded (idle)" for r in rows)


def one_run(client: httpx.Client, model: str, idle_s: float) -> dict[str, float]:
    path, body = REQUESTS[model]
    warm_s = []
    for _ in range(5):
        start = time.perf_counter()
        client.post(path, json=body).raise_for_status()
        warm_s.append(time.perf_counter() - start)
    wait_until(lambda: parked(client, model), idle_s + 30, f"{model} never unloaded")
    loads_before = metric(client, "fulcrum_model_cold_start_seconds_sum", model)
    start = time.perf_counter()
    client.post(path, json=body).raise_for_status()
    cold_s = time.perf_counter() - start
    load_s = metric(client, "fulcrum_model_cold_start_seconds_sum", model) - loads_before
    memory_mb = metric(client, "fulcrum_model_memory_bytes", model) / 2**20
    return {"cold_first_answer_s": cold_s, "server_load_s": load_s,
            "warm_median_s": statistics.median(warm_s), "memory_mb": memory_mb}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "models"
        subprocess.run([sys.executable, "-m", "fulcrum.cli", "examples", str(root)], check=True)
        for model in args.models:
            with open(root / model / "config.toml", "a") as config:
                config.write(f"\n[lifecycle]\nidle_unload_s = {args.idle_s}\n")
        port = free_port()
        command = [sys.executable, "-m", "fulcrum.cli", "--log-level", "WARNING", "serve",
                   "--repository", str(root), "--port", str(port)]  # fmt: skip
        for model in args.models:
            command += ["--model", model]
        server = subprocess.Popen(command, env={**os.environ})
        results: dict[str, list[dict[str, float]]] = {m: [] for m in args.models}
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
                wait_until(lambda: _ready(client), 300, "server never ready")
                for run in range(args.runs):
                    for model in args.models:
                        row = one_run(client, model, args.idle_s)
                        results[model].append(row)
                        print(json.dumps({"model": model, "run": run + 1, **row}), flush=True)
        finally:
            server.terminate()
            server.wait(60)
    for model, rows in results.items():
        cold = [r["cold_first_answer_s"] * 1000 for r in rows]
        warm = [r["warm_median_s"] * 1000 for r in rows]
        print(f"{model}: cold first answer {min(cold):.0f}-{max(cold):.0f} ms "
              f"(median {statistics.median(cold):.0f}), warm {statistics.median(warm):.1f} ms, "
              f"cold/warm {statistics.median(cold) / statistics.median(warm):.0f}x")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


def _ready(client: httpx.Client) -> bool:
    try:
        return client.get("/v2/health/ready").status_code == 200
    except httpx.TransportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
