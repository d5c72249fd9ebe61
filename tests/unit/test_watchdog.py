"""The execution watchdog: a backend call past the limit fails its batch, sets its instance aside.

Issue 9, finding 3: a hung backend's batch and every later request to that model hung, while
readiness stayed 200. Backends here block on a threading.Event the test releases at the end; the
limits are small, and the tests assert outcomes, never timings.
"""

from __future__ import annotations

import asyncio
import threading

import msgspec
import numpy as np
import pytest

from fulcrum.batcher import DynamicBatcher
from fulcrum.config import DynamicBatching, Instances, ModelConfig, TensorSpec, validate
from fulcrum.errors import ConfigError, ExecutionTimeout, ModelError, Unavailable
from fulcrum.instances import InstancePool
from fulcrum.types import TensorMap

WAIT_S = 10.0  # a hang guard for thread hand-offs, never a speed assertion
LIMIT_S = 0.2  # generous for a busy 2-core machine: a normal call must never reach it
HANG = -1.0  # a batch holding this value blocks until the test releases it


class HangingBackend:
    """y = x + 1; a batch holding HANG blocks on `release` (a stuck GPU call, a deadlock)."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.threads: list[str] = []
        self.closed = threading.Event()

    def execute(self, inputs: TensorMap) -> TensorMap:
        self.threads.append(threading.current_thread().name)
        if np.any(inputs["x"] == HANG) and not self.release.wait(WAIT_S):
            raise TimeoutError("never released")
        return {"y": inputs["x"] + 1}

    def close(self) -> None:
        self.closed.set()


def x(value: float) -> TensorMap:
    return {"x": np.full((1, 1), value, np.float32)}


async def recovered(pool: InstancePool) -> None:
    """Wait until the hung calls have returned and their instances are back in service."""
    for _ in range(int(WAIT_S / 0.01)):
        if pool.num_hung == 0:
            return
        await asyncio.sleep(0.01)  # a hand-off from threads: a hang guard, not a timing
    raise AssertionError("hung instances never came back")


async def test_a_hung_call_fails_its_batch_and_later_batches_use_the_other_instance(
    release: threading.Event,
) -> None:
    backends = [HangingBackend(release), HangingBackend(release)]
    pool = InstancePool(backends, name="m/1", execution_timeout_s=LIMIT_S)
    with pytest.raises(ExecutionTimeout) as info:
        await asyncio.wait_for(pool.run(x(HANG)), WAIT_S)
    assert info.value.status_code == 500
    assert "exceeded its execution limit of 200 ms" in info.value.message
    assert (pool.num_hung, pool.is_healthy) == (1, True)
    hung_thread = next(b for b in backends if b.threads).threads[0]

    for value in (1.0, 2.0, 3.0):
        assert (await asyncio.wait_for(pool.run(x(value)), WAIT_S))["y"][0, 0] == value + 1
    healthy = next(b for b in backends if hung_thread not in b.threads)
    assert len(healthy.threads) == 3  # every later batch went to the instance not stuck

    with pytest.raises(ExecutionTimeout):
        await asyncio.wait_for(pool.run(x(HANG)), WAIT_S)
    assert (pool.num_hung, pool.is_healthy) == (2, False)
    with pytest.raises(Unavailable, match="no healthy instance") as refused:
        await pool.run(x(4.0))  # at once: nothing will ever free an instance for it
    assert refused.value.status_code == 503
    assert sum(len(b.threads) for b in backends) == 5

    release.set()
    await recovered(pool)
    assert pool.is_healthy and pool.num_free == 2
    assert (await asyncio.wait_for(pool.run(x(5.0)), WAIT_S))["y"][0, 0] == 6
    pool.close()


async def test_batches_waiting_for_an_instance_fail_fast_when_the_last_one_hangs(
    release: threading.Event,
) -> None:
    pool = InstancePool([HangingBackend(release)], name="m/1", execution_timeout_s=LIMIT_S)
    hung = asyncio.create_task(pool.run(x(HANG)))
    waiting = asyncio.create_task(pool.run(x(1.0)))
    outcomes = await asyncio.wait_for(asyncio.gather(hung, waiting, return_exceptions=True), WAIT_S)
    assert isinstance(outcomes[0], ExecutionTimeout)
    assert isinstance(outcomes[1], Unavailable)
    assert not pool.is_healthy
    release.set()
    await recovered(pool)
    pool.close()


async def test_a_hung_model_behind_the_batcher_fails_its_batch_then_refuses_with_503(
    release: threading.Event,
) -> None:
    config = ModelConfig(
        name="m",
        platform="echo",
        max_batch_size=8,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(1,)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(1,)),),
        dynamic_batching=DynamicBatching(),
        instances=Instances(count=2, execution_timeout_ms=LIMIT_S * 1000),
    )
    limit_s = config.instances.execution_timeout_ms / 1000
    backends = [HangingBackend(release), HangingBackend(release)]
    pool = InstancePool(backends, name="m/1", execution_timeout_s=limit_s)
    batcher = DynamicBatcher(config, pool.run)
    batcher.start()
    # A batch of several requests, one of them hangs: all fail with the limit's error, and the
    # batch is not re-run, which would hang the other instance as well.
    together = [batcher.submit(x(v)) for v in (1.0, HANG, 2.0)]
    outcomes = await asyncio.wait_for(asyncio.gather(*together, return_exceptions=True), WAIT_S)
    for outcome in outcomes:
        assert isinstance(outcome, ExecutionTimeout) and isinstance(outcome, ModelError)
        assert "execution limit of 200 ms" in outcome.message
    assert (pool.num_hung, pool.is_healthy) == (1, True)
    assert (await asyncio.wait_for(batcher.submit(x(3.0)), WAIT_S)).outputs["y"][0, 0] == 4

    with pytest.raises(ExecutionTimeout):
        await asyncio.wait_for(batcher.submit(x(HANG)), WAIT_S)
    assert not pool.is_healthy
    with pytest.raises(Unavailable) as refused:
        await asyncio.wait_for(batcher.submit(x(5.0)), WAIT_S)
    assert refused.value.status_code == 503
    await batcher.stop()
    release.set()
    await recovered(pool)
    pool.close()


async def test_close_does_not_wait_for_a_hung_instance(release: threading.Event) -> None:
    backend = HangingBackend(release)
    pool = InstancePool([backend], name="m/1", execution_timeout_s=LIMIT_S)
    with pytest.raises(ExecutionTimeout):
        await asyncio.wait_for(pool.run(x(HANG)), WAIT_S)
    await asyncio.wait_for(asyncio.to_thread(pool.close), WAIT_S)
    assert not backend.closed.is_set()  # its thread still uses it
    release.set()
    assert await asyncio.to_thread(backend.closed.wait, WAIT_S)  # closed once it returned


async def test_without_a_limit_a_slow_call_is_left_alone(release: threading.Event) -> None:
    pool = InstancePool([HangingBackend(release)], name="m/1", execution_timeout_s=0)
    assert pool.execution_timeout_s is None
    slow = asyncio.create_task(pool.run(x(HANG)))
    done, _ = await asyncio.wait({slow}, timeout=3 * LIMIT_S)
    assert not done and pool.num_hung == 0 and pool.is_healthy
    release.set()
    assert (await asyncio.wait_for(slow, WAIT_S))["y"][0, 0] == 0
    pool.close()


def test_execution_limit_defaults_to_60_s_and_refuses_negative_values() -> None:
    assert Instances().execution_timeout_ms == 60000
    config = ModelConfig(name="m", platform="echo")
    validate(msgspec.structs.replace(config, instances=Instances(execution_timeout_ms=0)))
    for bad in (-1.0, float("nan")):
        broken = msgspec.structs.replace(config, instances=Instances(execution_timeout_ms=bad))
        with pytest.raises(ConfigError, match=r"instances\.execution_timeout_ms"):
            validate(broken)
