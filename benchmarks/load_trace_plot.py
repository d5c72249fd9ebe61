"""The trace plot: offered and answered load, P99 and mean batch size over time, a line per policy.

Kept apart from `load_trace` so that running a trace never imports matplotlib.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from load_trace import PolicyResult


def plot_policies(
    results: Sequence[PolicyResult],
    capacity_rps: float,
    path: Path,
    metric: str,
    slo_ms: float,
    *,
    title: str,
    second: tuple[str, float] | None = None,
) -> Path:
    """Three panels sharing the time axis; step values drawn at each step's middle. The third
    shows the mean batch size, or with `second` = (metric, SLO ms) that metric's admitted P99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (load_ax, p99_ax, batch_ax) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    steps = results[0].steps
    mids = [s.step.start_s + s.step.duration_s / 2 for s in steps]
    offered = [s.step.load * capacity_rps for s in steps]
    load_ax.step(mids, offered, where="mid", color="black", linestyle="--", label="offered")
    for result in results:
        good = [s.good / s.step.duration_s for s in result.steps]
        load_ax.plot(mids, good, marker=".", label=f"{result.name}: within SLO")
        p99 = [_finite(s.p99_ms[metric]) for s in result.steps]
        p99_ax.plot(mids, p99, marker=".", label=result.name)
        if second is None:
            batch = [math.nan if s.mean_batch is None else s.mean_batch for s in result.steps]
        else:
            batch = [_finite(s.p99_ms[second[0]]) for s in result.steps]
        batch_ax.plot(mids, batch, marker=".", label=result.name)
    load_ax.set_ylabel("requests/s")
    load_ax.set_title(title)
    p99_ax.axhline(slo_ms, color="red", linewidth=0.8, label=f"SLO {slo_ms:g} ms")
    p99_ax.set_yscale("log")
    p99_ax.set_ylabel(f"admitted P99 {metric} (ms)")
    if second is None:
        batch_ax.set_ylabel("mean batch size (rows)")
    else:
        batch_ax.axhline(second[1], color="red", linewidth=0.8, label=f"SLO {second[1]:g} ms")
        batch_ax.set_ylabel(f"admitted P99 {second[0]} (ms)")
    batch_ax.set_xlabel("time (s)")
    for ax in (load_ax, p99_ax, batch_ax):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _finite(value: float) -> float:
    return math.nan if math.isinf(value) else value
