"""Latency statistics and SLOs: percentiles of a sample, SLO parsing, goodput accounting."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal, cast

import msgspec
import numpy as np

from fulcrum.errors import InvalidInput
from fulcrum.loadgen.records import RequestRecord

PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)
Metric = Literal["latency", "ttft", "tpot"]
_UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_SLO_RE = re.compile(
    r"^\s*(?:(?P<metric>latency|ttft|tpot)\s*(?::|(?P<le><=)))?\s*"
    r"(?:p(?P<pct>\d+(?:\.\d+)?)\s*=)?\s*(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>us|ms|s)\s*$"
)


class LatencySummary(msgspec.Struct, frozen=True, kw_only=True):
    """Mean, percentiles and max of one sample, in milliseconds."""

    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float

    def percentile_ms(self, pct: float) -> float:
        """One of the reported percentiles (50, 90, 95, 99, 99.9)."""
        by_pct = {
            50.0: self.p50_ms,
            90.0: self.p90_ms,
            95.0: self.p95_ms,
            99.0: self.p99_ms,
            99.9: self.p999_ms,
            100.0: self.max_ms,
        }
        if pct not in by_pct:
            raise InvalidInput(f"percentile p{pct:g} is not reported; use one of {PERCENTILES}")
        return by_pct[pct]


EMPTY = LatencySummary(
    count=0, mean_ms=0.0, p50_ms=0.0, p90_ms=0.0, p95_ms=0.0, p99_ms=0.0, p999_ms=0.0, max_ms=0.0
)


def summarize_s(values_s: Sequence[float] | np.ndarray) -> LatencySummary:
    """Summary of durations given in seconds (linear interpolation between order statistics)."""
    values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if values_ms.size == 0:
        return EMPTY
    p50, p90, p95, p99, p999 = np.percentile(values_ms, PERCENTILES)
    return LatencySummary(
        count=int(values_ms.size),
        mean_ms=float(values_ms.mean()),
        p50_ms=float(p50),
        p90_ms=float(p90),
        p95_ms=float(p95),
        p99_ms=float(p99),
        p999_ms=float(p999),
        max_ms=float(values_ms.max()),
    )


class Slo(msgspec.Struct, frozen=True, kw_only=True):
    """A latency objective: `metric` under `bound_ms`, at a percentile or for every request."""

    metric: Metric = "latency"
    bound_ms: float
    percentile: float | None = None  # None: per-request form (`latency<=100ms`)

    def __str__(self) -> str:
        if self.percentile is None:
            return f"{self.metric}<={self.bound_ms:g}ms"
        prefix = "" if self.metric == "latency" else f"{self.metric}:"
        return f"{prefix}p{self.percentile:g}={self.bound_ms:g}ms"

    def request_value_s(self, record: RequestRecord) -> float | None:
        """This SLO's metric for one request (None when the request has no such figure)."""
        if self.metric == "ttft":
            return record.ttft_s
        if self.metric == "tpot":
            return record.tpot_s
        return record.latency_s


def parse_slo(text: str) -> Slo:
    """`p99=100ms`, `latency<=100ms`, `ttft<=200ms`, `tpot:p90=50ms` -> Slo."""
    match = _SLO_RE.match(text)
    if match is None or (match["le"] and match["pct"]):
        raise InvalidInput(
            f"bad SLO {text!r}: expected e.g. p99=100ms, latency<=100ms, ttft<=200ms, tpot:p99=50ms"
        )
    if not match["le"] and not match["pct"]:
        raise InvalidInput(f"bad SLO {text!r}: give a percentile (p99=...) or a bound (<=...)")
    percentile = float(match["pct"]) if match["pct"] else None
    if percentile is not None and not 0 < percentile <= 100:
        raise InvalidInput(f"bad SLO {text!r}: percentile must lie in (0, 100]")
    bound_ms = float(match["value"]) * _UNITS_S[match["unit"]] * 1000.0
    metric = cast(Metric, match["metric"] or "latency")  # the regex admits only Metric names
    return Slo(metric=metric, bound_ms=bound_ms, percentile=percentile)


def meets_all(record: RequestRecord, slos: Sequence[Slo]) -> bool:
    """A request is good when it succeeded and each SLO's metric is within its bound."""
    if not record.outcome.ok:
        return False
    for slo in slos:
        value_s = slo.request_value_s(record)
        if value_s is not None and value_s * 1000.0 > slo.bound_ms:
            return False
    return True


def percentile_ms(records: Sequence[RequestRecord], slo: Slo) -> float:
    """The SLO metric's percentile in ms; a failed request counts as infinitely slow."""
    values_s = [
        (v if r.outcome.ok else np.inf)
        for r in records
        if (v := slo.request_value_s(r)) is not None
    ]
    if not values_s:
        return 0.0
    pct = 100.0 if slo.percentile is None else slo.percentile
    # Nearest rank (inverted CDF), not interpolation: no arithmetic on inf.
    return float(np.percentile(np.asarray(values_s) * 1000.0, pct, method="inverted_cdf"))


def slo_met(records: Sequence[RequestRecord], slos: Sequence[Slo]) -> bool:
    """Every SLO holds over the sample (per-request forms: for every request; errors fail)."""
    return all(percentile_ms(records, slo) <= slo.bound_ms for slo in slos)
