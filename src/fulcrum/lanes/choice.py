"""Which lane serves a request: pure, on a snapshot of each lane's state taken at `now`.

The home lane is the one named (header or parameter), else the one the deadline asks for: the
loosest lane whose SLO still fits the request's budget (the batched lane for loose deadlines,
the fast one for tight ones; a default lane without an SLO counts as the loosest), else the
tightest; without a deadline, the default lane. The home
lane serves unless it is down (failover) or saturated: its queue is full or its estimate of when
a new request would finish is past the budget (spill-over). Then the first other lane, tightest
SLO first, that is up, not full and on time serves. None on time: the home lane still serves
when it has room (its batch policy decides), else 503 with Retry-After.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fulcrum.errors import InvalidInput, Unavailable

Outcome = Literal["routed", "spilled", "failed_over", "refused"]
By = Literal["name", "variant", "deadline", "default"]  # how the home lane was chosen
MIN_RETRY_AFTER_S = 0.05
NO_ESTIMATE_RETRY_AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class LaneState:
    """One lane as the router sees it now."""

    name: str
    variant: str
    slo_s: float  # the lane's latency objective; 0: none
    is_healthy: bool  # ready: not stopping, batcher alive, an instance not hung
    is_full: bool  # its queue bound is reached: a new request would get 503
    finish_s: float  # predicted seconds until a new request of this size would be answered


@dataclass(frozen=True, slots=True)
class Choice:
    """The lane taken, how the home lane was chosen, and where it spilled from (if it did)."""

    lane: str  # refused: the home lane
    variant: str
    by: By
    outcome: Outcome = "routed"
    home: str = ""  # the home lane, when it is not `lane` (or the choice is a refusal)
    retry_after_s: float = 0.0  # refused: when a lane could take it
    why: str = ""  # refused: the 503's message


def choose(
    lanes: Sequence[LaneState],
    *,
    named: str | None,
    by: By,
    budget_s: float | None,
    default: str,
    model: str,
) -> Choice:
    """The lane for a request (`budget_s`: seconds left before its deadline, None: none);
    InvalidInput for an unknown lane; outcome "refused" when no lane can take it."""
    by_name = {lane.name: lane for lane in lanes}
    if named is not None and named not in by_name:
        raise InvalidInput(f"model '{model}' has no lane {named!r} (lanes: {list(by_name)})")
    home = _home(lanes, by_name, named, budget_s, default)
    if named is None:
        by = "deadline" if budget_s is not None else by
    # Without a deadline of its own a request is due within its home lane's SLO.
    due_s = budget_s if budget_s is not None else (home.slo_s or None)
    if _fits(home, due_s):
        return Choice(home.name, home.variant, by)
    others = sorted((x for x in lanes if x is not home), key=_tightness)
    for lane in others:
        if _fits(lane, due_s):
            outcome: Outcome = "spilled" if home.is_healthy else "failed_over"
            return Choice(lane.name, lane.variant, by, outcome, home.name)
    if home.is_healthy and not home.is_full:
        # Predicted late everywhere, but the home lane has room: its own policy decides (it
        # sheds with 503, or runs the request as a probe). Refusing here would starve a lane
        # whose fit is too pessimistic: only a batch that runs can correct it.
        return Choice(home.name, home.variant, by)
    return _refusal(model, home, lanes, due_s, by)


def _home(
    lanes: Sequence[LaneState],
    by_name: dict[str, LaneState],
    named: str | None,
    budget_s: float | None,
    default: str,
) -> LaneState:
    if named is not None:
        return by_name[named]
    if budget_s is None:
        return by_name[default]
    # A default lane without an SLO promises nothing to compare: it takes what its estimate
    # says it finishes in time (the loosest choice), and spills the rest.
    within = [x for x in lanes if 0 < x.slo_s <= budget_s or (x.slo_s == 0 and x.name == default)]
    if within:
        return max(within, key=_tightness)
    return min(lanes, key=_tightness)  # no lane promises that much: the fastest promise


def _tightness(lane: LaneState) -> float:
    return lane.slo_s if lane.slo_s > 0 else float("inf")


def _fits(lane: LaneState, due_s: float | None) -> bool:
    if not lane.is_healthy or lane.is_full:
        return False
    return due_s is None or lane.finish_s <= due_s


def refusal_error(choice: Choice) -> Unavailable:
    """The 503 of a refused choice, with its Retry-After."""
    return Unavailable(choice.why, retry_after_s=choice.retry_after_s)


def _refusal(
    model: str, home: LaneState, lanes: Sequence[LaneState], due_s: float | None, by: By
) -> Choice:
    # Retry when the soonest lane with room could take it (a full lane's estimate counts only
    # when every lane is full: its queue must drain first).
    up = [x.finish_s for x in lanes if x.is_healthy]
    up = [x.finish_s for x in lanes if x.is_healthy and not x.is_full] or up
    retry_after_s = max(MIN_RETRY_AFTER_S, min(up)) if up else NO_ESTIMATE_RETRY_AFTER_S
    why = "no lane is healthy" if not up else "no lane has room in time"
    wanted = "" if due_s is None else f" within {due_s * 1000:.0f} ms"
    message = f"model '{model}' cannot take the request{wanted}: {why} (home lane {home.name!r})"
    return Choice(home.name, home.variant, by, "refused", home.name, retry_after_s, message)
