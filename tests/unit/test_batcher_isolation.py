"""Failure isolation: a failed batch is re-run in halves, so a failure stays with its request.

Issue 9, finding 6: a model exception failed all 32 requests of a batch, and the innocent 31
received the poison request's error text. A fake model that fails on poisoned rows; no sleeps.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from fulcrum.backends.echo import EchoBackend
from fulcrum.batcher import BatchRecord, DynamicBatcher, InferResult
from fulcrum.config import DynamicBatching, Instances, ModelConfig, TensorSpec
from fulcrum.errors import ExecutionTimeout, InvalidInput, ModelError, Unavailable
from fulcrum.instances import InstancePool
from fulcrum.isolation import isolate
from fulcrum.types import TensorMap

BLOCKER = 1000.0  # the value of a request that holds the model while a batch forms
WAIT_S = 10.0  # a hang guard for thread hand-offs, never a speed assertion


def make_config(max_batch_size: int = 64) -> ModelConfig:
    return ModelConfig(
        name="m",
        platform="echo",
        max_batch_size=max_batch_size,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(2,)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(2,)),),
        dynamic_batching=DynamicBatching(),
    )


class PoisonModel:
    """Fake dispatch: y = 2x + 1, row by row, so a request's answer never depends on its batch.

    A batch holding a poisoned value raises, its message quoting that value (as a real
    backend's message quotes the bad input); a batch whose values are a key of `holds` waits
    for that event first.
    """

    def __init__(self, poison: dict[float, Callable[[str], Exception]]) -> None:
        self.poison = poison
        self.batches: list[list[float]] = []
        self.holds: dict[tuple[float, ...], asyncio.Event] = {}
        self.num_held = 0

    async def __call__(self, inputs: TensorMap) -> TensorMap:
        x = inputs["x"]
        values = [float(v) for v in x[:, 0]]
        self.batches.append(values)
        hold = self.holds.get(tuple(values))
        if hold is not None:
            self.num_held += 1
            try:
                await hold.wait()
            finally:
                self.num_held -= 1
        for value in values:
            if value in self.poison:
                raise self.poison[value](f"cannot process row value {value:g}")
        return {"y": x * 2 + 1}


def request(value: float, num_rows: int = 1) -> TensorMap:
    return {"x": np.full((num_rows, 2), value, dtype=np.float32)}


async def until(condition: Callable[[], bool]) -> None:
    """Let other tasks run until `condition` holds (scheduling steps, not wall-clock time)."""
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def batch_of(
    batcher: DynamicBatcher, model: PoisonModel, inputs: list[TensorMap]
) -> list[asyncio.Task[InferResult]]:
    """Submit `inputs` while a blocker holds the model, so they run as one batch; then go."""
    gate = model.holds[(BLOCKER,)] = asyncio.Event()
    blocker = asyncio.create_task(batcher.submit(request(BLOCKER)))
    await until(lambda: model.num_held == 1)
    tasks = [asyncio.create_task(batcher.submit(one)) for one in inputs]
    await until(lambda: batcher.queue_depth == len(inputs))
    gate.set()
    await blocker
    return tasks


def num_rows_of(i: int) -> int:
    return 1 + i % 2  # requests of 1 and 2 rows, so halves split by rows, not by count


async def test_one_poisoned_request_among_32_fails_alone_31_get_their_single_answers() -> None:
    model = PoisonModel({7.0: RuntimeError})
    records: list[BatchRecord] = []
    batcher = DynamicBatcher(make_config(), model, on_batch=records.append)
    batcher.start()
    inputs = [request(float(i), num_rows_of(i)) for i in range(32)]
    alone = [await batcher.submit(one) for i, one in enumerate(inputs) if i != 7]
    num_before = len(model.batches)
    tasks = await batch_of(batcher, model, inputs)
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)

    poisoned = outcomes.pop(7)
    assert isinstance(poisoned, ModelError) and poisoned.status_code == 500
    assert "row value 7" in poisoned.message
    assert isinstance(poisoned.__cause__, RuntimeError)
    for single, batched in zip(alone, outcomes, strict=True):
        assert isinstance(batched, InferResult), batched
        np.testing.assert_array_equal(batched.outputs["y"], single.outputs["y"])
    assert len(model.batches[num_before + 1]) == 48  # the 32 ran together first: 48 rows
    # One failing request among 32: two re-runs per level, five levels.
    num_retries = len(model.batches) - num_before - 2  # less the blocker and the first run
    assert num_retries == 2 * math.ceil(math.log2(32))
    [record] = [r for r in records if r.num_requests == 32]
    assert (record.num_requests, record.batch_size, record.failed) == (32, 48, True)
    assert record.num_retried_dispatches == num_retries
    assert record.num_isolated_failures == 1
    assert record.retry_compute_s >= 0
    await batcher.stop()


async def test_each_poisoned_request_gets_the_error_of_its_own_run_and_nobody_else_does() -> None:
    model = PoisonModel({3.0: RuntimeError, 20.0: InvalidInput})
    batcher = DynamicBatcher(make_config(), model)
    batcher.start()
    tasks = await batch_of(batcher, model, [request(float(i)) for i in range(32)])
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    errors = {i: o for i, o in enumerate(outcomes) if isinstance(o, Exception)}
    assert sorted(errors) == [3, 20]
    assert isinstance(errors[3], ModelError) and "row value 3" in errors[3].message
    assert isinstance(errors[20], InvalidInput) and errors[20].status_code == 400
    assert "row value 20" in errors[20].message
    for i, outcome in enumerate(outcomes):
        if i not in errors:
            assert isinstance(outcome, InferResult)
            np.testing.assert_array_equal(outcome.outputs["y"], request(2.0 * i + 1)["x"])
    assert len(model.batches) - 2 <= 2 * 2 * math.ceil(math.log2(32))
    await batcher.stop()


@pytest.mark.parametrize(("num_items", "poisoned"), [(2, {0}), (3, {2}), (7, {3}), (33, {32})])
async def test_isolation_costs_at_most_two_runs_per_level_per_failing_request(
    num_items: int, poisoned: set[int]
) -> None:
    runs: list[list[int]] = []
    answered: dict[int, str] = {}

    async def run(group: list[int]) -> None:
        runs.append(group)
        bad = [i for i in group if i in poisoned]
        if bad:
            raise RuntimeError(f"item {bad[0]}")
        answered.update(dict.fromkeys(group, "ok"))

    def fail(group: list[int], error: Exception) -> None:
        answered.update(dict.fromkeys(group, str(error)))

    await isolate(list(range(num_items)), run, fail, lambda _: True)
    assert answered == {i: f"item {i}" if i in poisoned else "ok" for i in range(num_items)}
    assert len(runs) <= 2 * math.ceil(math.log2(num_items)) * len(poisoned)


async def test_a_model_that_fails_everything_costs_at_most_2n_minus_2_reruns() -> None:
    runs: list[list[int]] = []
    failed: dict[int, str] = {}

    async def run(group: list[int]) -> None:
        runs.append(group)
        raise RuntimeError(f"items {group}")

    def fail(group: list[int], error: Exception) -> None:
        failed.update(dict.fromkeys(group, str(error)))

    await isolate(list(range(16)), run, fail, lambda _: True)
    assert failed == {i: f"items [{i}]" for i in range(16)}  # each its own run's error
    assert len(runs) == 2 * 16 - 2


async def test_a_hung_or_vanished_model_is_not_run_again() -> None:
    for error in (ExecutionTimeout, Unavailable):
        model = PoisonModel({5.0: error})
        batcher = DynamicBatcher(make_config(), model)
        batcher.start()
        tasks = await batch_of(batcher, model, [request(float(i)) for i in range(8)])
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(o, error) for o in outcomes)
        assert len(model.batches) == 2  # the blocker and the batch: no re-run
        await batcher.stop()


async def test_a_caller_cancelled_during_isolation_is_not_run_again() -> None:
    model = PoisonModel({2.0: RuntimeError})
    batcher = DynamicBatcher(make_config(), model)
    batcher.start()
    first_half = model.holds[(1.0, 2.0, 3.0, 4.0)] = asyncio.Event()
    tasks = await batch_of(batcher, model, [request(float(v)) for v in range(1, 9)])
    await until(lambda: model.num_held == 1)  # the first half's re-run is running
    tasks[2].cancel()  # value 3: running now; its result is dropped
    tasks[5].cancel()  # value 6: in the half not yet re-run
    first_half.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert tasks[2].cancelled() and tasks[5].cancelled()
    assert isinstance(outcomes[1], ModelError)
    for i in (0, 3, 4, 6, 7):
        assert isinstance(outcomes[i], InferResult)
        np.testing.assert_array_equal(outcomes[i].outputs["y"], request(2.0 * (i + 1) + 1)["x"])
    reruns = model.batches[3:]
    assert all(6.0 not in batch for batch in reruns)
    assert all(3.0 not in batch for batch in reruns)  # not re-run after its cancel either
    assert batcher.num_in_flight == 0
    await batcher.stop()


async def test_queued_requests_wait_while_the_reruns_hold_the_batch_slot() -> None:
    model = PoisonModel({1.0: RuntimeError})
    batcher = DynamicBatcher(make_config(), model)  # one instance: one batch at a time
    batcher.start()
    rerun = model.holds[(0.0, 1.0)] = asyncio.Event()
    tasks = await batch_of(batcher, model, [request(float(v)) for v in range(4)])
    await until(lambda: model.num_held == 1)
    later = asyncio.create_task(batcher.submit(request(9.0)))
    await until(lambda: batcher.queue_depth == 1)
    for _ in range(20):
        await asyncio.sleep(0)
    assert batcher.queue_depth == 1 and all(9.0 not in b for b in model.batches)
    rerun.set()
    np.testing.assert_array_equal((await later).outputs["y"], request(19.0)["x"])
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert [type(o).__name__ for o in outcomes] == [
        "InferResult",
        "ModelError",
        "InferResult",
        "InferResult",
    ]
    assert model.batches[-1] == [9.0]  # it ran only after the isolation finished
    await batcher.stop()


async def test_stop_during_isolation_resolves_every_future_exactly_once() -> None:
    model = PoisonModel({1.0: RuntimeError})
    batcher = DynamicBatcher(make_config(), model)
    batcher.start()
    model.holds[(2.0, 3.0)] = asyncio.Event()  # the second half's re-run never finishes
    tasks = await batch_of(batcher, model, [request(float(v)) for v in range(4)])
    await until(lambda: model.num_held == 1)
    await batcher.stop(drain_timeout_s=0.01)
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(outcomes[0], InferResult)
    assert isinstance(outcomes[1], ModelError)
    for stopped in outcomes[2:]:
        assert isinstance(stopped, Unavailable) and "stopped while running" in stopped.message
    assert batcher.num_in_flight == 0


async def test_without_isolation_a_batch_fails_as_one_with_a_neutral_error() -> None:
    model = PoisonModel({1.0: RuntimeError})
    batcher = DynamicBatcher(make_config(), model, isolate_failures=False)
    batcher.start()
    tasks = await batch_of(batcher, model, [request(float(v)) for v in range(4)])
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    for outcome in outcomes:
        assert isinstance(outcome, ModelError)
        assert "batch of 4 requests" in outcome.message
        assert "row value" not in outcome.message  # that text may quote another request
    assert len(model.batches) == 2  # the blocker and the batch: nothing re-run
    alone = PoisonModel({1.0: RuntimeError})
    single = DynamicBatcher(make_config(), alone, isolate_failures=False)
    single.start()
    with pytest.raises(ModelError, match="row value 1"):  # alone, its own error as before
        await single.submit(request(1.0))
    await asyncio.gather(batcher.stop(), single.stop())


async def test_a_real_pool_answers_31_of_32_when_one_request_makes_the_model_raise() -> None:
    config = msgspec.structs.replace(
        make_config(), instances=Instances(count=2), parameters={"fail_value": -1.0}
    )
    backends = [EchoBackend(config), EchoBackend(config)]
    pool = InstancePool(backends, name="m/1", execution_timeout_s=WAIT_S)
    records: list[BatchRecord] = []
    batcher = DynamicBatcher(config, pool.run, on_batch=records.append)
    batcher.start()
    values = [-1.0 if i == 13 else float(i) for i in range(32)]
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(batcher.submit(request(v)) for v in values), return_exceptions=True),
        WAIT_S,
    )
    for value, outcome in zip(values, outcomes, strict=True):
        if value == -1.0:
            assert isinstance(outcome, ModelError) and "fail_value" in outcome.message
        else:
            assert isinstance(outcome, InferResult), outcome
            np.testing.assert_array_equal(outcome.outputs["y"], request(value)["x"])
    assert sum(r.num_isolated_failures for r in records) == 1
    assert sum(r.num_requests for r in records) == 32
    await batcher.stop()
    pool.close()
