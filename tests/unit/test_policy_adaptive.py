"""AdaptivePolicy on a fake clock: a discrete-event simulation of one instance, no sleeps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from fulcrum.batcher import BatchRecord
from fulcrum.config import DynamicBatching, ModelConfig, QueuePolicy, load_model_config, validate
from fulcrum.errors import ConfigError, QueueFull
from fulcrum.pending import Pending, PendingQueue
from fulcrum.policy import Plan, TritonPolicy, make_policy
from fulcrum.policy_adaptive import AdaptivePolicy
from fulcrum.repository import apply_override

TimeOf = Callable[[int, float], float]  # (rows, now) -> seconds


def linear(rows: int, _now: float = 0.0) -> float:
    return 0.002 + 0.0005 * rows  # 2 ms fixed, 0.5 ms a row: 32 rows in 18 ms


def make_config(
    max_batch_size: int = 32, *, slo_ms: float = 50.0, **settings: object
) -> ModelConfig:
    config = ModelConfig(
        name="m",
        platform="echo",
        max_batch_size=max_batch_size,
        dynamic_batching=DynamicBatching(policy="adaptive", slo_p99_ms=slo_ms, **settings),  # type: ignore[arg-type]
    )
    validate(config)
    return config


def record(rows: int, seconds: float, num_requests: int | None = None) -> BatchRecord:
    return BatchRecord(rows, num_requests or rows, seconds, [], False)


def warm(policy: AdaptivePolicy, time_of: TimeOf = linear) -> None:
    """Teach the model the backend's speed, as a few minutes of traffic would."""
    for rows in [1, 4, 8, 16, 32] * 8:
        policy.observe(record(rows, time_of(rows, 0.0)))


@dataclass
class Sim:
    """One instance, arrivals at given times; plans only while the instance is free (as the
    batcher does) and feeds each finished batch back to `observe`."""

    config: ModelConfig
    time_of: TimeOf = linear
    queue: PendingQueue = field(init=False)
    policy: AdaptivePolicy = field(init=False)
    batches: list[tuple[float, int]] = field(default_factory=list)  # (start, rows)
    finished: list[tuple[Pending, float]] = field(default_factory=list)  # (item, finish)
    shed: list[tuple[Pending, float, float]] = field(default_factory=list)  # (item, when, retry)
    num_full: int = 0
    limits: list[tuple[float, int]] = field(default_factory=list)  # (time, batch_limit)
    answers: bool = False  # tell the policy how long each answer took (as `Servable` does)

    def __post_init__(self) -> None:
        self.queue = PendingQueue(self.config)
        self.policy = AdaptivePolicy(self.config)

    def run(self, arrivals: list[float], priority: int | None = None) -> None:
        running: tuple[float, list[Pending], int, float] | None = None
        wake: float | None = None
        now, i = 0.0, 0
        for _ in range(10 * len(arrivals) + 100):
            times = [arrivals[i]] if i < len(arrivals) else []
            times += [running[0]] if running else [wake] if wake is not None else []
            if not times:
                break
            now = max(now, min(times))
            while i < len(arrivals) and arrivals[i] <= now:
                self._admit(Pending(1, "k", now), priority)
                i += 1
            if running and running[0] <= now:
                _, items, rows, seconds = running
                self.finished += [(item, now) for item in items]
                for item in items if self.answers else ():
                    self.policy.observe_answer(0.0, now - item.origin_s)
                self.policy.observe(record(rows, seconds, len(items)))
                self.limits.append((now, self.policy.batch_limit))
                running = None
            if running is None:
                plan = self.policy.plan(self.queue, now)
                assert not plan.reject
                self.shed += [(item, now, plan.retry_after_s) for item in plan.shed]
                wake = plan.wake_at_s
                if plan.run:
                    rows = sum(item.num_rows for item in plan.run)
                    seconds = self.time_of(rows, now)
                    running = (now + seconds, list(plan.run), rows, seconds)
                    self.batches.append((now, rows))
        assert i == len(arrivals) and not self.queue and running is None

    def _admit(self, item: Pending, priority: int | None) -> None:
        try:
            self.queue.admit(item, priority=priority, timeout_s=None)
        except QueueFull:
            self.num_full += 1

    def late(self) -> list[float]:
        """How late each late request finished (seconds past its due time)."""
        return [done - item.due_s for item, done in self.finished if done > item.due_s + 1e-9]

    def mean_batch(self, start: float, end: float) -> float:
        sizes = [rows for t, rows in self.batches if start <= t < end]
        return float(np.mean(sizes))


def poisson(rate_per_s: float, start: float, end: float, seed: int = 1) -> list[float]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate_per_s, int(rate_per_s * (end - start) * 2) + 10)
    times = start + np.cumsum(gaps)
    return [float(t) for t in times[times < end]]


def test_every_request_meets_its_deadline_under_steady_load() -> None:
    sim = Sim(make_config())
    warm(sim.policy)
    sim.run(poisson(1000, 0.0, 2.0))  # ~56% of the 1778 rows/s a full batch gives
    assert len(sim.finished) > 1800 and not sim.shed and not sim.num_full
    assert sim.late() == []


def test_batches_grow_when_load_rises_and_shrink_when_it_falls() -> None:
    sim = Sim(make_config())
    warm(sim.policy)
    arrivals = poisson(50, 0.0, 1.0, 1) + poisson(1500, 1.0, 2.0, 2) + poisson(50, 2.0, 3.0, 3)
    sim.run(arrivals)
    light, peak, light_again = (sim.mean_batch(s, s + 1.0) for s in (0.0, 1.0, 2.0))
    assert light < 1.5 and light_again < 1.5  # no added wait at night
    assert peak > 8  # the peak is batched
    assert sim.late() == [] and not sim.shed


def test_overload_is_refused_at_admission_and_admitted_requests_keep_the_slo() -> None:
    sim = Sim(make_config())
    warm(sim.policy)
    capacity_per_s = 32 / linear(32)
    sim.run(poisson(3 * capacity_per_s, 0.0, 2.0))
    assert sim.num_full > len(sim.finished)  # most of a 3x overload is refused at once
    assert len(sim.finished) >= 0.9 * capacity_per_s * 2.0  # goodput stays near capacity
    assert sim.late() == [] and not sim.shed
    assert sim.queue.bound(1) < 100  # derived from capacity and SLO, not the static 64 x 32


def test_queue_bound_and_its_retry_after_follow_the_fitted_capacity() -> None:
    queue, policy = PendingQueue(make_config()), AdaptivePolicy(make_config())
    assert queue.bound(1) == 64 * 32  # before any batch: the generous static default
    warm(policy)
    policy.plan(queue, 0.0)
    capacity = 32 / linear(32)  # rows/s at the batch limit (32: 18 ms is within 25 ms)
    expected = int(capacity * (0.050 - linear(32)) * 0.8)  # drained, then run, in the SLO
    assert queue.bound(1) == expected == policy.queue_bound
    assert queue.retry_after_s == pytest.approx(expected / capacity)


def test_explicit_max_queue_size_is_kept() -> None:
    config = make_config(default_queue_policy=QueuePolicy(max_queue_size=7))
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    warm(policy)
    policy.plan(queue, 0.0)
    assert queue.bound(1) == 7


def test_hopeless_request_is_shed_at_once_with_the_predicted_drain_as_retry_after() -> None:
    config = make_config()
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    warm(policy)
    for _ in range(40):
        queue.admit(Pending(1, "k", 0.0), priority=None, timeout_s=None)
    hopeless = Pending(1, "k", 0.0)
    queue.admit(hopeless, priority=None, timeout_s=0.001)  # 1 ms: even alone it takes 2.5
    plan = policy.plan(queue, 0.0)
    assert plan.shed == (hopeless,)
    assert len(plan.run) == 32  # the rest runs: the largest batch within the budget
    # The drain of the 40 still queued at the time: a batch of 32, then one of 8.
    assert plan.retry_after_s == pytest.approx(linear(32) + linear(8), rel=1e-3)
    assert policy.num_shed == 1


def test_the_last_queued_request_timing_out_is_rejected_and_an_empty_queue_plans_nothing() -> None:
    config = make_config()
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    warm(policy)
    assert policy.plan(queue, 0.0) == Plan()  # nothing queued: wait
    late = Pending(1, "k", 0.0)
    queue.admit(late, priority=None, timeout_s=0.010)
    plan = policy.plan(queue, 0.020)  # its queue timeout passed: the queue is empty after it
    assert plan.reject == (late,) and not plan.run and len(queue) == 0


def test_a_fit_too_pessimistic_to_run_anything_is_corrected_by_probe_batches() -> None:
    # The fit learnt 25x the real speed (a cold start, a burst of contention): even one row is
    # predicted past the 50 ms SLO, so every head would be shed, nothing would run and nothing
    # would correct the fit. After an SLO of shedding with the instance idle, the head runs.
    sim = Sim(make_config())
    warm(sim.policy, lambda rows, now: 25 * linear(rows))
    assert sim.policy.model.predict(1) > 0.050
    sim.run(poisson(300, 0.0, 2.0))
    assert sim.policy.num_probes >= 1
    assert sim.policy.model.predict(1) == pytest.approx(linear(1), rel=0.25)
    served_late = [item for item, _ in sim.finished if item.enqueue_s >= 0.5]
    shed_late = [item for item, _, _ in sim.shed if item.enqueue_s >= 0.5]
    assert len(shed_late) < 0.02 * len(served_late)  # recovered: serving, not shedding


def test_a_fit_that_refuses_every_arrival_still_lets_a_probe_through() -> None:
    # Refused on arrival, nothing is ever queued, so no plan can probe: after an SLO of
    # refusals with nothing ahead, an arrival is let in and runs as the probe.
    config = make_config()
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    warm(policy, lambda rows, now: 25 * linear(rows))
    assert policy.plan(queue, 0.0).run == ()  # the batcher's first look, at start
    first = Pending(1, "k", 0.01)
    queue.admit(first, priority=None, timeout_s=None)
    assert policy.on_arrival(queue, first, 0.01) is not None  # 62.5 ms alone > 50 ms SLO
    queue.take((first,))
    later = Pending(1, "k", 0.07)
    queue.admit(later, priority=None, timeout_s=None)
    assert policy.on_arrival(queue, later, 0.07) is None
    assert policy.plan(queue, 0.07).run == (later,)
    assert policy.num_probes == 1


def test_the_arrival_margin_weighs_the_work_ahead_not_the_request_itself() -> None:
    config = make_config()
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    warm(policy)
    policy.arrival_margin = 3.0
    alone = Pending(1, "k", 0.0)
    queue.admit(alone, priority=None, timeout_s=0.003)  # due in 3 ms; alone it takes 2.5
    assert policy.on_arrival(queue, alone, 0.0) is None


def test_a_hopeless_head_is_still_shed_while_batches_keep_running() -> None:
    # A probe is for a starved fit only: with batches starting, a request that cannot make its
    # deadline is shed, never run late in place of requests that can.
    config = make_config()
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    warm(policy)
    queue.admit(Pending(1, "k", 0.0), priority=None, timeout_s=None)
    assert len(policy.plan(queue, 0.0).run) == 1
    policy.observe(record(1, linear(1)))
    hopeless = Pending(1, "k", 1.0)
    queue.admit(hopeless, priority=None, timeout_s=0.001)
    assert policy.plan(queue, 1.0).shed == (hopeless,)  # idle long, but nothing shed before
    queue.admit(Pending(1, "k", 1.0), priority=None, timeout_s=None)
    assert len(policy.plan(queue, 1.0).run) == 1
    policy.observe(record(1, linear(1)))
    again = Pending(1, "k", 1.02)
    queue.admit(again, priority=None, timeout_s=0.001)
    assert policy.plan(queue, 1.02).shed == (again,)  # a batch started 20 ms ago
    assert policy.num_probes == 0
    late = Pending(1, "k", 1.2)
    queue.admit(late, priority=None, timeout_s=0.001)
    assert policy.plan(queue, 1.2).run == (late,)  # shed since, idle an SLO since: a probe
    assert policy.num_probes == 1


def test_retry_after_counts_the_batches_still_running() -> None:
    config = make_config()
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    warm(policy)
    for _ in range(4):
        queue.admit(Pending(1, "k", 0.0), priority=None, timeout_s=None)
    assert len(policy.plan(queue, 0.0).run) == 4  # busy until linear(4) = 4 ms
    late = Pending(1, "k", 0.001)
    queue.admit(late, priority=None, timeout_s=0.001)
    plan = policy.plan(queue, 0.0015)  # as if a second instance were free
    assert plan.shed == (late,)
    assert plan.retry_after_s == pytest.approx(linear(4) - 0.0015, rel=1e-3)


def test_a_sudden_3x_slowdown_is_detected_and_the_policy_settles_without_oscillating() -> None:
    def backend(rows: int, now: float) -> float:
        return linear(rows) * (3.0 if now >= 1.0 else 1.0)

    sim = Sim(make_config(), time_of=backend)
    warm(sim.policy)
    sim.run(poisson(300, 0.0, 3.0))
    assert sim.policy.model.num_shifts == 1  # detected once, never flipped back
    after = [limit for t, limit in sim.limits if t >= 1.2]
    assert after and len(set(after)) == 1  # settled: one limit, no swinging
    assert after[0] == int((0.025 - 0.006) / 0.0015)  # the budget at the new speed: 12 rows
    misses = [item for item, done in sim.finished if done > item.due_s]
    assert all(item.enqueue_s < 1.1 for item in misses)  # only around the change
    assert len(misses) + len(sim.shed) < 0.02 * len(sim.finished)


def test_levels_are_strictly_ordered_and_deadline_first_within_a_level() -> None:
    config = make_config(2, priority_levels=2)
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    warm(policy)
    low = [Pending(1, "k", 0.0) for _ in range(2)]
    for item in low:
        queue.admit(item, priority=2, timeout_s=None)
    relaxed, urgent = Pending(1, "k", 0.0), Pending(1, "k", 0.001)
    queue.admit(relaxed, priority=1, timeout_s=None)
    queue.admit(urgent, priority=1, timeout_s=0.02)  # arrived last, due first
    assert policy.plan(queue, 0.001).run == (urgent, relaxed)
    assert policy.plan(queue, 0.001).run == tuple(low)


def test_lower_levels_fill_spare_room_and_are_not_starved() -> None:
    config = make_config(8, priority_levels=2)
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    warm(policy)
    high, low = Pending(1, "k", 0.0), Pending(1, "k", 0.0)
    queue.admit(low, priority=2, timeout_s=None)
    queue.admit(high, priority=1, timeout_s=None)
    assert policy.plan(queue, 0.0).run == (high, low)


def test_waits_for_a_fuller_batch_only_while_the_earliest_deadline_allows() -> None:
    config = make_config(max_queue_delay_ms=100.0)
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    warm(policy)
    item = Pending(1, "k", 0.0)
    queue.admit(item, priority=None, timeout_s=None)
    plan = policy.plan(queue, 0.0)
    assert not plan.run
    # Not the 100 ms delay: a full batch started then must still end by the 50 ms deadline.
    assert plan.wake_at_s == pytest.approx(0.050 - linear(32))
    assert policy.plan(queue, plan.wake_at_s).run == (item,)


def test_no_added_wait_without_a_queue_delay() -> None:
    config = make_config()
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    item = Pending(1, "k", 0.0)
    queue.admit(item, priority=None, timeout_s=None)
    assert policy.plan(queue, 0.0).run == (item,)


def test_delay_action_runs_a_hopeless_request_late_instead_of_shedding_it() -> None:
    config = make_config(1, default_queue_policy=QueuePolicy(timeout_action="delay"))
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    warm(policy)
    hopeless, on_time = Pending(1, "k", 0.0), Pending(1, "k", 0.0)
    queue.admit(hopeless, priority=None, timeout_s=0.001)
    queue.admit(on_time, priority=None, timeout_s=None)
    first = policy.plan(queue, 0.0)
    assert first.run == (on_time,) and not first.shed
    assert policy.plan(queue, 0.0).run == (hopeless,)


def test_failed_batches_do_not_teach_the_model() -> None:
    policy = AdaptivePolicy(make_config())
    warm(policy)
    before = policy.model.predict(8)
    policy.observe(BatchRecord(8, 8, 5.0, [], True))
    assert policy.model.predict(8) == before


def test_state_shows_the_fit_the_limit_and_the_prediction_error() -> None:
    policy = AdaptivePolicy(make_config())
    warm(policy)
    policy.observe(record(8, 0.010))
    state = policy.state()
    assert state["name"] == "adaptive" and state["batch_limit"] == 32
    assert state["batch_fixed_ms"] == pytest.approx(2.0, rel=0.2)
    assert state["predicted_batch_ms"] == pytest.approx(linear(8) * 1000, rel=1e-3)
    assert state["observed_batch_ms"] == pytest.approx(10.0)


def test_make_policy_follows_the_config() -> None:
    assert isinstance(make_policy(make_config()), AdaptivePolicy)
    triton = ModelConfig(name="m", platform="echo", max_batch_size=8)
    assert isinstance(make_policy(triton), TritonPolicy)


def test_adaptive_needs_a_slo() -> None:
    with pytest.raises(ConfigError, match="slo_p99_ms"):
        make_config(slo_ms=0.0)


def write(tmp_path: Path, batching: str, max_batch_size: int = 16) -> ModelConfig:
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    text = f'platform = "echo"\nmax_batch_size = {max_batch_size}\n[dynamic_batching]\n{batching}'
    (folder / "config.toml").write_text(text)
    return load_model_config(folder / "config.toml", dir_name="m")


def test_realtime_profile_fills_what_the_file_leaves_out(tmp_path: Path) -> None:
    batching = write(tmp_path, 'profile = "realtime"\nslo_p99_ms = 40\n').dynamic_batching
    assert batching is not None
    assert (batching.policy, batching.max_queue_delay_ms, batching.slo_batch_fraction) == (
        "adaptive",
        0.0,
        0.25,
    )


def test_profile_never_overrides_a_key_the_file_sets(tmp_path: Path) -> None:
    text = 'profile = "throughput"\nslo_batch_fraction = 0.5\nmax_queue_delay_ms = 0\n'
    config = write(tmp_path, text)
    batching = config.dynamic_batching
    assert batching is not None
    assert batching.policy == "triton"  # no SLO: the static policy
    assert (batching.slo_batch_fraction, batching.max_queue_delay_ms) == (0.5, 0.0)
    assert config.queue_policy(1).max_queue_size == 256 * 16  # a deep queue


def test_mixed_profile_without_a_slo_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"slo_p99_ms.*profile 'mixed'"):
        write(tmp_path, 'profile = "mixed"\n')


def test_a_load_override_gets_its_profile_filled_in_too() -> None:
    base = ModelConfig(name="m", platform="echo", max_batch_size=8)
    override: dict[str, object] = {
        "dynamic_batching": {"profile": "realtime", "slo_p99_ms": 40.0, "slo_batch_fraction": 0.5}
    }
    batching = apply_override(base, override).dynamic_batching
    assert batching is not None
    assert (batching.policy, batching.slo_batch_fraction) == ("adaptive", 0.5)


def test_an_arrival_that_cannot_make_its_deadline_is_refused_at_once() -> None:
    # 32-row batches take 18 ms; SLO 50 ms. 100 rows ahead need four batches (~60 ms): a new
    # request is refused on arrival instead of waiting to be shed at the head of the queue.
    config = make_config()
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    warm(policy)
    for _ in range(3):
        queue.admit(Pending(1, "k", 0.0), priority=None, timeout_s=None)
    early = Pending(1, "k", 0.0)
    queue.admit(early, priority=None, timeout_s=None)
    assert policy.on_arrival(queue, early, 0.0) is None  # 4 rows: one short batch, in time
    for _ in range(96):
        queue.admit(Pending(1, "k", 0.0), priority=None, timeout_s=None)
    late = Pending(1, "k", 0.0)
    queue.admit(late, priority=None, timeout_s=None)
    retry_after_s = policy.on_arrival(queue, late, 0.0)
    assert retry_after_s == pytest.approx(policy.drain_s(100, 0.0))  # the queue without it
    assert policy.state()["shed_deadline"] == 1


def test_arrival_shedding_counts_only_the_rows_that_run_before_the_request() -> None:
    config = make_config(priority_levels=2, default_priority_level=2)
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    warm(policy)
    for _ in range(120):  # low priority: a long queue
        queue.admit(Pending(1, "k", 0.0), priority=2, timeout_s=None)
    urgent = Pending(1, "k", 0.0)
    queue.admit(urgent, priority=1, timeout_s=None)
    assert queue.rows_through(1) == 1 and queue.rows_through(2) == 121
    assert policy.on_arrival(queue, urgent, 0.0) is None  # it runs first: no reason to refuse
    low = Pending(1, "k", 0.0)
    queue.admit(low, priority=2, timeout_s=None)
    assert policy.on_arrival(queue, low, 0.0) is not None


def test_arrival_shedding_waits_for_a_trusted_fit_and_spares_delayed_levels() -> None:
    config = make_config(default_queue_policy=QueuePolicy(timeout_action="delay"))
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    items = [Pending(1, "k", 0.0) for _ in range(200)]
    for item in items:
        queue.admit(item, priority=None, timeout_s=None)
    assert policy.on_arrival(queue, items[-1], 0.0) is None  # nothing measured yet
    warm(policy)
    assert policy.on_arrival(queue, items[-1], 0.0) is None  # it would run late, as configured


def test_late_sheds_make_the_arrival_check_stricter_and_batches_relax_it() -> None:
    config = make_config(default_queue_policy=QueuePolicy(max_queue_size=1000))
    queue, policy = PendingQueue(config), AdaptivePolicy(config)
    warm(policy)
    assert policy.arrival_margin == 1.0
    # Admitted with room to spare, then the clock jumps: hopeless at the head, shed late.
    for _ in range(5):
        queue.admit(Pending(1, "k", 0.0), priority=None, timeout_s=None)
    plan = policy.plan(queue, 0.049)
    assert len(plan.shed) == 5
    assert policy.arrival_margin == pytest.approx(1.05**5)
    # A queue that passes at margin 1 is now refused on arrival: 70 rows drain in ~41 ms, within
    # the 50 ms SLO, but not with the margin (~52 ms).
    for _ in range(69):
        queue.admit(Pending(1, "k", 0.010), priority=None, timeout_s=None)
    newcomer = Pending(1, "k", 0.010)
    queue.admit(newcomer, priority=None, timeout_s=None)
    assert policy.drain_s(70, 0.010) < 0.050 < 1.05**5 * policy.drain_s(70, 0.010)
    assert policy.on_arrival(queue, newcomer, 0.010) is not None
    for _ in range(300):  # batches that run relax it back to the plain prediction
        policy.observe(record(8, linear(8)))
    assert policy.arrival_margin == 1.0
