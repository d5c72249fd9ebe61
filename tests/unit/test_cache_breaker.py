"""The remote cache's circuit breaker, on a fake clock."""

from __future__ import annotations

from fulcrum.cache.breaker import CircuitBreaker


def test_closed_breaker_allows_every_call() -> None:
    breaker = CircuitBreaker()
    assert all(breaker.allow(now) for now in (0.0, 0.0, 1.0))
    assert not breaker.is_open


def test_failure_skips_calls_for_the_backoff_then_lets_one_probe_through() -> None:
    breaker = CircuitBreaker(min_backoff_s=0.1, max_backoff_s=2.0, failure_threshold=1)
    breaker.failure(10.0)
    assert breaker.is_open
    assert not breaker.allow(10.05)
    assert breaker.allow(10.1)  # the probe
    assert not breaker.allow(10.1)  # the others wait for its verdict
    breaker.success()
    assert not breaker.is_open
    assert breaker.allow(10.2) and breaker.allow(10.2)


def test_failed_probes_double_the_backoff_up_to_the_cap() -> None:
    breaker = CircuitBreaker(min_backoff_s=0.1, max_backoff_s=0.5, failure_threshold=1)
    now = 0.0
    backoffs = []
    breaker.failure(now)
    for _ in range(4):
        backoffs.append(breaker.backoff_s)
        now = breaker.open_until or now
        assert breaker.allow(now)
        breaker.failure(now)
    assert backoffs == [0.1, 0.2, 0.4, 0.5]
    assert breaker.num_opens == 5


def test_success_resets_the_backoff() -> None:
    breaker = CircuitBreaker(min_backoff_s=0.1, max_backoff_s=2.0, failure_threshold=1)
    breaker.failure(0.0)
    assert breaker.allow(0.1)
    breaker.failure(0.1)
    assert breaker.backoff_s == 0.2
    assert breaker.allow(0.4)
    breaker.success()
    breaker.failure(1.0)
    assert breaker.backoff_s == 0.1
    assert breaker.open_until == 1.1


def test_concurrent_failures_open_once_without_stacking_backoffs() -> None:
    breaker = CircuitBreaker(min_backoff_s=0.1, max_backoff_s=2.0, failure_threshold=1)
    assert breaker.allow(0.0) and breaker.allow(0.0)  # two calls in flight while closed
    breaker.failure(0.01)
    breaker.failure(0.02)  # the second call's failure: already open, nothing changes
    assert breaker.open_until == 0.11
    assert breaker.num_opens == 1


def test_released_probe_lets_another_probe_through() -> None:
    breaker = CircuitBreaker(min_backoff_s=0.1, failure_threshold=1)
    breaker.failure(0.0)
    assert breaker.allow(0.2)
    breaker.release_probe()  # its caller was cancelled: no verdict on the backend
    assert breaker.is_open
    assert breaker.allow(0.2)


def test_opens_only_after_failures_in_a_row() -> None:
    breaker = CircuitBreaker(min_backoff_s=0.1, failure_threshold=3)
    breaker.failure(0.0)
    breaker.failure(0.0)
    breaker.success()  # one late answer between good ones is not an outage
    breaker.failure(0.0)
    breaker.failure(0.0)
    assert not breaker.is_open and breaker.allow(0.0)
    breaker.failure(0.0)
    assert breaker.is_open and not breaker.allow(0.05)
    assert breaker.allow(0.1)
    breaker.failure(0.1)  # a failed probe reopens at once
    assert breaker.is_open and breaker.backoff_s == 0.2
