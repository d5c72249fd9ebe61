"""The LLM engine's token budget per step and running limit, held to TTFT/TPOT SLOs as load moves.

Control law. When decodes run every step, a request's time per output token is the step time,
and step time is close to affine in the tokens computed: step_s ~= a + b * tokens. So the TPOT
SLO caps the tokens of one step at (headroom * slo_tpot - a) / b; decodes take one token each and
prefill chunks get the rest. `StepTimeModel` fits a and b online (exponentially forgetting,
Huber-weighted least squares: one slow step is noise, a run of them is a new machine speed, so a
3x slowdown moves the model within a few steps). Within that cap the budget moves AIMD-style, as
Clipper does for batch sizes, on the P99 of the inter-token latencies of the last WINDOW_STEPS
steps, which also sees what the model cannot (overhead between steps): multiplicative decrease
when the P99 is above slo_tpot, additive increase toward the cap only while the P99 is below
LOW_WATER * slo_tpot and prefill work is waiting (or first tokens run late), hold in between.
Why both: AIMD alone finds the cap only by missing the SLO, a sawtooth; the model alone is blind
to costs outside the step. The band between the two thresholds plus a fresh window
after every decrease is the hysteresis that keeps the budget from oscillating. The budget never
falls below the running sequences (each needs its next token) nor rises above
max_num_batched_tokens; the running limit follows the budget, so a TPOT that even pure decodes
cannot meet stops admissions rather than adding decodes.

Admission. A new request's TTFT is predicted as the steps needed to prefill the prompt tokens
ahead of it plus its own at the current budget (what the decodes leave), times the predicted step
time; above slo_ttft_ms it is shed (errors.Shed, 503) with a Retry-After of the predicted time to
drain the queue ahead, or admitted anyway under slo_ttft_action = "queue". Under overload the
running set is full and a prompt cannot start before a running sequence ends, so the prediction
is at least that wait plus its own prefill: the k-th request in line for a slot waits for the k-th
running sequence to end, each at its max_tokens at the latest (`finish_steps`). Not modelled:
stops before max_tokens (EOS, stop strings) and prefix-cache hits (so the prediction errs long,
towards shedding).

Admission plans the wait behind others WAIT_MARGIN times as long as predicted, and the request's
own prefill as predicted (so a lone request on an idle engine is never refused for the margin):
step times swing 1.5x and more for a hundred milliseconds at a time on a shared machine, the
first token still has to cross the HTTP front end, and with the running slots full a longer line
adds no throughput, only waiting (benchmarks/RESULTS.md, stop 42).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable

from fulcrum.errors import Shed
from fulcrum.llm.params import EngineParams
from fulcrum.llm.step_model import StepTimeModel

HEADROOM = 0.9  # the model's step time is kept under this share of slo_tpot
WAIT_MARGIN = 1.5  # admission plans the wait behind others this many times as long as predicted
LOW_WATER = 0.9  # grow only while the observed P99 is under this share of the SLO (= HEADROOM)
DECREASE = 0.7  # multiplicative decrease on an SLO miss
NUM_INCREASE_STEPS = 16  # additive increase: the full range in this many steps
MIN_WINDOW = 16  # latencies needed before a P99 counts
WINDOW_STEPS = 16  # inter-token latencies of this many steps; a decrease starts a fresh window
MAX_TTFT_WINDOW = 64  # first-token latencies kept (one per request: sparse, so by count)


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one engine step did and what it left behind."""

    num_prefill_tokens: int
    num_decode_tokens: int
    step_s: float
    num_running: int  # sequences running after the step
    num_decoding: int  # running sequences past their prefill: one token each per step
    num_queued_tokens: int  # prompt tokens not yet computed, waiting and running alike
    num_waiting: int = 0  # sequences queued for a running slot
    # Per running sequence, the steps until it ends at its max_tokens at the latest, ascending.
    finish_steps: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclasses.dataclass(frozen=True)
class BudgetState:
    """The controller's published decision; immutable, so another thread may read it."""

    token_budget: int
    max_running: int
    num_decoding: int = 0
    num_queued_tokens: int = 0
    intercept_s: float | None = None  # the step-time model; None until it has data
    per_token_s: float = 0.0
    num_running: int = 0
    num_waiting: int = 0  # sequences queued for a running slot
    finish_steps: tuple[int, ...] = ()  # see StepRecord

    def step_s(self, num_tokens: int) -> float | None:
        """Predicted time of a step of num_tokens tokens; None before the model has data."""
        if self.intercept_s is None:
            return None
        return self.intercept_s + self.per_token_s * num_tokens


class TokenBudget:
    """Sets the scheduler's token budget and running limit each step from the SLOs; pure.

    The engine thread calls the observe_* methods; `state` and `check_admission` read one
    immutable snapshot, so the event loop may call them between steps.
    """

    def __init__(self, params: EngineParams, *, model: StepTimeModel | None = None) -> None:
        self.slo_ttft_s = params.slo_ttft_ms / 1000.0 or None
        self.slo_tpot_s = params.slo_tpot_ms / 1000.0 or None
        self.shed = params.slo_ttft_action == "shed"
        self.min_tokens = max(1, params.min_num_batched_tokens)
        self.max_tokens = params.max_num_batched_tokens
        self.max_num_seqs = params.max_num_seqs
        self.increase_tokens = max(1, self.max_tokens // NUM_INCREASE_STEPS)
        self.model = model or StepTimeModel()
        self.num_decreases = 0  # cumulative
        self._itl = _StepWindow()
        self._ttft_s: deque[float] = deque(maxlen=MAX_TTFT_WINDOW)
        # Without a TPOT SLO nothing argues for a smaller step: the budget stays at the top.
        self.state = BudgetState(self.max_tokens, self._running_limit(self.max_tokens))

    def observe_itl(self, itl_s: float) -> None:
        """One request's time between two consecutive output tokens."""
        self._itl.add(itl_s)

    def observe_ttft(self, ttft_s: float) -> None:
        """One request's time from arrival to its first token."""
        self._ttft_s.append(ttft_s)

    def observe_step(self, record: StepRecord) -> BudgetState:
        """Learn from a finished step and decide the next step's limits."""
        if record.num_tokens > 0:
            self.model.observe(record.num_tokens, record.step_s)
        budget = self.state.token_budget
        if self.slo_tpot_s is not None:
            budget = self._next_budget(budget, record, self.slo_tpot_s)
        self._itl.next_step()
        self.state = BudgetState(
            token_budget=budget,
            max_running=self._running_limit(budget),
            num_decoding=record.num_decoding,
            num_queued_tokens=record.num_queued_tokens,
            intercept_s=self.model.intercept_s if self.model.is_ready else None,
            per_token_s=self.model.per_token_s,
            num_running=record.num_running,
            num_waiting=record.num_waiting,
            finish_steps=record.finish_steps,
        )
        return self.state

    def observe_queue(self, record: StepRecord) -> None:
        """The queue changed between steps (a request added or aborted): publish it, so that
        admission never judges by a queue that is gone (an idle engine runs no step to say so).
        Only the record's queue fields are read."""
        self.state = dataclasses.replace(
            self.state,
            num_decoding=record.num_decoding,
            num_queued_tokens=record.num_queued_tokens,
            num_running=record.num_running,
            num_waiting=record.num_waiting,
            finish_steps=record.finish_steps,
        )

    def predicted_ttft_s(
        self, num_prompt_tokens: int, num_pending_tokens: int = 0, num_pending: int = 0
    ) -> float | None:
        """Predicted TTFT of a new request; None before the model has data.

        num_pending_tokens / num_pending: prompt tokens and requests admitted but not yet seen
        by the last step.
        """
        return _ttft_s(self.state, num_prompt_tokens, num_pending_tokens, num_pending)

    def check_admission(
        self, num_prompt_tokens: int, num_pending_tokens: int = 0, num_pending: int = 0
    ) -> None:
        """Raise Shed (503, Retry-After: the queue's predicted drain) for a request that is
        predicted to miss slo_ttft_ms, its wait behind others planned WAIT_MARGIN times as
        long as predicted, unless slo_ttft_action is "queue"."""
        if self.slo_ttft_s is None or not self.shed:
            return
        state = self.state  # one snapshot: the engine thread may publish another meanwhile
        predicted_s = _ttft_s(state, num_prompt_tokens, num_pending_tokens, num_pending)
        if predicted_s is None:
            return
        if _planned_s(state, num_prompt_tokens, predicted_s) <= self.slo_ttft_s:
            return
        num_ahead = state.num_queued_tokens + num_pending_tokens
        drain_s = max(
            _prefill_time_s(state, num_ahead) or 0.0, _slot_wait_s(state, num_pending) or 0.0
        )
        raise Shed(
            f"predicted time to first token {predicted_s * 1000:.0f} ms, its wait planned at "
            f"{WAIT_MARGIN:g}x, exceeds slo_ttft_ms ({self.slo_ttft_s * 1000:.0f} ms)",
            retry_after_s=drain_s,
        )

    def _next_budget(self, budget: int, record: StepRecord, slo_tpot_s: float) -> int:
        p99_s = self._itl.p99()
        if p99_s is not None and p99_s > slo_tpot_s:
            budget = int(budget * DECREASE)
            self.num_decreases += 1
            self._itl.clear()  # judge the new budget on its own latencies only
        elif self._has_room(p99_s, record, slo_tpot_s) and self._has_demand(budget, record):
            budget += self.increase_tokens
        cap = self.model.max_tokens_within(HEADROOM * slo_tpot_s)
        if cap is not None:
            budget = min(budget, cap)
        floor = min(max(self.min_tokens, record.num_running), self.max_tokens)
        return max(floor, min(budget, self.max_tokens))

    def _has_room(self, p99_s: float | None, record: StepRecord, slo_tpot_s: float) -> bool:
        if p99_s is None:  # no fresh latencies: only safe with nobody decoding to hurt
            return record.num_decoding == 0
        return p99_s <= LOW_WATER * slo_tpot_s

    def _has_demand(self, budget: int, record: StepRecord) -> bool:
        # Prefill work that this budget cannot finish in one step, or first tokens running late.
        if record.num_queued_tokens > budget - record.num_decoding:
            return True
        ttft_p99_s = _p99(self._ttft_s)
        return (
            self.slo_ttft_s is not None
            and ttft_p99_s is not None
            and ttft_p99_s > LOW_WATER * self.slo_ttft_s
        )

    def _running_limit(self, budget: int) -> int:
        # Each running sequence takes at least one token a step: more than the budget would
        # leave some with none.
        return max(1, min(self.max_num_seqs, budget))


def _ttft_s(
    state: BudgetState, num_prompt_tokens: int, num_pending_tokens: int, num_pending: int
) -> float | None:
    """The queued prompts' prefill and its own; or, when it must wait for a running slot, that
    wait and its own prefill, if longer."""
    queued_s = _prefill_time_s(
        state, state.num_queued_tokens + num_pending_tokens + num_prompt_tokens
    )
    wait_s = _slot_wait_s(state, num_pending + 1)
    if queued_s is None or not wait_s:
        return queued_s
    return max(queued_s, wait_s + (_prefill_time_s(state, num_prompt_tokens) or 0.0))


def _planned_s(state: BudgetState, num_prompt_tokens: int, predicted_s: float) -> float:
    """The TTFT admission plans for: the request's own prefill as predicted, the rest of the
    prediction (the wait behind others) WAIT_MARGIN times as long."""
    own_s = _prefill_time_s(state, num_prompt_tokens) or 0.0
    return own_s + WAIT_MARGIN * max(0.0, predicted_s - own_s)


def _slot_wait_s(state: BudgetState, num_new: int) -> float | None:
    """Predicted time until the last of `num_new` new requests, behind the waiting ones, gets a
    running slot: the k-th in line past the free slots waits for the k-th running sequence to
    end (a sequence after each of them to end again, beyond one round)."""
    if state.intercept_s is None:
        return None
    place = state.num_waiting + num_new - max(0, state.max_running - state.num_running)
    finish = state.finish_steps
    if place <= 0 or not finish:
        return 0.0
    rounds, index = divmod(place - 1, len(finish))
    num_steps = finish[index] + rounds * finish[-1]
    step_s = state.step_s(min(state.token_budget, state.num_running + state.num_queued_tokens))
    return num_steps * (step_s or 0.0)


def _prefill_time_s(state: BudgetState, num_tokens: int) -> float | None:
    """Predicted time to prefill num_tokens at state's budget, beside its running decodes."""
    if state.intercept_s is None:
        return None
    if num_tokens <= 0:
        return 0.0
    per_step = max(1, state.token_budget - state.num_decoding)
    num_steps = math.ceil(num_tokens / per_step)
    step_s = state.step_s(min(state.token_budget, state.num_decoding + num_tokens))
    return num_steps * (step_s or 0.0)


def _p99(samples: Iterable[float]) -> float | None:
    ordered = sorted(samples)
    if len(ordered) < MIN_WINDOW:
        return None
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


class _StepWindow:
    """Latencies of the last WINDOW_STEPS steps: stale ones must not outlive a change of load
    (a count window with few decodes would hold a slow spell for hundreds of steps)."""

    def __init__(self) -> None:
        self._steps: deque[list[float]] = deque([[]], maxlen=WINDOW_STEPS)

    def add(self, latency_s: float) -> None:
        self._steps[-1].append(latency_s)

    def next_step(self) -> None:
        self._steps.append([])

    def clear(self) -> None:
        self._steps.clear()
        self._steps.append([])

    def p99(self) -> float | None:
        return _p99(s for step in self._steps for s in step)
