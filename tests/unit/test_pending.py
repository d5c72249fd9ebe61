"""PendingQueue: bounded by default, EDF order for the adaptive policy; a fake clock, no sleeps."""

from __future__ import annotations

import pytest

from fulcrum.batcher import BatchRecord
from fulcrum.config import DynamicBatching, ModelConfig, QueuePolicy, validate
from fulcrum.errors import QueueFull
from fulcrum.pending import Pending, PendingQueue
from fulcrum.policy import TritonPolicy


def make_config(max_batch_size: int = 8, **settings: object) -> ModelConfig:
    config = ModelConfig(
        name="m",
        platform="echo",
        max_batch_size=max_batch_size,
        dynamic_batching=DynamicBatching(**settings),  # type: ignore[arg-type]
    )
    validate(config)
    return config


def fill(queue: PendingQueue, count: int) -> None:
    for _ in range(count):
        queue.admit(Pending(1, "k", 0.0), priority=None, timeout_s=None)


def test_a_level_without_max_queue_size_is_bounded_by_default() -> None:
    # Before issue 11 an unset max_queue_size meant unbounded: overload grew the queue forever.
    queue = PendingQueue(make_config(2))
    assert queue.bound(1) == 64 * 2
    fill(queue, 128)
    with pytest.raises(QueueFull, match="128 requests waiting"):
        fill(queue, 1)


@pytest.mark.parametrize("size", [0, -1])
def test_zero_or_minus_one_keeps_the_queue_unbounded(size: int) -> None:
    queue = PendingQueue(make_config(1, default_queue_policy=QueuePolicy(max_queue_size=size)))
    fill(queue, 200)
    assert queue.depth(1) == 200 and queue.bound(1) == 0


def test_a_derived_bound_replaces_only_the_default_one() -> None:
    fixed = QueuePolicy(max_queue_size=3)
    queue = PendingQueue(make_config(8, priority_levels=2, priority_queue_policy={"1": fixed}))
    queue.set_derived_bound(5)
    assert (queue.bound(1), queue.bound(2)) == (3, 5)


def test_edf_queue_serves_each_level_by_deadline() -> None:
    config = make_config(8, priority_levels=2, policy="adaptive", slo_p99_ms=100.0)
    queue = PendingQueue(config)
    items = [Pending(1, "k", t) for t in (0.0, 0.01, 0.02, 0.03)]
    queue.admit(items[0], priority=2, timeout_s=None)  # due 0.100
    queue.admit(items[1], priority=1, timeout_s=None)  # due 0.110
    queue.admit(items[2], priority=1, timeout_s=0.05)  # due 0.070
    queue.admit(items[3], priority=1, timeout_s=None)  # due 0.130
    assert [item.due_s for item in items] == pytest.approx([0.1, 0.11, 0.07, 0.13])
    assert list(queue.live()) == [items[2], items[1], items[3], items[0]]
    queue.take([items[2], items[1]])
    assert list(queue.live()) == [items[3], items[0]] and queue.num_rows == 2


def test_triton_policy_learns_only_the_queue_bound() -> None:
    queue, policy = PendingQueue(make_config(4)), TritonPolicy(make_config(4))
    for _ in range(5):  # 4 rows in 0.5 s: 8 rows/s, one row per request
        policy.observe(BatchRecord(4, 4, 0.5, [], False))
    state = policy.state()
    assert state["name"] == "triton" and state["batch_limit"] == 4
    assert state["queue_bound"] == 8  # what one instance drains in DEFAULT_WAIT_S (1 s)
    fill(queue, 6)
    plan = policy.plan(queue, 0.0)  # the batching rules themselves are unchanged
    assert len(plan.run) == 4 and plan.shed == () and len(queue) == 2
    assert queue.bound(1) == 8


def test_triton_policy_bounds_the_queue_by_the_preferred_batch_it_runs_under_a_backlog() -> None:
    # max 64, preferred 16, no added wait, SLO 100 ms: a backlog drains in 16-row batches, so
    # the bound and its floor are counted in those, not in 64-row batches it never runs.
    config = make_config(64, preferred_batch_sizes=(16,), slo_p99_ms=100)
    policy = TritonPolicy(config)
    for _ in range(5):  # 16 rows in 60 ms: 3.75 ms a row, one row per request
        policy.observe(BatchRecord(16, 16, 0.060, [], False))
    state = policy.state()
    assert state["batch_limit"] == 16
    assert state["queue_bound"] == 16  # a 16-row batch: at most one full batch ahead
    waiting = TritonPolicy(make_config(64, preferred_batch_sizes=(16,), max_queue_delay_ms=5))
    assert waiting.state()["batch_limit"] == 64  # past its delay it runs everything queued
