"""Results files, tables and plots: what a user reads and what `compare` reloads."""

from __future__ import annotations

import csv
from pathlib import Path

import msgspec
import pytest
from rich.console import Console

from fulcrum.errors import InvalidInput
from fulcrum.loadgen.compare import compare
from fulcrum.loadgen.plots import CDF_PNG, CURVE_PNG, write_plots
from fulcrum.loadgen.report import compare_table, load_run, print_run, run_table, write_run
from fulcrum.loadgen.results import BenchRun, PointResult
from fulcrum.loadgen.server_stats import ServerSplit
from fulcrum.loadgen.stats import summarize_s


def point(level: float, p50_s: float, warnings: list[str] | None = None) -> PointResult:
    sample = [p50_s * f for f in (0.5, 1.0, 1.0, 1.5, 3.0)]
    return PointResult(
        mode="concurrency", level=level, duration_s=2.0, num_requests=5, num_ok=4,
        throughput_rps=100 * level, rows_per_s=400 * level, latency=summarize_s(sample),
        errors={"503": 1}, goodput_rps=90.0 * level, slo_met=True,
        server=ServerSplit(queue_ms=1.0, compute_ms=2.0, mean_batch_size=3.5, num_executions=9),
        header_queue_ms=None, header_compute_ms=4.0, header_batch_size=None, client_cpu=0.05,
        num_behind=0, max_lag_ms=0.0, stable=True, num_windows=3, warnings=warnings or [],
        cdf_ms=sorted(s * 1000 for s in sample),
    )  # fmt: skip


def run(label: str, scale: float = 1.0) -> BenchRun:
    points = [point(1.0, 0.002 * scale), point(4.0, 0.005 * scale, ["client used 90% of a core"])]
    return BenchRun(model="minilm", url="http://x", label=label, batch_size=4, points=points)


def render(renderable: object) -> str:
    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


def test_results_round_trip_through_json_and_csv(tmp_path: Path) -> None:
    original = run("batch-1")
    paths = write_run(original, tmp_path / "out")
    assert [p.name for p in paths] == ["results.json", "results.csv"]
    assert load_run(tmp_path / "out") == original
    rows = list(csv.DictReader((tmp_path / "out" / "results.csv").read_text().splitlines()))
    assert [r["level"] for r in rows] == ["1.0", "4.0"]
    assert float(rows[1]["rows_per_s"]) == 1600
    # Headers win over the stats API for compute; the stats API fills queue.
    assert rows[0]["server_compute_ms"] == "4.0" and rows[0]["server_queue_ms"] == "1.0"
    assert rows[0]["errors"] == "503:1"


def test_load_run_rejects_other_files(tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text('{"hello": 1}')
    with pytest.raises(InvalidInput):
        load_run(tmp_path)
    with pytest.raises(InvalidInput):
        load_run(tmp_path / "missing")


def test_tables_show_points_and_warnings() -> None:
    text = render(run_table(run("dyn")))
    assert "c=1" in text and "c=4" in text and "400.0" in text and "3.5" in text
    console = Console(width=200, record=True)
    print_run(run("dyn"), console)
    assert "client used 90% of a core" in console.export_text()


def test_compare_puts_runs_side_by_side(tmp_path: Path) -> None:
    write_run(run("batch-1", 1.0), tmp_path / "a")
    write_run(run("batch-1", 2.0), tmp_path / "b")  # same label: folder names tell them apart
    console = Console(width=250, record=True)
    runs = compare([tmp_path / "a", tmp_path / "b"], out_dir=tmp_path / "cmp", console=console)
    text = console.export_text()
    assert [r.label for r in runs] == ["batch-1 (a)", "batch-1 (b)"]
    assert "batch-1 (a)" in text and "batch-1 (b)" in text
    assert (tmp_path / "cmp" / CURVE_PNG).stat().st_size > 1000
    assert "batch-1 (a)" in render(compare_table(runs))


def test_plots_are_png_files(tmp_path: Path) -> None:
    paths = write_plots([run("x")], tmp_path)
    assert [p.name for p in paths] == [CURVE_PNG, CDF_PNG]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_is_plain_data(tmp_path: Path) -> None:
    write_run(run("x"), tmp_path)
    data = msgspec.json.decode((tmp_path / "results.json").read_bytes())
    assert data["points"][0]["latency"]["p99_ms"] > 0
