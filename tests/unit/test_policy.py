"""TritonPolicy and PendingQueue: Triton's batching rules on a fake clock, no sleeps."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import pytest

from fulcrum.config import DynamicBatching, ModelConfig, QueuePolicy, TensorSpec, validate
from fulcrum.errors import InvalidInput, QueueFull
from fulcrum.policy import (
    Pending,
    PendingQueue,
    Plan,
    TritonPolicy,
    compat_key,
    dynamic_axes,
)
from fulcrum.types import FakeClock, TensorMap


def make_config(
    max_batch_size: int = 8, *, batching: bool = True, **settings: object
) -> ModelConfig:
    config = ModelConfig(
        name="m",
        platform="echo",
        max_batch_size=max_batch_size,
        dynamic_batching=DynamicBatching(**settings) if batching else None,  # type: ignore[arg-type]
    )
    validate(config)
    return config


class Harness:
    """A queue, its policy and a fake clock; items are named so plans read as lists of names."""

    def __init__(self, config: ModelConfig) -> None:
        self.queue = PendingQueue(config)
        self.policy = TritonPolicy(config)
        self.clock = FakeClock()
        self.names: dict[int, str] = {}

    def add(
        self,
        name: str,
        *,
        rows: int = 1,
        key: Hashable = "k",
        priority: int | None = None,
        timeout_s: float | None = None,
    ) -> Pending:
        item = Pending(rows, key, self.clock.now())
        self.queue.admit(item, priority=priority, timeout_s=timeout_s)
        self.names[id(item)] = name
        return item

    def plan(self) -> Plan:
        return self.policy.plan(self.queue, self.clock.now())

    def run(self) -> list[str]:
        return self.label(self.plan().run)

    def label(self, items: Sequence[Pending]) -> list[str]:
        return [self.names[id(item)] for item in items]


def test_empty_queue_has_nothing_to_do() -> None:
    plan = Harness(make_config()).plan()
    assert plan == Plan()


def test_never_exceeds_max_batch_size_in_rows() -> None:
    h = Harness(make_config(4))
    for i in range(10):
        h.add(f"r{i}")
    assert h.run() == ["r0", "r1", "r2", "r3"]
    assert h.run() == ["r4", "r5", "r6", "r7"]
    assert h.run() == ["r8", "r9"]
    assert len(h.queue) == 0


def test_multi_row_requests_count_rows_not_requests() -> None:
    h = Harness(make_config(8))
    for name in "abc":
        h.add(name, rows=3)
    assert h.run() == ["a", "b"]  # 6 rows; a third request would make 9
    assert h.run() == ["c"]


def test_waits_until_oldest_plus_queue_delay_then_runs_what_is_there() -> None:
    h = Harness(make_config(8, max_queue_delay_ms=10))
    h.add("a")
    h.clock.advance(0.004)
    h.add("b")
    plan = h.plan()
    assert plan.run == ()
    assert plan.wake_at_s == pytest.approx(0.010)
    h.clock.advance(0.005)  # t = 0.009: still inside the window
    assert h.plan().run == ()
    h.clock.advance(0.001)
    assert h.run() == ["a", "b"]


def test_full_batch_runs_before_the_delay() -> None:
    h = Harness(make_config(4, max_queue_delay_ms=1000))
    for name in "abcde":
        h.add(name)
    assert h.run() == ["a", "b", "c", "d"]
    assert h.plan().wake_at_s == pytest.approx(1.0)


def test_zero_queue_delay_runs_at_once() -> None:
    h = Harness(make_config(8, max_queue_delay_ms=0))
    h.add("a")
    assert h.run() == ["a"]


def test_runs_the_largest_preferred_size_that_can_be_formed() -> None:
    h = Harness(make_config(8, max_queue_delay_ms=100, preferred_batch_sizes=(2, 4)))
    h.add("a")
    assert h.plan().run == ()  # 1 row: no preferred size yet
    for name in "bcde":
        h.add(name)
    assert h.run() == ["a", "b", "c", "d"]  # 5 pending: 4 is the largest formable
    assert h.plan().run == ()  # e alone waits for its delay
    h.add("f")
    h.add("g")
    assert h.run() == ["e", "f"]  # 3 pending: 2 is the largest formable


def test_without_delay_a_preferred_size_caps_a_backlog_and_less_runs_at_once() -> None:
    # The shipped minilm config: max 64, preferred 16, no delay.
    h = Harness(make_config(64, max_queue_delay_ms=0, preferred_batch_sizes=(16,)))
    backlog = [f"r{i}" for i in range(24)]
    for name in backlog:
        h.add(name)
    assert h.run() == backlog[:16]
    assert h.run() == backlog[16:]  # 8 left: under the preferred size, they run at once
    h.add("big", rows=40)  # a request may still carry up to max_batch_size rows
    assert h.run() == ["big"]


def test_preferred_sizes_give_way_to_everything_once_the_delay_passed() -> None:
    h = Harness(make_config(8, max_queue_delay_ms=100, preferred_batch_sizes=(2,)))
    for name in "abc":
        h.add(name)
    h.clock.advance(0.1)
    assert h.run() == ["a", "b", "c"]


def test_higher_priority_level_first_fifo_within_a_level() -> None:
    h = Harness(make_config(2, priority_levels=2))
    h.add("low1", priority=2)
    h.add("high1", priority=1)
    h.add("low2", priority=2)
    h.add("high2", priority=1)
    assert h.run() == ["high1", "high2"]
    assert h.run() == ["low1", "low2"]


def test_default_priority_is_the_lowest_level_unless_configured() -> None:
    h = Harness(make_config(8, priority_levels=3))
    assert h.add("a").level == 3
    assert h.add("b", priority=0).level == 3
    h2 = Harness(make_config(8, priority_levels=3, default_priority_level=2))
    assert h2.add("c").level == 2


@pytest.mark.parametrize("priority", [-1, 3, 99])
def test_priority_outside_the_levels_is_invalid(priority: int) -> None:
    h = Harness(make_config(8, priority_levels=2))
    with pytest.raises(InvalidInput, match="priority"):
        h.add("a", priority=priority)
    assert len(h.queue) == 0


def test_negative_timeout_is_invalid() -> None:
    h = Harness(make_config(8))
    with pytest.raises(InvalidInput, match="timeout"):
        h.add("a", timeout_s=-1.0)


def test_full_level_rejects_at_once_other_levels_still_admit() -> None:
    full = QueuePolicy(max_queue_size=2)
    h = Harness(make_config(8, priority_levels=2, priority_queue_policy={"2": full}))
    h.add("a", priority=2)
    h.add("b", priority=2)
    with pytest.raises(QueueFull) as info:
        h.add("c", priority=2)
    assert info.value.status_code == 503
    assert info.value.retry_after_s > 0
    assert "Retry-After" in info.value.headers()
    h.add("d", priority=1)  # level 1 is unbounded
    assert h.queue.depth(2) == 2
    h.run()  # frees level 2
    h.add("e", priority=2)


def test_expired_reject_items_are_reported_and_never_run() -> None:
    reject = QueuePolicy(default_timeout_ms=100, timeout_action="reject")
    h = Harness(make_config(8, max_queue_delay_ms=1000, default_queue_policy=reject))
    h.add("a")
    h.clock.advance(0.05)
    h.add("b")
    plan = h.plan()
    assert plan.run == ()
    assert plan.wake_at_s == pytest.approx(0.1)  # the deadline comes before the delay
    h.clock.advance(0.05)
    plan = h.plan()
    assert h.label(plan.reject) == ["a"]
    assert plan.run == ()
    h.clock.advance(0.05)
    assert h.label(h.plan().reject) == ["b"]
    assert len(h.queue) == 0
    assert h.plan() == Plan()


def test_expired_reject_item_does_not_join_a_full_batch() -> None:
    reject = QueuePolicy(default_timeout_ms=100)
    h = Harness(make_config(2, default_queue_policy=reject))
    h.add("a")
    h.clock.advance(0.1)
    h.add("b")
    h.add("c")
    plan = h.plan()
    assert h.label(plan.reject) == ["a"]
    assert h.label(plan.run) == ["b", "c"]


def test_expired_delay_items_run_after_the_on_time_ones() -> None:
    delay = QueuePolicy(default_timeout_ms=1000, timeout_action="delay")
    h = Harness(make_config(1, priority_levels=2, default_queue_policy=delay))
    h.add("late", priority=1)
    h.clock.advance(0.5)
    h.add("on_time", priority=1)
    h.add("low", priority=2)
    h.clock.advance(0.6)  # late expired at 1.0; on_time expires at 1.5
    plan = h.plan()
    assert plan.reject == ()
    assert h.label(plan.run) == ["on_time"]
    # A delayed level-1 item still comes before level 2 (behind only its own level's rest).
    assert h.run() == ["late"]
    assert h.run() == ["low"]


def test_delayed_item_never_rejected() -> None:
    delay = QueuePolicy(default_timeout_ms=10, timeout_action="delay")
    h = Harness(make_config(4, max_queue_delay_ms=1000, default_queue_policy=delay))
    h.add("a")
    h.clock.advance(0.5)
    assert h.plan().reject == ()
    h.clock.advance(0.5)
    assert h.run() == ["a"]


@pytest.mark.parametrize(
    ("default_ms", "request_s", "expected_s"),
    [
        (100, None, 0.1),  # no request timeout: the default
        (100, 0.05, 0.05),  # shorter: applies
        (100, 0.5, 0.1),  # longer: may not extend the default
        (0, 0.2, 0.2),  # default 0 means none, so any request timeout applies
        (0, None, None),
    ],
)
def test_override_may_only_shorten_the_default(
    default_ms: float, request_s: float | None, expected_s: float | None
) -> None:
    policy = QueuePolicy(default_timeout_ms=default_ms, allow_timeout_override=True)
    h = Harness(make_config(8, default_queue_policy=policy))
    h.clock.advance(10.0)
    item = h.add("a", timeout_s=request_s)
    if expected_s is None:
        assert item.deadline_s is None
    else:
        assert item.deadline_s == pytest.approx(10.0 + expected_s)


@pytest.mark.parametrize(("default_ms", "expected_s"), [(100, 0.1), (0, None)])
def test_override_disallowed_ignores_the_request_timeout(
    default_ms: float, expected_s: float | None
) -> None:
    policy = QueuePolicy(default_timeout_ms=default_ms, allow_timeout_override=False)
    h = Harness(make_config(8, default_queue_policy=policy))
    item = h.add("a", timeout_s=0.01)
    assert item.deadline_s == (None if expected_s is None else pytest.approx(expected_s))


def test_incompatible_items_never_share_a_batch() -> None:
    h = Harness(make_config(8))
    h.add("a1", key="A")
    h.add("b1", key="B")
    h.add("a2", key="A")
    # Like Triton, the batch stops at the first item that cannot join (FIFO is kept).
    assert h.run() == ["a1"]
    assert h.run() == ["b1"]
    assert h.run() == ["a2"]


def test_incompatible_next_item_sends_the_batch_without_waiting() -> None:
    h = Harness(make_config(8, max_queue_delay_ms=1000))
    h.add("a1", key="A")
    h.add("b1", key="B")
    assert h.run() == ["a1"]
    assert h.plan().run == ()  # b1 alone waits for its delay


def test_cancelled_items_are_dropped_and_never_run() -> None:
    h = Harness(make_config(8))
    a, b = h.add("a"), h.add("b")
    c = h.add("c")
    assert h.queue.cancel(b)
    assert b.cancelled
    assert len(h.queue) == 2
    assert h.run() == ["a", "c"]
    assert not h.queue.cancel(b)
    assert not h.queue.cancel(a)  # already taken: too late to cancel
    assert not c.cancelled


def test_cancelling_everything_empties_the_queue() -> None:
    h = Harness(make_config(8, max_queue_delay_ms=1000))
    items = [h.add(name) for name in "abc"]
    for item in items:
        h.queue.cancel(item)
    assert len(h.queue) == 0
    assert h.plan() == Plan()


def test_cancelled_item_frees_its_queue_slot() -> None:
    h = Harness(make_config(8, default_queue_policy=QueuePolicy(max_queue_size=1)))
    a = h.add("a")
    h.queue.cancel(a)
    h.add("b")
    assert h.run() == ["b"]


@pytest.mark.parametrize("max_batch_size", [0, 8])
def test_models_without_dynamic_batching_run_one_request_at_a_time(max_batch_size: int) -> None:
    # max_batch_size 0: no batch axis at all; max_batch_size > 0 without [dynamic_batching]:
    # Triton's default scheduler, one request per execution.
    h = Harness(make_config(max_batch_size, batching=False))
    for name in "abc":
        h.add(name)
    assert h.run() == ["a"]
    assert h.run() == ["b"]
    assert h.run() == ["c"]


def test_drain_returns_every_live_item() -> None:
    h = Harness(make_config(8, priority_levels=2))
    h.add("a", priority=2)
    b = h.add("b", priority=1)
    h.add("c", priority=2)
    h.queue.cancel(b)
    assert h.label(h.queue.drain()) == ["a", "c"]
    assert len(h.queue) == 0
    assert h.plan() == Plan()


def test_dynamic_axes_from_the_specs() -> None:
    config = ModelConfig(
        name="m",
        platform="echo",
        max_batch_size=4,
        inputs=(
            TensorSpec(name="ids", datatype="INT64", shape=(-1,)),
            TensorSpec(name="image", datatype="FP32", shape=(3, -1, -1)),
            TensorSpec(name="fixed", datatype="FP32", shape=(2,)),
            TensorSpec(name="text", datatype="BYTES", shape=(-1,)),
        ),
    )
    assert dynamic_axes(config) == {"ids": (1,), "image": (2, 3)}
    assert dynamic_axes(ModelConfig(name="m", platform="echo", inputs=config.inputs)) == {}


def test_compat_key_ignores_rows_and_dynamic_axes_only() -> None:
    axes = {"ids": (1,)}

    def key(ids: np.ndarray, other: np.ndarray) -> Hashable:
        return compat_key({"ids": ids, "x": other}, axes)

    base = key(np.zeros((1, 5), np.int64), np.zeros((1, 3), np.float32))
    assert key(np.zeros((4, 9), np.int64), np.zeros((4, 3), np.float32)) == base
    assert key(np.zeros((1, 5), np.int32), np.zeros((1, 3), np.float32)) != base
    assert key(np.zeros((1, 5), np.int64), np.zeros((1, 4), np.float32)) != base
    assert key(np.zeros((1, 5), np.int64), np.zeros((1, 3), np.float64)) != base
    assert compat_key({"ids": np.zeros((1, 5), np.int64)}, axes) != base
    # Dict order does not matter; BYTES (object) arrays are never padded, so shape counts.
    swapped: TensorMap = {"x": np.zeros((1, 3), np.float32), "ids": np.zeros((1, 5), np.int64)}
    assert compat_key(swapped, axes) == base
    text = {"t": np.array([[b"a", b"b"]], dtype=object)}
    longer = {"t": np.array([[b"a", b"b", b"c"]], dtype=object)}
    assert compat_key(text, {}) != compat_key(longer, {})


def test_finished_items_do_not_linger_in_the_deadline_heap() -> None:
    # Taken items keep their payloads alive while anything references them: the queue must not.
    policy = QueuePolicy(default_timeout_ms=30_000)
    h = Harness(make_config(4, default_queue_policy=policy))
    for i in range(1000):
        h.add(f"r{i}", timeout_s=float(1 + i % 7))  # mixed timeouts: not FIFO by deadline
        if i % 4 == 3:
            assert len(h.plan().run) == 4
    assert len(h.queue) == 0
    assert len(h.queue._deadlines) <= 64
    assert h.queue.next_deadline_s is None
