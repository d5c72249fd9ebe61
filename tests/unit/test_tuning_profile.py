"""`fulcrum profile` on the echo backend (known latency a + b*batch) and on hand-written fakes:
sweep shape, the knee location, the memory fit, inputs, the report files and the CLI's errors."""

from __future__ import annotations

import argparse
import json
import mmap
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from fulcrum.config import ModelConfig, TensorSpec
from fulcrum.errors import ConfigError, InvalidInput, ModelError, NotFound
from fulcrum.tuning.knee import find_knee
from fulcrum.tuning.profile import (
    ProfileOptions,
    ProfileResult,
    measure,
    profile_backend,
    sweep_batch_sizes,
)
from fulcrum.tuning.profile_cli import register
from fulcrum.tuning.profile_inputs import InputMaker, text_of_tokens
from fulcrum.tuning.resources import MIB, Nvml, ResourceMonitor
from fulcrum.types import TensorMap

A_MS, B_MS = 20.0, 1.0
VECTOR = (TensorSpec(name="x", datatype="FP32", shape=(4,)),)
OUT = (TensorSpec(name="y", datatype="FP32", shape=(4,)),)
ECHO_TOML = """\
platform = "echo"
max_batch_size = 8
default_variant = "slow"

[[inputs]]
name = "x"
datatype = "FP32"
shape = [4]

[[outputs]]
name = "y"
datatype = "FP32"
shape = [4]

[variants.slow]
parameters = { latency_a_ms = 3.0, latency_b_ms = 0.5 }

[variants.fast]
parameters = { latency_a_ms = 1.0 }
"""


def echo_config(max_batch_size: int = 16, **parameters: float) -> ModelConfig:
    return ModelConfig(
        name="echo",
        platform="echo",
        max_batch_size=max_batch_size,
        inputs=VECTOR,
        outputs=OUT,
        parameters=dict(parameters),
    )


class SteppedBackend:
    """40 ms for up to 4 rows (throughput doubles with the batch), then 25 ms a row (it falls);
    holds `bytes_per_row` of touched memory per row while it runs."""

    def __init__(self, bytes_per_row: int = 0) -> None:
        self.bytes_per_row = bytes_per_row
        self.batch_sizes: list[int] = []

    def execute(self, inputs: TensorMap) -> TensorMap:
        rows = len(inputs["x"])
        self.batch_sizes.append(rows)
        scratch = np.ones(rows * self.bytes_per_row // 8)  # written, so resident
        time.sleep(0.040 if rows <= 4 else 0.025 * rows)  # the workload being profiled
        del scratch
        return {"y": inputs["x"]}

    def close(self) -> None:
        pass


def test_echo_throughput_follows_the_known_latency_model(tmp_path: Path) -> None:
    config = echo_config(latency_a_ms=A_MS, latency_b_ms=B_MS)
    options = ProfileOptions(warmup=1, repeats=3, stop_at_knee=False, memory_budget_mb=1000)
    result = measure(config, tmp_path, options)
    # Doubling to max_batch_size, and the knee rule's choice (at 16 backed off 20%: 12).
    doubling = [p for p in result.points if p.batch_size in (1, 2, 4, 8, 16)]
    assert [p.batch_size for p in doubling] == [1, 2, 4, 8, 16]
    rates = [p.throughput_rps for p in doubling]
    assert rates == sorted(rates)  # gains of 56-91% a doubling: far above the noise
    for p in result.points:
        model_ms = A_MS + B_MS * p.batch_size
        assert (p.length, p.num_tokens, p.encode_ms_p50, p.num_runs) == (0, 0, None, 3)
        # A sleep never ends early; a busy 2-core machine may add a lot, never 3x + 50 ms.
        assert model_ms <= p.latency_ms_p50 <= p.latency_ms_p99
        assert p.latency_ms_p50 <= 3 * model_ms + 50
        assert p.throughput_rps == pytest.approx(p.batch_size / p.latency_ms_p50 * 1000)
        assert 0.0 <= p.cpu_util <= 1.0 and p.rss_mb_peak >= 0.0
    assert result.latency_ms_b1 == result.points[0].latency_ms_p50
    assert result.version == tmp_path.name and result.model == "echo"
    knee = find_knee([(p.batch_size, p.throughput_rps) for p in doubling])
    assert (result.saturation_batch, result.knee_batch) == (knee.saturation_batch, knee.batch)
    assert result.knee_batch in [p.batch_size for p in result.points]
    assert any(n.startswith("GPU: not measured") for n in result.notes)


def test_a_strongly_saturating_curve_puts_the_knee_where_it_bends() -> None:
    backend = SteppedBackend()
    options = ProfileOptions(warmup=1, repeats=2, memory_budget_mb=1000)
    result = profile_backend(backend, echo_config(), options, monitor=ResourceMonitor())
    assert (result.saturation_batch, result.saturated, result.knee_batch) == (4, True, 3)
    # Doubling stopped at the first flat step (8); the backed-off knee (3) was measured too.
    assert [p.batch_size for p in result.points] == [1, 2, 3, 4, 8]
    assert 16 not in backend.batch_sizes
    knee = next(p for p in result.points if p.batch_size == 3)
    assert result.knee_throughput_rps == knee.throughput_rps


class HoldingBackend(SteppedBackend):
    """Holds its per-row memory in fresh pages (an anonymous map, written) for 100 ms a batch.
    Not `np.ones`: after earlier tests, malloc may serve that from freed memory the process
    still holds, whose pages are already resident, and RSS would not see the batch at all."""

    def execute(self, inputs: TensorMap) -> TensorMap:
        rows = len(inputs["x"])
        with mmap.mmap(-1, rows * self.bytes_per_row) as pages:
            view = np.frombuffer(pages, dtype=np.uint8)
            view.fill(1)  # written, so resident
            time.sleep(0.100)
            del view
        return {"y": inputs["x"]}


def test_memory_per_row_is_the_slope_between_the_two_largest_batches() -> None:
    per_row_mb = 8
    backend = HoldingBackend(bytes_per_row=per_row_mb * 1024 * 1024)
    options = ProfileOptions(batch_sizes=(1, 4, 8), warmup=0, repeats=1, memory_budget_mb=2000)
    result = profile_backend(backend, echo_config(), options, monitor=ResourceMonitor())
    memory = result.memory
    assert memory is not None and memory.budget_mb == 2000
    peaks = [(p.batch_size, round(p.rss_mb_peak, 1)) for p in result.points]
    assert per_row_mb * 0.6 <= memory.per_sample_mb <= per_row_mb * 1.4, peaks
    expected = int((2000 - memory.weights_mb) // memory.per_sample_mb)
    assert result.memory_bound_batch == pytest.approx(expected, abs=1)
    assert peaks[-1][1] > peaks[0][1] + 3 * per_row_mb


class FailingBackend:
    """Fails every batch over `max_rows` rows, like a model running out of memory."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows

    def execute(self, inputs: TensorMap) -> TensorMap:
        if len(inputs["x"]) > self.max_rows:
            raise ModelError("out of memory")
        return {"y": inputs["x"]}

    def close(self) -> None:
        pass


def test_a_failing_batch_ends_the_sweep_with_a_note() -> None:
    options = ProfileOptions(warmup=0, repeats=1, stop_at_knee=False)  # no timing involved
    result = profile_backend(FailingBackend(2), echo_config(), options, monitor=ResourceMonitor())
    assert [p.batch_size for p in result.points] == [1, 2]
    assert "batch 4 at length 0 failed: out of memory" in result.notes
    with pytest.raises(ModelError, match="no point could be measured"):
        profile_backend(FailingBackend(0), echo_config(), options, monitor=ResourceMonitor())


def test_samples_are_tiled_and_cut_to_each_batch() -> None:
    samples: TensorMap = {"x": np.arange(12, dtype=np.float32).reshape(3, 4)}
    maker = InputMaker(echo_config(), None, samples=samples)
    rows = maker.rows(5, 0)["x"]
    assert rows[:, 0].tolist() == [0, 4, 8, 0, 4]
    assert maker.rows(2, 0)["x"].shape == (2, 4)
    # A model that does not batch takes one row without the row axis.
    unbatched = InputMaker(echo_config(max_batch_size=0), None, samples=samples)
    assert unbatched.rows(1, 0)["x"].tolist() == [0, 1, 2, 3]
    with pytest.raises(InvalidInput, match="same number"):
        InputMaker(echo_config(), None, samples={"x": samples["x"], "z": samples["x"][:1]}).rows(
            2, 0
        )


def test_measure_with_samples_profiles_one_length(tmp_path: Path) -> None:
    samples: TensorMap = {"x": np.ones((3, 4), dtype=np.float32)}
    options = ProfileOptions(batch_sizes=(1,), warmup=0, repeats=1, lengths=(8, 16))
    result = measure(echo_config(), tmp_path, options, samples=samples)
    assert [(p.length, p.batch_size) for p in result.points] == [(0, 1)]
    assert result.headline_length == 0


def test_dynamic_dims_take_the_length_and_are_swept_longest_first(tmp_path: Path) -> None:
    spec = TensorSpec(name="x", datatype="INT64", shape=(-1,))
    config = msgspec.structs.replace(echo_config(), inputs=(spec,), outputs=())
    assert InputMaker(config, None).rows(3, 7)["x"].shape == (3, 7)
    options = ProfileOptions(batch_sizes=(1,), lengths=(4, 9), warmup=0, repeats=1)
    result = measure(config, tmp_path, options)
    assert [(p.length, p.num_tokens) for p in result.points] == [(4, 4), (9, 9)]
    assert result.headline_length == 9


def test_text_of_tokens_hits_the_count_exactly() -> None:
    rng = np.random.default_rng(0)

    def count(text: str) -> int:  # two special tokens; words over 4 letters are two tokens
        return 2 + sum(1 if len(w) <= 4 else 2 for w in text.split())

    for num_tokens in (2, 3, 17, 64):
        assert count(text_of_tokens(count, num_tokens, rng)) == num_tokens
    with pytest.raises(InvalidInput, match="special tokens"):
        text_of_tokens(count, 1, rng)


def test_batch_sizes_double_up_to_the_limit() -> None:
    assert sweep_batch_sizes(echo_config(16), ProfileOptions()) == (1, 2, 4, 8, 16)
    assert sweep_batch_sizes(echo_config(16), ProfileOptions(max_batch=48))[-2:] == (32, 48)
    assert sweep_batch_sizes(echo_config(16), ProfileOptions(batch_sizes=(4, 1, 4))) == (1, 4)
    assert sweep_batch_sizes(echo_config(0), ProfileOptions()) == (1,)
    with pytest.raises(InvalidInput, match="does not batch"):
        sweep_batch_sizes(echo_config(0), ProfileOptions(batch_sizes=(2,)))


@pytest.mark.parametrize(
    "options",
    [ProfileOptions(repeats=0), ProfileOptions(lengths=(0,)), ProfileOptions(batch_sizes=(0,))],
)
def test_bad_options_are_refused(options: ProfileOptions, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput):
        measure(echo_config(), tmp_path, options)


def test_an_llm_config_is_sent_to_the_llm_profiler(tmp_path: Path) -> None:
    config = ModelConfig(name="lm", platform="llm")
    with pytest.raises(InvalidInput, match="profile_llm"):
        measure(config, tmp_path, ProfileOptions())


def test_result_json_round_trips(tmp_path: Path) -> None:
    options = ProfileOptions(batch_sizes=(1, 2), warmup=0, repeats=1)
    result = measure(echo_config(latency_a_ms=1.0), tmp_path, options)
    again = ProfileResult.from_json(result.to_json())
    assert again == result
    assert json.loads(result.to_json())["points"][0]["batch_size"] == 1


class FakeNvml:
    """pynvml's calls used by `Nvml`: two GPUs, the second busier and holding more memory."""

    class NVMLError(Exception):
        pass

    class _Rates:
        def __init__(self, gpu: int) -> None:
            self.gpu = gpu

    class _Memory:
        def __init__(self, used_mb: float, total_mb: float) -> None:
            self.used = int(used_mb * MIB)
            self.total = int(total_mb * MIB)

    def __init__(self) -> None:
        self.used_mb = {0: 100.0, 1: 300.0}
        self.shut_down = False

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> _Rates:
        return self._Rates(30 + 40 * handle)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> _Memory:
        return self._Memory(self.used_mb[handle], 1000.0)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        if handle == 1:
            raise self.NVMLError("not supported")  # some boards report no power
        return 75_000  # mW

    def nvmlDeviceGetName(self, handle: int) -> str:
        return f"Fake GPU {handle}"

    def nvmlShutdown(self) -> None:
        self.shut_down = True


def test_gpu_figures_come_from_nvml_when_a_gpu_is_present() -> None:
    fake = FakeNvml()
    nvml = Nvml(fake, [0, 1], "")
    monitor = ResourceMonitor(nvml)  # GPU baseline: 400 MB in use
    fake.used_mb[1] = 350.0  # the model's weights and batch: 50 MB more
    monitor.start()
    usage = monitor.stop()
    assert usage.gpu is not None
    assert usage.gpu.util_pct == 70  # the busiest GPU
    assert usage.gpu.mem_mb_peak == pytest.approx(50.0)
    assert usage.gpu.power_w == pytest.approx(75.0)  # the silent board counts 0
    options = ProfileOptions(batch_sizes=(1, 2), warmup=0, repeats=1, memory_budget_mb=1000)
    result = profile_backend(SteppedBackend(), echo_config(), options, monitor=monitor)
    assert all(p.gpu_util_pct == 70 for p in result.points)
    assert "Fake GPU 0, Fake GPU 1" in result.machine
    assert not any(n.startswith("GPU:") for n in result.notes)
    nvml.close()
    assert fake.shut_down


def test_without_pynvml_the_gpu_is_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    nvml = Nvml.open()
    assert not nvml.available and nvml.note.startswith("not measured: no GPU")


# --- the CLI ---------------------------------------------------------------------------------


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["profile", *argv])
    return int(args.func(args))


@pytest.fixture
def echo_repo(tmp_path: Path) -> Path:
    model = tmp_path / "repo" / "echo"
    (model / "1").mkdir(parents=True)
    (model / "config.toml").write_text(ECHO_TOML)
    return tmp_path / "repo"


FAST_ARGS = ("--batch-sizes", "1,2", "--warmup", "0", "--repeats", "2")


def test_cli_prints_a_table_and_writes_json_and_png(
    echo_repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert run_cli("echo", "--repository", str(echo_repo), "--out", str(out), *FAST_ARGS) == 0
    printed = capsys.readouterr().out
    assert "fulcrum profile echo [slow]" in printed and "rows/s" in printed
    assert "knee" in printed and "not measured: no GPU" in printed
    data = json.loads((out / "profile.json").read_text())
    assert data["variant"] == "slow" and [p["batch_size"] for p in data["points"]] == [1, 2]
    assert (out / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_all_variants_compares_them(
    echo_repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ("echo", "--repository", str(echo_repo), "--all-variants", "--out", str(out))
    assert run_cli(*argv, *FAST_ARGS) == 0
    assert "variants compared" in capsys.readouterr().out
    variants = json.loads((out / "profile.json").read_text())["variants"]
    assert sorted(variants) == ["fast", "slow"]
    # The variant's parameters reached the backend: slow sleeps 3 ms + 0.5 ms a row, fast 1 ms.
    assert variants["slow"]["points"][0]["latency_ms_p50"] >= 3.5


def test_cli_errors_name_what_is_missing(echo_repo: Path, tmp_path: Path) -> None:
    with pytest.raises(NotFound, match=r"no model 'nope'.*\['echo'\]"):
        run_cli("nope", "--repository", str(echo_repo))
    with pytest.raises(ConfigError, match=r"no variant 'int4'.*'slow', 'fast'"):
        run_cli("echo", "--repository", str(echo_repo), "--variant", "int4")
    with pytest.raises(NotFound, match="no version 7"):
        run_cli("echo", "--repository", str(echo_repo), "--version", "7")
    (echo_repo / "echo" / "1").rmdir()
    with pytest.raises(NotFound, match="no version folder"):
        run_cli("echo", "--repository", str(echo_repo))
    with pytest.raises(NotFound, match="no model repository"):
        run_cli("echo", "--repository", str(tmp_path / "missing"))


def test_cli_margin_takes_percent_or_fraction() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["profile", "m", "--repository", ".", "--knee-margin", "15%"])
    assert args.knee_margin == pytest.approx(0.15)
    args = parser.parse_args(["profile", "m", "--repository", ".", "--backoff", "0.3"])
    assert args.backoff == pytest.approx(0.3)
    with pytest.raises(SystemExit):
        parser.parse_args(["profile", "m", "--repository", ".", "--backoff", "150%"])
