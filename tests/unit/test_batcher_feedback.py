"""DynamicBatcher and its policy: feedback after every batch, shedding (503 + Retry-After)."""

from __future__ import annotations

import numpy as np
import pytest

from fulcrum.batcher import BatchRecord, DynamicBatcher
from fulcrum.config import DynamicBatching, ModelConfig, TensorSpec
from fulcrum.errors import ModelError, Shed
from fulcrum.pending import PendingQueue
from fulcrum.policy import Plan, TritonPolicy
from fulcrum.policy_adaptive import AdaptivePolicy
from fulcrum.types import FakeClock, TensorMap


def make_config(max_batch_size: int, **batching: object) -> ModelConfig:
    return ModelConfig(
        name="m",
        platform="echo",
        max_batch_size=max_batch_size,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(2,)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(2,)),),
        dynamic_batching=DynamicBatching(**batching),  # type: ignore[arg-type]
    )


class Doubler:
    """Fake dispatch: y = 2x, a batch containing -1 raises; keeps every batch it saw."""

    def __init__(self) -> None:
        self.batches: list[np.ndarray] = []

    async def __call__(self, inputs: TensorMap) -> TensorMap:
        self.batches.append(inputs["x"])
        if np.any(inputs["x"] == -1):
            raise RuntimeError("boom")
        return {"y": inputs["x"] * 2}


def rows(*values: float) -> np.ndarray:
    return np.array([[v, v] for v in values], dtype=np.float32)


async def started(config: ModelConfig, model: Doubler, **kwargs: object) -> DynamicBatcher:
    batcher = DynamicBatcher(config, model, **kwargs)  # type: ignore[arg-type]
    batcher.start()
    return batcher


class Observing(TritonPolicy):
    """Triton's rules, and a log of what the batcher fed back."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.observed: list[BatchRecord] = []

    def observe(self, record: BatchRecord) -> None:
        self.observed.append(record)


async def test_the_policy_observes_every_batch_before_on_batch_sees_it() -> None:
    config = make_config(8)
    policy = Observing(config)
    seen: list[int] = []
    on_batch = lambda r: seen.append(len(policy.observed))  # noqa: E731
    batcher = await started(config, Doubler(), policy=policy, on_batch=on_batch)
    await batcher.submit({"x": rows(1, 2)})
    with pytest.raises(ModelError):
        await batcher.submit({"x": rows(-1)})
    assert [(r.batch_size, r.failed) for r in policy.observed] == [(2, False), (1, True)]
    assert seen == [1, 2]
    await batcher.stop()


async def test_a_request_that_cannot_meet_its_deadline_is_shed_with_503_and_retry_after() -> None:
    config = make_config(8, policy="adaptive", slo_p99_ms=50.0)
    policy = AdaptivePolicy(config)
    for size in (1, 8) * 5:  # 2 ms + 0.5 ms a row
        policy.observe(BatchRecord(size, size, 0.002 + 0.0005 * size, [], False))
    model = Doubler()
    batcher = await started(config, model, policy=policy, clock=FakeClock())
    with pytest.raises(Shed) as info:
        await batcher.submit({"x": rows(1)}, timeout_s=0.001)  # alone it needs 2.5 ms
    assert info.value.status_code == 503 and info.value.reason == "deadline"
    assert info.value.headers() == {"Retry-After": "1"}  # whole seconds, rounded up
    assert info.value.retry_after_s == pytest.approx(0.0)  # the queue was empty
    assert model.batches == []  # never touched the model
    ok = await batcher.submit({"x": rows(3)}, timeout_s=0.01)
    np.testing.assert_array_equal(ok.outputs["y"], rows(6))
    await batcher.stop()


def test_retry_after_rounds_up_to_whole_seconds() -> None:
    assert Shed("x", retry_after_s=1.2).headers() == {"Retry-After": "2"}
    assert Shed("x", retry_after_s=0.004).headers() == {"Retry-After": "1"}


class Ordering(Observing):
    """Observing, and the order of plans (of a queue that holds something) and observations."""

    def __init__(self, config: ModelConfig, log: list[str]) -> None:
        super().__init__(config)
        self.log = log

    def plan(self, queue: PendingQueue, now: float) -> Plan:
        if len(queue):
            self.log.append("plan")
        return super().plan(queue, now)

    def observe(self, record: BatchRecord) -> None:
        self.log.append("observe")
        super().observe(record)


async def test_a_caller_is_answered_before_its_batch_is_accounted_and_planned_after() -> None:
    # The accounting (fit, statistics) is off a lone request's path to its answer, and the
    # policy still learns from a batch before it plans the next one.
    log: list[str] = []
    config = make_config(8)
    batcher = await started(config, Doubler(), policy=Ordering(config, log))
    for value in (1.0, 2.0):
        await batcher.submit({"x": rows(value)})
        log.append("answered")
    await batcher.stop()
    assert log == ["plan", "answered", "observe"] * 2
