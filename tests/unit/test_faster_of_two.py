"""FasterOfTwo: measures both choices first, then runs the faster and explores the other."""

from __future__ import annotations

import pytest

from fulcrum.backends.faster_of_two import FIRST, SECOND, FasterOfTwo


def run(chooser: FasterOfTwo, times_s: dict[int, float], num: int) -> list[int]:
    picks = []
    for _ in range(num):
        choice = chooser.pick()
        chooser.observe(choice, times_s[choice], 1)
        picks.append(choice)
    return picks


def test_each_choice_is_measured_once_before_either_is_favoured() -> None:
    chooser = FasterOfTwo(explore_every=4)
    assert run(chooser, {FIRST: 0.010, SECOND: 0.005}, 2) == [FIRST, SECOND]


def test_the_faster_runs_most_and_the_other_every_nth_pick() -> None:
    chooser = FasterOfTwo(explore_every=4)
    picks = run(chooser, {FIRST: 0.010, SECOND: 0.005}, 18)
    assert chooser.favourite == SECOND
    # Picks 4, 8, 12 and 16 explore; after the two first measurements, FIRST is the loser.
    assert [i + 1 for i, c in enumerate(picks) if c == FIRST] == [1, 4, 8, 12, 16]


def test_the_favourite_follows_when_the_machine_changes() -> None:
    chooser = FasterOfTwo(explore_every=2, weight=0.5)
    run(chooser, {FIRST: 0.005, SECOND: 0.007}, 6)
    assert chooser.favourite == FIRST
    # FIRST becomes three times slower (other work took the cores): the moving average follows.
    run(chooser, {FIRST: 0.015, SECOND: 0.007}, 6)
    assert chooser.favourite == SECOND


def test_time_is_compared_per_row() -> None:
    chooser = FasterOfTwo()
    chooser.observe(FIRST, 0.020, 4)  # 5 ms a row
    chooser.observe(SECOND, 0.006, 1)  # 6 ms a row
    assert chooser.favourite == FIRST


@pytest.mark.parametrize(("explore_every", "weight"), [(1, 0.2), (8, 0.0), (8, 1.5)])
def test_bad_settings_are_refused(explore_every: int, weight: float) -> None:
    with pytest.raises(ValueError):
        FasterOfTwo(explore_every=explore_every, weight=weight)
