"""Overload on a real BatchServable (echo backend, a + b·batch ms): the bounded default queue
refuses the excess with 503 + Retry-After, and every admitted request gets its own rows back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from fulcrum.batcher import InferResult
from fulcrum.config import DynamicBatching, ModelConfig, TensorSpec, validate
from fulcrum.errors import QueueFull, Shed, Unavailable
from fulcrum.metrics import ServerMetrics
from fulcrum.servable import BatchServable

NUM_REQUESTS = 1500


def echo_config(**batching: object) -> ModelConfig:
    config = ModelConfig(
        name="echo",
        platform="echo",
        max_batch_size=4,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(3,)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(3,)),),
        parameters={"latency_a_ms": 1.0, "latency_b_ms": 0.25},
        dynamic_batching=DynamicBatching(**batching),  # type: ignore[arg-type]
    )
    validate(config)
    return config


def own_rows(i: int) -> np.ndarray:
    """Request i's rows: 1 to 3 rows, each naming i and its row, so a mix-up shows."""
    num_rows = 1 + i % 3
    return np.array([[i, r, -i] for r in range(num_rows)], dtype=np.float32)


async def flood(servable: BatchServable) -> list[InferResult | BaseException]:
    """Every request at once: far beyond what 1 instance drains while they arrive."""

    async def one(i: int) -> InferResult:
        return await servable.infer({"x": own_rows(i)}, priority=None, timeout_s=None)

    tasks = [asyncio.create_task(one(i)) for i in range(NUM_REQUESTS)]
    return await asyncio.gather(*tasks, return_exceptions=True)


def check(outcomes: list[InferResult | BaseException]) -> tuple[int, list[Unavailable]]:
    refused: list[Unavailable] = []
    num_ok = 0
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, InferResult):
            np.testing.assert_array_equal(outcome.outputs["y"], own_rows(i))
            num_ok += 1
        else:
            assert isinstance(outcome, QueueFull | Shed), repr(outcome)
            refused.append(outcome)
    return num_ok, refused


async def test_bounded_default_queue_sheds_the_excess_and_answers_the_rest(
    tmp_path: Path,
) -> None:
    config = echo_config(max_queue_delay_ms=1.0)  # no max_queue_size: the default bound
    servable = await BatchServable.load(config, 1, tmp_path, ServerMetrics().for_model("echo", 1))
    try:
        outcomes = await flood(servable)
    finally:
        await servable.stop()
    num_ok, refused = check(outcomes)
    bound = 64 * 4
    assert bound <= num_ok < NUM_REQUESTS  # the queue filled, and never grew past its bound
    assert len(refused) == NUM_REQUESTS - num_ok
    assert all(r.status_code == 503 and r.headers()["Retry-After"].isdigit() for r in refused)
    assert servable.stats.shed["queue_full"] == len(refused)
    assert servable.stats.inference_count == sum(1 + i % 3 for i in range(NUM_REQUESTS)) - sum(
        1 + i % 3 for i, o in enumerate(outcomes) if not isinstance(o, InferResult)
    )


async def test_adaptive_queue_bound_follows_the_measured_capacity(tmp_path: Path) -> None:
    config = echo_config(policy="adaptive", slo_p99_ms=200.0)
    metrics = ServerMetrics()
    servable = await BatchServable.load(config, 1, tmp_path, metrics.for_model("echo", 1))
    try:
        for i in range(20):  # a light warm-up: the policy learns the backend's speed
            await servable.infer({"x": own_rows(i)}, priority=None, timeout_s=None)
        outcomes = await flood(servable)
        after = [  # the flood is over: the model serves again, each caller its own rows
            await servable.infer({"x": own_rows(i)}, priority=None, timeout_s=None)
            for i in range(10)
        ]
        policy = servable.stats.to_json("echo", 1)["policy"]
        sample = metrics.registry.get_sample_value(
            "fulcrum_shed_requests_total",
            {"model": "echo", "version": "1", "variant": "default", "reason": "queue_full"},
        )
    finally:
        await servable.stop()
    _, refused = check(outcomes)  # each admitted one got its own rows back
    assert check(after) == (10, [])
    assert isinstance(policy, dict) and policy["name"] == "adaptive"
    bound = policy["queue_bound"]
    assert isinstance(bound, int) and 0 < bound < 64 * 4  # measured, tighter than the default
    shed = policy["shed"]
    assert isinstance(shed, dict) and sum(shed.values()) == len(refused)
    # Admission refuses most of the flood at once, the queue full or (batch times noisy, the
    # policy planning with their slow runs) the request predicted late on arrival; what was
    # admitted ran, or was shed late (503, not 504) when the event loop, busy admitting the
    # flood, left it too little time.
    late = policy["shed_late"]
    assert isinstance(late, int)
    assert shed.get("queue_full", 0) + shed.get("deadline", 0) - late > NUM_REQUESTS // 2
    assert sample == shed.get("queue_full", 0)
