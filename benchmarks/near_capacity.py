"""Servers side by side near capacity: how many requests are late or refused, and why.

    .venv/bin/python benchmarks/near_capacity.py --repository /tmp/bench_models --out /tmp/near \
        --server "shipped:src:" --server 'triton:src:dynamic_batching.policy="triton"' \
        [--server "before:/tmp/before/src:"] [--rates 260,290,320] [--rounds 3] [--seconds 15]

Each `--server NAME:SRC:OVERRIDES` is one `fulcrum serve --model minilm` process running the code
under SRC, on a copy of the repository's minilm with the comma-separated config.toml overrides
(TOML values) applied. All run at once, idle but one: per round and rate, each server in turn
(the order reversed every other round, so that a drift of the shared machine does not always
favour the same one) gets the load generator's open loop (Poisson) for --seconds. Printed per
point: P50 / P99 of the answers, the share of requests late or refused (a 503 counts as late, as
in the max-rate search), mean batch, refusals by reason and the batch policy's state from the
statistics API. Paired rows are the comparison: at one rate two 15 s runs of the same server
differ by several points on a shared 2-core machine.

`--bare` adds adaptive_ends' bare app (FastAPI + ONNX Runtime per request, ORT's defaults) at
its own `--bare-rates`, its k-th rate in the same step as the others' k-th. The report pools
each server's rounds per rate: the share late or refused over all of them is the pooled P99's
side of the SLO, and a server's pooled max rate is the highest rate at which it, and every lower
rate it ran, stayed within 1% (the highest rate held, lower ones or not, is printed too). That
answers "the highest Poisson rate that keeps P99 <= the SLO" without a bisection, whose outcome
one unlucky point decides; the ratios to the bare app's are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from adaptive_ends import BARE, Server, bare_serving, copy_with, point
from adaptive_vs_static import v2_requests
from health_under_flood import serving

from fulcrum.loadgen.stats import Slo

STATE_KEYS = ("batch_limit", "queue_bound", "batch_error", "caution", "late_answers",
              "arrival_margin", "shed_late", "shed_head")  # fmt: skip


def policy_state(url: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{url}/v2/models/minilm/stats") as response:
        row = json.load(response)["model_stats"][0]
    return dict(row.get("policy", {}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repository", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("/tmp/near_capacity"))
    parser.add_argument("--server", action="append", required=True, help="NAME:SRC:OVERRIDES")
    parser.add_argument("--rates", default="260,290,320")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--slo-ms", type=float, default=100.0)
    parser.add_argument("--bare", action="store_true", help="also the bare app, at --bare-rates")
    parser.add_argument("--bare-rates", default="150,165,180,195")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    slo = Slo(bound_ms=args.slo_ms, percentile=99.0)
    rows = []
    with ExitStack() as stack:
        servers = []
        for i, spec in enumerate(args.server):
            name, src, overrides = spec.split(":", 2)
            repo = args.repository
            if overrides:
                repo = copy_with(repo, args.out / f"repo{i}", overrides.split(","))
            log = args.out / f"{name}.log"
            url, _ = stack.enter_context(serving(repo, Path(src).resolve(), log))
            servers.append(Server(name, url, v2_requests(url, 256, 12)))
        rates = {s.name: [float(r) for r in args.rates.split(",")] for s in servers}
        if args.bare:
            servers.append(
                stack.enter_context(bare_serving(args.repository, args.out / "bare.log", 12))
            )
            rates[BARE] = [float(r) for r in args.bare_rates.split(",")]
        for round_ in range(args.rounds):
            # Step k runs each server's k-th rate: the bare app's ramp interleaves with the others.
            for k in range(max(len(r) for r in rates.values())):
                for server in servers if round_ % 2 == 0 else servers[::-1]:
                    if k < len(rates[server.name]):
                        rate = rates[server.name][k]
                        rows.append(measure(server, rate, args.seconds, slo, round_))
                        print(json.dumps(rows[-1]), flush=True)
    (args.out / "near_capacity.json").write_text(json.dumps(rows, indent=1))
    pooled_report(rows)
    return 0


def pooled_report(rows: list[dict]) -> None:
    """Per server and rate, the share late or refused over all rounds; the pooled max rate."""
    pooled: dict[str, dict[float, list[float]]] = {}
    for row in rows:
        late = row["late_or_refused_pct"] * row["requests"] / 100
        totals = pooled.setdefault(row["server"], {}).setdefault(row["rate"], [0.0, 0.0])
        totals[0] += late
        totals[1] += row["requests"]
    best: dict[str, float] = {}  # the highest rate held, every lower one held too
    top: dict[str, float] = {}  # the highest rate held
    print("\n| server | rate (req/s): % late or refused, pooled over rounds | pooled max rate "
          "| highest rate held |\n|---|---|---:|---:|")  # fmt: skip
    for name, by_rate in pooled.items():
        cells, holding = [], True
        for rate in sorted(by_rate):
            late, total = by_rate[rate]
            pct = 100 * late / max(1.0, total)
            holding = holding and pct <= 1.0
            if holding:
                best[name] = rate
            if pct <= 1.0:
                top[name] = rate
            cells.append(f"{rate:g}: {pct:.2f}%")
        print(f"| {name} | {', '.join(cells)} | {best.get(name, 0):g} | {top.get(name, 0):g} |")
    for name in best.keys() - {BARE}:
        if best.get(BARE) and top.get(BARE):
            print(f"{name}: {best[name] / best[BARE]:.2f}x the bare app's pooled max rate, "
                  f"{top[name] / top[BARE]:.2f}x its highest rate held")  # fmt: skip


def measure(server: Server, rate: float, seconds: float, slo: Slo, round_: int) -> dict:
    fulcrum = server.name != BARE
    before = policy_state(server.url).get("shed", {}) if fulcrum else {}
    result = point(server, rate, seconds, slo, seed=round_ + 1)
    state = policy_state(server.url) if fulcrum else {}
    after = state.get("shed", {})
    assert isinstance(before, dict) and isinstance(after, dict)
    answered_late = sum(1 for ms in result.cdf_ms if ms > slo.bound_ms)
    answered_late *= result.num_ok / max(1, len(result.cdf_ms))  # the CDF may be a sample
    refused = sum(result.errors.values())
    return {
        "round": round_,
        "rate": rate,
        "server": server.name,
        "requests": result.num_requests,
        "p50_ms": round(result.latency.p50_ms, 1),
        "p99_ms": round(result.latency.p99_ms, 1),
        "late_or_refused_pct": round(
            100 * (refused + answered_late) / max(1, result.num_requests), 2
        ),
        "mean_batch": result.server.mean_batch_size,
        "refused": {k: after.get(k, 0) - before.get(k, 0) for k in after},
        "policy": {k: state[k] for k in STATE_KEYS if k in state},
    }


if __name__ == "__main__":
    sys.exit(main())
