"""The lane decision on snapshots of lane state: by name, by deadline, spill-over, failover,
refusal with Retry-After."""

from __future__ import annotations

import pytest

from fulcrum.errors import InvalidInput
from fulcrum.lanes.choice import Choice, LaneState, choose, refusal_error


def lane(
    name: str,
    slo_ms: float,
    *,
    finish_ms: float = 1.0,
    healthy: bool = True,
    full: bool = False,
) -> LaneState:
    variant = "int8" if name == "realtime" else "fp32"
    return LaneState(name, variant, slo_ms / 1000, healthy, full, finish_ms / 1000)


def pick(
    lanes: list[LaneState], *, named: str | None = None, budget_ms: float | None = None
) -> Choice:
    budget_s = None if budget_ms is None else budget_ms / 1000
    return choose(lanes, named=named, by="name" if named else "default", budget_s=budget_s,
                  default="bulk", model="m")  # fmt: skip


def both(**bulk: object) -> list[LaneState]:
    return [lane("realtime", 20), lane("bulk", 500, **bulk)]  # type: ignore[arg-type]


def test_a_named_lane_serves_even_when_another_fits_better() -> None:
    choice = pick(both(), named="realtime", budget_ms=5000)
    assert choice == Choice("realtime", "int8", "name")


def test_an_unknown_lane_is_a_400_naming_it_and_the_known_ones() -> None:
    with pytest.raises(InvalidInput, match=r"no lane 'fast' \(lanes: \['realtime', 'bulk'\]\)"):
        pick(both(), named="fast")


def test_without_a_deadline_the_default_lane_serves() -> None:
    assert pick(both()) == Choice("bulk", "fp32", "default")


def test_a_tight_deadline_goes_to_the_lane_whose_slo_fits_it() -> None:
    assert pick(both(), budget_ms=50) == Choice("realtime", "int8", "deadline")


def test_a_loose_deadline_goes_to_the_loosest_lane_that_still_fits() -> None:
    assert pick(both(), budget_ms=2000) == Choice("bulk", "fp32", "deadline")


def test_a_deadline_tighter_than_every_slo_goes_to_the_fastest_promise() -> None:
    assert pick(both(), budget_ms=10).lane == "realtime"


def test_a_full_home_lane_spills_to_another_on_time() -> None:
    choice = pick(both(full=True))
    assert choice == Choice("realtime", "int8", "default", "spilled", "bulk")


def test_a_home_lane_predicted_late_spills() -> None:
    choice = pick(both(finish_ms=1200), budget_ms=1000)
    assert (choice.lane, choice.outcome, choice.home) == ("realtime", "spilled", "bulk")


def test_predicted_late_everywhere_the_home_lane_with_room_decides() -> None:
    # Refusing here would starve a home lane whose fit is too pessimistic: its policy decides.
    lanes = [lane("realtime", 20, finish_ms=80), lane("bulk", 500, finish_ms=90)]
    assert pick(lanes, budget_ms=60) == Choice("realtime", "int8", "deadline")


def test_a_full_home_lane_with_no_other_on_time_is_refused() -> None:
    lanes = [lane("realtime", 20, finish_ms=80, full=True), lane("bulk", 500, finish_ms=400)]
    choice = pick(lanes, budget_ms=60)
    assert (choice.outcome, choice.lane) == ("refused", "realtime")
    error = refusal_error(choice)
    assert error.status_code == 503
    assert "no lane has room in time (home lane 'realtime')" in error.message
    assert error.retry_after_s == pytest.approx(0.400)  # the soonest a lane with room could


def test_an_unhealthy_home_lane_fails_over() -> None:
    lanes = [lane("realtime", 20, healthy=False), lane("bulk", 500, finish_ms=10)]
    choice = pick(lanes, budget_ms=50)
    assert (choice.lane, choice.outcome, choice.home) == ("bulk", "failed_over", "realtime")


def test_a_failover_target_must_still_meet_the_deadline() -> None:
    lanes = [lane("realtime", 20, healthy=False), lane("bulk", 500, finish_ms=400)]
    assert pick(lanes, budget_ms=50).outcome == "refused"


def test_no_healthy_lane_is_a_503_with_a_default_retry_after() -> None:
    lanes = [lane("realtime", 20, healthy=False), lane("bulk", 500, healthy=False)]
    error = refusal_error(pick(lanes))
    assert "no lane is healthy" in error.message
    assert error.headers() == {"Retry-After": "1"}


def test_a_request_without_deadline_is_due_within_its_home_lanes_slo() -> None:
    # bulk promises 500 ms but predicts 600: the request spills to the lane that is on time.
    choice = pick(both(finish_ms=600))
    assert (choice.lane, choice.outcome) == ("realtime", "spilled")


def test_lanes_without_slo_take_the_default_and_spill_only_when_full() -> None:
    lanes = [lane("realtime", 0), lane("bulk", 0, finish_ms=8)]
    assert pick(lanes, budget_ms=10).lane == "bulk"  # no promise to choose by: the default ...
    lanes = [lane("realtime", 0), lane("bulk", 0, full=True)]
    assert pick(lanes).lane == "realtime"  # ... until it is full ...
    lanes = [lane("realtime", 0, finish_ms=5), lane("bulk", 0, finish_ms=30)]
    assert pick(lanes, budget_ms=10).lane == "realtime"  # ... or predicted late


def test_a_default_lane_without_slo_takes_deadlines_it_can_meet() -> None:
    lanes = [lane("realtime", 20), lane("bulk", 0, finish_ms=8)]
    assert pick(lanes, budget_ms=5000) == Choice("bulk", "fp32", "deadline")
    assert pick(lanes, budget_ms=50) == Choice("bulk", "fp32", "deadline")
    choice = pick([lane("realtime", 20), lane("bulk", 0, finish_ms=80)], budget_ms=50)
    assert (choice.lane, choice.outcome) == ("realtime", "spilled")
