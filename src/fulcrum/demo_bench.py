"""The demo's closing act: `minilm` at batch-1 and with dynamic batching, side by side."""

from __future__ import annotations

import tomllib
from pathlib import Path

import httpx
import msgspec
from rich.console import Console
from rich.table import Table

from fulcrum.loadgen.bench import BenchOptions, run_bench
from fulcrum.loadgen.inputs import LengthDist
from fulcrum.loadgen.kserve import V2Inputs
from fulcrum.loadgen.results import BenchRun
from fulcrum.loadgen.windows import MeasurePlan

# Batch-1 with an unbounded queue, as Triton runs a model by default: 32 clients wait in line
# instead of meeting minilm's SLO-derived queue bound, so the table compares latency and
# throughput, not refusals.
BATCH_ONE = {
    "max_batch_size": 1,
    "dynamic_batching": {"max_queue_delay_ms": 0, "default_queue_policy": {"max_queue_size": 0}},
}
CONCURRENCY = (1, 8, 32)


def under_triton_rules(config_path: Path) -> dict[str, object]:
    """The reload override that keeps the file's [dynamic_batching] under Triton's rules (an
    override replaces a whole top-level table). minilm ships the adaptive policy, which at 32
    closed-loop clients (about 110 ms in the system by Little's law) refuses the requests that
    cannot meet its 100 ms SLO; the demo's table compares latency and throughput, not refusals."""
    batching = tomllib.loads(config_path.read_text()).get("dynamic_batching", {})
    return {"dynamic_batching": {**batching, "policy": "triton"}}


def _reload(url: str, override: dict[str, object] | None) -> None:
    body = {"parameters": {"config": msgspec.json.encode(override).decode()}} if override else {}
    response = httpx.post(f"{url}/v2/repository/models/minilm/load", json=body, timeout=120)
    response.raise_for_status()


def _bench(url: str, label: str, duration_s: float) -> BenchRun:
    plan = MeasurePlan(warmup_s=1.0, window_s=1.0, max_duration_s=duration_s)
    options = BenchOptions(
        model="minilm", url=url, concurrency=CONCURRENCY, plan=plan, label=label,
        v2=V2Inputs(lengths=LengthDist(12, 20), num_distinct=64, binary=True),
    )  # fmt: skip
    return run_bench(options, progress=True)


def _table(runs: list[BenchRun]) -> Table:
    """A compact side-by-side table that fits an 80-column terminal."""
    table = Table(title="minilm: batch-1 vs dynamic batching (closed loop, latency in ms)")
    for header in ("config", "clients", "req/s", "P50", "P99", "batch", "queue", "compute"):
        table.add_column(header, justify="left" if header == "config" else "right")
    for run in runs:
        for i, p in enumerate(run.points):
            table.add_row(
                run.label if i == 0 else "", f"{p.level:g}", f"{p.throughput_rps:.0f}",
                f"{p.latency.p50_ms:.1f}", f"{p.latency.p99_ms:.1f}",
                _fmt(p.header_batch_size), _fmt(p.header_queue_ms), _fmt(p.header_compute_ms),
                end_section=i == len(run.points) - 1,
            )  # fmt: skip
    return table


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def batching_trade_off(url: str, repository: Path, *, duration_s: float, console: Console) -> None:
    """Bench `minilm` reloaded as batch-1, then its own batching under Triton's rules."""
    console.rule("[bold]the latency/throughput trade-off of minilm")
    _reload(url, BATCH_ONE)
    batch_one = _bench(url, "batch-1", duration_s)
    _reload(url, under_triton_rules(repository / "minilm" / "config.toml"))
    batched = _bench(url, "dynamic batching", duration_s)
    console.print(_table([batch_one, batched]))
    a, b = batch_one.points[-1], batched.points[-1]
    console.print(
        f"At {CONCURRENCY[-1]} concurrent clients dynamic batching serves "
        f"[bold]{b.throughput_rps / a.throughput_rps:.1f}x[/] the requests/s of batch-1 "
        f"({b.throughput_rps:.0f} vs {a.throughput_rps:.0f}); P99 {b.latency.p99_ms:.0f} ms "
        f"vs {a.latency.p99_ms:.0f} ms. At one client batching cannot help: "
        f"{batched.points[0].latency.p50_ms:.1f} vs {batch_one.points[0].latency.p50_ms:.1f} ms "
        "P50."
    )
