"""The live progress display advances per window and settles on each point's summary."""

from __future__ import annotations

import io

from rich.console import Console

from fulcrum.loadgen.progress import BenchProgress
from fulcrum.loadgen.results import PointResult
from fulcrum.loadgen.server_stats import ServerSplit
from fulcrum.loadgen.stats import summarize_s
from fulcrum.loadgen.windows import WindowStats


def test_windows_advance_the_bar_and_the_point_completes_it() -> None:
    console = Console(file=io.StringIO(), width=120, record=True)
    with BenchProgress(max_duration_s=4.0, console=console) as bar:
        bar.on_window("c=2", WindowStats(0.0, 1.0, 50, 50, 0.02))
        task = bar.progress.tasks[0]
        assert task.completed == 1.0 and "50.0 req/s" in task.description
        bar.on_window("c=2", WindowStats(1.0, 2.0, 60, 60, 0.02))
        assert bar.progress.tasks[0].completed == 2.0
        point = PointResult(
            mode="concurrency", level=2.0, duration_s=2.0, num_requests=110, num_ok=110,
            throughput_rps=55.0, rows_per_s=55.0, latency=summarize_s([0.02] * 10), errors={},
            goodput_rps=None, slo_met=None, server=ServerSplit(), header_queue_ms=None,
            header_compute_ms=None, header_batch_size=None, client_cpu=0.01, num_behind=0,
            max_lag_ms=0.0, stable=False, num_windows=2, warnings=[], cdf_ms=[],
        )  # fmt: skip
        bar.on_point(point)
        [task] = bar.progress.tasks  # the same line, not a new one
        assert task.completed == 4.0 and "unstable" in task.description
