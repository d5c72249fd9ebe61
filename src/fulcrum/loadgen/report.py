"""What a user reads: the terminal tables (one run, or several side by side) and the files."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from fulcrum.errors import InvalidInput
from fulcrum.loadgen.results import BenchRun, PointResult

RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
CSV_COLUMNS = (
    "label", "mode", "level", "throughput_rps", "rows_per_s", "goodput_rps", "mean_ms", "p50_ms",
    "p90_ms", "p95_ms", "p99_ms", "p999_ms", "max_ms", "num_requests", "num_ok", "errors",
    "server_queue_ms", "server_compute_ms", "mean_batch_size", "client_cpu", "num_behind",
    "max_lag_ms", "stable", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "tpot_p50_ms",
    "output_tokens_per_s", "first_rows_p50_ms", "first_rows_p99_ms",
)  # fmt: skip


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _errors(point: PointResult) -> str:
    return ", ".join(f"{k}:{v}" for k, v in sorted(point.errors.items())) or "0"


def queue_ms(point: PointResult) -> float | None:
    """Server queue time: Server-Timing headers when present, else the stats API."""
    return point.header_queue_ms if point.header_queue_ms is not None else point.server.queue_ms


def compute_ms(point: PointResult) -> float | None:
    """Server compute time: Server-Timing headers when present, else the stats API."""
    if point.header_compute_ms is not None:
        return point.header_compute_ms
    return point.server.compute_ms


def batch_size(point: PointResult) -> float | None:
    """Rows per execution from the stats API, else the request-weighted Server-Timing mean."""
    if point.server.mean_batch_size is not None:
        return point.server.mean_batch_size
    return point.header_batch_size


def _row(point: PointResult) -> list[str]:
    lat = point.latency
    batch = batch_size(point)
    return [
        point.label,
        f"{point.throughput_rps:.1f}",
        f"{point.rows_per_s:.1f}",
        "-" if point.goodput_rps is None else f"{point.goodput_rps:.1f}",
        _ms(lat.mean_ms), _ms(lat.p50_ms), _ms(lat.p90_ms), _ms(lat.p99_ms), _ms(lat.p999_ms),
        _ms(lat.max_ms),
        _ms(queue_ms(point)), _ms(compute_ms(point)),
        "-" if batch is None else f"{batch:.1f}",
        _errors(point),
        f"{point.client_cpu:.0%}",
    ]  # fmt: skip


_HEADERS = ("point", "req/s", "rows/s", "goodput", "mean", "p50", "p90", "p99", "p99.9", "max",
            "queue", "compute", "batch", "errors", "client cpu")  # fmt: skip


def run_table(run: BenchRun) -> Table:
    """One run's points; latencies in ms."""
    table = Table(title=f"fulcrum bench {run.label}  (latency ms)")
    for header in _HEADERS:
        table.add_column(header, justify="left" if header == "point" else "right")
    for point in run.points:
        table.add_row(*_row(point))
    return table


def llm_table(run: BenchRun) -> Table:
    """Streaming figures per point: TTFT, ITL, TPOT (ms) and output tokens/s."""
    table = Table(title=f"{run.label}  streaming (ms)")
    for header in ("point", "ttft p50", "ttft p99", "itl p50", "itl p99", "tpot p50", "tok/s"):
        table.add_column(header, justify="right")
    for p in run.points:
        if p.llm is not None:
            f = p.llm
            cells = [f.ttft.p50_ms, f.ttft.p99_ms, f.itl.p50_ms, f.itl.p99_ms, f.tpot.p50_ms]
            table.add_row(p.label, *map(_ms, cells), f"{f.output_tokens_per_s:.1f}")
    return table


def rows_table(run: BenchRun) -> Table:
    """Streamed rows per point: time to first rows beside the whole answer's latency (ms)."""
    table = Table(title=f"{run.label}  streamed rows (ms)")
    for header in ("point", "first rows p50", "first rows p99", "all rows p50", "all rows p99"):
        table.add_column(header, justify="right")
    for p in run.points:
        if p.first_rows is not None:
            cells = [p.first_rows.p50_ms, p.first_rows.p99_ms, p.latency.p50_ms, p.latency.p99_ms]
            table.add_row(p.label, *map(_ms, cells))
    return table


def compare_table(runs: Sequence[BenchRun]) -> Table:
    """Several labelled runs side by side, point by point: the trade-off at a glance."""
    table = Table(title="fulcrum bench compare  (latency ms)")
    table.add_column("run")
    for header in _HEADERS:
        table.add_column(header, justify="left" if header == "point" else "right")
    for index, run in enumerate(runs):
        if not run.points:
            table.add_row(run.label, "(no points)", end_section=index < len(runs) - 1)
        for number, point in enumerate(run.points):
            last = number == len(run.points) - 1 and index < len(runs) - 1
            table.add_row(run.label if number == 0 else "", *_row(point), end_section=last)
    return table


def print_run(run: BenchRun, console: Console | None = None) -> None:
    """The final table, the search's answer and every warning."""
    console = console or Console()
    console.print(run_table(run))
    if run.api == "openai":
        console.print(llm_table(run))
    if run.stream_rows:
        console.print(rows_table(run))
    if run.search_bound is not None:
        answer = "none held" if run.max_rate_under is None else f"{run.max_rate_under:.1f} req/s"
        console.print(f"max rate under {run.search_bound}: [bold]{answer}[/bold]")
    for point in run.points:
        for warning in point.warnings:
            console.print(f"[yellow]warning[/yellow] {point.label}: {warning}")


def csv_row(run: BenchRun, point: PointResult) -> dict[str, object]:
    """One point as a flat CSV row."""
    lat, llm = point.latency, point.llm
    return {
        "label": run.label, "mode": point.mode, "level": point.level,
        "throughput_rps": point.throughput_rps, "rows_per_s": point.rows_per_s,
        "goodput_rps": point.goodput_rps, "mean_ms": lat.mean_ms, "p50_ms": lat.p50_ms,
        "p90_ms": lat.p90_ms, "p95_ms": lat.p95_ms, "p99_ms": lat.p99_ms,
        "p999_ms": lat.p999_ms, "max_ms": lat.max_ms, "num_requests": point.num_requests,
        "num_ok": point.num_ok, "errors": _errors(point), "server_queue_ms": queue_ms(point),
        "server_compute_ms": compute_ms(point), "mean_batch_size": batch_size(point),
        "client_cpu": point.client_cpu, "num_behind": point.num_behind,
        "max_lag_ms": point.max_lag_ms, "stable": point.stable,
        "ttft_p50_ms": llm.ttft.p50_ms if llm else None,
        "ttft_p99_ms": llm.ttft.p99_ms if llm else None,
        "itl_p50_ms": llm.itl.p50_ms if llm else None,
        "tpot_p50_ms": llm.tpot.p50_ms if llm else None,
        "output_tokens_per_s": llm.output_tokens_per_s if llm else None,
        "first_rows_p50_ms": point.first_rows.p50_ms if point.first_rows else None,
        "first_rows_p99_ms": point.first_rows.p99_ms if point.first_rows else None,
    }  # fmt: skip


def write_run(run: BenchRun, out_dir: Path) -> list[Path]:
    """`results.json` (everything), `results.csv` (one row per point); their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / RESULTS_JSON
    json_path.write_bytes(msgspec.json.format(msgspec.json.encode(run), indent=2))
    csv_path = out_dir / RESULTS_CSV
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(csv_row(run, point) for point in run.points)
    return [json_path, csv_path]


def load_run(path: Path) -> BenchRun:
    """A run from its `--out` folder (or its results.json)."""
    json_path = path / RESULTS_JSON if path.is_dir() else path
    try:
        return msgspec.json.decode(json_path.read_bytes(), type=BenchRun)
    except OSError as exc:
        raise InvalidInput(f"cannot read {json_path}: {exc.strerror}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"{json_path}: not a fulcrum bench result: {exc}") from exc
