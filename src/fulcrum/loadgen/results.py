"""What a run reports: one `PointResult` per load level, and the `BenchRun` holding them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np

from fulcrum.loadgen.driver import RawPoint
from fulcrum.loadgen.records import STATUS_CONNECT_ERROR, STATUS_TIMEOUT, RequestRecord
from fulcrum.loadgen.server_stats import ServerSplit
from fulcrum.loadgen.stats import LatencySummary, Slo, meets_all, slo_met, summarize_s

Mode = Literal["concurrency", "rate"]
MAX_CLIENT_CPU = 0.8  # above this share of one core the client may be what limits throughput
MAX_BEHIND_FRACTION = 0.01
MIN_BEHIND = 5
NUM_CDF_SAMPLES = 1000


class LlmFigures(msgspec.Struct, frozen=True, kw_only=True):
    """Streaming figures per point (vLLM's definitions)."""

    ttft: LatencySummary
    itl: LatencySummary
    tpot: LatencySummary
    output_tokens_per_s: float
    mean_output_tokens: float


class PointResult(msgspec.Struct, frozen=True, kw_only=True):
    """Everything measured at one load level."""

    mode: Mode
    level: float  # concurrency, or offered requests/s
    duration_s: float
    num_requests: int
    num_ok: int
    throughput_rps: float
    rows_per_s: float
    latency: LatencySummary
    errors: dict[str, int]  # by status: "503", "timeout", "connect"
    goodput_rps: float | None
    slo_met: bool | None
    server: ServerSplit  # from the stats API
    header_queue_ms: float | None  # from Server-Timing headers
    header_compute_ms: float | None
    header_batch_size: float | None  # mean over requests of the batch each ran in
    # Medians over answered requests with a Server-Timing `total`: the server's own time, and
    # the rest of each request's time from send to answer (HTTP, transport, the client itself).
    header_total_p50_ms: float | None = None
    outside_p50_ms: float | None = None
    client_cpu: float  # share of one core
    num_behind: int  # open loop: sends late behind schedule
    max_lag_ms: float
    stable: bool
    num_windows: int
    warnings: list[str]
    cdf_ms: list[float]  # sorted latency sample for the CDF plot
    llm: LlmFigures | None = None
    # Streamed v2 rows (`--stream-rows`): first row event's arrival after the scheduled send.
    first_rows: LatencySummary | None = None

    @property
    def label(self) -> str:
        return f"c={self.level:g}" if self.mode == "concurrency" else f"{self.level:g} rps"


class BenchRun(msgspec.Struct, kw_only=True):
    """One `fulcrum bench` run: what was measured, how, and each point."""

    model: str
    url: str
    label: str = ""
    api: Literal["v2", "openai"] = "v2"
    batch_size: int = 1
    stream_rows: bool = False  # v2 requests went to /infer_stream
    arrivals: str = ""
    slos: list[str] = []
    started_at: str = ""
    points: list[PointResult] = []
    max_rate_under: float | None = None  # the search's answer, requests/s
    search_bound: str | None = None


def _error_key(status: int) -> str:
    if status == STATUS_TIMEOUT:
        return "timeout"
    if status == STATUS_CONNECT_ERROR:
        return "connect"
    return str(status)


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _outside_ms(ok: Sequence[RequestRecord]) -> list[float | None]:
    """Per answer with a Server-Timing total: send to answer, less the server's own time."""
    return [
        None if r.outcome.total_ms is None else (r.done_s - r.sent_s) * 1e3 - r.outcome.total_ms
        for r in ok
    ]


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.median(present)) if present else None


def _cdf_sample(latencies_s: np.ndarray) -> list[float]:
    ordered = np.sort(latencies_s) * 1000.0
    if ordered.size > NUM_CDF_SAMPLES:
        ordered = ordered[np.linspace(0, ordered.size - 1, NUM_CDF_SAMPLES).astype(int)]
    return [round(float(v), 4) for v in ordered]


def llm_figures(records: Sequence[RequestRecord], duration_s: float) -> LlmFigures:
    """TTFT, ITL, TPOT summaries and output tokens/s over successful streams."""
    ok = [r for r in records if r.outcome.ok]
    num_tokens = sum(r.outcome.num_output_tokens for r in ok)
    return LlmFigures(
        ttft=summarize_s([t for r in ok if (t := r.ttft_s) is not None]),
        itl=summarize_s([gap for r in ok for gap in r.itl_s()]),
        tpot=summarize_s([t for r in ok if (t := r.tpot_s) is not None]),
        output_tokens_per_s=num_tokens / duration_s if duration_s > 0 else 0.0,
        mean_output_tokens=num_tokens / len(ok) if ok else 0.0,
    )


def first_rows_figures(ok: Sequence[RequestRecord]) -> LatencySummary:
    """Time to first rows over successful row streams: the first event after the schedule."""
    return summarize_s([t for r in ok if (t := r.ttft_s) is not None])


def _warnings(raw: RawPoint, num_requests: int, num_windows_stable: bool) -> list[str]:
    notes: list[str] = []
    if raw.client_cpu > MAX_CLIENT_CPU:
        notes.append(
            f"client used {raw.client_cpu:.0%} of a core: the generator may be the bottleneck"
        )
    # A handful of late sends is scheduling noise; latency counts from the schedule anyway.
    if raw.num_behind > max(MIN_BEHIND, MAX_BEHIND_FRACTION * num_requests):
        notes.append(
            f"generator fell behind its schedule: {raw.num_behind} sends late, "
            f"max lag {raw.max_lag_s * 1000:.1f} ms"
        )
    if not num_windows_stable:
        notes.append("not stable: windows disagreed until the time or request bound")
    return notes


def summarize_point(
    mode: Mode,
    level: float,
    raw: RawPoint,
    slos: Sequence[Slo],
    server: ServerSplit,
    *,
    llm: bool = False,
    stream_rows: bool = False,
) -> PointResult:
    """Figures of one load level from its records."""
    measurement = raw.measurement
    windowed = measurement.records
    every = windowed + measurement.drained  # latency counts the drained ones: stalls show
    duration_s = measurement.duration_s
    ok = [r for r in every if r.outcome.ok]
    num_ok_windowed = sum(1 for r in windowed if r.outcome.ok)
    latencies_s = np.array([r.latency_s for r in ok])
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return PointResult(
        mode=mode,
        level=level,
        duration_s=duration_s,
        num_requests=len(every),
        num_ok=len(ok),
        throughput_rps=num_ok_windowed * per_s,
        rows_per_s=sum(r.outcome.num_rows for r in windowed if r.outcome.ok) * per_s,
        latency=summarize_s(latencies_s),
        errors=dict(Counter(_error_key(r.outcome.status) for r in every if not r.outcome.ok)),
        goodput_rps=sum(1 for r in windowed if meets_all(r, slos)) * per_s if slos else None,
        slo_met=slo_met(every, slos) if slos else None,
        server=server,
        header_queue_ms=_mean([r.outcome.queue_ms for r in ok]),
        header_compute_ms=_mean([r.outcome.compute_ms for r in ok]),
        header_batch_size=_mean([r.outcome.batch_size for r in ok]),
        header_total_p50_ms=_median([r.outcome.total_ms for r in ok]),
        outside_p50_ms=_median(_outside_ms(ok)),
        client_cpu=raw.client_cpu,
        num_behind=raw.num_behind,
        max_lag_ms=raw.max_lag_s * 1000.0,
        stable=measurement.stable,
        num_windows=len(measurement.windows),
        warnings=_warnings(raw, len(every), measurement.stable),
        cdf_ms=_cdf_sample(latencies_s),
        llm=llm_figures(every, duration_s) if llm else None,
        first_rows=first_rows_figures(ok) if stream_rows else None,
    )
