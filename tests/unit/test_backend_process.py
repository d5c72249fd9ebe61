from __future__ import annotations

import os
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fulcrum.backends import create_backend
from fulcrum.backends.process import ProcessBackend
from fulcrum.backends.python import PythonBackend
from fulcrum.backends.restart_budget import RestartBudget
from fulcrum.backends.shm import NAME_PREFIX, Region
from fulcrum.config import ModelConfig, TensorSpec
from fulcrum.errors import ConfigError, InvalidInput, ModelError, Unavailable
from fulcrum.types import FakeClock

ParamValue = str | int | float | bool | list[str]

# What the model does is chosen by the batch's first value, so one process serves every test.
MODEL = """
import os
import signal
import threading
from pathlib import Path

import numpy as np
from fulcrum.errors import InvalidInput


class Model:
    def __init__(self, config, version_dir):
        self.version_dir = Path(version_dir)
        if (self.version_dir / "broken").exists():
            raise OSError("weights missing")

    def execute(self, batch):
        x = batch["x"]
        first = int(x.flat[0])
        if first == 3:
            os._exit(3)
        if first == 9:
            os.kill(os.getpid(), signal.SIGKILL)
        if first == 13:
            raise RuntimeError("unlucky")
        if first == -1:
            raise InvalidInput("x must be >= 0")
        if first == 60:
            threading.Event().wait()  # hangs
        doubled = x * 2
        if first == 7:
            doubled = doubled.astype(np.float32)
        if first == 8:
            doubled = doubled[:1]
        if first == 21:
            doubled = np.repeat(doubled, 1_000_000, axis=1)  # 8 MB a row
        labels = np.array([f"row{i}".encode() for i in range(len(x))], dtype=object)
        return {"doubled": doubled, "label": labels}

    def close(self):
        (self.version_dir / "closed").write_text(str(os.getpid()))
"""


def make_config(**params: ParamValue) -> ModelConfig:
    return ModelConfig(
        name="doubler",
        platform="python",
        max_batch_size=8,
        inputs=(TensorSpec(name="x", datatype="INT64", shape=(1,)),),
        outputs=(
            TensorSpec(name="doubled", datatype="INT64", shape=(1,)),
            TensorSpec(name="label", datatype="BYTES", shape=()),
        ),
        parameters={"isolation": "process", **params},
    )


def write(folder: Path, source: str) -> Path:
    (folder / "model.py").write_text(textwrap.dedent(source))
    return folder


def x(*values: int) -> dict[str, np.ndarray]:
    return {"x": np.array(values, dtype=np.int64).reshape(-1, 1)}


def segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("model"), MODEL)


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> Iterator[ProcessBackend]:
    loaded = create_backend(make_config(), model_dir)
    assert isinstance(loaded, ProcessBackend)
    yield loaded
    loaded.close()


def test_gives_the_thread_backend_outputs_from_another_process(
    backend: ProcessBackend, model_dir: Path
) -> None:
    thread = create_backend(make_config(isolation="thread"), model_dir)
    assert isinstance(thread, PythonBackend)
    assert backend.pid not in (None, os.getpid())
    for batch in (x(1), x(1, 2, 4), x(*range(20, 28))):
        got, want = backend.execute(batch), thread.execute(batch)
        assert list(got) == list(want) == ["doubled", "label"]
        for name in want:
            assert got[name].dtype == want[name].dtype
            np.testing.assert_array_equal(got[name], want[name])


def test_tensors_larger_than_the_shared_region_grow_it(backend: ProcessBackend) -> None:
    wide = {"x": np.arange(2 * 300_000, dtype=np.int64).reshape(2, -1)[:, ::2]}  # 2.4 MB, strided
    out = backend.execute(wide)
    np.testing.assert_array_equal(out["doubled"], wide["x"] * 2)
    np.testing.assert_array_equal(backend.execute(x(5))["doubled"], [[10]])


def test_an_exit_in_execute_fails_that_batch_and_the_next_runs_on_a_new_process(
    backend: ProcessBackend,
) -> None:
    before_pid, before_restarts = backend.pid, backend.num_restarts
    with pytest.raises(ModelError, match="exited with code 3 while running a batch"):
        backend.execute(x(3, 1))
    np.testing.assert_array_equal(backend.execute(x(1, 2))["doubled"], [[2], [4]])
    assert backend.pid != before_pid
    assert backend.num_restarts == before_restarts + 1


def test_a_killed_process_names_its_signal(backend: ProcessBackend) -> None:
    with pytest.raises(ModelError, match=r"exited with code -9 \(SIGKILL\) while running a batch"):
        backend.execute(x(9))
    assert backend.execute(x(2))["doubled"].tolist() == [[4]]


def test_a_process_that_dies_between_batches_is_replaced_without_failing_one(
    backend: ProcessBackend,
) -> None:
    old_pid = backend.pid
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    os.waitid(os.P_PID, old_pid, os.WEXITED | os.WNOWAIT)  # dead, and left for the backend to reap
    assert backend.execute(x(4))["doubled"].tolist() == [[8]]
    assert backend.pid != old_pid


def test_ctrl_c_to_the_process_group_leaves_the_model_process_running(
    backend: ProcessBackend,
) -> None:
    pid = backend.pid
    assert pid is not None
    os.kill(pid, signal.SIGINT)
    assert backend.execute(x(6))["doubled"].tolist() == [[12]]
    assert backend.pid == pid


def test_an_exception_in_execute_comes_back_as_a_model_error_with_its_message(
    backend: ProcessBackend,
) -> None:
    pid = backend.pid
    with pytest.raises(ModelError, match=r"execute raised RuntimeError\('unlucky'\)") as caught:
        backend.execute(x(13))
    assert "Traceback" not in caught.value.message
    with pytest.raises(InvalidInput, match="x must be >= 0"):  # the user's chosen error class
        backend.execute(x(-1))
    assert backend.pid == pid  # an exception is not a crash


@pytest.mark.parametrize(
    ("first", "message"),
    [
        (7, r"output 'doubled' has dtype float32, expected INT64 \(int64\)"),
        (8, r"output 'doubled' has shape \(1, 1\), expected 3 rows"),
    ],
)
def test_outputs_that_disagree_with_the_config_are_refused(
    backend: ProcessBackend, first: int, message: str
) -> None:
    with pytest.raises(ModelError, match=message):
        backend.execute(x(first, 1, 2))


def test_close_stops_the_process_runs_the_users_close_and_unlinks_every_segment(
    tmp_path: Path,
) -> None:
    before = segments()
    backend = ProcessBackend(make_config(), write(tmp_path, MODEL))
    backend.execute({"x": np.zeros((2, 400_000), dtype=np.int64)})  # grows both regions
    with pytest.raises(ModelError):
        backend.execute(x(3))  # and a crash and restart on the way
    backend.execute(x(1))
    pid = backend.pid
    assert pid is not None
    ours = segments() - before
    assert len(ours) == 2  # the grown input and output regions; the replaced ones are gone
    backend.close()
    assert not ours & segments()
    assert (tmp_path / "closed").read_text() == str(pid)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # exited and reaped
    with pytest.raises(Unavailable, match="closed"):
        backend.execute(x(1))


def test_past_the_restart_budget_the_model_is_unavailable_until_the_window_passes(
    tmp_path: Path,
) -> None:
    clock = FakeClock(100.0)
    config = make_config(max_restarts=1, restart_window_s=30)
    backend = ProcessBackend(config, write(tmp_path, MODEL), clock=clock)
    try:
        for _ in range(2):
            with pytest.raises(ModelError, match="exited with code 3"):
                backend.execute(x(3))
            clock.advance(10.0)
        with pytest.raises(Unavailable, match="crashed more than 1 times in 30 s") as caught:
            backend.execute(x(1))
        assert caught.value.retry_after_s == pytest.approx(10.0)
        assert backend.pid is None
        clock.advance(10.0)  # the first crash leaves the window
        assert backend.execute(x(1))["doubled"].tolist() == [[2]]
    finally:
        backend.close()


def test_a_hung_batch_is_killed_after_execute_timeout_s_and_the_next_runs(
    tmp_path: Path,
) -> None:
    backend = ProcessBackend(make_config(execute_timeout_s=1), write(tmp_path, MODEL))
    try:
        with pytest.raises(ModelError, match="did not finish a batch within 1 s; killed it"):
            backend.execute(x(60))
        assert backend.execute(x(1))["doubled"].tolist() == [[2]]
    finally:
        backend.close()


def test_a_restart_that_fails_to_load_fails_the_batch_and_counts_as_a_crash(
    tmp_path: Path,
) -> None:
    backend = ProcessBackend(make_config(max_restarts=1), write(tmp_path, MODEL))
    try:
        (tmp_path / "broken").touch()  # the next process will not load
        with pytest.raises(ModelError, match="exited with code 3"):
            backend.execute(x(3))
        with pytest.raises(ModelError, match=r"failed to restart \(.*OSError\('weights missing'"):
            backend.execute(x(1))
        with pytest.raises(Unavailable):
            backend.execute(x(1))
        assert backend.num_restarts == 2
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("source", "params", "error", "message"),
    [
        ("class Model:\n    pass\n", {}, ConfigError, "has no method 'execute'"),
        (
            "class Model:\n    def __init__(self):\n        raise ValueError('boom')\n",
            {},
            ModelError,
            r"__init__ raised ValueError\('boom'\)",
        ),
        (
            "import os\nclass Model:\n    def __init__(self):\n        os._exit(4)\n",
            {},
            ModelError,
            "exited with code 4 while loading",
        ),
        ("", {"isolation": "fork"}, ConfigError, "'parameters.isolation' = 'fork': expected one"),
        ("", {"restart_window_s": "1m"}, ConfigError, "'parameters.restart_window_s' = '1m'"),
    ],
)
def test_load_failures_keep_their_error_class_and_leave_nothing_behind(
    tmp_path: Path,
    source: str,
    params: dict[str, ParamValue],
    error: type[Exception],
    message: str,
) -> None:
    before = segments()
    with pytest.raises(error, match=message):
        create_backend(make_config(**params), write(tmp_path, source))
    assert segments() <= before


def test_restart_budget_counts_crashes_in_a_sliding_window() -> None:
    clock = FakeClock()
    budget = RestartBudget(max_restarts=2, window_s=10.0, clock=clock)
    for _ in range(2):
        budget.record_crash()
        clock.advance(1.0)
    assert budget.allows_restart() and budget.retry_after_s() == 0.0
    budget.record_crash()  # the third within 10 s
    assert not budget.allows_restart()
    assert budget.retry_after_s() == pytest.approx(8.0)  # when the crash at t=0 leaves
    clock.advance(8.0)
    assert budget.allows_restart()
    assert budget.num_crashes == 3


def test_outputs_that_find_no_room_fail_their_batch_and_the_next_one_runs(
    backend: ProcessBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(region: Region, num_bytes: int) -> None:
        if num_bytes > region.size:
            raise ModelError("no room (fake)")

    with monkeypatch.context() as patched:
        patched.setattr(Region, "ensure", full)
        with pytest.raises(ModelError, match=r"outputs of \d+ bytes found no room"):
            backend.execute(x(21))
    assert backend.execute(x(21))["doubled"].shape == (1, 1_000_000)  # grown now
    assert backend.execute(x(1))["doubled"].tolist() == [[2]]


def test_a_region_larger_than_dev_shm_is_an_error_not_a_crash() -> None:
    before = segments()
    region = Region(1024)
    try:
        with pytest.raises(ModelError, match=r"no room for \d+ bytes of shared memory"):
            region.ensure(1 << 45)  # 32 TiB
        assert region.size == 1024  # the old segment still serves
    finally:
        region.close()
    assert segments() <= before
