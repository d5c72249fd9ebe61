"""DynamicBatcher.is_healthy: a batcher whose loop dies says so, fails its callers, refuses more.

Issue 9, item 2: a batcher that dies must turn the model's readiness off (the servable reads
`is_healthy`); `stop()` is not death.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fulcrum.batcher import DynamicBatcher
from fulcrum.config import DynamicBatching, ModelConfig, TensorSpec
from fulcrum.errors import Unavailable
from fulcrum.policy import PendingQueue, Plan
from fulcrum.types import TensorMap

CONFIG = ModelConfig(
    name="m",
    platform="echo",
    max_batch_size=8,
    inputs=(TensorSpec(name="x", datatype="FP32", shape=(1,)),),
    outputs=(TensorSpec(name="y", datatype="FP32", shape=(1,)),),
    dynamic_batching=DynamicBatching(),
)


class CountingModel:
    """Fake dispatch: y = x; counts its batches."""

    def __init__(self) -> None:
        self.num_batches = 0

    async def __call__(self, inputs: TensorMap) -> TensorMap:
        self.num_batches += 1
        return {"y": inputs["x"]}


class BrokenPolicy:
    """A policy with a bug: plan() raises as soon as there is something to plan."""

    def plan(self, queue: PendingQueue, now: float) -> Plan:
        if len(queue):
            raise RuntimeError("policy bug at /srv/secret/path")
        return Plan()

    def on_arrival(self, queue: PendingQueue, item: object, now: float) -> float | None:
        return None


def x(value: float) -> TensorMap:
    return {"x": np.full((1, 1), value, np.float32)}


async def test_a_batcher_whose_loop_dies_turns_unhealthy_fails_callers_and_refuses_new() -> None:
    model = CountingModel()
    batcher = DynamicBatcher(CONFIG, model, policy=BrokenPolicy())
    batcher.start()
    assert batcher.is_healthy
    queued = [asyncio.create_task(batcher.submit(x(v))) for v in (1, 2, 3)]
    outcomes = await asyncio.gather(*queued, return_exceptions=True)
    for outcome in outcomes:
        assert isinstance(outcome, Unavailable) and outcome.status_code == 503
        assert "batcher failed" in outcome.message
        assert "/srv/secret" not in outcome.message  # the bug's text stays in the log
    assert not batcher.is_healthy
    with pytest.raises(Unavailable, match="no running batcher"):
        await batcher.submit(x(4))
    assert model.num_batches == 0 and batcher.queue_depth == 0
    await batcher.stop()
    assert not batcher.is_healthy  # stop() does not bring a dead batcher back


async def test_stop_is_not_death() -> None:
    batcher = DynamicBatcher(CONFIG, CountingModel())
    batcher.start()
    assert (await batcher.submit(x(1))).outputs["y"][0, 0] == 1
    await batcher.stop()
    assert batcher.is_healthy  # readiness after stop() is the servable's call


async def test_a_loop_cancelled_by_anyone_but_stop_is_death_even_before_it_ran() -> None:
    batcher = DynamicBatcher(CONFIG, CountingModel())
    batcher.start()
    [loop_task] = [t for t in asyncio.all_tasks() if t.get_name() == "batcher-m"]
    loop_task.cancel()  # before its first step: no except clause in the loop ever runs
    with pytest.raises(Unavailable):
        await asyncio.wait_for(batcher.submit(x(1)), 10)  # a hang guard, not a timing
    assert not batcher.is_healthy
    await batcher.stop()
