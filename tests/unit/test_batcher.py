"""DynamicBatcher: batches form while the model is busy, outputs split per request, every future
resolves once on every path. A gated fake model decides when each batch finishes; no sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from fulcrum.backends.echo import EchoBackend
from fulcrum.batcher import BatchRecord, DynamicBatcher, InferResult
from fulcrum.config import DynamicBatching, Instances, ModelConfig, QueuePolicy, TensorSpec
from fulcrum.errors import DeadlineExceeded, InvalidInput, ModelError, QueueFull, Unavailable
from fulcrum.instances import InstancePool
from fulcrum.types import FakeClock, TensorMap


def make_config(
    max_batch_size: int = 8,
    *,
    shape: tuple[int, ...] = (2,),
    pad_value: float = 0.0,
    instances: int = 1,
    **batching: object,
) -> ModelConfig:
    return ModelConfig(
        name="m",
        platform="echo",
        max_batch_size=max_batch_size,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=shape, pad_value=pad_value),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=shape),),
        dynamic_batching=DynamicBatching(**batching) if max_batch_size else None,  # type: ignore[arg-type]
        instances=Instances(count=instances),
    )


class GatedModel:
    """Fake dispatch: y = 2x; each batch waits for the gate; a batch containing -1 raises."""

    def __init__(self) -> None:
        self.batches: list[np.ndarray] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.num_running = 0

    async def __call__(self, inputs: TensorMap) -> TensorMap:
        x = inputs["x"]
        self.batches.append(x)
        self.num_running += 1
        try:
            await self.gate.wait()
        finally:
            self.num_running -= 1
        if np.any(x == -1):
            raise RuntimeError("boom")
        return {"y": x * 2}


def rows(*values: float, width: int = 2) -> np.ndarray:
    return np.array([[v] * width for v in values], dtype=np.float32)


async def until(condition: Callable[[], bool]) -> None:
    """Let other tasks run until `condition` holds (scheduling steps, not wall-clock time)."""
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


async def started(config: ModelConfig, model: GatedModel, **kwargs: object) -> DynamicBatcher:
    batcher = DynamicBatcher(config, model, **kwargs)  # type: ignore[arg-type]
    batcher.start()
    return batcher


def later(batcher: DynamicBatcher, x: np.ndarray, **kwargs: float) -> asyncio.Task[InferResult]:
    return asyncio.create_task(batcher.submit({"x": x}, **kwargs))  # type: ignore[arg-type]


async def busy(
    config: ModelConfig, **kwargs: object
) -> tuple[DynamicBatcher, GatedModel, asyncio.Task[InferResult]]:
    """A started batcher whose model holds a first request (value 0) until the gate opens."""
    model = GatedModel()
    model.gate.clear()
    batcher = await started(config, model, **kwargs)
    blocker = later(batcher, rows(0))
    await until(lambda: model.num_running == 1)
    return batcher, model, blocker


async def test_requests_accumulate_into_one_batch_while_the_model_is_busy() -> None:
    model = GatedModel()
    model.gate.clear()
    batcher = await started(make_config(8), model)
    first = later(batcher, rows(0))
    await until(lambda: len(model.batches) == 1)
    rest = [later(batcher, rows(i)) for i in range(1, 6)]
    await until(lambda: batcher.queue_depth == 5)
    assert len(model.batches) == 1
    assert batcher.num_in_flight == 1
    model.gate.set()
    results = await asyncio.gather(first, *rest)
    assert [len(b) for b in model.batches] == [1, 5]
    assert [r.batch_size for r in results] == [1, 5, 5, 5, 5, 5]
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.outputs["y"], rows(2 * i))
        assert result.queue_s >= 0 and result.compute_s >= 0
    assert batcher.num_in_flight == 0
    await batcher.stop()


async def test_batched_request_returns_exactly_what_it_returns_alone() -> None:
    model = GatedModel()
    batcher = await started(make_config(8), model)
    inputs = [rows(1), rows(2, 3, 4), rows(5, 6)]
    alone = [await batcher.submit({"x": x}) for x in inputs]
    model.gate.clear()
    blocker = later(batcher, rows(9))
    await until(lambda: model.num_running == 1)
    together = [later(batcher, x) for x in inputs]
    await until(lambda: batcher.queue_depth == 3)
    model.gate.set()
    batched = await asyncio.gather(*together)
    await blocker
    assert len(model.batches[-1]) == 6
    for one, many in zip(alone, batched, strict=True):
        assert one.batch_size < many.batch_size == 6
        np.testing.assert_array_equal(one.outputs["y"], many.outputs["y"])
    await batcher.stop()


async def test_dynamic_axis_is_padded_to_the_longest_in_the_batch() -> None:
    batcher, model, blocker = await busy(make_config(8, shape=(-1,), pad_value=7.0))
    short = later(batcher, rows(1, width=2))
    long = later(batcher, rows(2, 3, width=4))
    await until(lambda: batcher.queue_depth == 2)
    model.gate.set()
    short_result, long_result = await asyncio.gather(short, long)
    await blocker
    np.testing.assert_array_equal(
        model.batches[-1], np.array([[1, 1, 7, 7], [2, 2, 2, 2], [3, 3, 3, 3]], np.float32)
    )
    np.testing.assert_array_equal(short_result.outputs["y"], [[2, 2, 14, 14]])
    np.testing.assert_array_equal(long_result.outputs["y"], rows(4, 6, width=4))
    await batcher.stop()


async def test_incompatible_shapes_never_share_a_batch() -> None:
    batcher, model, blocker = await busy(make_config(8))  # fixed per-row shape: no padding
    a = later(batcher, rows(1, width=2))
    b = later(batcher, rows(2, width=3))
    await until(lambda: batcher.queue_depth == 2)
    model.gate.set()
    await asyncio.gather(blocker, a, b)
    assert [batch.shape for batch in model.batches] == [(1, 2), (1, 2), (1, 3)]
    await batcher.stop()


async def test_model_error_fails_only_its_request_and_the_next_batch_succeeds() -> None:
    batcher, model, blocker = await busy(make_config(2))
    bad = later(batcher, rows(-1))
    innocent = later(batcher, rows(5))  # batched with `bad`: re-run apart, answered alone
    good = [later(batcher, rows(v)) for v in (6, 7)]
    await until(lambda: batcher.queue_depth == 4)
    model.gate.set()
    with pytest.raises(ModelError) as info:
        await bad
    assert info.value.status_code == 500
    assert isinstance(info.value.__cause__, RuntimeError)
    np.testing.assert_array_equal((await innocent).outputs["y"], rows(10))
    results = await asyncio.gather(blocker, *good)
    np.testing.assert_array_equal(results[1].outputs["y"], rows(12))
    np.testing.assert_array_equal(results[2].outputs["y"], rows(14))
    assert (await batcher.submit({"x": rows(3)})).outputs["y"][0, 0] == 6
    await batcher.stop()


async def test_fulcrum_errors_from_the_model_pass_through_unchanged() -> None:
    config = msgspec.structs.replace(make_config(4), parameters={"fail_value": 13})
    pool = InstancePool([EchoBackend(config)], name="m")
    batcher = DynamicBatcher(config, pool.run)
    batcher.start()
    with pytest.raises(ModelError, match="fail_value") as info:
        await batcher.submit({"x": rows(13)})
    assert info.value.__cause__ is None
    result = await batcher.submit({"x": rows(1, 2)})
    np.testing.assert_array_equal(result.outputs["y"], rows(1, 2))
    await batcher.stop()
    pool.close()


async def test_request_that_expired_in_the_queue_gets_504_and_never_runs() -> None:
    clock = FakeClock()
    timeout = QueuePolicy(default_timeout_ms=100)
    batcher, model, running = await busy(make_config(8, default_queue_policy=timeout), clock=clock)
    late = later(batcher, rows(1))
    await until(lambda: batcher.queue_depth == 1)
    clock.advance(0.2)  # past `late`'s deadline, and also past `running`'s (it already runs)
    model.gate.set()
    with pytest.raises(DeadlineExceeded) as info:
        await late
    assert info.value.status_code == 504
    assert (await running).outputs["y"][0, 0] == 0
    assert [len(b) for b in model.batches] == [1]
    await batcher.stop()


async def test_expired_request_is_rejected_while_the_model_stays_busy() -> None:
    batcher, model, running = await busy(make_config(8))  # the real clock: a 10 ms timeout
    with pytest.raises(DeadlineExceeded):
        await batcher.submit({"x": rows(1)}, timeout_s=0.01)
    assert model.num_running == 1 and len(model.batches) == 1
    model.gate.set()
    await running
    await batcher.stop()


async def test_cancelled_queued_request_never_runs() -> None:
    batcher, model, running = await busy(make_config(8))
    doomed = later(batcher, rows(1))
    kept = later(batcher, rows(2))
    await until(lambda: batcher.queue_depth == 2)
    doomed.cancel()
    await until(lambda: batcher.queue_depth == 1)
    model.gate.set()
    await asyncio.gather(running, kept)
    assert doomed.cancelled()
    assert [b[:, 0].tolist() for b in model.batches] == [[0.0], [2.0]]
    await batcher.stop()


async def test_cancelled_running_request_drops_its_result_others_still_get_theirs() -> None:
    records: list[BatchRecord] = []
    batcher, model, a = await busy(make_config(8), on_batch=records.append)
    a.cancel()
    await until(a.done)
    model.gate.set()
    await until(lambda: len(records) == 1)
    assert a.cancelled()
    assert not records[0].failed
    assert (await batcher.submit({"x": rows(2)})).outputs["y"][0, 0] == 4
    await batcher.stop()


async def test_stop_drains_queued_and_in_flight_and_refuses_new() -> None:
    batcher, model, running = await busy(make_config(8))
    queued = later(batcher, rows(2))
    await until(lambda: batcher.queue_depth == 1)
    stopping = asyncio.create_task(batcher.stop())
    await asyncio.sleep(0)  # stop() refuses new requests from its first step
    with pytest.raises(Unavailable, match="shutting down") as info:
        await batcher.submit({"x": rows(3)})
    assert info.value.status_code == 503
    assert not stopping.done()
    model.gate.set()
    await stopping
    assert (await running).outputs["y"][0, 0] == 0
    assert (await queued).outputs["y"][0, 0] == 4


async def test_stop_fails_what_is_left_after_the_drain_timeout() -> None:
    batcher, _, running = await busy(make_config(1))  # the gate never opens: a hung model
    queued = later(batcher, rows(2))
    await until(lambda: batcher.queue_depth == 1)
    await batcher.stop(drain_timeout_s=0.01)
    for task in (running, queued):
        with pytest.raises(Unavailable):
            await task
    assert batcher.queue_depth == 0 and batcher.num_in_flight == 0


async def test_submit_before_start_is_refused_rather_than_left_hanging() -> None:
    batcher = DynamicBatcher(make_config(4), GatedModel())
    with pytest.raises(Unavailable, match="no running batcher"):
        await batcher.submit({"x": rows(1)})
    await batcher.stop()


async def test_submit_validates_rows_before_queuing() -> None:
    batcher = await started(make_config(4), GatedModel())
    with pytest.raises(InvalidInput, match=r"5 rows.*at most 4"):
        await batcher.submit({"x": rows(*range(5))})
    with pytest.raises(InvalidInput, match="rows"):
        await batcher.submit({"x": rows(1), "z": rows(1, 2)})
    with pytest.raises(InvalidInput, match="scalar"):
        await batcher.submit({"x": np.float32(1.0) * np.ones(())})
    with pytest.raises(InvalidInput, match="priority"):
        await batcher.submit({"x": rows(1)}, priority=5)
    assert batcher.queue_depth == 0
    await batcher.stop()


async def test_full_queue_rejects_at_once() -> None:
    full = QueuePolicy(max_queue_size=1)
    batcher, model, running = await busy(make_config(8, default_queue_policy=full))
    queued = later(batcher, rows(1))
    await until(lambda: batcher.queue_depth == 1)
    with pytest.raises(QueueFull):
        await batcher.submit({"x": rows(2)})
    model.gate.set()
    await asyncio.gather(running, queued)
    await batcher.stop()


async def test_higher_priority_runs_first() -> None:
    batcher, model, running = await busy(make_config(1, priority_levels=2))
    low = later(batcher, rows(1), priority=2)
    high = later(batcher, rows(2), priority=1)
    await until(lambda: batcher.queue_depth == 2)
    model.gate.set()
    await asyncio.gather(running, low, high)
    assert [b[0, 0] for b in model.batches] == [0, 2, 1]
    await batcher.stop()


async def test_on_batch_records_every_batch_including_failed_ones() -> None:
    records: list[BatchRecord] = []
    batcher = await started(make_config(8), GatedModel(), on_batch=records.append)
    await batcher.submit({"x": rows(1, 2)})
    with pytest.raises(ModelError):
        await batcher.submit({"x": rows(-1)})
    assert [(r.batch_size, r.num_requests, r.failed) for r in records] == [
        (2, 1, False),
        (1, 1, True),
    ]
    assert all(len(r.queue_s) == 1 and r.compute_s >= 0 for r in records)
    await batcher.stop()


async def test_model_without_batching_gets_whole_inputs() -> None:
    model = GatedModel()
    batcher = await started(make_config(0), model)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)  # no batch axis: any shape
    result = await batcher.submit({"x": x})
    np.testing.assert_array_equal(result.outputs["y"], x * 2)
    assert result.batch_size == 1
    await batcher.stop()


async def test_two_instances_run_two_batches_at_once() -> None:
    batcher, model, a = await busy(make_config(8, instances=2))
    b = later(batcher, rows(2))
    await until(lambda: model.num_running == 2)
    c = later(batcher, rows(3))
    await until(lambda: batcher.queue_depth == 1)
    assert model.num_running == 2
    model.gate.set()
    await asyncio.gather(a, b, c)
    await batcher.stop()


async def test_every_future_resolves_on_every_path() -> None:
    clock = FakeClock()
    model = GatedModel()
    model.gate.clear()
    timeout = QueuePolicy(default_timeout_ms=0, allow_timeout_override=True)
    batcher = await started(make_config(4, default_queue_policy=timeout), model, clock=clock)
    tasks: dict[str, asyncio.Task[InferResult]] = {}
    for i in range(24):
        value = -1.0 if i % 5 == 0 else float(i)
        timeout_s = 0.5 if i % 3 == 0 else None
        tasks[f"r{i}"] = asyncio.create_task(
            batcher.submit({"x": rows(value)}, timeout_s=timeout_s)
        )
    await until(lambda: model.num_running == 1)
    for i in range(1, 24, 7):
        tasks[f"r{i}"].cancel()
    clock.advance(1.0)
    model.gate.set()
    await until(lambda: batcher.queue_depth == 0 and batcher.num_in_flight == 0)
    await batcher.stop()
    await asyncio.wait_for(asyncio.wait(tasks.values()), timeout=10)
    kinds: set[str] = set()
    for name, task in tasks.items():
        assert task.done(), name
        if task.cancelled():
            kinds.add("cancelled")
            continue
        error = task.exception()
        if error is None:
            i = int(name[1:])
            np.testing.assert_array_equal(task.result().outputs["y"], rows(2 * i))
            kinds.add("ok")
        else:
            assert isinstance(error, (ModelError, DeadlineExceeded)), error
            kinds.add(type(error).__name__)
    assert kinds == {"ok", "cancelled", "ModelError", "DeadlineExceeded"}
