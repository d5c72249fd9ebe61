"""A lone request's path through the app alone: Fulcrum's handler beside the bare FastAPI app's.

    .venv/bin/python benchmarks/handler_path.py --repository /tmp/bench_models [--requests 3000]
        [--rounds 3] [--src-before /tmp/before/src]

No HTTP and no model run: each app gets ASGI messages directly, one request at a time, and its
ORT run is replaced by a random 384-float answer (tokenizing, thread hops, decoding, batching,
encoding all kept). What is left is the server's own path, which light load pays on every
request. Each kind runs in a child process (this script with --kind), in turn, --rounds times;
prints P50 / P10 / P90 µs per request and the process CPU per request. Kinds: `fulcrum` (the
minilm example through `Service`), `bare` (adaptive_ends' bare app), and with --src-before
`fulcrum_before` (Fulcrum from another source tree, for a before/after pair).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

TEXT = "The quick brown fox jumps over the lazy dog near the quiet river bank today."
Asgi = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def answer(num_rows: int) -> np.ndarray:
    return np.random.default_rng(0).random((num_rows, 384), np.float32)


def fulcrum_app(repo: Path) -> tuple[Asgi, Callable[[], Awaitable[None]], str, bytes]:
    from fulcrum.backends import onnx
    from fulcrum.server.app import create_app
    from fulcrum.service import Service, ServiceSettings

    def run(self: Any, session: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"embedding": answer(len(next(iter(feeds.values()))))}

    onnx.OnnxBackend._run = run  # type: ignore[method-assign]
    service = Service.from_repository(repo, ServiceSettings(load_models=("minilm",)))
    tensor = {"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": [TEXT]}
    body = json.dumps({"inputs": [tensor]}).encode()
    return (
        create_app(service, manage_lifespan=False),
        service.start,
        "/v2/models/minilm/infer",
        body,
    )


def bare_app(repo: Path) -> tuple[Asgi, Callable[[], Awaitable[None]], str, bytes]:
    from adaptive_ends import bare_app as bare_source

    source = bare_source(split=False)
    replacements = {
        "model_dir, port = sys.argv[1], int(sys.argv[2])": "model_dir = MODEL_DIR",
        'session.run(["embedding"], feeds)[0]': "ANSWER(len(encodings))",
        'uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", '
        'log_level="warning")': "",
    }
    for old, new in replacements.items():
        if old not in source:
            raise RuntimeError(f"the bare app changed: no {old[:40]!r} to replace")
        source = source.replace(old, new)
    namespace: dict[str, Any] = {"MODEL_DIR": str(repo / "minilm" / "1"), "ANSWER": answer}
    exec(source, namespace)  # the bare app's own module text, as a user would write it

    async def nothing() -> None:
        pass

    return namespace["app"], nothing, "/embed", json.dumps({"texts": [TEXT]}).encode()


async def one(app: Asgi, path: str, body: bytes) -> None:
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {},
        "headers": [(b"host", b"x"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }  # fmt: skip
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client stays: no disconnect
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    if status != [200]:
        raise RuntimeError(f"{path} answered {status}")


async def measure(kind: str, repo: Path, num: int) -> dict[str, float]:
    app, start, path, body = (bare_app if kind == "bare" else fulcrum_app)(repo)
    await start()
    for _ in range(200):  # warm-up, unmeasured
        await one(app, path, body)
    times = []
    cpu_s = time.process_time()
    for _ in range(num):
        start_s = time.perf_counter()
        await one(app, path, body)
        times.append(time.perf_counter() - start_s)
        await asyncio.sleep(0.0005)  # an idle moment, as between requests
    cpu_s = time.process_time() - cpu_s
    times.sort()
    return {"p50": statistics.median(times) * 1e6, "p10": times[num // 10] * 1e6,
            "p90": times[9 * num // 10] * 1e6, "cpu": cpu_s / num * 1e6}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repository", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--src-before", type=Path, help="another source tree: `fulcrum_before`")
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kind:
        import uvloop

        print(json.dumps(uvloop.run(measure(args.kind, args.repository, args.requests))))
        return 0
    kinds = ["bare", "fulcrum"] + (["fulcrum_before"] if args.src_before else [])
    for _ in range(args.rounds):
        for kind in kinds:
            env = dict(os.environ)
            if kind == "fulcrum_before":
                env["PYTHONPATH"] = os.pathsep.join(
                    [str(args.src_before), env.get("PYTHONPATH", "")]
                )
            command = [sys.executable, __file__, "--kind", kind, "--repository",
                       str(args.repository), "--requests", str(args.requests)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{kind:15} P50 {row['p50']:5.0f} µs (P10 {row['p10']:.0f}, P90 "
                  f"{row['p90']:.0f}); process CPU {row['cpu']:.0f} µs per request",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
