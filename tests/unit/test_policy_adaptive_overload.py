"""AdaptivePolicy under overload, on a fake clock: the request head's check against the full
path's, late sheds counted apart, and admitted requests on time when batch times are noisy."""

from __future__ import annotations

import numpy as np
import pytest
from test_policy_adaptive import Sim, poisson
from test_policy_adaptive import linear as sim_linear
from test_policy_adaptive import make_config as sim_config
from test_policy_adaptive import warm as warm_sim

from fulcrum.batcher import BatchRecord
from fulcrum.config import DynamicBatching, ModelConfig, validate
from fulcrum.errors import QueueFull
from fulcrum.pending import Pending, PendingQueue
from fulcrum.policy_adaptive import AdaptivePolicy

SLO_S = 0.050


def linear(rows: int) -> float:
    return 0.0021 + 0.0005 * rows  # 32 rows (the limit in a 25 ms budget) in 18.1 ms


def make_config(max_batch_size: int = 32) -> ModelConfig:
    batching = DynamicBatching(policy="adaptive", slo_p99_ms=SLO_S * 1000)
    config = ModelConfig(name="m", platform="echo", max_batch_size=max_batch_size,
                         dynamic_batching=batching)  # fmt: skip
    validate(config)
    return config


def warmed() -> tuple[PendingQueue, AdaptivePolicy]:
    config = make_config()
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    for rows in [1, 4, 8, 16, 32] * 8:
        policy.observe(BatchRecord(rows, rows, linear(rows), [], False))
    return queue, policy


def fill(queue: PendingQueue, num: int, now: float) -> None:
    for _ in range(num):
        queue.admit(Pending(1, "k", now), priority=None, timeout_s=None)


def head_probe(queue: PendingQueue, now: float) -> Pending:
    """What `DynamicBatcher.early_refusal` asks about: a one-row request not queued yet."""
    probe = Pending(1, None, now)
    assert queue.place(probe, None) is None
    return probe


def test_the_head_check_counts_the_request_itself_as_the_full_path_does() -> None:
    queue, policy = warmed()
    fill(queue, 87, 0.0)  # 87 rows drain in 49.8 ms: one more makes 50.3, past the SLO
    assert policy.drain_s(87, 0.0) < SLO_S < policy.drain_s(88, 0.0)
    assert policy.on_arrival(queue, head_probe(queue, 0.0), 0.0) is not None
    queued = Pending(1, "k", 0.0)
    queue.admit(queued, priority=None, timeout_s=None)
    assert policy.on_arrival(queue, queued, 0.0) is not None  # the same answer in full
    # Retry-After: the whole queue's drain, without the request, from either path.
    queue.take((queued,))
    assert policy.on_arrival(queue, head_probe(queue, 0.0), 0.0) == pytest.approx(
        policy.drain_s(87, 0.0)
    )


def test_the_head_check_adds_the_measured_time_from_head_to_queue() -> None:
    queue, policy = warmed()
    for i in range(300):  # each reached its queue 6 ms after its head
        now = i * 0.001
        item = Pending(1, "k", now, origin_s=now - 0.006)
        queue.admit(item, priority=None, timeout_s=None)
        assert policy.on_arrival(queue, item, now) is None
        queue.take((item,))
    assert policy.state()["arrival_age_ms"] == pytest.approx(6.0, rel=0.01)
    now = 1.0
    fill(queue, 80, now)  # with its own row: 46.3 ms of work, 52.3 ms with the 6 ms to come
    assert policy.drain_s(81, now) < SLO_S < policy.drain_s(81, now) + 0.006
    assert policy.on_arrival(queue, head_probe(queue, now), now) is not None
    # The same request queued 6 ms after its head, with the same rows ahead: refused in full.
    queued = Pending(1, "k", now + 0.006, origin_s=now)
    queue.admit(queued, priority=None, timeout_s=None)
    assert policy.on_arrival(queue, queued, now + 0.006) is not None
    # The head lets through what the full path admits.
    queue.take(tuple(queue.live())[:10])
    assert policy.on_arrival(queue, head_probe(queue, now), now) is None


def test_a_refused_probe_is_counted_once_and_an_admitted_one_not_at_all() -> None:
    queue, policy = warmed()
    assert policy.on_arrival(queue, head_probe(queue, 0.0), 0.0) is None
    assert policy.num_shed == 0
    fill(queue, 200, 0.0)
    assert policy.on_arrival(queue, head_probe(queue, 0.0), 0.0) is not None
    assert policy.num_shed == 1
    assert policy.state()["shed_head"] == 1


def test_late_sheds_are_counted_apart_from_refusals_on_arrival() -> None:
    queue, policy = warmed()
    fill(queue, 200, 0.0)
    newcomer = Pending(1, "k", 0.0)
    queue.admit(newcomer, priority=None, timeout_s=None)
    assert policy.on_arrival(queue, newcomer, 0.0) is not None  # refused on arrival
    queue.take((newcomer,))
    plan = policy.plan(queue, 0.049)  # then the clock jumps: the queued ones are hopeless
    state = policy.state()
    assert len(plan.shed) > 0
    assert state["shed_late"] == len(plan.shed)
    assert state["shed_deadline"] == len(plan.shed) + 1
    assert state["shed_head"] == 0  # the refusal on arrival came from the full path


class ArrivalSim(Sim):
    """`Sim` with the batcher's arrival check: a request the policy refuses leaves at once."""

    num_refused: int = 0

    def _admit(self, item: Pending, priority: int | None) -> None:
        try:
            self.queue.admit(item, priority=priority, timeout_s=None)
        except QueueFull:
            self.num_full += 1
            return
        if self.policy.on_arrival(self.queue, item, item.enqueue_s) is not None:
            self.queue.take((item,))
            self.num_refused += 1


def test_admitted_requests_keep_the_slo_at_3x_overload_when_batch_times_are_noisy() -> None:
    # Batches run 15% off their mean (lognormal): planned to end exactly at the earliest
    # deadline by the mean fit, every other one ended late (8% of admitted requests before).
    rng = np.random.default_rng(3)

    def noisy(rows: int, _now: float) -> float:
        return sim_linear(rows) * float(rng.lognormal(0.0, 0.15))

    sim = ArrivalSim(sim_config(), time_of=noisy)
    warm_sim(sim.policy)
    capacity_per_s = 32 / sim_linear(32)
    sim.run(poisson(3 * capacity_per_s, 0.0, 5.0))
    good = [item for item, done in sim.finished if done <= item.due_s + 1e-9]
    assert len(sim.late()) <= 0.01 * len(sim.finished)  # admitted P99 within the SLO
    assert len(good) >= 0.9 * capacity_per_s * 5.0  # goodput near capacity
    assert len(sim.shed) <= 0.01 * (sim.num_full + sim.num_refused)  # refused at once
    assert sim.policy.model.error > 1.1  # the spread it planned with


def test_noisy_batches_never_refuse_a_request_alone_on_an_idle_instance() -> None:
    queue, policy = warmed()
    policy.model.error = 3.0  # batches have run up to 3x their fit
    alone = Pending(1, "k", 0.0)
    queue.admit(alone, priority=None, timeout_s=0.005)  # 2.6 ms by the fit, 7.8 slow
    assert policy.on_arrival(queue, alone, 0.0) is None  # only the fit may refuse it alone
    fill(queue, 8, 0.0)
    behind = Pending(1, "k", 0.0)
    queue.admit(behind, priority=None, timeout_s=0.015)  # 6.6 ms by the fit, 19.8 slow
    assert policy.drain_s(10, 0.0) < 0.015 < 3.0 * policy.drain_s(10, 0.0)
    assert policy.on_arrival(queue, behind, 0.0) is not None  # work ahead: the slow runs


def test_the_arrival_margin_climbs_while_late_sheds_pass_one_in_fifty_batches() -> None:
    queue, policy = warmed()
    for batch in range(5000):  # one late shed every 10 batches: the margin climbs ...
        if batch % 10 == 0:
            late = Pending(1, "k", 0.0)
            queue.admit(late, priority=None, timeout_s=0.001)
            assert policy.plan(queue, 0.0009).shed == (late,)
        policy.observe(BatchRecord(8, 8, sim_linear(8), [], False))
    assert policy.arrival_margin > 2.9  # ... to its cap: 5x the rate it settles at
    for batch in range(5000):  # one in 100: it falls back to the plain prediction
        if batch % 100 == 0:
            late = Pending(1, "k", 0.0)
            queue.admit(late, priority=None, timeout_s=0.001)
            assert policy.plan(queue, 0.0009).shed == (late,)
        policy.observe(BatchRecord(8, 8, sim_linear(8), [], False))
    assert policy.arrival_margin < 1.1
