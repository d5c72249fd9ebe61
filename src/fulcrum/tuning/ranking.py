"""Trials and how they rank: constraints, the three objectives, the Pareto frontier, the plateau.

Pure: no I/O, no clock. A trial meets the constraints when it has no `reasons` (an SLO broken, a
fidelity loss too large, a reload refused). Objectives, higher merit is better:
- goodput: requests/s meeting the SLO at the operating point;
- cost: `cost_per_hour / (3600 * goodput) * 1e6`, dollars per million requests (lower is better;
  its merit is the reciprocal);
- score: the article's `alpha * (throughput / cost) + beta * (1 / latency)`, each term divided by
  the best value among the candidates that meet the constraints, so requests/s and milliseconds
  weigh by `alpha` and `beta`, not by their units (each term is at most 1).
Goodput and cost treat merits within `tie_pct` of the best as a tie (measurement noise), broken by
lower latency (again within `tie_pct`), then fewer cores, then the earlier trial: the current
config (trial 0) keeps its place unless a candidate is better by more than noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from fulcrum.errors import InvalidInput
from fulcrum.tuning.search_space import Candidate

Objective = Literal["goodput", "cost", "score"]
OBJECTIVES: tuple[Objective, ...] = ("goodput", "cost", "score")
PLATEAU_WINDOW = 4  # model_analyzer's THROUGHPUT_MINIMUM_CONSECUTIVE_PARAMETER_TRIES
PLATEAU_GAIN = 0.05  # model_analyzer's THROUGHPUT_MINIMUM_GAIN


class RatePoint(msgspec.Struct, frozen=True, kw_only=True):
    """One load level measured for a trial."""

    rate_rps: float
    goodput_rps: float
    throughput_rps: float
    latency_ms: float  # the first SLO's metric at its percentile
    slo_met: bool


class TrialFigures(msgspec.Struct, frozen=True, kw_only=True):
    """What a trial measured at its operating point: the highest rate that held the SLO (or
    `--rate`); for a trial that held at no rate, the lowest rate tried."""

    rate_rps: float
    goodput_rps: float  # requests/s meeting every SLO
    throughput_rps: float
    rows_per_s: float
    latency_ms: float  # the first SLO's metric at its percentile (what the SLO bounds)
    p50_ms: float
    p99_ms: float
    mean_batch_size: float | None = None
    errors: dict[str, int] = {}
    # The rate search ran out of steps before any rate failed: the true maximum may be higher.
    rate_is_lower_bound: bool = False


class Trial(msgspec.Struct, frozen=True, kw_only=True):
    """One configuration tried: what it changed, what it measured, and why it failed if it did."""

    index: int
    phase: str  # "current", "preset:batch", or the dimension being swept
    candidate: Candidate
    changes: dict[str, object]  # dotted config keys against the file (empty: the file config)
    figures: TrialFigures | None  # None: not measured (the reload was refused)
    reasons: tuple[str, ...] = ()  # constraints broken; empty: it meets every constraint
    points: tuple[RatePoint, ...] = ()

    @property
    def feasible(self) -> bool:
        return not self.reasons and self.figures is not None


class ObjectiveSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The objective and its knobs."""

    objective: Objective = "goodput"
    cost_per_hour: float | None = None
    alpha: float = 1.0
    beta: float = 1.0
    tie_pct: float = 2.0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise InvalidInput(f"objective {self.objective!r}: expected one of {OBJECTIVES}")
        if self.objective == "cost" and self.cost_per_hour is None:
            raise InvalidInput("objective 'cost' needs --cost-per-hour")
        if self.cost_per_hour is not None and not self.cost_per_hour > 0:
            raise InvalidInput(f"cost per hour {self.cost_per_hour}: must be > 0")
        if self.alpha < 0 or self.beta < 0 or self.alpha + self.beta <= 0:
            raise InvalidInput("alpha and beta must be >= 0, not both 0")
        if not 0 <= self.tie_pct < 100:
            raise InvalidInput(f"tie percent {self.tie_pct}: must lie in [0, 100)")


def cost_per_million(goodput_rps: float, cost_per_hour: float) -> float | None:
    """Dollars per million requests served within the SLO (None: nothing was served)."""
    if goodput_rps <= 0:
        return None
    return cost_per_hour / (3600.0 * goodput_rps) * 1e6


def merits(trials: Sequence[Trial], spec: ObjectiveSpec) -> dict[int, float]:
    """Each feasible trial's merit by trial index (higher is better); infeasible ones absent."""
    ok = [t for t in trials if t.feasible and t.figures is not None and t.figures.goodput_rps > 0]
    if spec.objective in ("goodput", "cost"):
        # 1 / cost per million is goodput times a constant: the same order, the same gains.
        return {t.index: _figures(t).goodput_rps for t in ok}
    if not ok:
        return {}
    cost = spec.cost_per_hour or 1.0  # one machine's price: the term is then throughput
    best_value = max(_figures(t).goodput_rps / cost for t in ok)
    best_speed = max(1.0 / max(_figures(t).latency_ms, 1e-9) for t in ok)
    return {
        t.index: spec.alpha * (_figures(t).goodput_rps / cost) / best_value
        + spec.beta * (1.0 / max(_figures(t).latency_ms, 1e-9)) / best_speed
        for t in ok
    }


def _figures(trial: Trial) -> TrialFigures:
    assert trial.figures is not None  # callers pass feasible trials only
    return trial.figures


def rank(trials: Sequence[Trial], spec: ObjectiveSpec) -> list[Trial]:
    """The trials that meet every constraint, best first."""
    scored = merits(trials, spec)
    ok = [t for t in trials if t.index in scored]
    if spec.objective == "score" or not ok:
        return sorted(ok, key=lambda t: (-scored[t.index], t.index))
    tie = spec.tie_pct / 100.0
    best = max(scored.values())
    tied = {t.index for t in ok if scored[t.index] >= best * (1.0 - tie)}
    fastest = min(_figures(t).latency_ms for t in ok if t.index in tied)

    def key(trial: Trial) -> tuple[int, float, int, int]:
        if trial.index not in tied:
            return (2, -scored[trial.index], 0, trial.index)
        latency = _figures(trial).latency_ms
        if latency <= fastest * (1.0 + tie):  # as fast as the fastest, within the noise
            return (0, 0.0, trial.candidate.num_cores, trial.index)
        return (1, latency, trial.candidate.num_cores, trial.index)

    return sorted(ok, key=key)


def objective_value(trial: Trial, spec: ObjectiveSpec, scored: dict[int, float]) -> float | None:
    """The objective in its own unit: goodput rps, $ per million requests, or the score."""
    if trial.index not in scored or trial.figures is None:
        return None
    if spec.objective == "cost":
        assert spec.cost_per_hour is not None  # ObjectiveSpec requires it for "cost"
        return cost_per_million(trial.figures.goodput_rps, spec.cost_per_hour)
    return scored[trial.index]


def pareto_front(trials: Sequence[Trial]) -> list[Trial]:
    """Feasible trials no other feasible trial beats on both goodput (higher) and latency
    (lower), by goodput ascending."""
    ok = [t for t in trials if t.feasible]

    def dominated(t: Trial) -> bool:
        a = _figures(t)
        for other in ok:
            b = _figures(other)
            no_worse = b.goodput_rps >= a.goodput_rps and b.latency_ms <= a.latency_ms
            better = b.goodput_rps > a.goodput_rps or b.latency_ms < a.latency_ms
            if no_worse and better:
                return True
        return False

    return sorted((t for t in ok if not dominated(t)), key=lambda t: _figures(t).goodput_rps)


def plateaued(
    history: Sequence[float | None],
    *,
    window: int = PLATEAU_WINDOW,
    min_gain: float = PLATEAU_GAIN,
) -> bool:
    """model_analyzer's rule: once `window` points are measured, stop when the best of the last
    `window` gains no more than `min_gain` over the first of them. None: the point failed."""
    if len(history) < window:
        return False
    recent = history[-window:]
    first = recent[0]
    present = [m for m in recent if m is not None]
    best = max(present) if present else None
    if best is None:
        return True  # nothing in the window held: no gain at all
    if first is None or first <= 0:
        return False  # from failing to holding is a gain
    return (best - first) / first <= min_gain
