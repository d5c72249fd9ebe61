"""PNG plots: the latency/throughput curve (one or several runs) and latency CDFs per point."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fulcrum.extras import require
from fulcrum.loadgen.results import BenchRun

CURVE_PNG = "latency_throughput.png"
CDF_PNG = "latency_cdf.png"
_PERCENTILES = (("p50_ms", "P50", "-"), ("p90_ms", "P90", "--"), ("p99_ms", "P99", ":"))


def _pyplot() -> Any:
    matplotlib = require("bench", "matplotlib", feature="benchmark plots")
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def plot_curve(runs: Sequence[BenchRun], path: Path) -> Path:
    """Latency percentiles vs achieved throughput, one colour per run, points in load order."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        points = sorted(run.points, key=lambda p: (p.mode, p.level))
        throughput = [p.throughput_rps for p in points]
        for field, name, style in _PERCENTILES:
            latency = [getattr(p.latency, field) for p in points]
            ax.plot(
                throughput, latency, style, marker="o", color=color, label=f"{run.label} {name}"
            )
    return _save(plt, fig, ax, path, "latency vs throughput", "throughput (requests/s)",
                 "latency (ms)")  # fmt: skip


def plot_cdf(runs: Sequence[BenchRun], path: Path) -> Path:
    """The latency CDF of every point (log-scaled latency axis)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for index, run in enumerate(runs):
        for number, point in enumerate(run.points):
            if not point.cdf_ms:
                continue
            num = len(point.cdf_ms)
            fraction = [(i + 1) / num for i in range(num)]
            style = ("-", "--", ":", "-.")[index % 4]
            label = f"{run.label} {point.label}" if len(runs) > 1 else point.label
            ax.plot(point.cdf_ms, fraction, style, color=f"C{number % 10}", label=label)
    ax.set_xscale("log")
    return _save(plt, fig, ax, path, "latency CDF per point", "latency (ms)",
                 "fraction of requests")  # fmt: skip


def _save(plt: Any, fig: Any, ax: Any, path: Path, title: str, xlabel: str, ylabel: str) -> Path:
    """Label, grid and legend the axes, write the PNG and free the figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(runs: Sequence[BenchRun], out_dir: Path) -> list[Path]:
    """Both plots into `out_dir`; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [plot_curve(runs, out_dir / CURVE_PNG), plot_cdf(runs, out_dir / CDF_PNG)]
