"""InstancePool: one thread per instance, N batches at once, waiting for a free instance."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from fulcrum.instances import InstancePool
from fulcrum.types import TensorMap

WAIT_S = 10.0  # a hang guard for thread hand-offs, never a speed assertion


class BlockingBackend:
    """Records its thread, then blocks until released; y = x + 1."""

    def __init__(self, barrier: threading.Barrier | None = None) -> None:
        self.barrier = barrier
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        self.threads: list[str] = []
        self.closed = False

    def execute(self, inputs: TensorMap) -> TensorMap:
        self.threads.append(threading.current_thread().name)
        self.started.release()
        if self.barrier is not None:
            self.barrier.wait(WAIT_S)  # passes only if every instance runs at the same time
        if not self.release.wait(WAIT_S):
            raise TimeoutError("never released")
        if np.any(np.less(inputs["x"], 0)):
            raise ValueError("negative input")
        return {"y": inputs["x"] + 1}

    def close(self) -> None:
        self.closed = True


async def started(backend: BlockingBackend) -> None:
    assert await asyncio.to_thread(backend.started.acquire, True, WAIT_S)


async def test_n_instances_run_n_batches_at_once_on_distinct_threads() -> None:
    barrier = threading.Barrier(3)
    backends = [BlockingBackend(barrier) for _ in range(3)]
    for backend in backends:
        backend.release.set()
    pool = InstancePool(backends, name="resnet")
    x = np.zeros((2, 1), np.float32)
    results = await asyncio.gather(*(pool.run({"x": x + i}) for i in range(3)))
    assert sorted(float(r["y"][0, 0]) for r in results) == [1.0, 2.0, 3.0]
    threads = [name for backend in backends for name in backend.threads]
    assert len(set(threads)) == 3
    assert all(name.startswith("resnet") for name in threads)
    assert pool.num_instances == 3 and pool.num_free == 3
    pool.close()


async def test_a_batch_waits_for_a_free_instance() -> None:
    backend = BlockingBackend()
    pool = InstancePool([backend], name="m")
    first = asyncio.create_task(pool.run({"x": np.zeros((1, 1))}))
    await started(backend)
    assert pool.num_free == 0
    second = asyncio.create_task(pool.run({"x": np.ones((1, 1))}))
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(backend.threads) == 1  # the second batch has not reached the backend
    backend.release.set()
    assert (await first)["y"][0, 0] == 1
    assert (await second)["y"][0, 0] == 2
    assert len(backend.threads) == 2 and pool.num_free == 1
    pool.close()


async def test_backend_errors_propagate_and_free_the_instance() -> None:
    backend = BlockingBackend()
    backend.release.set()
    pool = InstancePool([backend], name="m")
    with pytest.raises(ValueError, match="negative"):
        await pool.run({"x": -np.ones((1, 1))})
    assert pool.num_free == 1
    assert (await pool.run({"x": np.zeros((1, 1))}))["y"][0, 0] == 1
    pool.close()


async def test_cancelled_run_frees_its_instance_only_when_the_thread_finishes() -> None:
    backend = BlockingBackend()
    pool = InstancePool([backend], name="m")
    task = asyncio.create_task(pool.run({"x": np.zeros((1, 1))}))
    await started(backend)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.num_free == 0  # the thread is still busy with the batch
    backend.release.set()
    result = await asyncio.wait_for(pool.run({"x": np.ones((1, 1))}), WAIT_S)
    assert result["y"][0, 0] == 2
    assert pool.num_free == 1
    pool.close()


def test_close_closes_every_backend_and_refuses_work() -> None:
    backends = [BlockingBackend(), BlockingBackend()]
    pool = InstancePool(backends, name="m")
    pool.close()
    pool.close()  # idempotent
    assert all(backend.closed for backend in backends)
    with pytest.raises(RuntimeError):
        asyncio.run(pool.run({"x": np.zeros((1, 1))}))


def test_pool_needs_a_backend() -> None:
    with pytest.raises(ValueError, match="at least one"):
        InstancePool([], name="m")


class LoneAwareBackend(BlockingBackend):
    """Records which path ran each batch: `execute` or `execute_lone`."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    def execute(self, inputs: TensorMap) -> TensorMap:
        self.paths.append("execute")
        return super().execute(inputs)

    def execute_lone(self, inputs: TensorMap) -> TensorMap:
        self.paths.append("lone")
        return super().execute(inputs)


async def test_run_lone_takes_the_lone_path_when_every_other_instance_is_free() -> None:
    backends = [LoneAwareBackend(), LoneAwareBackend()]
    for backend in backends:
        backend.release.set()
    pool = InstancePool(backends, name="m")
    assert pool.lone_dispatch is not None
    y = await pool.lone_dispatch({"x": np.zeros((1, 1))})
    assert y["y"][0, 0] == 1
    await pool.run({"x": np.zeros((1, 1))})  # a plain run never takes it
    assert [p for b in backends for p in b.paths] == ["lone", "execute"]
    pool.close()


async def test_run_lone_takes_the_shared_path_while_another_instance_runs() -> None:
    busy, other = LoneAwareBackend(), LoneAwareBackend()
    other.release.set()
    pool = InstancePool([busy, other], name="m")
    first = asyncio.create_task(pool.run({"x": np.zeros((1, 1))}))
    await started(busy)
    assert (await pool.run_lone({"x": np.ones((1, 1))}))["y"][0, 0] == 2
    assert other.paths == ["execute"]  # the cores are not idle: no spinning session
    busy.release.set()
    await first
    pool.close()


def test_a_pool_of_plain_backends_has_no_lone_dispatch() -> None:
    pool = InstancePool([BlockingBackend()], name="m")
    assert pool.lone_dispatch is None
    pool.close()
