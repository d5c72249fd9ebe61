"""The Ray tests' cluster helpers: the test repository, `ray start`, waiting for readiness and
replica counts. Ray must never start on the host network:
`scripts/ray-tests.sh` runs these tests in a fresh namespace that has only loopback, and the
fixture refuses (fails, never skips) anywhere else."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ECHO = """
platform = "echo"
max_batch_size = 8
[[inputs]]
name = "x"
datatype = "FP32"
shape = [4]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [4]
[dynamic_batching]
max_queue_delay_ms = 1
{batching}
[parameters]
{params}
[scale]
{scale}
"""
# name -> (extra [dynamic_batching] keys, echo [parameters], [scale] table)
MODELS = {
    "echo": ("", "latency_a_ms = 2.0", "min_replicas = 2\nmax_replicas = 2\nnum_cpus = 0.25"),
    # A batch of 8 takes 200 ms against a 150 ms SLO: a dozen clients overload one replica.
    "slow": (
        "policy = \"adaptive\"\nslo_p99_ms = 150",
        "latency_a_ms = 40.0\nlatency_b_ms = 20.0",
        "min_replicas = 1\nmax_replicas = 3\nnum_cpus = 0.25\nupscale_delay_s = 1.0\n"
        "downscale_delay_s = 4.0",
    ),
    "zero": ("", "latency_a_ms = 1.0", "min_replicas = 0\nmax_replicas = 1\nnum_cpus = 0.25\n"
             "downscale_delay_s = 2.0"),
    "rolling": ("", "latency_a_ms = 5.0", "min_replicas = 2\nmax_replicas = 2\nnum_cpus = 0.25"),
}  # fmt: skip
APP = "fulcrum"
# Serve's autoscaling signals every half second (default 10 s), so a test sees a decision soon.
CLUSTER_ENV = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR": "0.2",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Only loopback in the namespace: no token. Left unset, Ray 2.59 turns token auth on for a
    # cluster whenever ~/.ray/auth_token exists (any earlier local `ray.init()` writes one).
    "RAY_AUTH_MODE": "disabled",
}


def only_loopback() -> bool:
    """True inside a network namespace whose only interface is lo."""
    # if_nameindex asks the kernel for this process's namespace (/sys may be the host's).
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_echo(repository: Path, name: str, batching: str, params: str, scale: str) -> None:
    model = repository / name
    (model / "1").mkdir(parents=True, exist_ok=True)
    text = ECHO.format(batching=batching, params=params, scale=scale)
    (model / "config.toml").write_text(text)


def build_repository(directory: Path) -> list[str]:
    for name, (batching, params, scale) in MODELS.items():
        write_echo(directory, name, batching, params, scale)
    names = list(MODELS)
    try:
        from fulcrum.examples import build_minilm, build_tiny_gpt2
    except Exception:  # no [examples] extra: the echo models alone
        return names
    names.append(build_minilm(directory))
    names.append(build_tiny_gpt2(directory))
    for extra in ("minilm", "tiny-gpt2"):  # a replica each, light on the shared CPUs
        config = directory / extra / "config.toml"
        if "[scale]" not in config.read_text():
            config.write_text(config.read_text() + "\n[scale]\nnum_cpus = 0.5\n")
    return names


@dataclass(frozen=True)
class Cluster:
    address: str
    url: str  # the ingress, through Serve's HTTP proxy
    repository: Path
    models: tuple[str, ...]


def ray_cli(*args: str) -> None:
    ray_bin = str(Path(sys.executable).parent / "ray")
    env = {**os.environ, **CLUSTER_ENV}
    subprocess.run([ray_bin, *args], check=True, env=env, capture_output=True, timeout=120)


def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"ingress at {url} not ready within {timeout_s} s")


def running_replicas(model: str) -> int:
    from fulcrum.ray.app import deployment_name
    from ray import serve

    status = serve.status().applications[APP].deployments[deployment_name(model)]
    return int(status.replica_states.get("RUNNING", 0))


def wait_for(predicate: object, timeout_s: float, what: str) -> float:
    """Seconds until `predicate()` held (polled twice a second); fails after `timeout_s`."""
    assert callable(predicate)
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout_s} s")
