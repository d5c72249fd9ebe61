"""FasterOfTwo: measures both choices first, then runs the faster and explores the other, less
often while the other keeps losing clearly; estimates are medians of recent runs."""

from __future__ import annotations

import math

import pytest

from fulcrum.backends.faster_of_two import FIRST, OTHER_WINDOW, SECOND, WINDOW, FasterOfTwo


def run(chooser: FasterOfTwo, times_s: dict[int, float], num: int) -> list[int]:
    picks = []
    for _ in range(num):
        choice = chooser.pick()
        chooser.observe(choice, times_s[choice], 1)
        picks.append(choice)
    return picks


def measured(chooser: FasterOfTwo, first_s: float, second_s: float) -> None:
    """Each choice run twice at these times per row (the first run of each is not measured)."""
    for choice, per_row_s in ((FIRST, first_s), (SECOND, second_s)):
        for _ in range(2):
            chooser.observe(choice, per_row_s, 1)


def explored(picks: list[int], loser: int) -> list[int]:
    return [i + 1 for i, c in enumerate(picks) if c == loser]


def test_each_choice_runs_twice_before_either_is_favoured() -> None:
    chooser = FasterOfTwo(explore_every=4)
    # The first run of each is not measured (cold after a load): each is picked until measured.
    assert run(chooser, {FIRST: 0.010, SECOND: 0.005}, 4) == [FIRST, FIRST, SECOND, SECOND]
    assert chooser.favourite == SECOND


def test_a_cold_first_run_is_not_measured() -> None:
    chooser = FasterOfTwo()
    chooser.observe(FIRST, 0.050, 1)  # the first run after load: ten times slower
    chooser.observe(FIRST, 0.005, 1)
    chooser.observe(SECOND, 0.008, 1)
    chooser.observe(SECOND, 0.008, 1)
    assert chooser.per_row_s == [0.005, 0.008]
    assert chooser.favourite == FIRST


def test_a_clear_loser_is_explored_half_as_often_each_time_down_to_the_limit() -> None:
    chooser = FasterOfTwo(explore_every=4, max_explore_every=16)
    picks = run(chooser, {FIRST: 0.010, SECOND: 0.005}, 84)
    assert chooser.favourite == SECOND
    # After the measurements (picks 1-4): every 4th pick until FIRST's third measured run (pick
    # 12), then every 8th, then every 16th (the limit) from then on.
    assert explored(picks, FIRST) == [1, 2, 8, 12, 20, 36, 52, 68, 84]
    assert chooser.interval == 16


def test_a_close_result_keeps_exploring_often() -> None:
    chooser = FasterOfTwo(explore_every=4)
    picks = run(chooser, {FIRST: 0.0055, SECOND: 0.005}, 20)  # 10% slower: not a clear loss
    assert explored(picks, FIRST) == [1, 2, 8, 12, 16, 20]
    assert chooser.interval == 4


def test_the_interval_narrows_again_when_the_loser_comes_close() -> None:
    chooser = FasterOfTwo(explore_every=4, max_explore_every=64)
    run(chooser, {FIRST: 0.010, SECOND: 0.005}, 60)
    assert chooser.interval > 4
    # FIRST's cores came back: its window turns over at each exploring run until one is close.
    run(chooser, {FIRST: 0.0052, SECOND: 0.005}, 64 * WINDOW)
    assert chooser.interval == 4


def test_the_favourite_follows_when_the_machine_changes() -> None:
    chooser = FasterOfTwo(explore_every=2)
    run(chooser, {FIRST: 0.005, SECOND: 0.007}, 8)
    assert chooser.favourite == FIRST
    # FIRST becomes three times slower (other work took the cores): its median follows.
    run(chooser, {FIRST: 0.015, SECOND: 0.007}, WINDOW)
    assert chooser.favourite == SECOND


def test_a_slowed_favourite_is_dropped_however_wide_the_interval() -> None:
    chooser = FasterOfTwo(explore_every=2, max_explore_every=64)
    run(chooser, {FIRST: 0.005, SECOND: 0.010}, 300)
    assert chooser.interval == 64
    # The favourite's window is fresh from every run: its median passes the other's in half of it.
    picks = run(chooser, {FIRST: 0.030, SECOND: 0.010}, WINDOW // 2 + 1)
    assert chooser.favourite == SECOND
    assert picks[-1] == SECOND


def test_a_winning_exploring_run_is_followed_by_more_at_once() -> None:
    """The other's older runs (a slow spell long past) do not hold it back once it is faster:
    each exploring run that beats the favourite brings the next pick to it, and its estimate
    is its last few runs, so it takes over in a few picks, not a few intervals."""
    chooser = FasterOfTwo(explore_every=4, max_explore_every=64)
    run(chooser, {FIRST: 0.010, SECOND: 0.007}, 400)
    assert chooser.favourite == SECOND
    assert chooser.interval == 64
    assert len(chooser.runs[FIRST]) > OTHER_WINDOW  # all from the slow spell
    fast = {FIRST: 0.005, SECOND: 0.007}
    picks = run(chooser, fast, 64)
    first = picks.index(FIRST)  # the interval's exploring pick
    picks = picks[first:] + run(chooser, fast, OTHER_WINDOW)
    # Wins in a row until FIRST's last OTHER_WINDOW runs have a median of 5 ms: 3 of them.
    assert picks[:3] == [FIRST, FIRST, FIRST]
    assert chooser.favourite == FIRST
    run(chooser, fast, 3 * WINDOW)
    assert chooser.per_row_s[FIRST] == pytest.approx(0.005)


def test_a_choice_that_takes_over_keeps_only_its_latest_runs() -> None:
    chooser = FasterOfTwo(explore_every=4, max_explore_every=64)
    run(chooser, {FIRST: 0.010, SECOND: 0.007}, 400)
    run(chooser, {FIRST: 0.005, SECOND: 0.007}, 70)
    assert chooser.favourite == FIRST
    # Its window keeps the runs that won and those since: of the slow spell's runs, at most the
    # two that the winning median of 5 outvoted.
    assert chooser.runs[FIRST].count(0.010) <= OTHER_WINDOW // 2
    assert len(chooser.runs[FIRST]) == WINDOW


def test_a_losing_exploring_run_is_not_followed() -> None:
    chooser = FasterOfTwo(explore_every=4)
    picks = run(chooser, {FIRST: 0.0052, SECOND: 0.005}, 40)
    assert explored(picks, FIRST) == [1, 2, 8, 12, 16, 20, 24, 28, 32, 36, 40]


def test_two_slow_runs_in_a_row_do_not_move_the_favourite() -> None:
    """A preempted two-thread run takes 2-3x its usual time; the median ignores a pair."""
    chooser = FasterOfTwo()
    measured(chooser, 0.005, 0.0075)
    for run_s in (0.005, 0.0055, 0.005, 0.013, 0.014):
        chooser.observe(FIRST, run_s, 1)
    assert chooser.favourite == FIRST


def test_time_is_compared_per_row() -> None:
    chooser = FasterOfTwo()
    measured(chooser, 0.020 / 4, 0.006)  # 5 ms a row against 6
    chooser.observe(FIRST, 0.020, 4)
    chooser.observe(SECOND, 0.006, 1)
    assert chooser.favourite == FIRST


def test_the_mean_per_row_counts_every_measured_run_and_not_the_first() -> None:
    """The medians are a snapshot of the last few runs; the mean covers a whole measurement."""
    chooser = FasterOfTwo()
    assert all(math.isnan(v) for v in chooser.mean_per_row_s)
    chooser.observe(FIRST, 0.100, 1)  # the first run is not measured
    for _ in range(WINDOW):
        chooser.observe(FIRST, 0.004, 1)
    chooser.observe(FIRST, 0.024, 4)  # 6 ms a row
    chooser.observe(SECOND, 0.050, 1)
    chooser.observe(SECOND, 0.007, 1)
    first, second = chooser.mean_per_row_s
    assert first == pytest.approx((WINDOW * 0.004 + 0.024) / (WINDOW + 4))
    assert second == pytest.approx(0.007)
    assert chooser.per_row_s[FIRST] == pytest.approx(0.004)  # the median of the last WINDOW


@pytest.mark.parametrize(("explore_every", "max_explore_every"), [(1, 64), (8, 4)])
def test_bad_settings_are_refused(explore_every: int, max_explore_every: int) -> None:
    with pytest.raises(ValueError):
        FasterOfTwo(explore_every=explore_every, max_explore_every=max_explore_every)
