"""Where an isolated request's time goes: Fulcrum's path beside a bare FastAPI + ORT app's.

    .venv/bin/python benchmarks/light_path.py --repository /tmp/bench_models [--rounds 3]
        [--requests 70] [--gap-s 0.15] [--kinds fulcrum,bare,fulcrum_spin]
        [--texts {fixed,corpus}] [--arrivals {uniform,poisson,open}]
        [--client {http.client,asyncio}]

Light load on this VM means one request at a time after an idle gap. For each kind, a server
runs in a child process (this script with --serve) with timestamps patched in along the path:
ASGI entry, Service.infer, DynamicBatcher.submit, the batch's launch, InstancePool.run, the
backend's execute on the instance thread, the ORT run, the result back on the loop, the
response's first and last send; a client process sends one JSON request at a time after a
random 0.5-1.5x --gap-s pause (`--arrivals poisson`: at Poisson arrival times, one at a time;
`--arrivals open`: at Poisson times beside any still in flight, as the load generator's open
loop, for the `*_serve` kinds; `--texts corpus`: `--ends`' 256 sentences in turn; keep-alive;
`--client asyncio`: the load generator's own client, fulcrum.client on uvloop, instead of
http.client). Stamps are `time.perf_counter()`
(CLOCK_MONOTONIC on Linux), so the client's and the server's compare. Per kind: the median
of each step, of the total and of the time outside the ORT run. Kinds run in turn, --rounds
times (interleaved, each round starting one kind further on), the first 10 requests of each run
unmeasured. Kinds: `fulcrum` (the repository's config), `bare`
(ORT defaults: threads = cores, spinning on), `bare_tuned` (2 threads, no spinning, as
Fulcrum's minilm), `fulcrum_spin` (spinning within runs), `fulcrum_t1` (one intra-op thread),
`fulcrum_idle_spin` (`spin_when_idle`), `fulcrum_dbb` (`dynamic_block_base = 4`), `fulcrum_stop`
(`spin_between_runs = false`: spinning stops when a run returns), `fulcrum_nodbb` (no
`dynamic_block_base`); `fulcrum_serve` and `bare_serve` run the server as `--ends` does, in its
own process (`fulcrum serve`; `--ends`' bare app), with the client's stamps only. Each
kind's parameters are merged into the config's as the backend reads them (before 2026-12-02
only the session options saw them, so `fulcrum_idle_spin` built no second session).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from corpus import sentences

MARKS: list[tuple[str, float]] = []
RUNS: list[list[tuple[str, float]]] = []
STEPS = ("client_send", "asgi_in", "service_in", "submit_in", "launch", "pool_in", "exec_in",
         "ort_in", "ort_out", "exec_out", "pool_out", "resolve", "submit_out", "service_out",
         "resp_start", "resp_sent", "client_recv")  # fmt: skip
KIND_PARAMETERS: dict[str, dict[str, object]] = {
    "fulcrum_spin": {"allow_spinning": True},
    "fulcrum_t1": {"intra_op_threads": 1},
    "fulcrum_idle_spin": {"spin_when_idle": True},
    "fulcrum_stop": {"spin_between_runs": False},
    "fulcrum_dbb": {"dynamic_block_base": 4},
    "fulcrum_nodbb": {"dynamic_block_base": 0},
}
TEXT = "The quick brown fox jumps over the lazy dog near the quiet river bank today."

# Both clients read the request bodies (a JSON list) on stdin and send them in turn; the gaps:
# uniform in 0.5-1.5x gap after each answer, or Poisson arrivals (each send at its scheduled
# time, or at once when the answer before came later: one request at a time, never two). The
# asyncio client's `open` arrivals are the load generator's open loop: each request at its
# Poisson time on a free connection, beside any still in flight (~7% of them at 10/s).
CLIENT = r"""
import http.client, json, random, sys, time
port, path, n, gap = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
arrivals = sys.argv[5]
bodies = [b.encode() for b in json.load(sys.stdin)]
conn = http.client.HTTPConnection("127.0.0.1", port)
rnd, out, due = random.Random(1), [], time.perf_counter()
for i in range(n):
    if arrivals == "poisson":
        due += rnd.expovariate(1 / gap)
        time.sleep(max(0.0, due - time.perf_counter()))
    else:
        time.sleep(rnd.uniform(0.5 * gap, 1.5 * gap))  # the idle gap is the workload
    t0 = time.perf_counter()
    conn.request("POST", path, bodies[i % len(bodies)], {"Content-Type": "application/json"})
    response = conn.getresponse(); response.read()
    assert response.status == 200, response.status
    out.append((t0, time.perf_counter()))
print(json.dumps(out))
"""
# The same, through the load generator's own HTTP client (asyncio, uvloop, fulcrum.client), which
# `adaptive_vs_static.py --ends` measures with: the two clients disagreed on the light-load gap.
CLIENT_ASYNC = r"""
import asyncio, json, random, sys, time
import uvloop
from fulcrum.client import Connection, Endpoint, build_request
port, path, n, gap = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
arrivals = sys.argv[5]
bodies = [b.encode() for b in json.load(sys.stdin)]
async def main():
    endpoint = Endpoint.from_url(f"http://127.0.0.1:{port}")
    headers = {"Content-Type": "application/json"}
    raws = [build_request(endpoint, "POST", path, headers=headers, body=b) for b in bodies]
    free, rnd, out, due = [Connection(endpoint)], random.Random(1), [None] * n, time.perf_counter()
    async def one(i):
        conn = free.pop() if free else Connection(endpoint)  # a request in flight keeps its own
        t0 = time.perf_counter()
        response = await conn.request(raws[i % len(raws)], timeout_s=10.0)
        assert response.status == 200, response.status
        out[i] = (t0, time.perf_counter())
        free.append(conn)
    sent = []
    for i in range(n):
        if arrivals in ("poisson", "open"):
            due += rnd.expovariate(1 / gap)
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
        else:
            await asyncio.sleep(rnd.uniform(0.5 * gap, 1.5 * gap))  # the idle gap is the workload
        if arrivals == "open":  # sent at its time, beside any request still in flight
            sent.append(asyncio.create_task(one(i)))
        else:
            await one(i)
    await asyncio.gather(*sent)
    for conn in free:
        conn.close()
    print(json.dumps(out))
uvloop.run(main())
"""
CLIENTS = {"http.client": CLIENT, "asyncio": CLIENT_ASYNC}

# The bare app as `--ends` runs it (memory_at_rest.BASELINE), with stamps. Its return type lets
# FastAPI encode the answer with pydantic's serializer: 0.54 ms from the run's end to the answer's
# first byte, where an unannotated return goes through jsonable_encoder (1.24 ms). Before
# 2026-12-03 it had none, and Fulcrum's path outside the run looked 0.3 ms quicker than this
# baseline's when it is 0.3 ms slower (RESULTS, stop 34).
BARE = """
import numpy as np, onnxruntime as ort
from fastapi import FastAPI
from tokenizers import Tokenizer

def build(model_dir, mark, tuned):
    tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    tokenizer.enable_padding()
    tokenizer.enable_truncation(max_length=256)
    options = ort.SessionOptions()
    if tuned:
        options.intra_op_num_threads = 2
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(f"{model_dir}/model.onnx", options,
                                   providers=["CPUExecutionProvider"])
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"ok": True}

    @app.post("/embed")
    def embed(body: dict[str, list[str]]) -> dict[str, list[list[float]]]:
        mark("exec_in")
        encodings = tokenizer.encode_batch(body["texts"])
        feeds = {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }
        mark("ort_in")
        out = session.run(["embedding"], feeds)[0]
        mark("ort_out")
        answer = {"embeddings": out.tolist()}
        mark("exec_out")
        return answer

    return app
"""

Asgi = Callable[[Any, Any, Any], Awaitable[None]]


def mark(name: str) -> None:
    MARKS.append((name, time.perf_counter()))


def stamped(app: Asgi, path: str) -> Asgi:
    """The app with a stamp at entry and at the response's first and last send."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != path:
            return await app(scope, receive, send)
        MARKS.clear()
        mark("asgi_in")

        async def stamped_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                mark("resp_start")
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                mark("resp_sent")
                RUNS.append(list(MARKS))

        await app(scope, receive, stamped_send)

    return wrapped


def patch(cls: Any, name: str, before: str, after: str | None) -> None:
    original = getattr(cls, name)
    if not callable(original):
        raise TypeError(name)
    if hasattr(original, "__code__") and original.__code__.co_flags & 0x80:  # a coroutine

        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            mark(before)
            try:
                return await original(*args, **kwargs)
            finally:
                if after:
                    mark(after)

        setattr(cls, name, traced_async)
        return

    def traced(*args: Any, **kwargs: Any) -> Any:
        mark(before)
        try:
            return original(*args, **kwargs)
        finally:
            if after:
                mark(after)

    setattr(cls, name, traced)


def fulcrum_app(repo: Path, kind: str) -> tuple[Asgi, Any]:
    from fulcrum import batcher, instances
    from fulcrum.backends import onnx
    from fulcrum.server.app import create_app
    from fulcrum.server.early_refusal import EarlyRefusal
    from fulcrum.server.limits import EdgeLimits, protocol_with
    from fulcrum.service import Service, ServiceSettings

    for cls, name, before, after in [
        (Service, "infer", "service_in", "service_out"),
        (batcher.DynamicBatcher, "submit", "submit_in", "submit_out"),
        (batcher.DynamicBatcher, "_start", "launch", None),  # a batch task made
        (batcher.DynamicBatcher, "_resolve", "resolve", None),
        (instances.InstancePool, "run", "pool_in", "pool_out"),
        (onnx.OnnxBackend, "execute", "exec_in", "exec_out"),
        (onnx.OnnxBackend, "execute_lone", "exec_in", "exec_out"),  # a lone batch's path
        (onnx.OnnxBackend, "_run", "ort_in", "ort_out"),
    ]:
        patch(cls, name, before, after)
    # The kind's parameters reach the backend itself, not only its session options: with
    # `spin_when_idle` the backend builds and picks a second session.
    decode = onnx.decode_parameters

    def parameters(raw: dict[str, Any], kind_type: Any) -> Any:
        return decode({**raw, **KIND_PARAMETERS.get(kind, {})}, kind_type)

    onnx.decode_parameters = parameters  # type: ignore[assignment]
    settings = ServiceSettings(load_models=("minilm",), freeze_gc_after_start=True)
    service = Service.from_repository(repo, settings)
    app = stamped(create_app(service), "/v2/models/minilm/infer")
    return app, protocol_with(EdgeLimits(), EarlyRefusal(service))


def bodies(kind: str, texts: list[str]) -> tuple[str, list[str]]:
    """The infer path and one JSON body per text for this kind's server."""
    if kind.startswith("fulcrum"):
        tensor = {"name": "text", "datatype": "BYTES", "shape": [1, 1]}
        return "/v2/models/minilm/infer", [
            json.dumps({"inputs": [{**tensor, "data": [t]}]}) for t in texts
        ]
    return "/embed", [json.dumps({"texts": [t]}) for t in texts]


def send(args: argparse.Namespace, port: int, path: str, payloads: list[str]
         ) -> list[list[float]]:  # fmt: skip
    """The client process's (send, answer) stamps, sending `payloads` in turn."""
    command = [sys.executable, "-c", CLIENTS[args.client], str(port), path, str(args.requests),
               str(args.gap_s), args.arrivals]  # fmt: skip
    done = subprocess.run(command, input=json.dumps(payloads), capture_output=True, text=True,
                          check=True)  # fmt: skip
    sent: list[list[float]] = json.loads(done.stdout)
    return sent


def serve_apart(args: argparse.Namespace, texts: list[str]) -> list[dict[str, float]]:
    """`fulcrum_serve` and `bare_serve`: the server in its own process, as `--ends` runs it
    (`fulcrum serve`; adaptive_ends' bare app); only the client's stamps."""
    from adaptive_ends import bare_app
    from health_under_flood import serving
    from memory_at_rest import server as bare_server

    from fulcrum.demo import free_port

    path, requests = bodies(args.serve, texts)
    with tempfile.TemporaryDirectory() as logs:
        if args.serve == "fulcrum_serve":
            src = Path(__file__).resolve().parents[1] / "src"
            with serving(args.repository, src, Path(logs) / "serve.log") as (_, port):
                sent = send(args, port, path, requests)
        else:
            port = free_port()
            command = [sys.executable, "-c", bare_app(), str(args.repository / "minilm" / "1"),
                       str(port)]  # fmt: skip
            with bare_server(command, f"http://127.0.0.1:{port}/health", Path(logs) / "b.log"):
                sent = send(args, port, path, requests)
    return [{"client_send": a, "client_recv": b} for a, b in sent[10:]]


def serve(args: argparse.Namespace) -> None:
    """Run one kind's server in this process and one client process against it; print JSON."""
    import uvicorn

    from fulcrum.demo import free_port

    texts = [TEXT] if args.texts == "fixed" else sentences(256, 12, seed=1)
    if args.serve.endswith("_serve"):
        print(json.dumps(serve_apart(args, texts)))
        return
    port, kind = free_port(), args.serve
    path, requests = bodies(kind, texts)
    if kind.startswith("fulcrum"):
        app, http = fulcrum_app(args.repository, kind)
    else:
        namespace: dict[str, Any] = {}
        exec(BARE, namespace)  # the bare app's own module text, as a user would write it
        model_dir = args.repository / "minilm" / "1"
        app = stamped(namespace["build"](model_dir, mark, kind == "bare_tuned"), "/embed")
        http = "httptools"
    config = uvicorn.Config(app, host="127.0.0.1", port=port, loop="uvloop", http=http,
                            log_level="warning", access_log=False, lifespan="on")  # fmt: skip
    server = uvicorn.Server(config)
    sent: list[list[float]] = []

    def client() -> None:
        while not server.started:
            time.sleep(0.1)  # start-up, not measured
        sent.extend(send(args, port, path, requests))
        server.should_exit = True

    thread = threading.Thread(target=client)
    thread.start()
    server.run()
    thread.join()
    rows = []
    for (send_s, recv_s), marks in list(zip(sent, RUNS, strict=True))[10:]:
        rows.append({**dict(marks), "client_send": send_s, "client_recv": recv_s})
    print(json.dumps(rows))


def summarize(kind: str, rows: list[dict[str, float]]) -> dict[str, float]:
    steps = [s for s in STEPS if all(s in r for r in rows)]
    out = {"total": statistics.median(r["client_recv"] - r["client_send"] for r in rows) * 1e3}
    if "ort_in" not in steps:  # a server in its own process: the client's stamps only
        return out
    out["ort"] = statistics.median(r["ort_out"] - r["ort_in"] for r in rows) * 1e3
    out["outside_ort"] = statistics.median(
        (r["client_recv"] - r["client_send"]) - (r["ort_out"] - r["ort_in"]) for r in rows
    ) * 1e3  # fmt: skip
    for a, b in itertools.pairwise(steps):
        out[f"{a}->{b}"] = statistics.median(r[b] - r[a] for r in rows) * 1e3
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repository", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=70)
    parser.add_argument("--gap-s", type=float, default=0.15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default="fulcrum,bare,bare_tuned,fulcrum_spin,fulcrum_t1")
    parser.add_argument("--client", choices=sorted(CLIENTS), default="http.client",
                        help="the client: http.client, or the load generator's")  # fmt: skip
    parser.add_argument("--texts", choices=["fixed", "corpus"], default="fixed",
                        help="one 16-word text, or --ends' 256 sentences in turn")  # fmt: skip
    parser.add_argument("--arrivals", choices=["uniform", "poisson", "open"], default="uniform",
                        help="uniform gaps after answers, Poisson arrival times one at a "
                             "time, or open: Poisson and overlapping")  # fmt: skip
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return 0
    if args.arrivals == "open" and (
        args.client != "asyncio" or not all(k.endswith("_serve") for k in args.kinds.split(","))
    ):
        # Overlapping requests would interleave the in-process kinds' stamps.
        parser.error("--arrivals open needs --client asyncio and *_serve kinds only")
    found: dict[str, list[dict[str, float]]] = {}
    kinds = args.kinds.split(",")
    for round_index in range(args.rounds):
        # Each round starts one kind further on, so no kind always follows the same one.
        shift = round_index % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            command = [sys.executable, __file__, "--serve", kind, "--repository",
                       str(args.repository), "--requests", str(args.requests),
                       "--gap-s", str(args.gap_s), "--client", args.client,
                       "--texts", args.texts, "--arrivals", args.arrivals]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            summary = summarize(kind, json.loads(done.stdout.strip().splitlines()[-1]))
            found.setdefault(kind, []).append(summary)
            inside = (f" ORT {summary['ort']:6.2f} outside ORT {summary['outside_ort']:5.2f}"
                      if "ort" in summary else "")  # fmt: skip
            print(f"{kind:12} total {summary['total']:6.2f}{inside} ms", flush=True)
    for kind, rounds in found.items():
        print(f"\n{kind}: median over {len(rounds)} rounds of each round's median, ms")
        for key in rounds[0]:
            values = [r[key] for r in rounds]
            print(f"  {key:28} {statistics.median(values):7.3f}  "
                  f"({', '.join(f'{v:.2f}' for v in values)})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
