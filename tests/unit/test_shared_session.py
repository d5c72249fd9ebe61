"""`share_session_between_instances`: one ONNX Runtime session (one backend) for every instance.

Each instance keeps its own thread and runs its batches on the shared session at the same time as
the others (ORT's Run is thread-safe); the `spin_when_idle` session gets the threads of every
instance, since a lone batch runs only while the others idle. Closing closes the backend once,
and not before the last hung call on it returns. No test here asserts a speed.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import msgspec
import numpy as np
import pytest

from fulcrum import examples
from fulcrum.backends import distinct, shared_between_instances
from fulcrum.backends.onnx import OnnxBackend
from fulcrum.config import Instances, ModelConfig, TensorSpec
from fulcrum.errors import ExecutionTimeout
from fulcrum.instances import InstancePool
from fulcrum.metrics import ServerMetrics
from fulcrum.parameters import OnnxParameters, decode_parameters
from fulcrum.servable import BatchServable
from fulcrum.types import TensorMap
from onnx_graphs import write_matmul_graph

WAIT_S = 10.0  # a hang guard for thread hand-offs, never a speed assertion
LIMIT_S = 0.2  # the execution limit of the hung-instance test; a normal call never nears it
WIDTH = 16
WEIGHTS = np.arange(WIDTH * WIDTH, dtype=np.float32).reshape(WIDTH, WIDTH) / 100


@pytest.fixture
def version_dir(tmp_path: Path) -> Path:
    """y = x @ WEIGHTS, x and y float [B, 16]: each row's answer is its own."""
    folder = tmp_path / "1"
    folder.mkdir()
    write_matmul_graph(folder / "model.onnx", WEIGHTS)
    return folder


def matmul_config(count: int, **parameters: bool | int | list[str]) -> ModelConfig:
    return ModelConfig(
        name="mm",
        platform="onnx",
        max_batch_size=8,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(WIDTH,)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(WIDTH,)),),
        instances=Instances(count=count),
        # Pinned to the CPU (a GPU machine's default is CUDA: tests/gpu/test_onnx_cuda.py).
        parameters={"execution_providers": ["CPUExecutionProvider"], **parameters},
    )


async def test_a_shared_session_is_loaded_once_for_every_instance(version_dir: Path) -> None:
    config = matmul_config(3, intra_op_threads=1, share_session_between_instances=True)
    servable = await BatchServable.load(config, 1, version_dir, ServerMetrics().for_model("mm", 1))
    try:
        backends = servable.pool._backends
        assert len(backends) == 3 and len(distinct(backends)) == 1
        assert shared_between_instances(backends[0])
        x = np.ones((1, WIDTH), np.float32)
        result = await servable.infer({"x": x}, priority=None, timeout_s=None)
        np.testing.assert_allclose(result.outputs["y"], x @ WEIGHTS, rtol=1e-6)
    finally:
        await servable.stop()
    assert "session" not in backends[0].__dict__  # closed


async def test_without_sharing_each_instance_loads_its_own_session(version_dir: Path) -> None:
    config = matmul_config(2, intra_op_threads=1)
    servable = await BatchServable.load(config, 1, version_dir, ServerMetrics().for_model("mm", 1))
    try:
        assert len(distinct(servable.pool._backends)) == 2
        assert not shared_between_instances(servable.pool._backends[0])
    finally:
        await servable.stop()


def test_instances_running_at_once_on_one_session_each_get_their_own_rows(
    version_dir: Path,
) -> None:
    """Two threads hammer one session with distinct batches: no answer crosses to the other."""
    backend = OnnxBackend(
        matmul_config(2, intra_op_threads=1, share_session_between_instances=True), version_dir
    )
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((1 + i % 8, WIDTH)).astype(np.float32) for i in range(400)]
    wrong: list[int] = []
    start = threading.Barrier(2)

    def run(offset: int) -> None:
        start.wait(WAIT_S)
        for i in range(offset, len(batches), 2):
            y = backend.execute({"x": batches[i]})["y"]
            if not np.allclose(y, batches[i] @ WEIGHTS, rtol=1e-5, atol=1e-5):
                wrong.append(i)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * 3)
    assert not any(thread.is_alive() for thread in threads)
    assert wrong == []
    backend.close()


class CountingBackend:
    """y = x + 1; counts `close` calls; a batch holding -1 blocks until `release` is set."""

    shared_between_instances = True

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.running = threading.Semaphore(0)
        self.both = threading.Barrier(2)
        self.num_closes = 0
        self.closed = threading.Event()

    def execute(self, inputs: TensorMap) -> TensorMap:
        self.running.release()
        if np.any(inputs["x"] == 2):
            self.both.wait(WAIT_S)  # passes only while two instances run at once
        if np.any(inputs["x"] == -1) and not self.release.wait(WAIT_S):
            raise TimeoutError("never released")
        return {"y": inputs["x"] + 1}

    def close(self) -> None:
        self.num_closes += 1
        self.closed.set()


async def test_one_shared_backend_runs_two_batches_at_once_and_closes_once(
    release: threading.Event,
) -> None:
    backend = CountingBackend(release)
    pool = InstancePool([backend, backend], name="m/1")
    two = np.full((1, 1), 2.0)
    both = asyncio.gather(pool.run({"x": two}), pool.run({"x": two}))
    results = await asyncio.wait_for(both, WAIT_S)
    assert [float(r["y"][0, 0]) for r in results] == [3.0, 3.0]
    pool.close()
    assert backend.num_closes == 1


async def test_a_shared_backend_closes_only_after_its_hung_call_returns(
    release: threading.Event,
) -> None:
    backend = CountingBackend(release)
    pool = InstancePool([backend, backend], name="m/1", execution_timeout_s=LIMIT_S)
    with pytest.raises(ExecutionTimeout):
        await asyncio.wait_for(pool.run({"x": -np.ones((1, 1))}), WAIT_S)
    assert pool.num_hung == 1 and pool.is_healthy
    answer = await asyncio.wait_for(pool.run({"x": np.zeros((1, 1))}), WAIT_S)
    assert answer["y"][0, 0] == 1  # the other instance serves on the same backend
    await asyncio.wait_for(asyncio.to_thread(pool.close), WAIT_S)
    assert not backend.closed.is_set()  # the hung thread still uses it
    release.set()
    assert await asyncio.to_thread(backend.closed.wait, WAIT_S)
    assert backend.num_closes == 1


@pytest.mark.parametrize(
    ("count", "threads", "lone_threads"), [(2, 1, 2), (1, 2, 2), (3, 2, 6), (2, 0, 0)]
)
def test_the_lone_session_gets_every_instance_s_threads(
    version_dir: Path, count: int, threads: int, lone_threads: int
) -> None:
    config = matmul_config(
        count, intra_op_threads=threads, spin_when_idle=True, share_session_between_instances=True
    )
    backend = OnnxBackend(config, version_dir)
    assert backend.lone_session is not None
    assert backend.session.get_session_options().intra_op_num_threads == threads
    assert backend.lone_session.get_session_options().intra_op_num_threads == lone_threads
    backend.close()


def test_the_minilm_example_runs_two_one_thread_instances_on_one_session() -> None:
    config = msgspec.toml.decode(examples._MINILM_CONFIG.encode())
    params = decode_parameters(config["parameters"], OnnxParameters)
    assert config["instances"]["count"] == 2
    assert params.intra_op_threads == 1 and params.share_session_between_instances
    assert params.spin_when_idle  # a lone request still runs on both cores
