"""`fulcrum tune`: search configs against a live server for the best one that meets the SLO.

Trial 0 is the file's config as it is. From the scenario preset (or the current config) each
dimension is swept in turn around the best trial so far (coordinate descent); a sweep stops early
by model_analyzer's plateau rule. Each candidate is applied by reloading the model with a config
override and measured by the load generator (`live.LiveMeasurer`): the highest request rate that
holds the SLO (bisection), or one point at `--rate`. At the end the server serves the file again.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec

from fulcrum.config import ModelConfig, load_model_config
from fulcrum.errors import FulcrumError, InvalidInput
from fulcrum.loadgen.kserve import V2Inputs
from fulcrum.loadgen.llm import LlmInputs
from fulcrum.loadgen.stats import parse_slo
from fulcrum.tuning.ranking import (
    PLATEAU_GAIN,
    PLATEAU_WINDOW,
    ObjectiveSpec,
    RatePoint,
    Trial,
    TrialFigures,
    merits,
    pareto_front,
    plateaued,
    rank,
)
from fulcrum.tuning.search_space import (
    Candidate,
    Scenario,
    SearchSpace,
    build_space,
    changed_keys,
    current_candidate,
    eligible_variants,
    preset,
)


class Measured(msgspec.Struct, frozen=True, kw_only=True):
    """What measuring one candidate gave: figures, constraints broken, the points behind it."""

    figures: TrialFigures | None
    reasons: tuple[str, ...] = ()
    points: tuple[RatePoint, ...] = ()


class Measurer(Protocol):
    """Applies a candidate and measures it; `changes` empty: the file's config as it is."""

    async def measure(
        self, candidate: Candidate, changes: dict[str, object], *, start_rate_rps: float | None
    ) -> Measured: ...


class Confirmation(msgspec.Struct, frozen=True, kw_only=True):
    """A trial's goodput measured again after the search: the search measured each candidate
    once, and on a noisy machine one lucky (or unlucky) run can crown a winner."""

    trial: int
    goodputs: list[float]  # the search's figure first, then each re-measurement (0: failed)

    @property
    def median(self) -> float:
        return statistics.median(self.goodputs)


TrialCallback = Callable[[Trial], None]
MAX_PASSES = 3  # coordinate descent converges in two or three passes on these few dimensions


@dataclass(slots=True)
class SearchPlan:
    """Where the search starts, what it may change, and how many trials it may spend."""

    space: SearchSpace
    current: Candidate
    changes: Callable[[Candidate], dict[str, object]]
    spec: ObjectiveSpec = field(default_factory=ObjectiveSpec)
    start: Candidate | None = None  # a scenario preset; None: start from the current config
    start_phase: str = "preset"
    budget_trials: int = 16
    # Constraints known before measuring (a variant's recorded fidelity), by candidate.
    known_reasons: Callable[[Candidate], tuple[str, ...]] = lambda _c: ()


class TuneSearch:
    """Coordinate descent over the plan's dimensions; every trial is kept."""

    def __init__(
        self, plan: SearchPlan, measurer: Measurer, *, on_trial: TrialCallback | None = None
    ) -> None:
        if plan.budget_trials < 1:
            raise InvalidInput(f"budget of {plan.budget_trials} trials: must be >= 1")
        self.plan = plan
        self.measurer = measurer
        self.on_trial = on_trial
        self.trials: list[Trial] = []
        self.notes: list[str] = []
        self._seen: dict[Candidate, Trial] = {}
        self._pass = 1

    @property
    def budget_left(self) -> int:
        return self.plan.budget_trials - len(self.trials)

    def best(self) -> Trial | None:
        """The best trial meeting every constraint so far."""
        ranked = rank(self.trials, self.plan.spec)
        return ranked[0] if ranked else None

    async def run(self) -> list[Trial]:
        """Trial 0, the preset, then passes of sweeps (each dimension in turn around the best so
        far) while a pass still finds a better config and the budget lasts."""
        plan = self.plan
        await self._try(plan.current, "current")
        start = plan.start or plan.current
        await self._try(start, plan.start_phase if plan.start else "current")
        for number in range(1, MAX_PASSES + 1):
            self._pass = number
            before = self.best()
            for name in plan.space.dimensions():
                if not await self._sweep(name, start):
                    self.notes.append(
                        f"budget of {plan.budget_trials} trials spent in pass {number}, "
                        f"sweeping {name}"
                    )
                    return self.trials
            after = self.best()
            if after is None or (before is not None and after.index == before.index):
                break  # a pass that found nothing better: a next one would repeat it
        return self.trials

    async def _sweep(self, name: str, start: Candidate) -> bool:
        """Sweep one dimension around the best trial; False when the budget ran out."""
        best = self.best()
        base = best.candidate if best is not None else start
        values = self.plan.space.sweep(name, base)
        swept: list[Trial] = []
        for candidate in values:
            trial = await self._try(candidate, name)
            if trial is None:
                return False
            swept.append(trial)
            scored = merits(self.trials, self.plan.spec)
            history = [scored.get(t.index) for t in swept]
            if plateaued(history) and len(swept) < len(values):
                self.notes.append(
                    f"pass {self._pass}, {name}: stopped at {candidate.label()} (plateau: the "
                    f"best of the last {PLATEAU_WINDOW} values gained <= {PLATEAU_GAIN:.0%})"
                )
                break
        return True

    async def confirm(self, winner: Trial, rounds: int) -> list[Confirmation]:
        """Re-measure the current config (trial 0) and `winner` in alternation, `rounds` times
        each, so both see the same stretch of the machine's noise."""
        current = self.trials[0]
        samples = {t.index: [_goodput(t.figures, t.reasons)] for t in (current, winner)}
        for _ in range(rounds):
            for trial in (current, winner):
                hint = trial.figures.rate_rps if trial.figures is not None else None
                measured = await self.measurer.measure(
                    trial.candidate, trial.changes, start_rate_rps=hint
                )
                samples[trial.index].append(_goodput(measured.figures, measured.reasons))
        return [Confirmation(trial=index, goodputs=values) for index, values in samples.items()]

    async def _try(self, candidate: Candidate, phase: str) -> Trial | None:
        """Measure `candidate` unless it was already (its trial), or the budget is spent (None)."""
        if candidate in self._seen:
            return self._seen[candidate]
        if self.budget_left <= 0:
            return None
        best = self.best()
        hint = best.figures.rate_rps if best is not None and best.figures is not None else None
        changes = self.plan.changes(candidate)
        known = self.plan.known_reasons(candidate)
        measured = await self.measurer.measure(candidate, changes, start_rate_rps=hint)
        trial = Trial(
            index=len(self.trials),
            phase=phase,
            candidate=candidate,
            changes=changes,
            figures=measured.figures,
            reasons=known + measured.reasons,
            points=measured.points,
        )
        self.trials.append(trial)
        self._seen[candidate] = trial
        if self.on_trial is not None:
            self.on_trial(trial)
        return trial


class TuneOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one `fulcrum tune` run needs."""

    model: str
    repository: Path
    url: str = "http://127.0.0.1:8000"
    slos: tuple[str, ...]
    rate_rps: float | None = None  # measure at this rate instead of searching the highest
    max_fidelity_loss: float = 0.01
    spec: ObjectiveSpec = ObjectiveSpec()
    scenario: Scenario | None = None
    budget_trials: int = 16
    confirm_rounds: int = 2  # re-measurements of trial 0 and the winner; 0: none
    num_cores: int = 0  # 0: this machine's
    only: tuple[str, ...] = ()  # sweep only these dimensions
    point_s: float = 3.0  # measured seconds per load point
    warmup_s: float = 0.5
    search_start_rps: float = 16.0
    search_steps: int = 6  # load points per candidate's rate search
    search_tolerance: float = 0.1
    v2: V2Inputs = V2Inputs()
    llm: LlmInputs = LlmInputs()
    timeout_s: float = 10.0
    admin_token: str = ""
    apply: bool = False
    seed: int = 0


class TuneResult(msgspec.Struct, kw_only=True):
    """One `fulcrum tune` run: the trials, the winner, and the config change it suggests."""

    model: str
    url: str
    platform: str
    slos: list[str]
    spec: ObjectiveSpec
    rate_rps: float | None
    scenario: str
    num_cores: int
    dimensions: list[str]
    skipped_variants: dict[str, str]
    trials: list[Trial]
    winner: int | None  # trial index; None: no trial met the constraints
    pareto: list[int]
    notes: list[str]
    confirmation: list[Confirmation] = []  # trial 0 and the search's winner, re-measured
    diff: str = ""  # the winner against config.toml ("" when the file config won)
    applied: bool = False
    started_at: str = ""

    def trial(self, index: int | None) -> Trial | None:
        return None if index is None else self.trials[index]


def _num_cores(requested: int) -> int:
    if requested > 0:
        return requested
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def plan_for(options: TuneOptions, config: ModelConfig) -> tuple[SearchPlan, dict[str, str]]:
    """The search plan for `config`, and the variants left out with why."""
    slos = [parse_slo(text) for text in options.slos]
    if not slos:
        raise InvalidInput("tune needs an SLO: e.g. --slo p99=100ms")
    bound = next((s.bound_ms for s in slos if s.metric == "latency"), None)
    choice = eligible_variants(config, options.max_fidelity_loss)
    space = build_space(
        config,
        variants=choice.allowed,
        num_cores=_num_cores(options.num_cores),
        min_rows=options.v2.batch_size,
        slo_bound_ms=bound,
        only=options.only,
    )
    current = current_candidate(config)

    def known_reasons(candidate: Candidate) -> tuple[str, ...]:
        why = choice.skipped.get(candidate.variant)
        return (f"variant {candidate.variant}: {why}",) if why else ()

    plan = SearchPlan(
        space=space,
        current=current,
        changes=lambda candidate: changed_keys(config, candidate),
        spec=options.spec,
        start=preset(options.scenario, config, space) if options.scenario else None,
        start_phase=f"preset:{options.scenario}",
        budget_trials=options.budget_trials,
        known_reasons=known_reasons,
    )
    return plan, choice.skipped


async def run_tune_async(
    options: TuneOptions, *, on_trial: TrialCallback | None = None
) -> TuneResult:
    """Search, then restore the server to the file's config (after writing it, with `apply`)."""
    from fulcrum.tuning.config_file import edit_config, set_values
    from fulcrum.tuning.live import LiveMeasurer

    config_path = options.repository / options.model / "config.toml"
    config = load_model_config(config_path, dir_name=options.model)
    plan, skipped = plan_for(options, config)
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    measurer = LiveMeasurer.from_options(options, config)
    search = TuneSearch(plan, measurer, on_trial=on_trial)
    confirmation: list[Confirmation] = []
    try:
        trials = await search.run()
        winner = search.best()
        if winner is not None and options.confirm_rounds > 0 and _comparable(search, winner):
            confirmation = await search.confirm(winner, options.confirm_rounds)
            winner = _confirmed(search, winner, confirmation, options.spec)
        changes = winner.changes if winner is not None else {}
        edit = edit_config(config_path, set_values(changes), write=options.apply and bool(changes))
    except BaseException:
        # Serve the file again on the way out; the error that stopped the run is the news.
        with contextlib.suppress(FulcrumError):
            await measurer.restore()
        raise
    await measurer.restore()  # the file serves again: the applied one, or the untouched one
    return TuneResult(
        model=options.model,
        url=options.url,
        platform=config.platform,
        slos=list(options.slos),
        spec=options.spec,
        rate_rps=options.rate_rps,
        scenario=options.scenario or "",
        num_cores=_num_cores(options.num_cores),
        dimensions=plan.space.dimensions(),
        skipped_variants=skipped,
        trials=trials,
        winner=None if winner is None else winner.index,
        pareto=[t.index for t in pareto_front(trials)],
        notes=search.notes,
        confirmation=confirmation,
        diff=edit.diff,
        applied=options.apply and edit.changed,
        started_at=started_at,
    )


def _goodput(figures: TrialFigures | None, reasons: tuple[str, ...]) -> float:
    return figures.goodput_rps if figures is not None and not reasons else 0.0


def _comparable(search: TuneSearch, winner: Trial) -> bool:
    """Whether re-measuring can overturn the winner: it beat a current config that meets the
    constraints, on goodput (goodput and cost rank alike; the score weighs latency too)."""
    current = search.trials[0]
    return (
        winner.index != current.index
        and search.plan.spec.objective != "score"
        and not current.reasons
        and current.figures is not None
    )


def _confirmed(
    search: TuneSearch, winner: Trial, confirmation: list[Confirmation], spec: ObjectiveSpec
) -> Trial:
    """The winner, unless its goodput gain over a current config that meets the constraints did
    not survive re-measuring both (medians within the tie margin): then the current config
    stays, since a change that only noise favoured is not worth applying."""
    current = search.trials[0]
    medians = {c.trial: c.median for c in confirmation}
    if medians[winner.index] > medians[current.index] * (1 + spec.tie_pct / 100):
        return winner
    search.notes.append(
        f"trial {winner.index}'s gain did not survive re-measuring: median goodput "
        f"{medians[winner.index]:.1f} vs the current config's {medians[current.index]:.1f} "
        f"requests/s (within {spec.tie_pct:g}%, or below): the current config stays"
    )
    return current
