"""Ranking `fulcrum tune` trials: constraints, the three objectives, Pareto, the plateau rule,
and the report built on them (table, why text, tune.json, pareto.png) from synthetic trials."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from rich.console import Console

from fulcrum.errors import InvalidInput
from fulcrum.tuning.ranking import (
    ObjectiveSpec,
    Trial,
    TrialFigures,
    cost_per_million,
    merits,
    objective_value,
    pareto_front,
    plateaued,
    rank,
)
from fulcrum.tuning.search_space import Candidate
from fulcrum.tuning.tune import TuneResult
from fulcrum.tuning.tune_report import PARETO_PNG, TUNE_JSON, print_result, why_text, write_result


def trial(
    index: int,
    goodput: float,
    latency_ms: float,
    *,
    reasons: tuple[str, ...] = (),
    instances: int = 1,
    batch: int = 1,
) -> Trial:
    figures = TrialFigures(
        rate_rps=goodput, goodput_rps=goodput, throughput_rps=goodput, rows_per_s=goodput,
        latency_ms=latency_ms, p50_ms=latency_ms / 2, p99_ms=latency_ms,
    )  # fmt: skip
    candidate = Candidate(max_batch_size=batch, batching=True, instances=instances)
    return Trial(
        index=index,
        phase="current" if index == 0 else "max_batch_size",
        candidate=candidate,
        changes={} if index == 0 else {"max_batch_size": batch},
        figures=figures,
        reasons=reasons,
    )


GOODPUT = ObjectiveSpec()


def test_goodput_ranks_feasible_trials_and_drops_slo_breakers() -> None:
    trials = [
        trial(0, 100.0, 40.0),
        trial(1, 300.0, 45.0, batch=8),
        trial(2, 900.0, 180.0, batch=64, reasons=("p99=100ms broken: 180.0 ms",)),
        trial(3, 250.0, 30.0, batch=4),
    ]
    ranked = rank(trials, GOODPUT)
    assert [t.index for t in ranked] == [1, 3, 0]  # the faster breaker is out, whatever its rate
    assert 2 not in merits(trials, GOODPUT)


def test_goodput_ties_go_to_latency_then_cores_then_the_current_config() -> None:
    within_noise = [trial(0, 100.0, 50.0), trial(1, 101.0, 30.0), trial(2, 99.5, 50.0)]
    assert rank(within_noise, GOODPUT)[0].index == 1  # 1% more goodput is noise; 30 ms is not
    same = [trial(0, 100.0, 30.0, instances=2), trial(1, 101.0, 30.2), trial(2, 100.5, 30.1)]
    assert rank(same, GOODPUT)[0].index == 1  # as fast within noise: fewer cores wins
    equal = [trial(0, 100.0, 30.0), trial(1, 101.0, 30.2)]
    assert rank(equal, GOODPUT)[0].index == 0  # nothing better by more than noise: keep it
    strict = ObjectiveSpec(tie_pct=0.0)
    assert rank(within_noise, strict)[0].index == 1
    assert rank([trial(0, 100.0, 20.0), trial(1, 150.0, 90.0)], GOODPUT)[0].index == 1


def test_cost_per_million_requests() -> None:
    assert cost_per_million(100.0, 3.6) == pytest.approx(10.0)  # $3.6/h at 100 rps
    assert cost_per_million(0.0, 3.6) is None
    spec = ObjectiveSpec(objective="cost", cost_per_hour=3.6)
    trials = [trial(0, 100.0, 40.0), trial(1, 200.0, 40.0)]
    scored = merits(trials, spec)
    assert rank(trials, spec)[0].index == 1  # half the cost per request
    assert objective_value(trials[1], spec, scored) == pytest.approx(5.0)
    with pytest.raises(InvalidInput, match="needs --cost-per-hour"):
        ObjectiveSpec(objective="cost")
    with pytest.raises(InvalidInput, match="must be > 0"):
        ObjectiveSpec(cost_per_hour=0.0)


def test_score_normalises_each_term_to_the_best_candidate() -> None:
    fast = trial(0, 100.0, 10.0)  # throughput term 0.5, latency term 1.0
    wide = trial(1, 200.0, 40.0)  # throughput term 1.0, latency term 0.25
    balanced = ObjectiveSpec(objective="score", cost_per_hour=2.0)
    scored = merits([fast, wide], balanced)
    assert scored == {0: pytest.approx(1.5), 1: pytest.approx(1.25)}
    assert rank([fast, wide], balanced)[0].index == 0
    throughput_heavy = ObjectiveSpec(objective="score", alpha=3.0, beta=1.0)
    assert rank([fast, wide], throughput_heavy)[0].index == 1  # 3 + 0.25 > 1.5 + 1
    # Units do not matter: latency in microseconds ranks the same.
    micro = [trial(0, 100.0, 10_000.0), trial(1, 200.0, 40_000.0)]
    assert merits(micro, balanced) == pytest.approx(scored)
    with pytest.raises(InvalidInput, match="alpha and beta"):
        ObjectiveSpec(objective="score", alpha=0.0, beta=0.0)


def test_pareto_front_keeps_only_undominated_feasible_trials() -> None:
    trials = [
        trial(0, 100.0, 20.0),
        trial(1, 200.0, 30.0),
        trial(2, 150.0, 35.0),  # dominated by 1: less goodput, more latency
        trial(3, 300.0, 60.0),
        trial(4, 400.0, 10.0, reasons=("p99=50ms broken",)),  # would dominate all; infeasible
        trial(5, 200.0, 30.0),  # equal to 1: neither dominates
    ]
    assert [t.index for t in pareto_front(trials)] == [0, 1, 5, 3]


def test_plateau_rule() -> None:
    assert not plateaued([100.0, 102.0, 103.0])  # fewer than four points
    assert plateaued([100.0, 102.0, 104.0, 103.0])  # best of the last four +4%
    assert plateaued([100.0, 101.0, 105.0, 90.0])  # exactly +5% stops too
    assert not plateaued([100.0, 101.0, 103.0, 110.0])  # +10%
    assert not plateaued([50.0, 100.0, 102.0, 104.0, 106.0])  # the window slides: +6%
    assert plateaued([None, None, None, None])  # nothing held
    assert not plateaued([None, 50.0, 60.0, 70.0])  # failing to holding is a gain
    assert plateaued([100.0, None, None, None])


DIFF = "--- a/echo/config.toml\n+++ b/echo/config.toml\n-max_batch_size = 1\n+max_batch_size = 8\n"


def result_of(trials: list[Trial], spec: ObjectiveSpec = GOODPUT) -> TuneResult:
    ranked = rank(trials, spec)
    return TuneResult(
        model="echo", url="http://127.0.0.1:1", platform="echo", slos=["p99=100ms"], spec=spec,
        rate_rps=None, scenario="", num_cores=2, dimensions=["max_batch_size"],
        skipped_variants={"int4": "fidelity 0.90 loses 10.00% > allowed 1.00%"}, trials=trials,
        winner=ranked[0].index if ranked else None,
        pareto=[t.index for t in pareto_front(trials)], notes=["max_batch_size: stopped"],
        diff=DIFF,
    )  # fmt: skip


def test_why_text_names_the_knockouts_and_the_margin_over_the_current_config() -> None:
    trials = [
        trial(0, 100.0, 40.0),
        trial(1, 300.0, 45.0, batch=8),
        trial(2, 900.0, 180.0, batch=64, reasons=("at 900 rps: p99=100ms broken: 180.0 ms",)),
    ]
    text = why_text(result_of(trials))
    assert "1 of 3 trials broke a constraint (SLO 1)" in text
    assert "trial 2 (b=64 d=0ms i=1): at 900 rps: p99=100ms broken" in text
    assert "Trial 1 (b=8 d=0ms i=1) wins on goodput = 300.000 rps" in text
    assert "goodput 100.0 -> 300.0 rps (+200%)" in text
    assert "Variants not tried: int4" in text


def test_why_text_when_nothing_meets_the_slo() -> None:
    trials = [trial(0, 100.0, 400.0, reasons=("at 16 rps: p99=100ms broken: 400.0 ms",))]
    result = result_of(trials)
    assert result.winner is None
    assert "No trial met every constraint" in why_text(result)


def test_report_files_and_table(tmp_path: Path) -> None:
    trials = [
        trial(0, 100.0, 40.0),
        trial(1, 300.0, 45.0, batch=8),
        trial(2, 900.0, 180.0, batch=64, reasons=("at 900 rps: [p99] broken",)),
    ]
    result = result_of(trials)
    written = write_result(result, tmp_path / "out")
    assert {p.name for p in written} == {TUNE_JSON, PARETO_PNG, "config.diff"}
    assert (tmp_path / "out" / PARETO_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    decoded = msgspec.json.decode((tmp_path / "out" / TUNE_JSON).read_bytes(), type=TuneResult)
    assert decoded.winner == 1 and decoded.trials[2].reasons == trials[2].reasons
    assert decoded.trials[1].candidate == trials[1].candidate
    console = Console(width=200, record=True)
    print_result(result, console)
    shown = console.export_text()
    assert "WINNER" in shown and "[p99] broken" in shown  # reasons are not read as markup
    assert "+max_batch_size = 8" in shown
