"""Compute threads at a lower priority: instance threads, the threads they start and the runtime
pools of backends built on a lowered thread run at the loop's nice + compute_nice; the loop's
own thread keeps its priority. Real threads, read back with os.getpriority on their native id."""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from fulcrum.cli import build_parser
from fulcrum.config import ModelConfig, TensorSpec
from fulcrum.errors import ConfigError
from fulcrum.instances import InstancePool
from fulcrum.metrics import ServerMetrics
from fulcrum.servable import BatchServable
from fulcrum.service import ServiceSettings
from fulcrum.thread_priority import (
    DEFAULT_COMPUTE_NICE,
    MAX_NICE,
    _warn_once,
    call_lowered,
    check_compute_nice,
    compute_initializer,
    lower_this_thread,
    thread_nice,
)
from fulcrum.types import TensorMap
from onnx_graphs import write_add_graph

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")
WAIT_S = 10.0  # a hang guard for thread hand-offs, never a speed assertion


def thread_nices() -> dict[int, int]:
    """Every thread of this process: native id -> nice value."""
    out = {}
    for entry in os.listdir("/proc/self/task"):
        try:
            out[int(entry)] = thread_nice(int(entry))
        except OSError:  # ended between the listing and the read
            continue
    return out


class NiceRecorder:
    """A backend that records the nice value of the thread it runs on and of a thread it starts
    (as a runtime's lazily started pool would be); y = x + 1."""

    def __init__(self) -> None:
        self.run_nice: int | None = None
        self.child_nice: int | None = None

    def execute(self, inputs: TensorMap) -> TensorMap:
        self.run_nice = thread_nice()
        seen: list[int] = []
        child = threading.Thread(target=lambda: seen.append(thread_nice()))
        child.start()
        child.join(WAIT_S)
        self.child_nice = seen[0]
        return {"y": inputs["x"] + 1}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("value", [0, 5, MAX_NICE])
def test_check_accepts_0_to_19(value: int) -> None:
    assert check_compute_nice(value) == value


@pytest.mark.parametrize("value", [-1, 20])
def test_check_refuses_values_outside_0_to_19_naming_them(value: int) -> None:
    with pytest.raises(ConfigError, match=f"compute_nice = {value}"):
        check_compute_nice(value)


def test_zero_means_no_initializer_at_all() -> None:
    assert compute_initializer(0) is None


async def test_instance_threads_and_their_children_run_lowered_and_the_loop_does_not() -> None:
    loop_nice = thread_nice()
    backends = [NiceRecorder(), NiceRecorder()]
    pool = InstancePool(backends, name="m", compute_nice=3)
    x = np.zeros((1, 1), np.float32)
    try:
        for _ in range(2):  # the second batch reaches the other instance too
            result = await pool.run({"x": x})
            np.testing.assert_array_equal(result["y"], x + 1)
        await pool.run({"x": x})
    finally:
        pool.close()
    ran = [b for b in backends if b.run_nice is not None]
    assert len(ran) == 2, "a batch did not reach each instance"
    for backend in ran:
        assert backend.run_nice == min(MAX_NICE, loop_nice + 3)
        assert backend.child_nice == backend.run_nice  # threads inherit their creator's nice
    assert thread_nice() == loop_nice


async def test_a_pool_without_compute_nice_runs_at_the_loops_priority() -> None:
    backend = NiceRecorder()
    pool = InstancePool([backend], name="m")
    try:
        await pool.run({"x": np.zeros((1, 1), np.float32)})
    finally:
        pool.close()
    assert backend.run_nice == thread_nice()


def test_the_nice_value_is_capped_at_19() -> None:
    initializer = compute_initializer(MAX_NICE)
    assert initializer is not None
    seen: list[int] = []

    def body() -> None:
        initializer()
        seen.append(thread_nice())

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(WAIT_S)
    assert seen == [MAX_NICE]


def test_a_thread_is_never_raised_above_its_current_priority() -> None:
    seen: list[int] = []

    def body() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        seen.append(int(lower_this_thread(4)))  # asks for higher priority: refused quietly
        seen.append(thread_nice())

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(WAIT_S)
    assert seen == [0, 10]


def test_off_linux_it_logs_once_and_lowers_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _warn_once.cache_clear()
    monkeypatch.setattr(sys, "platform", "darwin")
    seen: list[int] = []

    def body() -> None:
        before = thread_nice()
        assert not lower_this_thread(before + 2)
        assert not lower_this_thread(before + 2)
        seen.append(thread_nice() - before)

    with caplog.at_level(logging.WARNING, logger="fulcrum.thread_priority"):
        thread = threading.Thread(target=body)
        thread.start()
        thread.join(WAIT_S)
    _warn_once.cache_clear()
    assert seen == [0]
    assert [r.getMessage() for r in caplog.records] == [
        "compute_nice is applied on Linux only, not on darwin"
    ]


async def test_call_lowered_runs_on_a_lowered_thread_and_leaves_the_loop_alone() -> None:
    loop_nice = thread_nice()
    assert await call_lowered(4, thread_nice) == min(MAX_NICE, loop_nice + 4)
    assert await call_lowered(0, thread_nice) == loop_nice
    assert thread_nice() == loop_nice
    with pytest.raises(ZeroDivisionError):  # an error crosses back to the caller
        await call_lowered(2, divmod, 1, 0)


async def test_onnx_runtime_pool_threads_are_born_lowered(tmp_path: Path) -> None:
    """The ORT session of a servable loaded with compute_nice: its pool threads (spawned when the
    session is built) and the instance thread all run lowered; the loop does not."""
    write_add_graph(tmp_path / "model.onnx")
    config = ModelConfig(
        name="double",
        platform="onnx",
        max_batch_size=4,
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(2,)),),
        outputs=(TensorSpec(name="y", datatype="FP32", shape=(2,)),),
        parameters={"intra_op_threads": 3},  # two pool threads beside the caller
    )
    loop_nice = thread_nice()
    before = set(thread_nices())
    metrics = ServerMetrics().for_model("double", 1)
    servable = await BatchServable.load(config, 1, tmp_path, metrics, compute_nice=5)
    try:
        result = await servable.infer(
            {"x": np.ones((1, 2), np.float32)}, priority=None, timeout_s=None
        )
        np.testing.assert_array_equal(result.outputs["y"], np.full((1, 2), 2, np.float32))
        born = {tid: nice for tid, nice in thread_nices().items() if tid not in before}
    finally:
        await servable.stop()
    # ORT's 2 pool threads and the instance thread at least (the loader thread may have ended)
    assert len(born) >= 3
    assert set(born.values()) == {min(MAX_NICE, loop_nice + 5)}
    assert thread_nice() == loop_nice


def test_cli_takes_compute_nice_0_to_19_and_defaults_to_5() -> None:
    parser = build_parser()
    base = ["serve", "--repository", "r"]
    assert parser.parse_args(base).compute_nice == 5 == DEFAULT_COMPUTE_NICE
    assert ServiceSettings().compute_nice == DEFAULT_COMPUTE_NICE
    assert parser.parse_args([*base, "--compute-nice", "7"]).compute_nice == 7
    for bad in ("20", "-1", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, "--compute-nice", bad])
