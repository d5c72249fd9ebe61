"""The live progress bar: one line per point, advanced as windows close."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from fulcrum.loadgen.results import PointResult
from fulcrum.loadgen.windows import WindowStats


class BenchProgress:
    """Context manager whose `on_window` / `on_point` drive a rich progress display."""

    def __init__(self, max_duration_s: float, console: Console | None = None) -> None:
        self.max_duration_s = max_duration_s
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.tasks: dict[str, TaskID] = {}
        self.elapsed_s: dict[str, float] = {}

    def __enter__(self) -> BenchProgress:
        self.progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.progress.stop()

    def _task(self, label: str) -> TaskID:
        if label not in self.tasks:
            self.tasks[label] = self.progress.add_task(label, total=self.max_duration_s)
            self.elapsed_s[label] = 0.0
        return self.tasks[label]

    def on_window(self, label: str, window: WindowStats) -> None:
        task = self._task(label)
        self.elapsed_s[label] += window.end_s - window.start_s
        self.progress.update(
            task,
            completed=min(self.elapsed_s[label], self.max_duration_s),
            description=(
                f"{label:>12}  {window.throughput_rps:8.1f} req/s  "
                f"mean {window.mean_latency_s * 1000:7.2f} ms"
            ),
        )

    def on_point(self, point: PointResult) -> None:
        task = self._task(point.label)
        status = "stable" if point.stable else "unstable"
        self.progress.update(
            task,
            completed=self.max_duration_s,
            description=(
                f"{point.label:>12}  {point.throughput_rps:8.1f} req/s  "
                f"p99 {point.latency.p99_ms:7.2f} ms  {status}"
            ),
        )
