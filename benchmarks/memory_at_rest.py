"""Memory at rest: `fulcrum serve` serving `minilm` alone beside a bare FastAPI + ONNX Runtime
process serving the same ONNX file with the same tokenizer and session options.

    .venv/bin/python benchmarks/memory_at_rest.py

Three servers, one at a time, each on a free 127.0.0.1 port: `fulcrum serve --model minilm`;
the same with torch, numba, matplotlib and safetensors made unimportable (serving ONNX must not
need them); and the baseline. Each gets the same warm-up requests, sequential so no server batches
across requests; after a rest its resident set (VmRSS, and PSS from smaps_rollup) is read from
/proc. Prints the figures, the ratio, and whether any torch library is mapped into a process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

# The bare baseline: FastAPI + tokenizers + onnxruntime, as a user would write it by hand, with
# minilm's session options (2 intra-op threads, no spinning) and its tokenizer settings.
BASELINE = """
import sys

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI
from tokenizers import Tokenizer

model_dir, port = sys.argv[1], int(sys.argv[2])
tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
tokenizer.enable_padding()
tokenizer.enable_truncation(max_length=256)
options = ort.SessionOptions()
options.intra_op_num_threads = 2
options.add_session_config_entry("session.intra_op.allow_spinning", "0")
options.add_session_config_entry("session.inter_op.allow_spinning", "0")
providers = ["CPUExecutionProvider"]
session = ort.InferenceSession(f"{model_dir}/model.onnx", options, providers=providers)
app = FastAPI()


@app.get("/health")
def health() -> dict[str, bool]:
    return {"ok": True}


@app.post("/embed")
def embed(body: dict[str, list[str]]) -> dict[str, list[list[float]]]:
    encodings = tokenizer.encode_batch(body["texts"])
    feeds = {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
    }
    return {"embeddings": session.run(["embedding"], feeds)[0].tolist()}


uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning")
"""

# Makes the heavy optional packages unimportable before Fulcrum's CLI starts.
BLOCKED_SERVE = """
import sys

BLOCKED = {"torch", "numba", "matplotlib", "safetensors"}


class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, Blocker())
from fulcrum.cli import main

sys.exit(main(sys.argv[1:]))
"""

SENTENCES = [
    "The server batches requests to use the hardware well.",
    "Dynamic batching trades a little latency for a lot of throughput.",
    "A cat sat on the warm windowsill all afternoon.",
    "Kittens like to sleep in the sun.",
    "Memory at rest is what a replica costs before it serves anything at all.",
    "ONNX Runtime allocates its arena on the first runs and keeps it.",
    "Short.",
    "A much longer sentence " * 12,
]


Embed = Callable[[str, list[str]], np.ndarray]


@dataclass
class Reading:
    name: str
    ready_rss_mb: float  # after start-up, before any request
    rss_mb: float  # at rest after the warm-up
    pss_mb: float
    torch_mapped: bool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server(command: list[str], health_url: str, log_path: Path) -> Iterator[int]:
    """Start a server process, wait until `health_url` answers 200, yield its pid; stop it."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{command[:3]} exited {proc.returncode}; see {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(health_url, timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"not ready after 180 s; see {log_path}")
                time.sleep(0.2)  # a one-off start-up wait, not a measurement
            yield proc.pid
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def memory_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, Pss) of `pid` in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    pss_kb = next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
    return rss_kb / 1024, pss_kb / 1024


def torch_mapped(pid: int) -> bool:
    """True when any file of a torch installation is mapped into `pid`."""
    return "/torch/" in Path(f"/proc/{pid}/maps").read_text()


def fulcrum_embed(url: str, texts: list[str]) -> np.ndarray:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts), 1],
                        "data": texts}]}  # fmt: skip
    response = httpx.post(f"{url}/v2/models/minilm/infer", json=body, timeout=60)
    response.raise_for_status()
    out = response.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def baseline_embed(url: str, texts: list[str]) -> np.ndarray:
    response = httpx.post(f"{url}/embed", json={"texts": texts}, timeout=60)
    response.raise_for_status()
    return np.asarray(response.json()["embeddings"], dtype=np.float32)


def warm_up(embed: Embed, url: str, rounds: int) -> np.ndarray:
    """The same sequential requests for every server: single sentences and batches of 8."""
    for _ in range(rounds):
        for sentence in SENTENCES:
            embed(url, [sentence])
        embed(url, SENTENCES)
    return embed(url, SENTENCES)


def measure(name: str, pid: int, ready_rss_mb: float, rest_s: float) -> Reading:
    time.sleep(rest_s)  # at rest: no request in flight, background threads idle
    rss_mb, pss_mb = memory_mb(pid)
    return Reading(name, ready_rss_mb, rss_mb, pss_mb, torch_mapped(pid))


def commands(repo: Path, port: int) -> dict[str, tuple[list[str], str, Embed]]:
    """name -> (command, health URL, embed function) of each server on `port`."""
    python, url = sys.executable, f"http://127.0.0.1:{port}"
    serve = ["--log-level", "WARNING", "serve", "--repository", str(repo), "--model", "minilm"]
    serve += ["--port", str(port)]
    ready = f"{url}/v2/health/ready"
    return {
        FULCRUM: ([python, "-m", "fulcrum.cli", *serve], ready, fulcrum_embed),
        BLOCKED: ([python, "-c", BLOCKED_SERVE, *serve], ready, fulcrum_embed),
        BARE: ([python, "-c", BASELINE, str(repo / "minilm" / "1"), str(port)], f"{url}/health",
               baseline_embed),
    }  # fmt: skip


FULCRUM, BLOCKED, BARE = "fulcrum serve", "fulcrum serve, torch blocked", "bare FastAPI + ORT"


def run(repo: Path, rounds: int, rest_s: float, repeat: int) -> tuple[list[Reading], float]:
    """Every server `repeat` times, interleaved; the readings and the largest difference between
    the baseline's embeddings and Fulcrum's (the baseline must do the same work)."""
    logs = repo / "logs"
    logs.mkdir(exist_ok=True)
    readings: list[Reading] = []
    vectors: dict[str, np.ndarray] = {}
    for _ in range(repeat):
        for name in (FULCRUM, BLOCKED, BARE):
            port = free_port()
            command, health, embed = commands(repo, port)[name]
            log = logs / f"{len(readings)}.log"
            with server(command, health, log) as pid:
                ready_rss_mb = memory_mb(pid)[0]
                vectors[name] = warm_up(embed, f"http://127.0.0.1:{port}", rounds)
                readings.append(measure(name, pid, ready_rss_mb, rest_s))
    return readings, float(np.abs(vectors[BARE] - vectors[FULCRUM]).max())


def summary(readings: list[Reading]) -> dict[str, dict[str, float | bool]]:
    """Per server: median (and range) of each figure, and whether torch was ever mapped."""
    result: dict[str, dict[str, float | bool]] = {}
    for name in (FULCRUM, BLOCKED, BARE):
        mine = [r for r in readings if r.name == name]
        row: dict[str, float | bool] = {"torch_mapped": any(r.torch_mapped for r in mine)}
        for field in ("ready_rss_mb", "rss_mb", "pss_mb"):
            values = [getattr(r, field) for r in mine]
            row[field] = statistics.median(values)
            row[f"{field}_min"], row[f"{field}_max"] = min(values), max(values)
        result[name] = row
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20, help="warm-up rounds (9 requests each)")
    parser.add_argument("--rest", type=float, default=3.0, help="seconds idle before reading")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each server, interleaved")
    parser.add_argument("--json", type=Path, help="also write the readings here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        subprocess.run([sys.executable, "-m", "fulcrum.cli", "examples", str(repo)], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        readings, worst = run(repo, args.rounds, args.rest, args.repeat)
    table = summary(readings)
    print(f"median of {args.repeat} runs (range), MiB")
    print(f"{'process':30} {'RSS ready':>16} {'RSS at rest':>16} {'PSS at rest':>16}  torch")
    for name, row in table.items():
        cells = [
            f"{row[f]:6.1f} ({row[f + '_min']:.0f}-{row[f + '_max']:.0f})"
            for f in ("ready_rss_mb", "rss_mb", "pss_mb")
        ]
        mapped = "mapped" if row["torch_mapped"] else "not mapped"
        print(f"{name:30} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16}  {mapped}")
    fulcrum, bare = table[FULCRUM], table[BARE]
    rss_ratio = float(fulcrum["rss_mb"]) / float(bare["rss_mb"])
    pss_ratio = float(fulcrum["pss_mb"]) / float(bare["pss_mb"])
    print(f"ratio fulcrum / bare at rest: RSS {rss_ratio:.2f}x, PSS {pss_ratio:.2f}x")
    print(f"max |embedding difference| fulcrum vs bare: {worst:.2e}")
    print(f"machine: {os.uname().machine}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in readings], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
