"""A lone request (nothing queued, no other batch running) goes to the batcher's `dispatch_lone`;
a batch of several requests, or a lone one with others queued behind it, goes to `dispatch`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from fulcrum.batcher import DynamicBatcher
from fulcrum.config import DynamicBatching, ModelConfig, TensorSpec
from fulcrum.pending import PendingQueue
from fulcrum.policy import Plan, TritonPolicy
from fulcrum.types import TensorMap


def make_config(max_batch_size: int = 8) -> ModelConfig:
    return ModelConfig(
        name="m",
        platform="echo",
        max_batch_size=max_batch_size,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(2,)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(2,)),),
        dynamic_batching=DynamicBatching(max_queue_delay_ms=0),
    )


def rows(value: float) -> np.ndarray:
    return np.full((1, 2), value, np.float32)


async def until(condition: Callable[[], bool]) -> None:
    """Let other tasks run until `condition` holds (scheduling steps, not wall-clock time)."""
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


class TwoPathModel:
    """Fake dispatches: y = 2x; records which path ran each batch; `gate` holds every batch."""

    def __init__(self) -> None:
        self.paths: list[tuple[str, int]] = []  # (path, rows)
        self.gate = asyncio.Event()
        self.gate.set()
        self.num_running = 0

    async def _run(self, path: str, inputs: TensorMap) -> TensorMap:
        self.paths.append((path, len(inputs["x"])))
        self.num_running += 1
        try:
            await self.gate.wait()
        finally:
            self.num_running -= 1
        return {"y": inputs["x"] * 2}

    async def shared(self, inputs: TensorMap) -> TensorMap:
        return await self._run("shared", inputs)

    async def lone(self, inputs: TensorMap) -> TensorMap:
        return await self._run("lone", inputs)


def started(model: TwoPathModel, max_batch_size: int = 8) -> DynamicBatcher:
    batcher = DynamicBatcher(make_config(max_batch_size), model.shared, dispatch_lone=model.lone)
    batcher.start()
    return batcher


async def test_a_lone_request_at_light_load_takes_the_lone_path() -> None:
    model = TwoPathModel()
    batcher = started(model)
    for value in (1.0, 2.0, 3.0):  # one at a time: each runs alone
        result = await batcher.submit({"x": rows(value)})
        assert float(result.outputs["y"][0, 0]) == 2 * value
    assert model.paths == [("lone", 1)] * 3
    await batcher.stop()


async def test_a_batch_of_several_requests_takes_the_shared_path() -> None:
    model = TwoPathModel()
    model.gate.clear()
    batcher = started(model)
    first = asyncio.create_task(batcher.submit({"x": rows(0)}))
    await until(lambda: model.num_running == 1)
    queued = [asyncio.create_task(batcher.submit({"x": rows(v)})) for v in (1.0, 2.0)]
    await until(lambda: batcher.queue_depth == 2)
    model.gate.set()
    results = await asyncio.gather(first, *queued)
    assert [float(r.outputs["y"][0, 0]) for r in results] == [0.0, 2.0, 4.0]
    # The first ran alone; the two that queued behind it formed one batch: load, not idle.
    assert model.paths == [("lone", 1), ("shared", 2)]
    await batcher.stop()


async def test_a_lone_batch_with_requests_queued_behind_it_takes_the_shared_path() -> None:
    model = TwoPathModel()
    batcher = started(model, max_batch_size=1)  # every batch holds one request
    # Submitted in one tick: the first launches as a batch of one while the second waits.
    results = await asyncio.gather(batcher.submit({"x": rows(1)}), batcher.submit({"x": rows(2)}))
    assert [float(r.outputs["y"][0, 0]) for r in results] == [2.0, 4.0]
    # The second did queue behind the first, so the first is not lone; the second then is.
    assert model.paths == [("shared", 1), ("lone", 1)]
    await batcher.stop()


async def test_without_a_lone_path_every_batch_takes_dispatch() -> None:
    model = TwoPathModel()
    batcher = DynamicBatcher(make_config(), model.shared)
    batcher.start()
    result = await batcher.submit({"x": np.ones((1, 2), np.float32)})
    assert float(result.outputs["y"][0, 0]) == 2.0
    assert model.paths == [("shared", 1)]
    await batcher.stop()


class CountingPlans(TritonPolicy):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.num_plans = 0

    def plan(self, queue: PendingQueue, now: float) -> Plan:
        self.num_plans += 1
        return super().plan(queue, now)


async def test_a_lone_request_into_an_idle_batcher_reaches_its_model_without_the_loop() -> None:
    # Planned by a batch task of its own, in the loop turn the loop would plan in: the model is
    # reached one task hop sooner, and the freed slot does not wake the loop over an empty queue.
    model, config = TwoPathModel(), make_config()
    policy = CountingPlans(config)
    batcher = DynamicBatcher(config, model.shared, dispatch_lone=model.lone, policy=policy)
    batcher.start()
    await until(lambda: policy.num_plans == 1)  # the loop's first plan: an empty queue
    for i, value in enumerate((1.0, 2.0)):
        submitted = asyncio.create_task(batcher.submit({"x": rows(value)}))
        turns = 0
        while len(model.paths) == i and turns < 10:
            await asyncio.sleep(0)
            turns += 1
        assert turns == 2  # the submit's turn, then its batch task's (through the loop: 3)
        assert float((await submitted).outputs["y"][0, 0]) == 2 * value
        for _ in range(5):
            await asyncio.sleep(0)
    assert policy.num_plans == 3  # the loop's first, then each request's own: nothing more
    assert model.paths == [("lone", 1)] * 2
    await batcher.stop()


async def test_requests_submitted_in_one_turn_into_an_idle_batcher_form_one_batch() -> None:
    model = TwoPathModel()
    batcher = started(model)
    results = await asyncio.gather(*(batcher.submit({"x": rows(v)}) for v in (1.0, 2.0, 3.0)))
    assert [float(r.outputs["y"][0, 0]) for r in results] == [2.0, 4.0, 6.0]
    assert model.paths == [("shared", 3)]
    await batcher.stop()
