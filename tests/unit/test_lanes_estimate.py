"""Each batch policy's estimate of when a new request would be answered (what the lane router
reads): the rows queued ahead, the batches still running, then the request's own batch."""

from __future__ import annotations

import pytest

from fulcrum.config import DynamicBatching, Instances, ModelConfig, validate
from fulcrum.policy import BatchPolicy, BatchRecord, Pending, PendingQueue, TritonPolicy
from fulcrum.policy_adaptive import AdaptivePolicy

A_S, C_S = 0.010, 0.001  # a batch of b rows runs in 10 ms + 1 ms x b


def make_config(instances: int = 1, **settings: object) -> ModelConfig:
    config = ModelConfig(
        name="m",
        platform="echo",
        max_batch_size=8,
        dynamic_batching=DynamicBatching(**settings),  # type: ignore[arg-type]
        instances=Instances(count=instances),
    )
    validate(config)
    return config


def fitted(policy: TritonPolicy | AdaptivePolicy) -> TritonPolicy | AdaptivePolicy:
    policy.model.a_s, policy.model.c_s = A_S, C_S
    return policy


def run_batch(policy: BatchPolicy, config: ModelConfig, num_rows: int, now: float) -> None:
    queue = PendingQueue(config)
    queue.admit(Pending(num_rows, "k", now), priority=None, timeout_s=None)
    assert policy.plan(queue, now).run


def record(num_rows: int) -> BatchRecord:
    return BatchRecord(num_rows, 1, A_S + C_S * num_rows, [0.0], failed=False)


def test_triton_idle_is_its_own_batch_plus_the_queue_delay() -> None:
    policy = fitted(TritonPolicy(make_config(max_queue_delay_ms=2)))
    assert policy.estimate_finish_s(0, 1, now=0.0) == pytest.approx(0.002 + 0.011)


def test_triton_counts_queued_rows_in_full_batches_and_the_running_batch() -> None:
    config = make_config()
    policy = fitted(TritonPolicy(config))
    run_batch(policy, config, 8, now=0.0)  # runs until 0.018
    # At 0.005: 0.013 left of it, 20 rows queued (two batches of 8: 0.036, one of 4: 0.014),
    # then its own row (0.011).
    estimate_s = policy.estimate_finish_s(20, 1, now=0.005)
    assert estimate_s == pytest.approx(0.013 + 0.036 + 0.014 + 0.011)
    policy.observe(record(8))  # the batch ended: no more running time
    assert policy.estimate_finish_s(0, 1, now=0.005) == pytest.approx(0.011)


def test_triton_spreads_the_work_ahead_over_its_instances() -> None:
    config = make_config(instances=2)
    policy = fitted(TritonPolicy(config))
    assert policy.estimate_finish_s(16, 1, now=0.0) == pytest.approx(2 * 0.018 / 2 + 0.011)


def test_adaptive_counts_the_running_batch_and_its_batch_limit() -> None:
    config = make_config(policy="adaptive", slo_p99_ms=100)
    policy = fitted(AdaptivePolicy(config))
    assert policy.estimate_finish_s(0, 3, now=1.0) == pytest.approx(0.013)
    run_batch(policy, config, 4, now=1.0)  # runs until 1.014
    estimate_s = policy.estimate_finish_s(8, 1, now=1.004)
    assert estimate_s == pytest.approx(0.010 + 0.018 + 0.011)
