from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from test_faster_of_two import measured

from fulcrum.backends import create_backend
from fulcrum.backends.casting import cast_to
from fulcrum.backends.onnx import OnnxBackend, session_options
from fulcrum.config import ModelConfig, TensorSpec
from fulcrum.errors import ConfigError, InvalidInput, ModelError
from fulcrum.parameters import OnnxParameters

ParamValue = str | int | float | bool | list[str]


def write_add_graph(path: Path) -> None:
    """x (int64 [B, 2]) and y (float [B, 2]) -> as_float = Cast(x), total = as_float + y."""
    nodes = [
        oh.make_node("Cast", ["x"], ["as_float"], to=onnx.TensorProto.FLOAT),
        oh.make_node("Add", ["as_float", "y"], ["total"]),
    ]
    graph = oh.make_graph(
        nodes,
        "add",
        [
            oh.make_tensor_value_info("x", onnx.TensorProto.INT64, ["B", 2]),
            oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["B", 2]),
        ],
        [
            oh.make_tensor_value_info("total", onnx.TensorProto.FLOAT, ["B", 2]),
            oh.make_tensor_value_info("as_float", onnx.TensorProto.FLOAT, ["B", 2]),
        ],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def make_config(
    *,
    outputs: tuple[str, ...] = ("total",),
    inputs: tuple[str, ...] = ("x", "y"),
    **parameters: ParamValue,
) -> ModelConfig:
    dtypes = {"x": "INT64", "y": "FP32"}
    # Fulcrum's own logic, pinned to the CPU: a GPU machine's default is CUDA (tests/gpu).
    parameters.setdefault("execution_providers", ["CPUExecutionProvider"])
    return ModelConfig(
        name="add",
        platform="onnx",
        max_batch_size=8,
        inputs=tuple(
            TensorSpec(name=n, datatype=dtypes.get(n, "FP32"), shape=(2,)) for n in inputs
        ),
        outputs=tuple(TensorSpec(name=n, datatype="FP32", shape=(2,)) for n in outputs),
        parameters=dict(parameters),
    )


@pytest.fixture
def version_dir(tmp_path: Path) -> Path:
    write_add_graph(tmp_path / "model.onnx")
    return tmp_path


def batch(x: np.ndarray | None = None, y: np.ndarray | None = None) -> dict[str, np.ndarray]:
    return {
        "x": np.array([[1, 2], [3, 4]], dtype=np.int64) if x is None else x,
        "y": np.array([[0.5, 0.5], [1.0, 1.0]], dtype=np.float32) if y is None else y,
    }


def test_runs_and_returns_only_config_outputs(version_dir: Path) -> None:
    backend = create_backend(make_config(intra_op_threads=1), version_dir)
    out = backend.execute(batch())
    assert list(out) == ["total"]
    np.testing.assert_allclose(out["total"], [[1.5, 2.5], [4.0, 5.0]])
    backend.close()


def test_no_config_outputs_returns_every_graph_output(version_dir: Path) -> None:
    out = OnnxBackend(make_config(outputs=()), version_dir).execute(batch())
    assert sorted(out) == ["as_float", "total"]
    np.testing.assert_array_equal(out["as_float"], [[1, 2], [3, 4]])


def test_narrower_ints_and_wider_floats_are_cast_to_the_graph_dtype(version_dir: Path) -> None:
    backend = OnnxBackend(make_config(), version_dir)
    x32 = np.array([[1, 2], [3, 4]], dtype=np.int32)
    y64 = np.array([[0.5, 0.5], [1.0, 1.0]], dtype=np.float64)
    out = backend.execute(batch(x32, y64))
    np.testing.assert_allclose(out["total"], [[1.5, 2.5], [4.0, 5.0]])


@pytest.mark.parametrize(
    "x", [np.ones((2, 2), np.float32), np.ones((2, 2), np.uint8), np.ones((2, 2), np.bool_)]
)
def test_a_different_kind_of_dtype_is_refused(version_dir: Path, x: np.ndarray) -> None:
    with pytest.raises(InvalidInput, match=f"input 'x': datatype {x.dtype} cannot be fed as int64"):
        OnnxBackend(make_config(), version_dir).execute(batch(x))


def test_cast_to_refuses_narrowing_that_would_wrap() -> None:
    big = np.array([2**40], dtype=np.int64)
    with pytest.raises(InvalidInput, match="out of range for int32"):
        cast_to("ids", big, np.dtype(np.int32))
    assert cast_to("ids", np.array([7], np.int64), np.dtype(np.int32)).dtype == np.int32


def test_unknown_or_missing_request_inputs_are_invalid_input(version_dir: Path) -> None:
    backend = OnnxBackend(make_config(), version_dir)
    with pytest.raises(InvalidInput, match="unknown input 'z'"):
        backend.execute({**batch(), "z": np.zeros(2)})
    with pytest.raises(InvalidInput, match=r"missing inputs \['y'\]"):
        backend.execute({"x": batch()["x"]})


def test_a_failing_run_is_a_model_error_chained_from_ort(version_dir: Path) -> None:
    bad_y = np.ones((2, 3), dtype=np.float32)  # Add cannot broadcast [2, 2] with [2, 3]
    with pytest.raises(ModelError, match="model 'add' failed") as caught:
        OnnxBackend(make_config(), version_dir).execute(batch(y=bad_y))
    assert caught.value.__cause__ is not None


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("intra_op_threads", "two", "= 'two': Expected `int`, got `str`"),
        ("intra_op_threads", -1, "= -1: Expected `int` >= 0"),
        ("inter_op_threads", True, "Expected `int`, got `bool`"),
        ("graph_optimization_level", "max", "expected one of"),
        ("allow_spinning", "no", "Expected `bool`, got `str`"),
        ("intra_op_thread", 2, r"unknown; expected one of \['allow_spinning'"),
        ("execution_providers", ["NoSuchExecutionProvider"], "not available here"),
        ("execution_providers", "CPUExecutionProvider", "Expected `array \\| null`, got `str`"),
        ("model_file", "../model.onnx", "inside the version"),
        ("model_file", "other.onnx", "no model file"),
    ],
)
def test_bad_parameters_are_config_errors_naming_key_and_value(
    version_dir: Path, key: str, value: ParamValue, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        OnnxBackend(make_config(**{key: value}), version_dir)
    assert key in caught.value.message or "no model file" in message


def test_every_optimization_level_and_explicit_cpu_provider_load(version_dir: Path) -> None:
    for level in ("disable", "basic", "extended", "all"):
        backend = OnnxBackend(
            make_config(
                graph_optimization_level=level,
                execution_providers=["CPUExecutionProvider"],
                allow_spinning=True,
            ),
            version_dir,
        )
        assert backend.session.get_providers() == ["CPUExecutionProvider"]


def test_config_names_missing_from_the_graph_are_config_errors(version_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"inputs \['w'\] are not in the graph"):
        OnnxBackend(make_config(inputs=("x", "w")), version_dir)
    with pytest.raises(ConfigError, match=r"outputs \['nope'\] are not in the graph"):
        OnnxBackend(make_config(outputs=("nope",)), version_dir)


def test_a_corrupt_model_file_is_a_model_error(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(ModelError, match="cannot load"):
        OnnxBackend(make_config(), tmp_path)


def _entry(options: ort.SessionOptions, key: str) -> str | None:
    try:
        return str(options.get_session_config_entry(key))
    except RuntimeError:  # ORT raises for a key that was never set
        return None


def test_spinning_is_off_by_default() -> None:
    options = session_options(OnnxParameters())
    assert _entry(options, "session.intra_op.allow_spinning") == "0"
    assert _entry(options, "session.inter_op.allow_spinning") == "0"
    assert _entry(options, "session.force_spinning_stop") is None


def test_allowed_spinning_goes_on_after_a_run_unless_asked_to_stop() -> None:
    for between in (None, True):  # unset: ONNX Runtime's default, as explicitly true
        options = session_options(OnnxParameters(allow_spinning=True, spin_between_runs=between))
        assert _entry(options, "session.intra_op.allow_spinning") == "1"
        assert _entry(options, "session.force_spinning_stop") is None
    within_runs = session_options(OnnxParameters(allow_spinning=True, spin_between_runs=False))
    assert _entry(within_runs, "session.intra_op.allow_spinning") == "1"
    assert _entry(within_runs, "session.force_spinning_stop") == "1"


def test_dynamic_block_base_reaches_both_sessions_and_is_off_by_default(version_dir: Path) -> None:
    assert _entry(session_options(OnnxParameters()), "session.dynamic_block_base") is None
    backend = OnnxBackend(make_config(dynamic_block_base=4, spin_when_idle=True), version_dir)
    assert backend.lone_session is not None
    for session in (backend.session, backend.lone_session):
        assert _entry(session.get_session_options(), "session.dynamic_block_base") == "4"


def test_the_minilm_example_splits_work_dynamically() -> None:
    import msgspec

    from fulcrum import examples
    from fulcrum.parameters import decode_parameters

    config = msgspec.toml.decode(examples._MINILM_CONFIG.encode())
    params = decode_parameters(config["parameters"], OnnxParameters)
    assert params.dynamic_block_base == 4
    assert _entry(session_options(params), "session.dynamic_block_base") == "4"


def test_a_negative_dynamic_block_base_is_a_config_error(version_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"parameters\.dynamic_block_base"):
        OnnxBackend(make_config(dynamic_block_base=-1), version_dir)


def test_spinning_between_runs_without_spinning_is_a_config_error(version_dir: Path) -> None:
    with pytest.raises(ConfigError, match="'spin_between_runs' = true: needs allow_spinning"):
        OnnxBackend(make_config(spin_between_runs=True), version_dir)


def test_spin_between_runs_false_stops_the_spin_when_idle_session_when_a_run_returns(
    version_dir: Path,
) -> None:
    backend = OnnxBackend(make_config(spin_when_idle=True, spin_between_runs=False), version_dir)
    assert backend.lone_session is not None
    spinning = backend.lone_session.get_session_options()
    assert _entry(spinning, "session.intra_op.allow_spinning") == "1"
    assert _entry(spinning, "session.force_spinning_stop") == "1"  # within its runs only
    assert _entry(backend.session.get_session_options(), "session.force_spinning_stop") is None
    shared_options = backend.session.get_session_options()
    assert _entry(shared_options, "session.intra_op.allow_spinning") == "0"
    backend.close()


class RecordingSession:
    """Stands in for an InferenceSession: records that it ran, returns the real one's outputs."""

    def __init__(self, real: ort.InferenceSession) -> None:
        self.real = real
        self.num_runs = 0

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.num_runs += 1
        return list(self.real.run(names, feeds))


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class TimedSession(RecordingSession):
    """A RecordingSession whose every run takes `run_s` on a fake clock."""

    def __init__(self, real: ort.InferenceSession, clock: FakeClock, run_s: float) -> None:
        super().__init__(real)
        self.clock, self.run_s = clock, run_s

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.clock.now_s += self.run_s
        return super().run(names, feeds)


def test_spin_when_idle_runs_lone_batches_on_a_second_spinning_session(
    version_dir: Path,
) -> None:
    backend = OnnxBackend(make_config(spin_when_idle=True), version_dir)
    assert backend.lone_session is not None
    spinning = backend.lone_session.get_session_options()
    assert _entry(spinning, "session.intra_op.allow_spinning") == "1"
    assert _entry(spinning, "session.force_spinning_stop") is None  # ORT's default: spins on
    shared_options = backend.session.get_session_options()
    assert _entry(shared_options, "session.intra_op.allow_spinning") == "0"
    shared, lone = RecordingSession(backend.session), RecordingSession(backend.lone_session)
    backend.session, backend.lone_session = shared, lone  # type: ignore[assignment]
    expected = [[1.5, 2.5], [4.0, 5.0]]
    assert backend.execute_lone(batch())["total"].tolist() == expected
    assert (lone.num_runs, shared.num_runs) == (1, 0)
    assert backend.execute(batch())["total"].tolist() == expected
    assert (lone.num_runs, shared.num_runs) == (1, 1)
    backend.close()
    assert backend.lone_session is None


def test_lone_batches_leave_the_spinning_session_while_it_is_measured_slower(
    version_dir: Path,
) -> None:
    backend = OnnxBackend(make_config(spin_when_idle=True), version_dir)
    assert backend.lone_session is not None
    shared, lone = RecordingSession(backend.session), RecordingSession(backend.lone_session)
    backend.session, backend.lone_session = shared, lone  # type: ignore[assignment]
    measured(backend.lone_choice, 0.010, 0.005)  # spinning measured at twice the other
    clock = FakeClock()
    backend.clock = clock
    for _ in range(backend.lone_choice.explore_every):
        clock.now_s += 1.0  # sparse runs: the choice is by speed alone
        backend.execute_lone(batch())
    # The faster, non-spinning session ran all but the one exploring run of the spinning one.
    assert (shared.num_runs, lone.num_runs) == (backend.lone_choice.explore_every - 1, 1)


def test_without_spin_when_idle_a_lone_batch_runs_on_the_one_session(version_dir: Path) -> None:
    backend = OnnxBackend(make_config(), version_dir)
    assert backend.lone_session is None
    shared = RecordingSession(backend.session)
    backend.session = shared  # type: ignore[assignment]
    assert backend.execute_lone(batch())["total"].tolist() == [[1.5, 2.5], [4.0, 5.0]]
    assert shared.num_runs == 1


def test_spin_when_idle_beside_allow_spinning_is_a_config_error(version_dir: Path) -> None:
    with pytest.raises(ConfigError, match="'spin_when_idle' = true: the session already spins"):
        OnnxBackend(make_config(spin_when_idle=True, allow_spinning=True), version_dir)


def test_lone_batches_take_the_spinning_session_only_while_runs_are_sparse(
    version_dir: Path,
) -> None:
    backend = OnnxBackend(make_config(spin_when_idle=True, spin_idle_gap_ms=50), version_dir)
    assert backend.lone_session is not None
    shared, lone = RecordingSession(backend.session), RecordingSession(backend.lone_session)
    backend.session, backend.lone_session = shared, lone  # type: ignore[assignment]
    clock = FakeClock()
    backend.clock = clock
    backend.lone_choice.explore_every = 1000  # no exploring runs in this test
    measured(backend.lone_choice, 0.005, 0.008)  # spinning measured faster
    for _ in range(4):  # 5 runs a second: sparse
        clock.now_s += 0.2
        backend.execute_lone(batch())
    assert (lone.num_runs, shared.num_runs) == (4, 0)
    for _ in range(40):  # 100 runs a second, each alone: load, no spinning session
        clock.now_s += 0.01
        backend.execute_lone(batch())
    assert backend.gaps.mean_gap_s < 0.05
    assert lone.num_runs - 4 <= 16 and shared.num_runs >= 24  # within 16 runs of the load
    before = lone.num_runs
    for _ in range(20):  # sparse again: back to the spinning session
        clock.now_s += 0.5
        backend.execute_lone(batch())
    assert lone.num_runs - before >= 15


def test_long_lone_batches_back_to_back_stay_off_the_spinning_session(version_dir: Path) -> None:
    # Under load a batch starts as the last one ends: 60 ms from start to start is more than
    # spin_idle_gap_ms, but the instance never idles, and a spinning pool would take the cores
    # the next batch needs for ~45 ms after each of its runs.
    backend = OnnxBackend(make_config(spin_when_idle=True, spin_idle_gap_ms=50), version_dir)
    assert backend.lone_session is not None
    clock = FakeClock()
    backend.clock = clock
    shared = TimedSession(backend.session, clock, run_s=0.060)
    lone = TimedSession(backend.lone_session, clock, run_s=0.060)
    backend.session, backend.lone_session = shared, lone  # type: ignore[assignment]
    measured(backend.lone_choice, 0.005, 0.008)  # spinning measured faster
    backend.lone_choice.explore_every = 1000
    backend.execute(batch())  # the first run, after an idle machine
    for _ in range(40):
        clock.now_s += 0.0005  # the next batch starts half a millisecond after the last ends
        backend.execute_lone(batch())
    assert lone.num_runs <= 16  # only while the idle before the first run still counts
    assert shared.num_runs >= 24
    before = lone.num_runs
    for _ in range(10):
        clock.now_s += 0.0005
        backend.execute_lone(batch())
    assert lone.num_runs == before  # from then on, never


def write_embedding_graph(path: Path) -> np.ndarray:
    """ids (int64 [B, T]) -> emb = Gather(table, ids) (B, T, 64) -> out = emb @ proj (B, T, 64).
    Returns the table: 1024 x 64 floats (256 KiB), read only by the Gather."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((1024, 64)).astype(np.float32)
    proj = rng.standard_normal((64, 256)).astype(np.float32)[:, :64].copy()
    nodes = [
        oh.make_node("Gather", ["table", "ids"], ["emb"]),
        oh.make_node("MatMul", ["emb", "proj"], ["out"]),
    ]
    graph = oh.make_graph(
        nodes,
        "embed",
        [oh.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["B", "T"])],
        [
            oh.make_tensor_value_info("out", onnx.TensorProto.FLOAT, ["B", "T", 64]),
            oh.make_tensor_value_info("emb", onnx.TensorProto.FLOAT, ["B", "T", 64]),
        ],
        initializer=[
            onnx.numpy_helper.from_array(table, "table"),
            onnx.numpy_helper.from_array(proj, "proj"),
        ],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return table


def embedding_config(**parameters: ParamValue) -> ModelConfig:
    return ModelConfig(
        name="embed",
        platform="onnx",
        max_batch_size=8,
        inputs=(TensorSpec(name="ids", datatype="INT64", shape=(-1,)),),
        outputs=(
            TensorSpec(name="out", datatype="FP32", shape=(-1, 64)),
            TensorSpec(name="emb", datatype="FP32", shape=(-1, 64)),
        ),
        parameters={"execution_providers": ["CPUExecutionProvider"], **parameters},
    )


def test_both_sessions_read_the_embedding_table_from_one_buffer(tmp_path: Path) -> None:
    table = write_embedding_graph(tmp_path / "model.onnx")
    backend = OnnxBackend(embedding_config(spin_when_idle=True), tmp_path)
    assert backend.lone_session is not None
    # The table, read only by a Gather, is shared; the MatMul's weight, which ORT pre-packs
    # into a copy of each session's own, is not.
    assert list(backend.shared_weights) == ["table"]
    buffer = backend.shared_weights["table"].numpy()
    assert buffer.nbytes == table.nbytes and np.array_equal(buffer, table)
    ids = {"ids": np.array([[3, 7, 1000]], dtype=np.int64)}
    plain = backend._execute(backend.session, ids)
    lone = backend._execute(backend.lone_session, ids)
    for name in ("out", "emb"):
        assert np.array_equal(plain[name], lone[name])  # bitwise: same weights, same kernels
    # Writing to the one buffer changes what both sessions read: neither holds a copy.
    buffer[7] = 42.0
    for session in (backend.session, backend.lone_session):
        emb = backend._execute(session, ids)["emb"]
        assert np.all(emb[0, 1] == 42.0) and np.array_equal(emb[0, 0], table[3])
    backend.close()
    assert backend.shared_weights == {}


def test_without_spin_when_idle_ort_loads_every_weight_itself(tmp_path: Path) -> None:
    write_embedding_graph(tmp_path / "model.onnx")
    backend = OnnxBackend(embedding_config(), tmp_path)
    assert backend.shared_weights == {}
    out = backend.execute({"ids": np.array([[1, 2]], dtype=np.int64)})
    assert out["out"].shape == (1, 2, 64)


def test_lone_state_reports_the_choice_between_the_sessions(version_dir: Path) -> None:
    assert OnnxBackend(make_config(), version_dir).lone_state() is None  # no spin_when_idle
    backend = OnnxBackend(make_config(spin_when_idle=True, spin_idle_gap_ms=50), version_dir)
    clock = FakeClock()
    backend.clock = clock
    state = backend.lone_state()
    assert state == {
        "favourite": "spinning",
        "ms_per_row": {"spinning": None, "instance": None},
        "mean_ms_per_row": {"spinning": None, "instance": None},
        "runs": {"spinning": 0, "instance": 0},
        "explore_every": 8,
        "mean_idle_gap_ms": None,
        "sparse": True,  # the first run after a load comes after an idle
    }
    measured(backend.lone_choice, 0.004, 0.006)
    for _ in range(3):
        clock.now_s += 0.2
        backend.execute_lone(batch())
    state = backend.lone_state()
    assert state is not None
    assert state["runs"] == {"spinning": 5, "instance": 2}  # 2 measured each, then 3 favoured
    assert state["favourite"] == "spinning" and state["sparse"] is True
    # Each session's mean over its measured runs (not just the favourite's last few)
    means = state["mean_ms_per_row"]
    assert isinstance(means, dict) and means["instance"] == pytest.approx(6.0)
    assert means["spinning"] is not None and means["spinning"] > 0
    # The first run's idle counts as 5 gaps of 50 ms (250 ms), then two of 200 ms at 10%.
    assert state["mean_idle_gap_ms"] == pytest.approx(240.5)
