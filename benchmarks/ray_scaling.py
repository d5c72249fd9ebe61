"""The Ray Serve path (fulcrum.ray) against single-process `fulcrum serve`, and its scaling.

    unshare --net --pid --fork --mount-proc bash -c \
        'ip link set lo up && .venv/bin/python benchmarks/ray_scaling.py'

Ray must never start on the host network: this script refuses to run outside a network
namespace whose only interface is loopback (the command above makes one). In one run:
1. MiniLM: raw ONNX Runtime throughput in process (best batch), served by single-process
   `fulcrum serve`, and served through Ray (proxy -> ingress -> one model replica): served/raw.
2. An echo model with a fixed 50 ms latency (max batch 1: each replica serves 20 req/s, sleeping,
   so the two cores are not the limit) at 1, 2 and 4 replicas: throughput and its ratio to 1.
3. A model of larger clusters from the measured per-request cost of the Ray path (stated as a
   model, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import numpy as np
import serving_efficiency
from corpus import sentences
from serving_efficiency import raw_throughput, served_throughput

from fulcrum.client import Endpoint, build_request
from fulcrum.demo import free_port, serve
from fulcrum.examples import build_minilm
from fulcrum.protocol import RequestedOutput, encode_infer_request

ECHO = """
platform = "echo"
max_batch_size = 1
[[inputs]]
name = "text"
datatype = "BYTES"
shape = [1]
[[outputs]]
name = "embedding"
datatype = "BYTES"
shape = [1]
[parameters]
latency_a_ms = {latency_ms}
[scale]
min_replicas = {replicas}
max_replicas = {replicas}
num_cpus = 0.1
"""
REPLICAS = (1, 2, 4)


def only_loopback() -> bool:
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def start_ray(num_cpus: int) -> str:
    port = free_port()
    ray_bin = str(Path(sys.executable).parent / "ray")
    # Loopback only: no token (left unset, Ray enables token auth if ~/.ray/auth_token exists).
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([ray_bin, "start", "--head", f"--port={port}", f"--num-cpus={num_cpus}",
                    "--include-dashboard=false", "--node-ip-address=127.0.0.1"],
                   check=True, env=env, capture_output=True, timeout=180)  # fmt: skip
    return f"127.0.0.1:{port}"


def deploy(repository: Path, models: list[str], http_port: int) -> str:
    from fulcrum.ray import app_builder
    from ray import serve

    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": http_port})
    app = app_builder({"repository": str(repository), "models": ",".join(models)})
    serve.run(app, name="fulcrum", route_prefix="/")
    return f"http://127.0.0.1:{http_port}"


def measure(url: str, model: str, texts: list[str], concurrency: int, args: argparse.Namespace
            ) -> tuple[float, float, int]:  # fmt: skip
    """serving_efficiency's closed loop, its requests addressed to `model`."""
    import uvloop

    def prebuilt(endpoint: Endpoint, texts: list[str]) -> list[bytes]:
        out = []
        for text in texts:
            body, headers = encode_infer_request(
                {"text": np.array([[text.encode()]], dtype=object)}, binary=True,
                outputs=(RequestedOutput("embedding", True),),
            )  # fmt: skip
            path = f"/v2/models/{model}/infer"
            out.append(build_request(endpoint, "POST", path, headers=headers, body=body))
        return out

    serving_efficiency.prebuilt_requests = prebuilt  # the loop looks it up at each call
    return uvloop.run(served_throughput(url, texts, concurrency, args.warmup, args.duration))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--raw-seconds", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--echo-latency-ms", type=float, default=50.0)
    args = parser.parse_args()
    if not only_loopback():
        print("refusing: run inside a loopback-only network namespace (see the docstring)")
        return 2
    import ray

    texts = sentences(2048, 24, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        build_minilm(repo)
        config = repo / "minilm" / "config.toml"
        config.write_text(config.read_text() + "\n[scale]\nnum_cpus = 1\n")
        for n in REPLICAS:
            (repo / f"sleep-r{n}" / "1").mkdir(parents=True)
            (repo / f"sleep-r{n}" / "config.toml").write_text(
                ECHO.format(latency_ms=args.echo_latency_ms, replicas=n)
            )
        rates = raw_throughput(repo, texts, args.raw_seconds)
        raw_best = max(rates.values())
        single_repo = repo / "single"
        single_repo.mkdir()
        (single_repo / "minilm").symlink_to(repo / "minilm")
        with serve(single_repo, free_port(), log_path=repo / "single.log") as url:
            single = measure(url, "minilm", texts, args.concurrency, args)
        address = start_ray(num_cpus=2)
        ray.init(address=address, logging_level="WARNING")
        try:
            url = deploy(repo, ["minilm", *[f"sleep-r{n}" for n in REPLICAS]], free_port())
            time.sleep(2.0)  # let every replica report to the stats hub once
            on_ray = measure(url, "minilm", texts, args.concurrency, args)
            echo = {
                n: measure(url, f"sleep-r{n}", texts, args.concurrency * n // 2 or 1, args)
                for n in REPLICAS
            }
        finally:
            from ray import serve as ray_serve

            ray_serve.shutdown()
            ray.shutdown()
    print(render(args, rates, raw_best, single, on_ray, echo))
    return 0


def render(args: argparse.Namespace, rates: dict[int, float], raw_best: float,
           single: tuple[float, float, int], on_ray: tuple[float, float, int],
           echo: dict[int, tuple[float, float, int]]) -> str:  # fmt: skip
    per_replica = 1000.0 / args.echo_latency_ms
    by_batch = ", ".join(f"{b}: {r:.0f}" for b, r in rates.items())
    lines = [
        f"raw minilm best: {raw_best:.0f} seq/s (by batch size {by_batch})",
        "| path | req/s | P50 ms | errors | served / raw |",
        "|---|---|---|---|---|",
        f"| single-process fulcrum serve | {single[0]:.0f} | {single[1]:.1f} | {single[2]} | "
        f"{single[0] / raw_best:.2f} |",
        f"| Ray Serve (fulcrum.ray) | {on_ray[0]:.0f} | {on_ray[1]:.1f} | {on_ray[2]} | "
        f"{on_ray[0] / raw_best:.2f} |",
        f"Ray / single process: {on_ray[0] / single[0]:.2f}",
        "",
        f"| echo {args.echo_latency_ms:g} ms, replicas | req/s | P50 ms | errors | vs 1 replica "
        f"| vs ideal ({per_replica:.0f}/replica) |",
        "|---|---|---|---|---|---|",
    ]
    base = echo[REPLICAS[0]][0]
    for n, (rate, p50, errors) in echo.items():
        lines.append(f"| {n} | {rate:.1f} | {p50:.1f} | {errors} | {rate / base:.2f} | "
                     f"{rate / (n * per_replica):.2f} |")  # fmt: skip
    lines += ["", *scaling_model(on_ray[0], echo, per_replica)]
    return "\n".join(lines)


def scaling_model(
    ray_minilm_rps: float, echo: dict[int, tuple[float, float, int]], per_replica: float
) -> list[str]:
    """Beyond this machine, as a model: N replicas serve min(N x C x e, k x R), where C is one
    replica's capacity, e the per-replica efficiency measured here at the largest N, and R the
    rate one ingress replica (with its proxy) carried here."""
    largest = max(echo)
    efficiency = echo[largest][0] / (largest * per_replica)
    ingress_rps = max(ray_minilm_rps, max(rate for rate, _, _ in echo.values()))
    lines = [
        "Model (not measured): N replicas of C req/s each behind k ingress replicas serve "
        f"min(N*C*e, k*R); e = {efficiency:.2f} (measured at {largest} replicas), R >= "
        f"{ingress_rps:.0f} req/s (the most one ingress carried here, a lower bound).",
        "| N replicas (C = 20 req/s) | k = 1 | k = 4 |",
        "|---|---|---|",
    ]
    for n in (8, 16, 64, 256):
        one = min(n * per_replica * efficiency, ingress_rps)
        four = min(n * per_replica * efficiency, 4 * ingress_rps)
        lines.append(f"| {n} | {one:.0f} | {four:.0f} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
