"""`Service.early_refusal`: the 503 an overloaded batch model gives from a request's headers,
before its body is read, and where it must leave the decision to the full path."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from fulcrum.context import RequestContext
from fulcrum.errors import QueueFull
from fulcrum.protocol.request import InferRequest
from fulcrum.service import Service

SLOW_ECHO = """platform = "echo"
max_batch_size = 1
inputs = [{{name = "x", datatype = "FP32", shape = [1]}}]
outputs = [{{name = "x", datatype = "FP32", shape = [1]}}]
[parameters]
latency_a_ms = 300
[dynamic_batching]
default_queue_policy = {{max_queue_size = 1}}
{extra}
"""


def write_model(root: Path, name: str, extra: str = "") -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.toml").write_text(SLOW_ECHO.format(extra=extra))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_model(tmp_path, "slow")
    write_model(tmp_path, "cached", "[cache]\nexact = true")
    return tmp_path


def ctx() -> RequestContext:
    return RequestContext(request_id="r", tenant="t", api="v2")


def request() -> InferRequest:
    x = np.ones((1, 1), np.float32)
    return InferRequest(None, {"x": x}, (), False, None, None, {})


async def fill(service: Service, name: str) -> list[asyncio.Task[object]]:
    """One request running (300 ms) and one queued: the queue (bound 1) is full."""
    tasks: list[asyncio.Task[object]] = []
    for _ in range(2):
        tasks.append(asyncio.ensure_future(service.infer(ctx(), name, None, request())))
        await asyncio.sleep(0.02)
    return tasks


async def test_a_full_queue_is_refused_from_the_headers_and_counted(service: Service) -> None:
    assert service.early_refusal(ctx(), "slow", None) is None  # idle: read the body
    tasks = await fill(service, "slow")
    refusal = service.early_refusal(ctx(), "slow", None)
    assert isinstance(refusal, QueueFull)
    assert refusal.status_code == 503 and refusal.headers()["Retry-After"].isdigit()
    stats = service.statistics(ctx(), "slow", None)["model_stats"][0]
    assert stats["policy"]["shed"]["queue_full"] == 1  # counted as the full path counts it
    await asyncio.gather(*tasks)
    assert service.early_refusal(ctx(), "slow", None) is None  # drained: admitted again


async def test_the_full_path_decides_where_the_headers_cannot(service: Service) -> None:
    tasks = await fill(service, "cached")
    assert service.early_refusal(ctx(), "cached", None) is None  # a cache hit needs no queue
    assert service.early_refusal(ctx(), "nope", None) is None  # unknown: the full path's 404
    await asyncio.gather(*tasks)
