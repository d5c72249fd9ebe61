"""The derived queue bound, the overhead reserve, and SLO deadlines that count from arrival."""

from __future__ import annotations

import pytest

from fulcrum.batcher import BatchRecord
from fulcrum.config import DynamicBatching, ModelConfig, validate
from fulcrum.latency_model import LatencyModel
from fulcrum.pending import Pending, PendingQueue
from fulcrum.policy import TritonPolicy
from fulcrum.policy_adaptive import AdaptivePolicy
from fulcrum.queue_bound import (
    DEFAULT_WAIT_S,
    MAX_RESERVE_SHARE,
    RESERVE_EVERY,
    RESERVE_WINDOW,
    DerivedBound,
    OverheadReserve,
)


def make_config(policy: str = "adaptive", slo_ms: float = 100.0) -> ModelConfig:
    config = ModelConfig(
        name="m",
        platform="echo",
        max_batch_size=32,
        dynamic_batching=DynamicBatching(policy=policy, slo_p99_ms=slo_ms),
    )
    validate(config)
    return config


def trained(seconds_per_batch: float, rows: int = 32) -> LatencyModel:
    model = LatencyModel()
    for _ in range(10):
        model.observe(rows, seconds_per_batch)
    return model


def test_no_slo_bounds_the_queue_at_the_default_wait() -> None:
    bound = DerivedBound(num_instances=2, slo_s=0.0)
    bound.refresh(trained(0.1), batch_limit=32)  # 2 x 320 rows/s
    assert bound.bound == int(640 * DEFAULT_WAIT_S)
    assert bound.retry_after_s == pytest.approx(DEFAULT_WAIT_S)


def test_an_slo_and_its_reserve_shorten_the_wait() -> None:
    model = trained(0.02)  # 1600 rows/s
    plain, reserved = DerivedBound(1, slo_s=0.1), DerivedBound(1, slo_s=0.1)
    plain.refresh(model, 32)
    reserved.refresh(model, 32, reserve_s=0.03)
    assert plain.bound == int(1600 * (0.1 - 0.02) * 0.8)
    assert reserved.bound == int(1600 * (0.1 - 0.03 - 0.02) * 0.8) < plain.bound


def test_the_bound_waits_for_a_trusted_fit_and_never_drops_below_one_batch() -> None:
    bound = DerivedBound(1, slo_s=0.001)
    bound.refresh(LatencyModel(), 32)
    assert bound.bound == 0  # nothing measured: the queue's static default holds
    bound.refresh(trained(0.5), 32)
    assert bound.bound == 32


def test_the_reserve_is_a_high_quantile_of_the_window_and_capped_by_the_slo() -> None:
    reserve = OverheadReserve(slo_s=0.1)
    for i in range(RESERVE_EVERY - 1):
        reserve.add(0.001 * i)
    assert reserve.reserve_s == 0.0  # recomputed only every RESERVE_EVERY requests
    reserve.add(0.004)
    assert reserve.reserve_s == pytest.approx(0.030)  # the P99 of 0..31 ms
    for _ in range(RESERVE_WINDOW):
        reserve.add(1.0)  # an absurd overhead cannot eat the whole SLO
    assert reserve.reserve_s == pytest.approx(0.1 * MAX_RESERVE_SHARE)
    for _ in range(RESERVE_WINDOW):
        reserve.add(0.002)  # the window forgets
    assert reserve.reserve_s == pytest.approx(0.002)
    reserve.add(float("nan"))
    reserve.add(-1.0)
    assert reserve.reserve_s == pytest.approx(0.002)


def test_a_request_is_due_an_slo_after_it_arrived_not_after_it_was_queued() -> None:
    queue = PendingQueue(make_config())
    early = Pending(1, "k", enqueue_s=1.0, origin_s=0.97)  # 30 ms reading its body
    late = Pending(1, "k", enqueue_s=1.0)
    future = Pending(1, "k", enqueue_s=1.0, origin_s=2.0)  # a clock skew never pushes it later
    for item in (late, early, future):
        queue.admit(item, priority=None, timeout_s=None)
    assert early.due_s == pytest.approx(1.07) and late.due_s == pytest.approx(1.1)
    assert future.due_s == pytest.approx(1.1)
    assert next(queue.live()) is early  # earliest deadline first


def test_the_adaptive_policy_plans_new_requests_against_the_slo_minus_the_reserve() -> None:
    config = make_config()
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    for _ in range(RESERVE_EVERY):
        policy.observe_answer(0.02, 0.0)
    policy.plan(queue, 0.0)
    item = Pending(1, "k", enqueue_s=0.0)
    queue.admit(item, priority=None, timeout_s=None)
    assert item.due_s == pytest.approx(0.08)
    assert policy.state()["overhead_reserve_ms"] == pytest.approx(20.0)


def test_the_static_policy_bounds_its_queue_by_the_slo_when_it_has_one() -> None:
    config = make_config(policy="triton", slo_ms=100.0)
    queue, policy = PendingQueue(config), TritonPolicy(config)
    for _ in range(10):
        policy.observe(BatchRecord(32, 32, 0.02, [], False))
    policy.plan(queue, 0.0)
    assert queue.bound(1) == int(1600 * (0.1 - 0.02) * 0.8)
    assert queue.retry_after_s == pytest.approx(queue.bound(1) / 1600)
