"""benchmarks/adaptive_vs_static.py imports, answers --help, and its trace bookkeeping is right.

The benchmark itself (servers, timings) is not run here: speed is never asserted in tests.
"""

from __future__ import annotations

import importlib
import itertools
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from fulcrum.loadgen.records import STATUS_TIMEOUT, Outcome, RequestRecord
from fulcrum.loadgen.stats import Slo

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import their siblings by name
load_trace = importlib.import_module("load_trace")
Step = load_trace.Step


def test_help_names_every_mode() -> None:
    script = BENCHMARKS / "adaptive_vs_static.py"
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    for flag in ("--ends", "--llm", "--repository", "--out", "--slo-ms", "--variant"):
        assert flag in done.stdout


def test_defaults_parse() -> None:
    adaptive_vs_static = importlib.import_module("adaptive_vs_static")
    args = adaptive_vs_static.parse_args([])
    assert args.slo_ms == 100.0 and args.peak == 1.5 and not args.ends and not args.llm
    assert adaptive_vs_static.adaptive_override(100.0, None) == {
        "dynamic_batching": {"policy": "adaptive", "slo_p99_ms": 100.0}
    }


def test_ramp_goes_up_to_the_peak_and_back_with_two_bursts() -> None:
    steps = load_trace.ramp_trace(2.0, low=0.1, peak=1.5, num_levels=8, burst_s=1.0, burst_load=2.0)
    plain = [s.load for s in steps if not s.burst]
    assert plain[0] == plain[-1] == 0.1 and max(plain) == 1.5
    assert plain.index(1.5) == 7 and plain == plain[::-1]
    assert [s.load for s in steps if s.burst] == [2.0, 2.0]
    assert all(a.end_s == b.start_s for a, b in itertools.pairwise(steps))
    assert steps[-1].end_s == 15 * 2.0 + 2 * 1.0


def test_arrivals_replay_identically_and_follow_each_steps_rate() -> None:
    steps = [Step(0.0, 20.0, 0.1), Step(20.0, 20.0, 1.0)]
    first = load_trace.arrival_times(steps, 100.0, seed=3)
    assert first == load_trace.arrival_times(steps, 100.0, seed=3)
    low = sum(1 for t in first if t < 20.0)
    high = len(first) - low
    assert 150 < low < 250 and 1800 < high < 2200  # 10/s and 100/s for 20 s each
    assert first == sorted(first) and first[-1] < 40.0


def _record(scheduled_s: float, latency_s: float, status: int = 200) -> RequestRecord:
    return RequestRecord(scheduled_s, scheduled_s, scheduled_s + latency_s, Outcome(status))


def test_steps_count_by_scheduled_time_and_widest_load_stops_at_the_first_miss() -> None:
    steps = [Step(0.0, 1.0, 0.1), Step(1.0, 1.0, 0.5), Step(2.0, 1.0, 1.0), Step(3.0, 1.0, 0.5)]
    records = [_record(0.5, 0.01), _record(0.6, 0.02)]  # step 0: all good
    records += [_record(1.5, 0.05) for _ in range(100)]  # step 1: all good
    records += [_record(2.5, 0.5), _record(2.6, 0.0, 503)]  # step 2: late and shed
    # step 3 (load 0.5 again, after the peak): one timeout in 50 -> 98% good, below 99%
    records += [_record(3.5, 0.05) for _ in range(49)] + [_record(3.9, 5.0, STATUS_TIMEOUT)]
    run = load_trace.Replayed(start_s=0.0, records=records)
    good = lambda r: r.outcome.ok and r.latency_s <= 0.1  # noqa: E731
    results = load_trace.summarize_steps(run, steps, [Slo(bound_ms=100.0, percentile=99.0)], good)
    assert [(s.offered, s.good, s.shed, s.timed_out) for s in results] == [
        (2, 2, 0, 0),
        (100, 100, 0, 0),
        (2, 0, 1, 0),
        (50, 49, 0, 1),
    ]
    assert results[2].p99_ms["latency"] == pytest.approx(500.0)
    policy = load_trace.PolicyResult("p", None, results, 4.0)
    assert policy.steps_within() == [True, True, False, False]
    # 0.5 missed on the way down, so the range where the SLO held ends at 0.1
    assert policy.widest_load() == 0.1
    assert policy.goodput_rps == pytest.approx(151 / 4.0)
    assert policy.shed == 1 and policy.timed_out == 1


MINILM_TOML = """platform = "onnx"
max_batch_size = 64

[dynamic_batching]
# the shipped policy
policy = "adaptive"
slo_p99_ms = 100
preferred_batch_sizes = [8]
"""


def test_static_configs_are_told_the_slo() -> None:
    adaptive_vs_static = importlib.import_module("adaptive_vs_static")
    assert adaptive_vs_static.static_override(16, 5.0, 80.0) == {
        "max_batch_size": 16,
        "dynamic_batching": {"policy": "triton", "max_queue_delay_ms": 5.0, "slo_p99_ms": 80.0},
    }
    args = adaptive_vs_static.parse_args(["--no-tune", "--tune-trials", "5"])
    assert args.no_tune and args.tune_trials == 5


def test_tune_reads_a_copy_under_tritons_rules_and_its_winner_keeps_the_slo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fulcrum.config import load_model_config
    from fulcrum.tuning.ranking import Trial, TrialFigures
    from fulcrum.tuning.search_space import Candidate

    static_by_tune = importlib.import_module("static_by_tune")
    (tmp_path / "repo" / "minilm").mkdir(parents=True)
    original = tmp_path / "repo" / "minilm" / "config.toml"
    original.write_text(MINILM_TOML)
    copy = static_by_tune.triton_copy(tmp_path / "repo", tmp_path / "work", "minilm")
    assert original.read_text() == MINILM_TOML  # the user's repository is left alone
    config = load_model_config(copy / "minilm" / "config.toml", dir_name="minilm")
    assert config.dynamic_batching is not None
    assert config.dynamic_batching.policy == "triton"
    assert config.dynamic_batching.slo_p99_ms == 100
    assert "# the shipped policy" in (copy / "minilm" / "config.toml").read_text()

    figures = TrialFigures(rate_rps=300, goodput_rps=290, throughput_rps=300, rows_per_s=300,
                           latency_ms=90, p50_ms=20, p99_ms=90)  # fmt: skip
    winner = Trial(
        index=4, phase="max_queue_delay_ms", figures=figures,
        candidate=Candidate(max_batch_size=16, batching=True, max_queue_delay_ms=2.0),
        changes={"max_batch_size": 16, "dynamic_batching.max_queue_delay_ms": 2.0},
    )  # fmt: skip
    seen = []

    class Result:
        def __init__(self, trial: Trial | None) -> None:
            self.notes: list[str] = []
            self.confirmation: list[object] = []
            self.winner = None if trial is None else trial.index
            self._trial = trial

        def trial(self, index: int | None) -> Trial | None:
            return None if index is None else self._trial

    args = importlib.import_module("adaptive_vs_static").parse_args([])
    monkeypatch.setattr(static_by_tune, "run_tune", lambda o: seen.append(o) or Result(winner))
    found = static_by_tune.tuned_static("http://127.0.0.1:1", copy, "minilm", args, 200.0)
    assert seen[0].only == static_by_tune.DIMENSIONS and seen[0].slos == ("p99=100ms",)
    assert seen[0].search_start_rps == 100.0  # from half the capacity
    assert found is not None
    label, override = found
    assert "b=16" in label and "d=2ms" in label
    # The whole [dynamic_batching] table goes with the change: Triton's rules and the SLO stay.
    assert override == {
        "max_batch_size": 16,
        "dynamic_batching": {
            **override["dynamic_batching"],
            "policy": "triton",
            "slo_p99_ms": 100.0,
            "max_queue_delay_ms": 2.0,
            "preferred_batch_sizes": (8,),  # msgspec.to_builtins of the file
        },
    }
    # Nothing held the SLO, or tune kept the file's config: no policy of its own.
    monkeypatch.setattr(static_by_tune, "run_tune", lambda o: Result(None))
    assert static_by_tune.tuned_static("http://127.0.0.1:1", copy, "minilm", args, 200.0) is None
    kept = msgspec.structs.replace(winner, changes={})
    monkeypatch.setattr(static_by_tune, "run_tune", lambda o: Result(kept))
    assert static_by_tune.tuned_static("http://127.0.0.1:1", copy, "minilm", args, 200.0) is None


def test_llm_overload_parses_trees_and_refuses_a_bare_path() -> None:
    llm_overload = importlib.import_module("llm_overload")
    args = llm_overload.parse_args(["--src", "old:/tmp/old/src", "--src", "new:src"])
    assert args.load == 1.3 and args.config == "adaptive" and args.slo_ttft_ms == 100.0
    assert [name for name, _ in llm_overload.trees(args)] == ["old", "new"]
    assert llm_overload.trees(llm_overload.parse_args([]))[0][0] == "tree"
    with pytest.raises(SystemExit, match="NAME:PATH"):
        llm_overload.trees(llm_overload.parse_args(["--src", "/tmp/old/src"]))
