"""ModelStats follows Triton's statistics extension: per-request durations, rows as inferences,
batches as executions; a batched run's statistics equal the sum of its requests' own timings."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from fulcrum.batcher import InferResult
from fulcrum.config import DynamicBatching, ModelConfig, TensorSpec
from fulcrum.errors import ModelError
from fulcrum.metrics import ServerMetrics
from fulcrum.servable import BatchServable
from fulcrum.stats import Duration, ModelStats, to_ns


def echo_config(max_batch_size: int = 8, **parameters: float) -> ModelConfig:
    return ModelConfig(
        name="echo",
        platform="echo",
        max_batch_size=max_batch_size,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(2,)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(2,)),),
        # A long delay: batches run when full, so every request here shares a batch.
        dynamic_batching=DynamicBatching(max_queue_delay_ms=5000),
        parameters=dict(parameters),
    )


def rows(num_rows: int, start: float) -> dict[str, np.ndarray]:
    return {"x": np.arange(start, start + 2 * num_rows, dtype=np.float32).reshape(num_rows, 2)}


def test_to_ns_rounds_to_the_nearest_nanosecond() -> None:
    assert to_ns(1.5e-9) == 2 and to_ns(0.25) == 250_000_000 and to_ns(0.0) == 0


def test_each_request_adds_its_batchs_whole_compute_time() -> None:
    stats = ModelStats()
    for _ in range(4):  # four one-row requests that shared one 4-row batch of 10 ms
        stats.record_success(1, total_s=0.015, queue_s=0.003, compute_s=0.010)
    stats.record_execution(4, 0.010)
    assert stats.compute_infer == Duration(4, 40_000_000)  # per request: 10 ms each
    assert stats.queue == Duration(4, 12_000_000)
    assert stats.success == Duration(4, 60_000_000)
    assert stats.inference_count == 4 and stats.execution_count == 1
    assert stats.batches == {4: Duration(1, 10_000_000)}  # per execution


def test_inference_count_counts_rows_and_failures_count_nothing_else() -> None:
    stats = ModelStats()
    stats.record_success(3, total_s=0.01, queue_s=0.0, compute_s=0.005)
    stats.record_failure(0.002)
    out = stats.to_json("m", 2)
    assert out["inference_count"] == 3  # "each inference in a batched request" counts
    inference = out["inference_stats"]
    assert isinstance(inference, dict)
    assert inference["success"] == {"count": 1, "ns": 10_000_000}
    assert inference["fail"] == {"count": 1, "ns": 2_000_000}
    assert inference["queue"]["count"] == 1 and inference["compute_infer"]["count"] == 1
    assert out["execution_count"] == 0 and out["batch_stats"] == []


async def test_statistics_of_a_batched_run_equal_the_sum_of_the_requests_own_timings(
    tmp_path: Path,
) -> None:
    metrics = ServerMetrics()
    servable = await BatchServable.load(echo_config(), 1, tmp_path, metrics.for_model("echo", 1))
    sizes = [1, 2, 1, 1, 2, 1, 2, 1, 1, 4]  # 16 rows: two full batches of 8, in arrival order
    try:
        results: list[InferResult] = await asyncio.gather(
            *(
                servable.infer(rows(n, 100 * i), priority=None, timeout_s=None)
                for i, n in enumerate(sizes)
            )
        )
    finally:
        await servable.stop()
    for i, (n, result) in enumerate(zip(sizes, results, strict=True)):
        np.testing.assert_array_equal(result.outputs["y"], rows(n, 100 * i)["x"])
    batches = {(r.compute_s, r.batch_size) for r in results}  # one entry per execution
    assert len(batches) < len(results)  # requests did share batches

    stats = servable.stats
    assert stats.success.count == len(sizes) and stats.fail.count == 0
    assert stats.queue == Duration(len(sizes), sum(to_ns(r.queue_s) for r in results))
    assert stats.compute_infer == Duration(len(sizes), sum(to_ns(r.compute_s) for r in results))
    assert stats.success.ns >= stats.queue.ns + stats.compute_infer.ns
    assert stats.inference_count == sum(sizes) == 16
    assert stats.execution_count == len(batches)
    by_size: dict[int, Duration] = {}
    for compute_s, batch_size in batches:
        by_size.setdefault(batch_size, Duration()).add(compute_s)
    assert dict(stats.batches) == by_size
    assert sum(size * d.count for size, d in stats.batches.items()) == stats.inference_count


async def test_a_failed_request_counts_as_a_failure_and_not_an_execution(tmp_path: Path) -> None:
    metrics = ServerMetrics()
    config = echo_config(max_batch_size=1, fail_value=-1.0)
    servable = await BatchServable.load(config, 1, tmp_path, metrics.for_model("echo", 1))
    try:
        with pytest.raises(ModelError):
            await servable.infer({"x": np.full((1, 2), -1.0, np.float32)}, priority=None,
                                 timeout_s=None)  # fmt: skip
        await servable.infer(rows(1, 0), priority=None, timeout_s=None)
    finally:
        await servable.stop()
    stats = servable.stats
    assert stats.fail.count == 1 and stats.success.count == 1
    assert stats.compute_infer.count == 1 and stats.queue.count == 1
    assert stats.inference_count == 1 and stats.execution_count == 1
    assert stats.batches.keys() == {1}
