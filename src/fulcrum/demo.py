"""`make demo`: build the example repository, serve it, embed a few sentences, then measure the
latency/throughput trade-off of `minilm` without and with dynamic batching."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from fulcrum.examples import build_examples
from fulcrum.extras import missing_extra

try:
    import httpx
except ImportError as exc:  # the demo's client comes with the [examples] extra
    raise missing_extra("examples", "httpx", exc, feature="the demo") from exc

SENTENCES = [
    "The server batches requests to use the hardware well.",
    "Dynamic batching trades a little latency for a lot of throughput.",
    "A cat sat on the warm windowsill all afternoon.",
    "Kittens like to sleep in the sun.",
]
console = Console()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(repository: Path, port: int, *, log_path: Path) -> Iterator[str]:
    """Run `fulcrum serve` in a child process until the block ends (SIGTERM, then drain)."""
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fulcrum.cli", "serve", "--repository", str(repository),
             "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_ready(url, proc, timeout_s=180)
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_ready(url: str, proc: subprocess.Popen[bytes], *, timeout_s: float) -> None:
    """Block until /v2/health/ready answers 200 (a one-off start-up wait, with backoff)."""
    deadline = time.monotonic() + timeout_s
    delay_s = 0.05
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fulcrum serve exited with code {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                return
        time.sleep(delay_s)
        delay_s = min(delay_s * 2, 1.0)
    raise RuntimeError(f"fulcrum serve not ready after {timeout_s:.0f} s")


def embed(url: str, sentences: list[str]) -> np.ndarray:
    body = {
        "inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [len(sentences), 1], "data": sentences}
        ]
    }
    response = httpx.post(f"{url}/v2/models/minilm/infer", json=body, timeout=30)
    response.raise_for_status()
    out = response.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def show_similarities(url: str) -> None:
    vectors = embed(url, SENTENCES)
    table = Table(title="minilm: cosine similarity of sentence embeddings")
    table.add_column("")
    for i in range(len(SENTENCES)):
        table.add_column(f"#{i}", justify="right")
    for i, sentence in enumerate(SENTENCES):
        table.add_row(f"#{i} {sentence[:48]}", *(f"{v:.2f}" for v in vectors @ vectors[i]))
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repository", default="models")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--duration", type=float, default=float(os.environ.get("DEMO_S", 8)))
    args = parser.parse_args(argv)
    repository = Path(args.repository)
    names = build_examples(repository)
    console.print(f"[bold]model repository[/] {repository}: {', '.join(names)}")
    port = args.port or free_port()
    log_path = repository / "server.log"
    with serve(repository, port, log_path=log_path) as url:
        console.print(f"[bold]fulcrum serve[/] listening on {url} (log: {log_path})")
        show_similarities(url)
        from fulcrum.demo_bench import batching_trade_off

        batching_trade_off(url, repository, duration_s=args.duration, console=console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
