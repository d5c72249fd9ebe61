"""Both ends of the load range (`adaptive_vs_static.py --ends`): Fulcrum beside the simplest
server a user could write, in one run, open loop.

Servers, all up at once on 127.0.0.1 and measured in turn (each point starting one server further
on), interleaved per rate and repeat with the same arrival times: `fulcrum serve --model minilm`
with the shipped config (minilm ships `policy = "adaptive"`); the same under Triton's batching
rules (`policy = "triton"`, a second server on a copy of the repository); any `--variant
NAME:KEY=VALUE,...` (more copies, e.g. `spin:parameters.allow_spinning=true` to see what one
setting contributes); and memory_at_rest.py's bare FastAPI + ONNX Runtime app, here with ONNX
Runtime's default session options (threads = cores, spinning on).

Light load: Poisson at 2, 5 and 10 requests/s, P50 and P99, each --light-repeats times. Mid load:
50% and 80% of the capacity under Triton's rules (the adaptive policy's 503s would lower it), each
repeated --repeats times (P99 of each and their spread). Then the highest Poisson rate whose P99 (a
failure counting as late) is <= the SLO, by the load generator's bisection (`max_rate_under`), for
every server at once with their points taken in turns (`turn_search`), --search-repeats times.
Every repeat runs all servers before the next repeat starts, so a drift of the shared machine
reaches every server alike. Last, each server's CPU seconds over --idle-s seconds with no
requests (all servers idle at once). Every point prints the median of each server's own time
(Server-Timing `total`) and of the rest (send to answer, less it); --split makes the bare app
answer that header too, timing its handler as Fulcrum does. The report ends with each server's
light-load P50 and P99 minus the bare app's, paired by repeat with an interval (`paired`).
After the light points, each Fulcrum server's lone batches by session (spinning or one-thread)
are printed from its statistics API.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from corpus import sentences
from health_under_flood import serving
from memory_at_rest import BASELINE
from memory_at_rest import server as bare_server
from paired import paired_quantile_difference
from serving_efficiency import apply_overrides
from turn_search import measure, searches

from fulcrum.client import Endpoint, build_request
from fulcrum.demo import free_port
from fulcrum.loadgen.kserve import PreparedRequest, V2Target
from fulcrum.loadgen.results import PointResult
from fulcrum.loadgen.stats import Slo

# memory_at_rest's baseline uses minilm's tuned session options; the simplest app keeps ORT's.
TUNED_ORT = """options.intra_op_num_threads = 2
options.add_session_config_entry("session.intra_op.allow_spinning", "0")
options.add_session_config_entry("session.inter_op.allow_spinning", "0")
"""
# --split: the bare app's handler timed as Fulcrum times its own (handler start to answer built).
TIMED = {
    "from fastapi import FastAPI\n": "import time\n\nfrom fastapi import FastAPI, Response\n",
    "def embed(body: dict[str, list[str]]) -> dict[str, list[list[float]]]:\n":
        "def embed(body: dict[str, list[str]], response: Response)"
        " -> dict[str, list[list[float]]]:\n"
        "    start_s = time.perf_counter()\n",
    '    return {"embeddings": session.run(["embedding"], feeds)[0].tolist()}\n':
        '    out = session.run(["embedding"], feeds)[0].tolist()\n'
        '    total_ms = (time.perf_counter() - start_s) * 1e3\n'
        '    response.headers["Server-Timing"] = f"total;dur={total_ms:.3f}"\n'
        '    return {"embeddings": out}\n',
}  # fmt: skip
TRITON = "fulcrum triton"  # the shipped config under Triton's batching rules
BARE = "bare FastAPI + ORT (defaults)"


def add_ends_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument_group("--ends").add_argument
    add("--light-rates", default="2,5,10", help="light-load rates, requests/s")
    add("--light-s", type=float, default=15.0, help="measured seconds per light-load point")
    add("--mid", default="0.5,0.8", help="mid-load rates as fractions of capacity")
    add("--mid-s", type=float, default=6.0, help="measured seconds per mid-load point")
    add("--repeats", type=int, default=3, help="repeats of each mid-load rate")
    add("--search-s", type=float, default=5.0, help="seconds per point of the rate search")
    add("--no-search", action="store_true", help="skip the max-rate-under search")
    add("--light-repeats", type=int, default=1, help="repeats of each light-load rate")
    add("--search-repeats", type=int, default=1, help="repeats of the max-rate search")
    add("--search-start", type=float, help="the search's first rate (default: half capacity)")
    add(
        "--search-tolerance",
        type=float,
        default=0.08,
        help="stop bisecting when the bracket is within this share of its top (finer: more steps)",
    )
    add("--capacity", type=float,
        help="capacity, req/s (default: measured; minilm under Triton's rules, --llm by a "
             "closed loop of --llm-clients streams)")  # fmt: skip
    add("--idle-s", type=float, default=30.0, help="seconds of idle CPU measured (0: skip)")
    add("--split", action="store_true",
        help="the bare app also answers a Server-Timing header (tokenize, compute, total), so "
             "each point splits every server's time into its own and the rest")  # fmt: skip
    add("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
        help="one more Fulcrum server with these config.toml overrides")  # fmt: skip


def bare_app(split: bool = False) -> str:
    """memory_at_rest's baseline app with ONNX Runtime's default session options; `split`: its
    handler also times itself into a Server-Timing header, as Fulcrum's answers carry one."""
    app = BASELINE
    for old, new in [(TUNED_ORT, ""), *(TIMED.items() if split else [])]:
        if old not in app:
            raise RuntimeError(f"memory_at_rest.BASELINE changed: no {old[:40]!r} to replace")
        app = app.replace(old, new)
    return app


@dataclass
class Server:
    name: str
    url: str
    requests: list[PreparedRequest]
    points: dict[str, list[PointResult]] = field(default_factory=dict)
    max_rates: list[float | None] = field(default_factory=list)
    idle_cpu_s: float | None = None
    rss_bytes: int | None = None  # resident memory at the idle measurement

    @property
    def max_rate(self) -> float | None:
        """The median of the searches' rates (a search that found none counts as 0; of an even
        number, the mean of the middle two)."""
        return statistics.median(r or 0.0 for r in self.max_rates) if self.max_rates else None


def bare_requests(url: str, texts: list[str]) -> list[PreparedRequest]:
    endpoint = Endpoint.from_url(url)
    headers = {"Content-Type": "application/json"}
    out = []
    for text in texts:
        body = json.dumps({"texts": [text]}).encode()
        out.append(PreparedRequest(build_request(endpoint, "POST", "/embed", headers=headers,
                                                 body=body), 1))  # fmt: skip
    return out


def copy_with(repo: Path, dest: Path, assignments: list[str]) -> Path:
    """A repository holding a copy of minilm with `assignments` applied to its config.toml."""
    shutil.copytree(repo / "minilm", dest / "minilm")
    apply_overrides(dest / "minilm" / "config.toml", assignments)
    return dest


@contextmanager
def servers(repo: Path, args: argparse.Namespace) -> Iterator[list[Server]]:
    from adaptive_vs_static import v2_requests

    logs = args.out
    with ExitStack() as stack:
        url, _ = stack.enter_context(serving(repo, args.src.resolve(), logs / "shipped.log"))
        out = [Server("fulcrum shipped", url, v2_requests(url, 256, args.words))]
        variants = [[TRITON, 'dynamic_batching.policy="triton"']]
        variants += [v.split(":", 1) for v in args.variant]
        for i, (name, assignments) in enumerate(variants):
            copy = copy_with(repo, args.out / f"repo{i}", assignments.split(","))
            url, _ = stack.enter_context(serving(copy, args.src.resolve(), logs / f"v{i}.log"))
            out.append(Server(name, url, v2_requests(url, 256, args.words)))
        out.append(
            stack.enter_context(bare_serving(repo, logs / "bare.log", args.words, args.split))
        )
        yield out


@contextmanager
def bare_serving(repo: Path, log_path: Path, words: int, split: bool = False) -> Iterator[Server]:
    """The bare app over repo's minilm on a free loopback port, with 256 sentences of `words`
    words (the same texts as `v2_requests`)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-c", bare_app(split), str(repo / "minilm" / "1"), str(port)]
    with bare_server(command, f"{url}/health", log_path):
        yield Server(BARE, url, bare_requests(url, sentences(256, words, seed=1)))


def point(server: Server, rate: float, seconds: float, slo: Slo, seed: int) -> PointResult:
    from adaptive_vs_static import run_async

    return run_async(measure(server, rate, seconds, slo, seed))


def run_ends(repo: Path, args: argparse.Namespace) -> int:
    from adaptive_vs_static import capacity_rps, run_async
    from load_trace import open_loop_capacity

    slo = Slo(bound_ms=args.slo_ms, percentile=99.0)
    light = [float(r) for r in args.light_rates.split(",")]
    mid = [float(f) for f in args.mid.split(",")]
    with servers(repo, args) as all_servers:
        basis = next(s for s in all_servers if s.name == TRITON)  # capacity without 503s
        target = V2Target(Endpoint.from_url(basis.url), basis.requests)
        if args.capacity:
            capacity = args.capacity
            print(f"capacity: {capacity:.1f} req/s (given)", flush=True)
        else:
            closed = max(capacity_rps(basis.url, target, args.capacity_s) for _ in range(2))
            capacity = run_async(open_loop_capacity(target, basis.url, "minilm", closed))
            print(f"capacity under Triton's rules: {capacity:.1f} req/s open loop "
                  f"({closed:.1f} closed loop)", flush=True)  # fmt: skip
            # On a machine loaded by others no open-loop rate may hold: the mid-load rates are
            # then fractions of the closed-loop one rather than of nothing.
            capacity = capacity or closed
        plan = [(f"{r:g} rps", r, args.light_s, k) for k in range(args.light_repeats)
                for r in light]  # fmt: skip
        plan += [(f"{f:.0%} cap", f * capacity, args.mid_s, k) for k in range(args.repeats)
                 for f in mid]  # fmt: skip
        for i, (label, rate, seconds, k) in enumerate(plan):
            # Each point starts one server further on, so an effect of going first (or right
            # after another server's run) reaches every server alike.
            for server in all_servers[i % len(all_servers) :] + all_servers[: i % len(all_servers)]:
                p = point(server, rate, seconds, slo, seed=args.seed + k)
                server.points.setdefault(label, []).append(p)
                split = (
                    ""
                    if p.header_total_p50_ms is None or p.outside_p50_ms is None
                    else (
                        f" (server {p.header_total_p50_ms:5.1f}, outside {p.outside_p50_ms:4.1f})"
                    )
                )
                print(f"  {server.name:34} {label:>8} ({rate:5.1f}/s) P50 {p.latency.p50_ms:6.1f}"
                      f"{split} P99 {p.latency.p99_ms:7.1f} ms errors {p.errors}",
                      flush=True)  # fmt: skip
        if args.light_repeats:
            lone_sessions(all_servers)
        for k in range(0 if args.no_search else args.search_repeats):
            start = args.search_start or max(8.0, 0.5 * capacity)
            found = run_async(searches(all_servers, start, args, slo, k % len(all_servers)))
            for server, best in zip(all_servers, found, strict=True):
                server.max_rates.append(best)
                print(f"  {server.name}: max rate with P99 <= {args.slo_ms:g} ms: {best}",
                      flush=True)  # fmt: skip
        if args.idle_s > 0:
            idle_cpu(all_servers, args.idle_s)
    ends_report(all_servers, capacity, args)
    return 0


def lone_sessions(all_servers: list[Server]) -> None:
    """Which session each Fulcrum server's lone batches took so far (its statistics API)."""
    for server in all_servers:
        if server.name == BARE:
            continue
        url = f"{server.url}/v2/models/minilm/stats"
        with urllib.request.urlopen(url, timeout=10) as answer:
            rows = json.load(answer).get("model_stats", [])
        for state in (s for row in rows for s in row.get("lone_session", [])):
            # The median is of the last few runs only (a snapshot at the end, which differed
            # between servers by up to 0.9 ms while their whole-run quantiles were level); the
            # mean is over every measured run.
            print(
                f"  {server.name}: lone batches by session {state['runs']}, mean ms per row "
                f"over the run {state.get('mean_ms_per_row')}, median of the last runs "
                f"{state['ms_per_row']}, favourite {state['favourite']}",
                flush=True,
            )


def idle_cpu(all_servers: list[Server], seconds: float) -> None:
    """Each server's CPU seconds (all its threads) over `seconds` with no requests at all, and
    its resident memory then."""
    procs = {s.name: _listener(s.url) for s in all_servers}
    before = {name: _cpu_s(p) for name, p in procs.items()}
    time.sleep(seconds)  # the measurement itself: every server sits idle this long
    for server in all_servers:
        server.idle_cpu_s = _cpu_s(procs[server.name]) - before[server.name]
        server.rss_bytes = int(procs[server.name].memory_info().rss)


def _listener(url: str) -> psutil.Process:
    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            return psutil.Process(conn.pid)
    raise RuntimeError(f"no process listens on port {port}")


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def ends_report(all_servers: list[Server], capacity: float, args: argparse.Namespace) -> None:
    labels = list(all_servers[0].points)
    print(
        f"\ncapacity {capacity:.1f} req/s; P50 / P99 ms of the answered requests (each repeat "
        "for mid-load rates); (miss): P99 over the SLO once a 503 or a timeout counts as late"
    )
    print("| " + " | ".join(["server", *labels, "max rate P99<=SLO"]) + " |")
    print("|---|" + "---:|" * (len(labels) + 1))
    for server in all_servers:
        cells = []
        for label in labels:
            points = server.points[label]
            cells.append(", ".join(f"{p.latency.p50_ms:.1f} / {p.latency.p99_ms:.0f}"
                                   + ("" if not p.errors else f" {p.errors}")
                                   + ("" if p.slo_met else " (miss)")
                                   for p in points))  # fmt: skip
        rate = "-" if server.max_rate is None else f"{server.max_rate:.1f}"
        if len(server.max_rates) > 1:
            rate += " (" + ", ".join(f"{r or 0:.0f}" for r in server.max_rates) + ")"
        print("| " + " | ".join([server.name, *cells, rate]) + " |")
    bare = all_servers[-1]
    for server in all_servers[:-1]:
        spread = {label: [p.latency.p99_ms for p in server.points[label]] for label in labels}
        mid = {k: f"{min(v):.0f}-{max(v):.0f}" for k, v in spread.items() if len(v) > 1}
        ratio = (f"{server.max_rate / bare.max_rate:.2f}x" if server.max_rate and bare.max_rate
                 else "-")  # fmt: skip
        pairs = zip(server.max_rates, bare.max_rates, strict=True)  # search k: same round
        each = ", ".join("-" if not (ours and theirs) else f"{ours / theirs:.2f}x"
                         for ours, theirs in pairs)  # fmt: skip
        print(f"{server.name}: P99 spread over repeats {mid}; max rate vs bare {ratio} (goal "
              f"1.5x; per search: {each or '-'})")  # fmt: skip
    light_against(bare, all_servers[:-1])
    for server in all_servers:
        if server.idle_cpu_s is not None:
            rss_mb = (server.rss_bytes or 0) / 2**20
            print(f"{server.name}: {server.idle_cpu_s:.2f} CPU s over {args.idle_s:g} s idle, "
                  f"RSS {rss_mb:.0f} MiB")  # fmt: skip
    data = {
        s.name: {"max_rates": s.max_rates, "max_rate": s.max_rate, "idle_cpu_s": s.idle_cpu_s,
                 "rss_bytes": s.rss_bytes, "points": _points_json(s)}
        for s in all_servers
    }  # fmt: skip
    (args.out / "ends.json").write_text(json.dumps({"capacity_rps": capacity, **data}, indent=1))


def light_against(bare: Server, others: list[Server]) -> None:
    """Each server's light-load P50 and P99 minus the bare app's, per rate and over all light
    rates, paired by repeat (same arrivals) with a bootstrap interval (`paired`)."""
    labels = [label for label in bare.points if label.endswith(" rps")]
    if not labels:
        return
    print("\nlight load, minus the bare app (ms; the mean of the repeats' differences, its "
          "90% interval drawing repeats and requests again):")  # fmt: skip
    for server in others:
        cells = {
            label: ([p.cdf_ms for p in server.points[label]],
                    [p.cdf_ms for p in bare.points[label]])
            for label in labels
        }  # fmt: skip
        ours = [x for pair in cells.values() for x in pair[0]]  # every light cell, as repeats
        theirs = [x for pair in cells.values() for x in pair[1]]
        for q, name in ((0.5, "P50"), (0.99, "P99")):
            for label, (our_cells, their_cells) in cells.items():
                d = paired_quantile_difference(our_cells, their_cells, q)
                print(f"  {server.name:20} {name} {label:>7}: {d.describe()}")
            total = paired_quantile_difference(ours, theirs, q)
            print(f"  {server.name:20} {name}     all: {total.estimate:+.2f} ("
                  f"{total.confidence:.0%} interval {total.low:+.2f} to {total.high:+.2f}, "
                  f"{len(ours)} cells)")  # fmt: skip


def _points_json(server: Server) -> dict[str, list[dict[str, object]]]:
    return {
        label: [
            {
                "rate": p.level,
                "p50_ms": p.latency.p50_ms,
                "p99_ms": p.latency.p99_ms,
                "errors": p.errors,
                "n": p.num_requests,
                "slo_met": p.slo_met,
                "latencies_ms": p.cdf_ms,  # sorted; every answer up to 1,000 of them
            }
            for p in points
        ]
        for label, points in server.points.items()
    }
