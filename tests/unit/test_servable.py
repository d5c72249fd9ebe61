"""BatchServable: canonical shapes batch together; an unloaded version leaves no metric series
and nothing that keeps it alive."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import msgspec
import numpy as np
import pytest
from prometheus_client import generate_latest

from fulcrum.config import DynamicBatching, ModelConfig, TensorSpec
from fulcrum.errors import ConfigError, ModelError
from fulcrum.metrics import ServerMetrics
from fulcrum.protocol import validate_inputs
from fulcrum.servable import BatchServable


def column_config(max_batch_size: int = 6) -> ModelConfig:
    return ModelConfig(
        name="col",
        platform="echo",
        max_batch_size=max_batch_size,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(1,)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(1,)),),
        # Batches run when full: the two requests below fill one exactly.
        dynamic_batching=DynamicBatching(max_queue_delay_ms=5000),
    )


async def test_n_and_n_by_1_requests_batch_together_and_get_equal_answers(tmp_path: Path) -> None:
    config = column_config()
    servable = await BatchServable.load(config, 1, tmp_path, ServerMetrics().for_model("col", 1))
    values = np.array([1.5, -2.0, 3.25], np.float32)
    flat = validate_inputs(config, {"x": values})  # [3]
    column = validate_inputs(config, {"x": values.reshape(3, 1)})  # [3, 1]
    try:
        a, b = await asyncio.gather(
            servable.infer(flat, priority=None, timeout_s=None),
            servable.infer(column, priority=None, timeout_s=None),
        )
    finally:
        await servable.stop()
    assert a.batch_size == b.batch_size == 6  # one batch, not two
    assert a.compute_s == b.compute_s
    np.testing.assert_array_equal(a.outputs["y"], b.outputs["y"])
    assert a.outputs["y"].shape == (3, 1)
    assert servable.stats.execution_count == 1


async def load_cycle(metrics: ServerMetrics, tmp_path: Path, version: int) -> tuple[int, int]:
    """Load a version, serve one request, stop it: /metrics size while loaded and after."""
    config = column_config(max_batch_size=1)
    servable = await BatchServable.load(config, version, tmp_path,
                                        metrics.for_model("col", version))  # fmt: skip
    await servable.infer({"x": np.ones((1, 1), np.float32)}, priority=None, timeout_s=None)
    loaded = len(generate_latest(metrics.registry))
    await servable.stop()
    return loaded, len(generate_latest(metrics.registry))


async def test_load_stop_cycles_of_new_versions_leave_metrics_flat(tmp_path: Path) -> None:
    metrics = ServerMetrics()
    empty = len(generate_latest(metrics.registry))
    sizes = [await load_cycle(metrics, tmp_path, version) for version in range(1, 10)]
    assert all(after == empty for _, after in sizes)
    assert all(loaded > empty for loaded, _ in sizes)
    assert metrics.num_versions == 0


async def test_a_stopped_servable_is_not_kept_alive(tmp_path: Path) -> None:
    metrics = ServerMetrics()
    servable = await BatchServable.load(column_config(1), 1, tmp_path,
                                        metrics.for_model("col", 1))  # fmt: skip
    await servable.infer({"x": np.ones((1, 1), np.float32)}, priority=None, timeout_s=None)
    ref = weakref.ref(servable)
    await servable.stop()
    assert not servable.is_ready
    del servable
    gc.collect()
    assert ref() is None  # no gauge callback or registry entry holds it


async def test_the_gauges_read_the_live_servable(tmp_path: Path) -> None:
    metrics = ServerMetrics()
    servable = await BatchServable.load(column_config(), 1, tmp_path,
                                        metrics.for_model("col", 1))  # fmt: skip
    task = asyncio.ensure_future(
        servable.infer({"x": np.ones((2, 1), np.float32)}, priority=None, timeout_s=None)
    )
    await asyncio.sleep(0)  # let it queue: the batch waits to fill
    labels = {"model": "col", "version": "1", "variant": "default"}
    assert metrics.registry.get_sample_value("fulcrum_queue_depth", labels) == 1.0
    assert metrics.registry.get_sample_value("fulcrum_inflight_requests", labels) == 1.0
    filler = servable.infer({"x": np.ones((4, 1), np.float32)}, priority=None, timeout_s=None)
    await filler  # fills the batch: both run
    assert (await task).outputs["y"].shape == (2, 1)
    assert metrics.registry.get_sample_value("fulcrum_queue_depth", labels) == 0.0
    await servable.stop()
    assert metrics.registry.get_sample_value("fulcrum_queue_depth", labels) is None


async def test_a_failed_load_releases_its_series(tmp_path: Path) -> None:
    metrics = ServerMetrics()
    broken = ModelConfig(name="broken", platform="onnx", max_batch_size=1)  # no model file
    with pytest.raises(ConfigError):
        await BatchServable.load(broken, 1, tmp_path, metrics.for_model("broken", 1))
    assert metrics.num_versions == 0
    assert 'model="broken"' not in generate_latest(metrics.registry).decode()


async def test_a_failed_batch_leaves_no_unretrieved_exception_behind(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    params: dict[str, str | int | float | bool | list[str]] = {"fail_value": -1.0}
    config = msgspec.structs.replace(column_config(1), parameters=params)
    servable = await BatchServable.load(config, 1, tmp_path, ServerMetrics().for_model("col", 1))
    try:
        await servable.infer({"x": -np.ones((1, 1), np.float32)}, priority=None, timeout_s=None)
    except ModelError:
        pass  # not kept: its traceback would keep the batch's futures alive
    else:
        pytest.fail("the batch should have failed")
    await servable.stop()
    gc.collect()  # a future whose exception nobody read logs an error when collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


async def test_isolation_reruns_count_as_executions_and_in_metrics(tmp_path: Path) -> None:
    """A batch of 4 with one poisoned request: the 3 innocent ones are answered by re-runs,
    which statistics count as executions and metrics as extra dispatches."""
    config = msgspec.structs.replace(
        column_config(max_batch_size=4), parameters={"fail_value": -1.0}
    )
    metrics = ServerMetrics()
    servable = await BatchServable.load(config, 1, tmp_path, metrics.for_model("col", 1))
    rows = [{"x": np.array([[v]], np.float32)} for v in (1.0, -1.0, 2.0, 3.0)]
    try:
        answers = await asyncio.gather(
            *(servable.infer(r, priority=None, timeout_s=None) for r in rows),
            return_exceptions=True,
        )
        labels = {
            "model": "col",
            "version": "1",
            "variant": "default",
        }  # read before stop() removes the series
        retried = metrics.registry.get_sample_value("fulcrum_isolation_dispatches_total", labels)
    finally:
        await servable.stop()
    assert [type(a).__name__ for a in answers] == [
        "InferResult", "ModelError", "InferResult", "InferResult"
    ]  # fmt: skip
    stats = servable.stats.to_json("col", 1)
    # first dispatch (4 rows) failed; re-runs [1, -1] failed, [1] ok, [-1] failed, [2, 3] ok
    assert stats["execution_count"] == 2
    assert stats["inference_count"] == 3
    assert retried == 4
