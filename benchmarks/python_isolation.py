"""MiniLM's latency beside a Python model that holds the GIL, with that model in a thread of the
server (`isolation = "thread"`) or in its own process (`"process"`); and what a crash does.

    .venv/bin/python benchmarks/python_isolation.py [--duration 10] [--record]

Three server runs on one machine: MiniLM alone (the hog loaded, idle), then MiniLM under load
beside the hog under load, once per isolation. The figures that matter are the ratios of
MiniLM's P99 to its P99 alone, measured in the same run. Then one request makes the hog call
`os._exit`: the table says what it answered and whether MiniLM still answers.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from corpus import sentences

from fulcrum.client import Connection, Endpoint, build_request
from fulcrum.demo import free_port, serve
from fulcrum.examples import build_examples
from fulcrum.protocol import RequestedOutput, encode_infer_request

HOG_MODEL = """
import os
import numpy as np


class Model:
    def execute(self, batch):
        x = batch["x"]
        if int(x.flat[0]) < 0:
            os._exit(3)
        total = 0
        for i in range(200_000 * len(x)):  # pure Python: holds the GIL (~10 ms a row)
            total += i % 7
        return {"y": x + total % 2}
"""

HOG_CONFIG = """
platform = "python"
max_batch_size = 8

[[inputs]]
name = "x"
datatype = "INT64"
shape = [1]

[[outputs]]
name = "y"
datatype = "INT64"
shape = [1]

[parameters]
isolation = "{isolation}"
"""


def add_hog(repo: Path, isolation: str) -> None:
    folder = repo / "hog"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.py").write_text(textwrap.dedent(HOG_MODEL))
    (folder / "config.toml").write_text(HOG_CONFIG.format(isolation=isolation))


def requests(endpoint: Endpoint, texts: list[str]) -> tuple[list[bytes], bytes, bytes]:
    """MiniLM requests (binary BYTES), one hog request, and one that makes the hog exit."""
    minilm = []
    for text in texts:
        body, headers = encode_infer_request(
            {"text": np.array([[text.encode()]], dtype=object)},
            binary=True,
            outputs=(RequestedOutput("embedding", True),),
        )
        minilm.append(
            build_request(endpoint, "POST", "/v2/models/minilm/infer", headers=headers, body=body)
        )
    hog = []
    for value in (1, -1):
        body, headers = encode_infer_request({"x": np.array([[value]])}, binary=False)
        hog.append(build_request(endpoint, "POST", "/v2/models/hog/infer", headers=headers,
                                 body=body))  # fmt: skip
    return minilm, hog[0], hog[1]


async def measure(
    url: str, texts: list[str], hog_clients: int, duration_s: float
) -> tuple[list[float], int]:
    """MiniLM latencies (s) of 4 closed-loop clients while `hog_clients` keep the hog busy;
    and the number of hog requests served."""
    endpoint = Endpoint.from_url(url)
    minilm, hog, _ = requests(endpoint, texts)
    stop_at = time.perf_counter() + duration_s
    latencies: list[float] = []
    num_hog = 0

    async def minilm_client(k: int) -> None:
        connection, i = Connection(endpoint), k
        while (start := time.perf_counter()) < stop_at:
            response = await connection.request(minilm[i % len(minilm)], timeout_s=60)
            assert response.status == 200, response.body[:200]
            latencies.append(time.perf_counter() - start)
            i += 4
        connection.close()

    async def hog_client() -> None:
        nonlocal num_hog
        connection = Connection(endpoint)
        while time.perf_counter() < stop_at:
            assert (await connection.request(hog, timeout_s=60)).status == 200
            num_hog += 1
        connection.close()

    await asyncio.gather(*(minilm_client(k) for k in range(4)),
                         *(hog_client() for _ in range(hog_clients)))  # fmt: skip
    return latencies, num_hog


async def crash(url: str, texts: list[str]) -> tuple[int, int, int]:
    """Statuses of: the request that makes the hog exit, the next hog request, a MiniLM one."""
    endpoint = Endpoint.from_url(url)
    minilm, hog, fatal = requests(endpoint, texts[:1])
    statuses = []
    for request in (fatal, hog, minilm[0]):
        connection = Connection(endpoint)
        try:
            statuses.append((await connection.request(request, timeout_s=60)).status)
        except Exception:  # the server is gone
            statuses.append(0)
        connection.close()
    return statuses[0], statuses[1], statuses[2]


def p99_ms(latencies: list[float]) -> float:
    return float(np.percentile(latencies, 99) * 1e3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--hog-clients", type=int, default=2)
    parser.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    texts = sentences(512, 24, seed=1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        build_examples(repo)
        for label, isolation, hog_clients in (
            ("MiniLM alone (hog idle)", "thread", 0),
            ("beside the hog, isolation = thread", "thread", args.hog_clients),
            ("beside the hog, isolation = process", "process", args.hog_clients),
        ):
            add_hog(repo, isolation)
            with serve(repo, free_port(), log_path=repo / "server.log") as url:
                latencies, num_hog = asyncio.run(measure(url, texts, hog_clients, args.duration))
                statuses = asyncio.run(crash(url, texts)) if hog_clients else None
            rows.append((label, latencies, num_hog, statuses))
    report = render(rows, args)
    print(report)
    if args.record:
        with (Path(__file__).parent / "RESULTS.md").open("a") as f:
            f.write("\n" + report)
    return 0


Row = tuple[str, list[float], int, tuple[int, int, int] | None]


def render(rows: list[Row], args: argparse.Namespace) -> str:
    alone_p99 = p99_ms(rows[0][1])
    lines = [
        f"### python_isolation — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC — "
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "",
        f"Command: `.venv/bin/python benchmarks/python_isolation.py --duration {args.duration:g}"
        f" --hog-clients {args.hog_clients}`. MiniLM: 4 closed-loop clients, one sentence each;"
        " the hog: a Python model spending ~10 ms a row in a pure-Python loop.",
        "",
        "| run | MiniLM requests | P50 ms | P99 ms | P99 / alone | hog requests "
        "| hog `os._exit` request, next hog request, next MiniLM request |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for label, latencies, num_hog, statuses in rows:
        crash_text = "—" if statuses is None else ", ".join(str(s or "no answer") for s in statuses)
        lines.append(
            f"| {label} | {len(latencies)} | {statistics.median(latencies) * 1e3:.1f} | "
            f"{p99_ms(latencies):.1f} | **{p99_ms(latencies) / alone_p99:.2f}x** | {num_hog} | "
            f"{crash_text} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
