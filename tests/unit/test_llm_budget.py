"""The SLO token-budget controller and its step-time model, on a fake machine with no clock: each
step's time is whatever the fake says, and every decode sees that step time as its latency."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fulcrum.errors import ConfigError, Shed
from fulcrum.llm.budget import HEADROOM, WAIT_MARGIN, BudgetState, StepRecord, TokenBudget
from fulcrum.llm.params import EngineParams
from fulcrum.llm.step_model import SHIFT_RUN, StepTimeModel

SLO_TPOT_S = 0.050


@dataclass
class FakeMachine:
    """step_s = slowdown * (fixed_s + per_token_s * tokens)."""

    fixed_s: float = 0.002
    per_token_s: float = 0.00005
    slowdown: float = 1.0

    def step_s(self, num_tokens: int) -> float:
        return self.slowdown * (self.fixed_s + self.per_token_s * num_tokens)

    def cap(self, target_s: float) -> int:
        """The most tokens a step may hold within target_s on this machine."""
        return int((target_s / self.slowdown - self.fixed_s) / self.per_token_s)


def _budget(**params: object) -> TokenBudget:
    values: dict[str, object] = {"slo_tpot_ms": SLO_TPOT_S * 1000, **params}
    return TokenBudget(EngineParams.from_parameters(values))


def _run(
    budget: TokenBudget,
    machine: FakeMachine,
    num_steps: int,
    *,
    num_decoding: int = 32,
    num_queued_tokens: int = 100_000,
) -> list[tuple[int, float]]:
    """Steps under a full queue: each takes the whole budget. (budget, step_s) per step."""
    history = []
    for _ in range(num_steps):
        num_tokens = min(budget.state.token_budget, num_decoding + num_queued_tokens)
        step_s = machine.step_s(num_tokens)
        for _ in range(num_decoding):
            budget.observe_itl(step_s)
        budget.observe_step(
            StepRecord(
                num_prefill_tokens=num_tokens - num_decoding,
                num_decode_tokens=num_decoding,
                step_s=step_s,
                num_running=num_decoding,
                num_decoding=num_decoding,
                num_queued_tokens=num_queued_tokens,
            )
        )
        history.append((num_tokens, step_s))
    return history


def test_budget_settles_under_the_tpot_cap() -> None:
    machine = FakeMachine()
    budget = _budget()
    history = _run(budget, machine, 60)
    cap = machine.cap(HEADROOM * SLO_TPOT_S)  # 860 tokens: under max_num_batched_tokens 1024
    assert history[0][0] == 1024  # starts where the static engine sits
    assert cap - 2 <= budget.state.token_budget <= cap
    assert all(step_s <= SLO_TPOT_S for _, step_s in history[5:])
    assert budget.state.max_running == 64  # the budget covers every running slot


def test_a_3x_slowdown_shrinks_the_budget_and_recovery_grows_it_back() -> None:
    machine = FakeMachine()
    budget = _budget()
    _run(budget, machine, 40)
    fast_budget = budget.state.token_budget
    machine.slowdown = 3.0
    slow = _run(budget, machine, 60)
    slow_cap = machine.cap(HEADROOM * SLO_TPOT_S)  # about 260 tokens
    late = [step_s for _, step_s in slow].index(next(s for _, s in slow if s <= SLO_TPOT_S))
    assert late <= 2 * SHIFT_RUN  # the misses end within a few steps
    assert slow_cap - 2 <= budget.state.token_budget <= slow_cap
    # No oscillation once settled: the budget holds and no decrease happens.
    num_decreases = budget.num_decreases
    settled = _run(budget, machine, 40)
    assert budget.num_decreases == num_decreases
    assert max(t for t, _ in settled) - min(t for t, _ in settled) <= 2
    assert all(step_s <= SLO_TPOT_S for _, step_s in settled)
    machine.slowdown = 1.0
    _run(budget, machine, 40)
    assert fast_budget - 2 <= budget.state.token_budget <= fast_budget + 2


def test_budget_never_leaves_the_running_decodes_without_a_token() -> None:
    machine = FakeMachine(fixed_s=0.060)  # even a step of pure decodes misses the SLO
    budget = _budget()
    history = _run(budget, machine, 30, num_decoding=24)
    assert budget.state.token_budget == 24  # one token per running sequence, no more
    assert min(t for t, _ in history) >= 24
    assert budget.state.max_running == 24  # so nobody new is admitted into a hopeless batch


def test_budget_never_exceeds_max_num_batched_tokens_or_falls_under_its_floor() -> None:
    budget = _budget(max_num_batched_tokens=256, min_num_batched_tokens=200)
    fast = FakeMachine(per_token_s=1e-7)  # the SLO alone would allow far more tokens
    _run(budget, fast, 30)
    assert budget.state.token_budget == 256
    _run(budget, FakeMachine(slowdown=10.0), 30)
    assert budget.state.token_budget == 200  # min_num_batched_tokens holds under any slowdown


def test_budget_grows_only_while_prefill_work_waits() -> None:
    machine = FakeMachine()
    budget = _budget()
    _run(budget, machine, 5, num_decoding=4, num_queued_tokens=0)  # decodes only
    _run(budget, FakeMachine(slowdown=3.0), 20, num_decoding=4)  # a slow spell under load
    low = budget.state.token_budget
    _run(budget, machine, 30, num_decoding=4, num_queued_tokens=0)
    assert budget.state.token_budget == low  # nothing to prefill: no reason to grow
    _run(budget, machine, 30, num_decoding=4)
    assert budget.state.token_budget > low


def test_without_a_tpot_slo_the_budget_stays_at_its_maximum() -> None:
    budget = TokenBudget(EngineParams(slo_ttft_ms=500.0))
    _run(budget, FakeMachine(slowdown=10.0), 20)
    assert budget.state == BudgetState(
        1024,
        64,
        num_decoding=32,
        num_queued_tokens=100_000,
        intercept_s=budget.model.intercept_s,
        per_token_s=budget.model.per_token_s,
        num_running=32,
    )


def test_a_request_predicted_to_miss_ttft_is_shed_with_the_drain_time() -> None:
    budget = _budget(slo_ttft_ms=1000.0)
    machine = FakeMachine()
    _run(budget, machine, 40, num_queued_tokens=20_000)
    state = budget.state
    per_step = state.token_budget - state.num_decoding
    step_s = machine.step_s(state.token_budget)
    drain_s = -(-20_000 // per_step) * step_s
    assert drain_s > 1.0  # the queue ahead alone takes longer than the SLO
    with pytest.raises(Shed, match="slo_ttft_ms") as shed:
        budget.check_admission(100)
    assert shed.value.retry_after_s == pytest.approx(drain_s, rel=0.01)
    assert shed.value.status_code == 503
    assert "Retry-After" in shed.value.headers()


def test_a_request_that_fits_is_admitted_and_pending_prompts_count() -> None:
    budget = _budget(slo_ttft_ms=1000.0)
    _run(budget, FakeMachine(), 40, num_queued_tokens=500)
    predicted_s = budget.predicted_ttft_s(100)
    assert predicted_s is not None and predicted_s < 0.1
    budget.check_admission(100)  # about two steps ahead: well within a second
    with pytest.raises(Shed):  # prompts admitted since the last step queue ahead too
        budget.check_admission(100, num_pending_tokens=50_000)


def _full_running_set(budget: TokenBudget, finish_steps: tuple[int, ...], num_waiting: int) -> None:
    """Every running slot taken, 50 prompt tokens queued and `num_waiting` in line for a slot."""
    running = budget.state.max_running
    assert len(finish_steps) == running
    budget.observe_queue(
        StepRecord(0, 0, 0.0, running, running, 50, num_waiting, tuple(sorted(finish_steps)))
    )


def test_a_request_that_must_wait_for_a_running_slot_counts_that_wait() -> None:
    """Under overload the running set is full: a short prompt still waits for a running
    sequence to end, which the queued prompt tokens alone do not show."""
    budget = _budget(slo_ttft_ms=100.0, max_num_seqs=4)
    _run(budget, FakeMachine(), 40, num_queued_tokens=50)
    step_s = budget.state.step_s(4 + 50)  # the four decodes and the queued prompts
    assert step_s is not None
    first, second, rest = int(0.05 / step_s), int(0.15 / step_s), int(0.3 / step_s)
    _full_running_set(budget, (first, second, rest, rest), num_waiting=0)
    # First in line: the shortest running sequence ends within the SLO.
    predicted_s = budget.predicted_ttft_s(10)
    assert predicted_s is not None and first * step_s <= predicted_s < 0.1
    budget.check_admission(10)
    # Second in line (one admitted since the last step): waits for the second to end.
    predicted_s = budget.predicted_ttft_s(10, num_pending_tokens=10, num_pending=1)
    assert predicted_s is not None and predicted_s >= second * step_s > 0.1
    with pytest.raises(Shed, match="slo_ttft_ms") as shed:
        budget.check_admission(10, num_pending_tokens=10, num_pending=1)
    assert shed.value.retry_after_s == pytest.approx(first * step_s, rel=0.01)
    # Behind five waiting ones: past one round of the running set.
    _full_running_set(budget, (first, second, rest, rest), num_waiting=5)
    predicted_s = budget.predicted_ttft_s(10)
    assert predicted_s is not None and predicted_s >= (second + rest) * step_s


def test_the_wait_behind_others_is_planned_with_a_margin() -> None:
    """First in line for a running slot, predicted within the SLO with 20% to spare: the wait,
    planned WAIT_MARGIN times as long, is not, so it is shed (a wait that fits is admitted)."""
    budget = _budget(slo_ttft_ms=100.0, max_num_seqs=4)
    _run(budget, FakeMachine(), 40, num_queued_tokens=50)
    step_s = budget.state.step_s(4 + 50)
    assert step_s is not None
    near, short, rest = int(0.08 / step_s), int(0.05 / step_s), int(0.3 / step_s)
    _full_running_set(budget, (near, rest, rest, rest), num_waiting=0)
    predicted_s = budget.predicted_ttft_s(10)
    assert predicted_s is not None and predicted_s < 0.1 < WAIT_MARGIN * predicted_s * 0.9
    with pytest.raises(Shed, match=r"planned at 1\.5x"):
        budget.check_admission(10)
    _full_running_set(budget, (short, rest, rest, rest), num_waiting=0)
    budget.check_admission(10)  # 1.5 x ~50 ms of wait, plus its own prefill: within 100 ms


def test_a_lone_prompt_on_an_idle_engine_is_not_refused_for_the_margin() -> None:
    """Its own prefill, predicted within the SLO, is planned as predicted: nobody is ahead."""
    budget = _budget(slo_ttft_ms=60.0, slo_tpot_ms=0.0)  # no TPOT SLO: the budget stays at 1024
    _run(budget, FakeMachine(), 40, num_decoding=0, num_queued_tokens=2000)
    budget.observe_queue(StepRecord(0, 0, 0.0, 0, 0, 0))  # the engine went idle
    predicted_s = budget.predicted_ttft_s(1000)  # one step of 1000 tokens: ~52 ms
    assert predicted_s is not None and predicted_s < 0.06 < WAIT_MARGIN * predicted_s
    budget.check_admission(1000)
    with pytest.raises(Shed):  # the same prompt behind another: two steps, over the SLO
        budget.check_admission(1000, num_pending_tokens=1000, num_pending=1)


def test_a_free_running_slot_means_no_wait() -> None:
    budget = _budget(slo_ttft_ms=100.0, max_num_seqs=4)
    _run(budget, FakeMachine(), 40, num_decoding=2, num_queued_tokens=50)
    budget.observe_queue(StepRecord(0, 0, 0.0, 2, 2, 50, 0, (500, 500)))
    predicted_s = budget.predicted_ttft_s(10)
    assert predicted_s is not None and predicted_s < 0.05  # two slots free: no wait
    budget.check_admission(10, num_pending_tokens=10, num_pending=1)
    with pytest.raises(Shed):  # the third new request finds both free slots taken
        budget.check_admission(10, num_pending_tokens=20, num_pending=2)


def test_queue_action_admits_what_shed_would_refuse() -> None:
    budget = _budget(slo_ttft_ms=10.0, slo_ttft_action="queue")
    _run(budget, FakeMachine(), 20)
    predicted_s = budget.predicted_ttft_s(100)
    assert predicted_s is not None and predicted_s > 0.010
    budget.check_admission(100)


def test_nothing_is_shed_before_the_model_has_seen_a_step() -> None:
    budget = _budget(slo_ttft_ms=0.001)
    assert budget.predicted_ttft_s(10_000) is None
    budget.check_admission(10_000)


def test_params_name_the_bad_slo_key() -> None:
    with pytest.raises(ConfigError, match="slo_tpot_ms' = -1"):
        EngineParams.from_parameters({"slo_tpot_ms": -1})
    with pytest.raises(ConfigError, match="slo_ttft_ms' = 'fast'"):
        EngineParams.from_parameters({"slo_ttft_ms": "fast"})
    with pytest.raises(ConfigError, match="min_num_batched_tokens' = 2048"):
        EngineParams.from_parameters({"min_num_batched_tokens": 2048})
    with pytest.raises(ConfigError, match="slo_ttft_action"):
        EngineParams.from_parameters({"slo_ttft_action": "drop"})
    assert not EngineParams().has_slo
    assert EngineParams.from_parameters({"slo_tpot_ms": 40}).has_slo


def _trained(machine: FakeMachine, sizes: list[int]) -> StepTimeModel:
    model = StepTimeModel()
    for num_tokens in sizes:
        model.observe(num_tokens, machine.step_s(num_tokens))
    return model


def test_step_model_fits_fixed_cost_and_cost_per_token() -> None:
    machine = FakeMachine()
    model = _trained(machine, [64, 512, 128, 1024, 256] * 4)
    assert model.intercept_s == pytest.approx(machine.fixed_s, rel=1e-6)
    assert model.per_token_s == pytest.approx(machine.per_token_s, rel=1e-6)
    assert model.max_tokens_within(0.045) == machine.cap(0.045)


def test_step_model_shrugs_off_one_slow_step() -> None:
    machine = FakeMachine()
    model = _trained(machine, [64, 512, 128, 1024, 256] * 4)
    model.observe(512, 10 * machine.step_s(512))  # a GC pause
    assert model.predict(512) == pytest.approx(machine.step_s(512), rel=0.05)


def test_step_model_follows_a_level_shift_after_a_run_of_outliers() -> None:
    machine = FakeMachine()
    model = _trained(machine, [64, 512, 128, 1024, 256] * 4)
    machine.slowdown = 3.0
    for num_tokens in [512] * SHIFT_RUN:
        model.observe(num_tokens, machine.step_s(num_tokens))
    assert model.predict(512) == pytest.approx(machine.step_s(512), rel=0.01)
    half = model.max_tokens_within(machine.step_s(512) / 2)  # steps of one size since the shift
    assert half is not None and machine.cap(machine.step_s(512) / 2) <= half < 512


def test_step_model_forgets_a_slow_drift() -> None:
    machine = FakeMachine()
    model = _trained(machine, [64, 512, 128, 1024, 256] * 4)
    for period in range(30):  # 2% slower every five steps, then steady: never an outlier
        machine.slowdown *= 1.02 if period < 20 else 1.0
        for num_tokens in (64, 512, 128, 1024, 256):
            model.observe(num_tokens, machine.step_s(num_tokens))
    assert machine.slowdown > 1.45
    # Without forgetting the fit would sit near the average speed, about 20% off.
    assert model.predict(512) == pytest.approx(machine.step_s(512), rel=0.03)


def test_step_model_with_one_step_size_caps_only_when_too_slow() -> None:
    model = _trained(FakeMachine(), [400] * 8)  # the slope cannot be told from the fixed cost
    assert model.max_tokens_within(0.045) is None
    assert model.max_tokens_within(0.011) == 200  # half the time: half the tokens
