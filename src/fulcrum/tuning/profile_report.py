"""`fulcrum profile`'s output: rich tables in the terminal, `profile.json`, and `profile.png`
(latency and throughput vs batch size, the knee marked)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fulcrum.extras import require
from fulcrum.tuning.profile import ProfileResult
from fulcrum.tuning.profile_llm import LlmProfileResult

JSON_FILE = "profile.json"
PNG_FILE = "profile.png"
AnyResult = ProfileResult | LlmProfileResult


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _title(result: AnyResult) -> str:
    variant = f" [{result.variant}]" if result.variant else ""
    return escape(f"fulcrum profile {result.model}{variant} v{result.version}  ({result.machine})")


def _gpu_measured(result: AnyResult) -> bool:
    return any(p.gpu_util_pct is not None for p in result.points)


def profile_table(result: ProfileResult) -> Table:
    """One row per (length, batch size) point."""
    gpu = _gpu_measured(result)
    table = Table(title=_title(result))
    heads = ["length", "tokens", "batch", "runs", "p50 ms", "p99 ms", "rows/s", "encode ms"]
    heads += ["model ms", "RSS MB", "CPU %"] + (["GPU %", "GPU MB", "W"] if gpu else [])
    for head in heads:
        table.add_column(head, justify="right")
    for p in result.points:
        row = [str(p.length or "-"), str(p.num_tokens or "-"), str(p.batch_size), str(p.num_runs)]
        row += [_num(p.latency_ms_p50, 2), _num(p.latency_ms_p99, 2), _num(p.throughput_rps)]
        row += [_num(p.encode_ms_p50, 2), _num(p.model_ms_p50, 2), _num(p.rss_mb_peak, 0)]
        row += [_num(p.cpu_util * 100, 0)]
        if gpu:
            row += [_num(p.gpu_util_pct, 0), _num(p.gpu_mem_mb_peak, 0), _num(p.gpu_power_w, 0)]
        table.add_row(*row)
    return table


def llm_table(result: LlmProfileResult) -> Table:
    """One row per number of concurrent sequences."""
    gpu = _gpu_measured(result)
    table = Table(title=_title(result))
    heads = ["seqs", "prompt", "output", "runs", "tok/s", "req/s", "TTFT p50", "TTFT p99"]
    heads += ["TPOT p50", "TPOT p99", "e2e p50", "preempt", "RSS MB", "CPU %"]
    heads += ["GPU %", "GPU MB", "W"] if gpu else []
    for head in heads:
        table.add_column(head, justify="right")
    for p in result.points:
        row = [str(p.batch_size), str(p.prompt_tokens), str(p.output_tokens), str(p.num_runs)]
        row += [_num(p.output_tokens_per_s), _num(p.throughput_rps, 2)]
        row += [_num(p.ttft_ms_p50, 2), _num(p.ttft_ms_p99, 2), _num(p.tpot_ms_p50, 2)]
        row += [_num(p.tpot_ms_p99, 2), _num(p.latency_ms_p50), str(p.num_preemptions)]
        row += [_num(p.rss_mb_peak, 0), _num(p.cpu_util * 100, 0)]
        if gpu:
            row += [_num(p.gpu_util_pct, 0), _num(p.gpu_mem_mb_peak, 0), _num(p.gpu_power_w, 0)]
        table.add_row(*row)
    return table


def _saturation(saturated: bool, batch: int, what: str, unit: str) -> str:
    if saturated:
        return f"{what} stopped growing after {batch} {unit}"
    return f"{what} still grew at {batch} {unit} (backed off from there)"


def summary_lines(result: AnyResult) -> list[str]:
    """The knee, the memory bound and the notes, as sentences."""
    if isinstance(result, LlmProfileResult):
        lines = [
            f"knee: {result.knee_batch} sequences ({result.knee_tokens_per_s:.1f} output tok/s); "
            + _saturation(result.saturated, result.saturation_batch, "tokens/s", "sequences"),
        ]
    else:
        where = f" at length {result.headline_length}" if result.headline_length else ""
        lines = [
            f"knee{where}: batch {result.knee_batch} ({result.knee_throughput_rps:.1f} rows/s); "
            + _saturation(result.saturated, result.saturation_batch, "throughput", "rows a batch"),
        ]
        memory = result.memory
        if memory is not None and memory.max_batch is not None:
            lines.append(
                f"memory bound: batch <= {memory.max_batch} = ({memory.budget_mb:.0f} MB budget "
                f"- {memory.weights_mb:.0f} MB weights) / {memory.per_sample_mb:.2f} MB per row"
            )
    return lines + [f"note: {note}" for note in result.notes]


def print_result(result: AnyResult, console: Console | None = None) -> None:
    """The table and the summary."""
    console = console or Console()
    table = llm_table(result) if isinstance(result, LlmProfileResult) else profile_table(result)
    console.print(table)
    for line in summary_lines(result):
        console.print(line, markup=False, highlight=False)


def comparison_table(results: Sequence[AnyResult]) -> Table:
    """One row per variant: batch-1 latency, knee, throughput at the knee, memory bound."""
    table = Table(title="fulcrum profile: variants compared")
    heads = ["variant", "b1 p50 ms", "knee batch", "at knee /s", "memory bound"]
    for head in heads:
        table.add_column(head, justify="right")
    for r in results:
        rate = r.knee_tokens_per_s if isinstance(r, LlmProfileResult) else r.knee_throughput_rps
        bound = "-" if r.memory_bound_batch is None else str(r.memory_bound_batch)
        table.add_row(r.variant, _num(r.latency_ms_b1, 2), str(r.knee_batch), _num(rate), bound)
    return table


def write_json(results: Sequence[AnyResult], out_dir: Path) -> Path:
    """`profile.json`: the result itself, or {"variants": {name: result}} for several."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / JSON_FILE
    if len(results) == 1:
        path.write_text(results[0].to_json() + "\n")
    else:
        data = {"variants": {r.variant: r for r in results}}
        text = msgspec.json.format(msgspec.json.encode(data).decode(), indent=2)
        path.write_text(text + "\n")
    return path


def _pyplot() -> Any:
    matplotlib = require("tune", "matplotlib", feature="fulcrum profile plots")
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def _series(result: AnyResult) -> list[tuple[str, list[int], list[float], list[float]]]:
    """(label, batch sizes, latency ms, per-second rate) per curve."""
    prefix = f"{result.variant} " if result.variant else ""
    if isinstance(result, LlmProfileResult):
        seqs = result.points
        rates = [p.output_tokens_per_s for p in seqs]
        tpot = [p.tpot_ms_p50 for p in seqs]
        return [(f"{prefix}tok/s", [p.batch_size for p in seqs], tpot, rates)]
    curves = []
    for length in sorted({p.length for p in result.points}):
        ps = [p for p in result.points if p.length == length]
        label = f"{prefix}length {length}" if length else prefix.strip() or "rows"
        latency = [p.latency_ms_p50 for p in ps]
        curves.append((label, [p.batch_size for p in ps], latency, [p.throughput_rps for p in ps]))
    return curves


def plot_profile(results: Sequence[AnyResult], path: Path) -> Path:
    """Latency (median; TPOT for an LLM) and throughput vs batch size; the knee dotted."""
    plt = _pyplot()
    fig, (ax_lat, ax_tp) = plt.subplots(1, 2, figsize=(12, 5))
    for index, result in enumerate(results):
        for number, (label, batches, latency, rate) in enumerate(_series(result)):
            color = f"C{(index * 4 + number) % 10}"
            ax_lat.plot(batches, latency, marker="o", color=color, label=label)
            ax_tp.plot(batches, rate, marker="o", color=color, label=label)
        knee = results[index].knee_batch
        ax_tp.axvline(knee, linestyle=":", color=f"C{index * 4 % 10}", label=f"knee {knee}")
    batches_seen = sorted({p.batch_size for r in results for p in r.points})
    llm = isinstance(results[0], LlmProfileResult)
    ax_lat.set_ylabel("time per output token p50 (ms)" if llm else "latency p50 (ms)")
    ax_tp.set_ylabel("output tokens/s" if llm else "throughput (rows/s)")
    for ax in (ax_lat, ax_tp):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches_seen, [str(b) for b in batches_seen])  # 1, 2, 4, not 2^0, 2^1
        ax.minorticks_off()
        ax.set_xlabel("concurrent sequences" if llm else "batch size")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    ax_tp.set_title("throughput (knee dotted)")
    ax_lat.set_title("latency")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
