"""`fulcrum quantize` on small ONNX graphs built here, and once on the minilm example."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from fulcrum.config import ModelConfig, load_model_config
from fulcrum.errors import ConfigError, NotFound
from fulcrum.tuning import quantize, quantize_cli
from fulcrum.tuning.fidelity import Fidelity, cosine, top1_agreement
from fulcrum.tuning.profile import ProfileOptions
from fulcrum.tuning.quantize import (
    QUANTIZERS,
    QuantizeJob,
    QuantizeOptions,
    Row,
    Speed,
    VariantFile,
    _judge,
    quantize_model,
    quantizer_for,
)
from fulcrum.tuning.quantize_onnx import gelu_fed_matmuls, name_nodes

CONFIG = """\
# a tiny classifier: keep this comment
platform = "onnx"
max_batch_size = 8

[[inputs]]
name = "x"
datatype = "FP32"
shape = [16]

[[outputs]]
name = "{output}"
datatype = "FP32"
shape = [{width}]

[parameters]
intra_op_threads = 1  # one thread, as the test machine is small
"""
NO_MEASURE = QuantizeOptions(measure=False, num_rows=32)


def _weight(rng: np.random.Generator, name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.5, name)


def classifier_graph() -> onnx.ModelProto:
    """x (N, 16) -> MatMul + Add -> Relu -> MatMul + Add -> logits (N, 4): 676 weights."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["o"]),
        helper.make_node("Add", ["o", "b2"], ["logits"]),
    ]
    inits = [
        _weight(rng, "w1", 16, 32),
        _weight(rng, "b1", 32),
        _weight(rng, "w2", 32, 4),
        _weight(rng, "b2", 4),
    ]
    return _model(nodes, inits, "logits", 4)


def embedding_graph() -> onnx.ModelProto:
    """x (N, 16) -> MatMul -> L2 normalisation -> embedding (N, 64)."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"]),
        helper.make_node("LpNormalization", ["y"], ["embedding"], axis=-1, p=2),
    ]
    return _model(nodes, [_weight(rng, "w", 16, 64)], "embedding", 64)


def _model(
    nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], output: str, width: int
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["N", width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _repository(tmp_path: Path, model: onnx.ModelProto, output: str, width: int) -> Path:
    folder = tmp_path / "repo" / "tiny" / "1"
    folder.mkdir(parents=True)
    onnx.save(model, str(folder / "model.onnx"))
    (folder.parent / "config.toml").write_text(CONFIG.format(output=output, width=width))
    return tmp_path / "repo"


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    """Batches of 8 rows, as the quantizer runs them: int8 dynamic scales each batch's
    activations by that batch's range, so other batches give other outputs."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    parts = [session.run(None, {"x": x[i : i + 8]})[0] for i in range(0, len(x), 8)]
    return np.concatenate(parts)


def _rows() -> np.ndarray:
    # the generated validation rows: seeded standard normal (32, 16)
    return np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)


@pytest.mark.parametrize(
    ("precision", "tolerance"),
    [("fp16", 0.01), ("int8", 0.3), ("int8-static", 0.3), ("int4", 0.6)],
)
def test_each_onnx_precision_loads_and_stays_close(
    tmp_path: Path, precision: str, tolerance: float
) -> None:
    repo = _repository(tmp_path, classifier_graph(), "logits", 4)
    options = QuantizeOptions(precisions=(precision,), measure=False, num_rows=32)
    report = quantize_model(repo, "tiny", options)
    version = repo / "tiny" / "1"
    written = version / f"model.{precision}.onnx"
    x = _rows()
    reference, variant = _run(version / "model.onnx", x), _run(written, x)
    assert variant.dtype == np.float32  # served inputs and outputs stay FP32
    assert np.max(np.abs(variant - reference)) < tolerance * np.max(np.abs(reference))
    row = report.rows[1]
    assert row.fidelity_metric == "top1"  # an output named "logits"
    assert row.fidelity == pytest.approx(top1_agreement(reference, variant).value)
    assert row.size_bytes == written.stat().st_size


def test_the_config_gets_reference_and_variant_and_keeps_comments(tmp_path: Path) -> None:
    repo = _repository(tmp_path, classifier_graph(), "logits", 4)
    quantize_model(repo, "tiny", QuantizeOptions(precisions=("int8",), measure=False))
    path = repo / "tiny" / "config.toml"
    text = path.read_text()
    assert "# a tiny classifier: keep this comment" in text
    assert "# one thread, as the test machine is small" in text
    config = load_model_config(path, dir_name="tiny")
    assert config.default_variant == "fp32"
    assert config.variants["fp32"].parameters == {"model_file": "model.onnx"}
    int8 = config.variants["int8"]
    assert int8.parameters == {"model_file": "model.int8.onnx"}
    assert int8.precision == "int8"
    assert int8.figures.reference == "fp32"
    assert int8.figures.size_bytes == (repo / "tiny" / "1" / "model.int8.onnx").stat().st_size
    assert int8.figures.fidelity is not None and int8.figures.measured_at
    assert int8.figures.latency_ms is None  # not measured: not made up


def test_an_embedding_model_is_judged_by_cosine(tmp_path: Path) -> None:
    repo = _repository(tmp_path, embedding_graph(), "embedding", 64)
    report = quantize_model(
        repo, "tiny", QuantizeOptions(precisions=("int8",), measure=False, num_rows=32)
    )
    version = repo / "tiny" / "1"
    x = _rows()
    expected = cosine(_run(version / "model.onnx", x), _run(version / "model.int8.onnx", x))
    row = report.rows[1]
    assert row.fidelity_metric == "cosine"
    assert row.fidelity == pytest.approx(expected.value, abs=1e-6)
    assert row.fidelity is not None and row.fidelity > 0.99


def test_a_variant_below_the_bound_is_kept_but_not_loaded(tmp_path: Path) -> None:
    repo = _repository(tmp_path, embedding_graph(), "embedding", 64)
    options = QuantizeOptions(precisions=("int8",), measure=False, min_fidelity=0.99999)
    report = quantize_model(repo, "tiny", options)
    assert report.rows[1].verdict.startswith("below fidelity bound")
    config = load_model_config(repo / "tiny" / "config.toml", dir_name="tiny")
    assert config.variants["int8"].load is False
    assert config.variants["int8"].figures.fidelity == report.rows[1].fidelity


def test_measured_figures_are_recorded(tmp_path: Path) -> None:
    repo = _repository(tmp_path, classifier_graph(), "logits", 4)
    profile = ProfileOptions(batch_sizes=(1, 2), warmup=1, repeats=2, max_seconds_per_point=1.0)
    options = QuantizeOptions(precisions=("int8",), num_rows=8, profile=profile)
    report = quantize_model(repo, "tiny", options)
    base, int8 = report.rows
    assert base.latency_ms is not None and base.throughput_rps is not None
    assert int8.knee_batch in (1, 2)
    assert int8.throughput_gain == pytest.approx(int8.throughput_rps / base.throughput_rps)
    config = load_model_config(repo / "tiny" / "config.toml", dir_name="tiny")
    figures = config.variants["int8"].figures
    assert figures.throughput_rps == pytest.approx(int8.throughput_rps)
    assert figures.machine  # where it was measured


def _row(latency_gain: float | None, throughput_gain: float | None, fidelity: float) -> Row:
    row = Row("v", "int8", size_bytes=50, fidelity=fidelity, fidelity_metric="cosine")
    row.latency_ms = None if latency_gain is None else 10.0 / latency_gain
    row.throughput_rps = None if throughput_gain is None else 100.0 * throughput_gain
    return row


def test_judge_reports_slower_and_less_faithful_variants() -> None:
    base = Row("fp32", "fp32", size_bytes=100, latency_ms=10.0, throughput_rps=100.0)
    slower = _row(0.5, 0.4, 0.999)  # FP16 on a CPU without FP16 units
    _judge(slower, base, 0.99)
    assert slower.verdict == "slower than the reference" and not slower.load
    assert slower.size_ratio == pytest.approx(0.5)
    unfaithful = _row(2.0, 2.0, 0.95)
    _judge(unfaithful, base, 0.99)
    assert unfaithful.verdict.startswith("below fidelity bound") and not unfaithful.load
    good = _row(1.5, 0.9, 0.995)  # faster alone, a little slower at the knee: still a gain
    _judge(good, base, 0.99)
    assert good.verdict == "ok" and good.load
    unmeasured = _row(None, None, 0.995)
    _judge(unmeasured, base, 0.99)
    assert unmeasured.verdict == "ok (speed not measured)"


def ffn_graph() -> onnx.ModelProto:
    """An FFN: up-projection, erf GELU (x * 0.5) * (1 + erf(x / sqrt 2)), down-projection."""
    rng = np.random.default_rng(2)
    # FFN: up-projection, erf GELU (x * 0.5) * (1 + erf(x / sqrt 2)), down-projection
    nodes = [
        helper.make_node("MatMul", ["x", "up"], ["h"]),
        helper.make_node("Div", ["h", "sqrt2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["h", "e1"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["g"]),
        helper.make_node("MatMul", ["g", "down"], ["y"]),
    ]
    consts = [numpy_helper.from_array(np.float32(v), n) for n, v in
              [("sqrt2", 1.4142135), ("one", 1.0), ("half", 0.5)]]  # fmt: skip
    inits = [_weight(rng, "up", 16, 32), _weight(rng, "down", 32, 16), *consts]
    return _model(nodes, inits, "y", 16)


def test_gelu_fed_matmuls_are_found_and_unnamed_nodes_named() -> None:
    model = ffn_graph()
    name_nodes(model)
    names = [n.name for n in model.graph.node]
    assert len(set(names)) == len(names) and all(names)
    assert gelu_fed_matmuls(model) == [names[-1]]  # the down-projection, not the up


def test_int8_retries_with_gelu_fed_matmuls_in_float_when_below_the_bound(
    tmp_path: Path,
) -> None:
    repo = _repository(tmp_path, ffn_graph(), "y", 16)
    options = QuantizeOptions(precisions=("int8",), measure=False, num_rows=16, min_fidelity=1.0)
    row = quantize_model(repo, "tiny", options).rows[1]
    assert [n.split(":")[0] for n in row.notes if "cosine" in n] == [
        "every weight int8",
        "1 GELU-fed MatMuls kept in float",
    ]
    written = onnx.load(str(repo / "tiny" / "1" / "model.int8.onnx"))
    ops = [n.op_type for n in written.graph.node]
    assert ops.count("MatMul") == 1 and ops.count("MatMulInteger") == 1  # down stays float
    assert row.verdict.startswith("below fidelity bound")  # 1.0 is out of reach: reported


def test_gelu_search_stops_at_non_elementwise_ops() -> None:
    rng = np.random.default_rng(3)
    # fused form: up -> Gelu -> down -> Add -> LayerNormalization -> next
    nodes = [
        helper.make_node("MatMul", ["x", "up"], ["h"], name="up"),
        helper.make_node("Gelu", ["h"], ["g"], name="gelu"),
        helper.make_node("MatMul", ["g", "down"], ["d"], name="down"),
        helper.make_node("Add", ["d", "x"], ["r"], name="residual"),
        helper.make_node("LayerNormalization", ["r", "scale"], ["n"], name="norm"),
        helper.make_node("MatMul", ["n", "next"], ["y"], name="next"),
    ]
    inits = [
        _weight(rng, "up", 16, 32),
        _weight(rng, "down", 32, 16),
        _weight(rng, "scale", 16),
        _weight(rng, "next", 16, 16),
    ]
    assert gelu_fed_matmuls(_model(nodes, inits, "y", 16)) == ["down"]


def test_errors_name_the_problem(tmp_path: Path) -> None:
    repo = _repository(tmp_path, classifier_graph(), "logits", 4)
    with pytest.raises(NotFound, match="no model 'nope'"):
        quantize_model(repo, "nope", NO_MEASURE)
    (repo / "tiny" / "1" / "model.onnx").unlink()
    with pytest.raises(ConfigError, match="no model file"):
        quantize_model(repo, "tiny", NO_MEASURE)
    with pytest.raises(ConfigError, match="precisions \\['int3'\\]"):
        quantize_model(repo, "tiny", QuantizeOptions(precisions=("int3",)))
    with pytest.raises(ConfigError, match="platform 'echo': fulcrum quantize supports"):
        quantizer_for("echo")
    assert "llm" in QUANTIZERS  # the LLM engine's quantizer plugs in here


class FakeQuantizer:
    """A platform quantizer without a batch backend (as the LLM engine's): fixed figures."""

    supported = ("int8",)
    default_model_file = "model.onnx"

    def __init__(self) -> None:
        self.rows_seen: list[int] = []

    def write(self, job: QuantizeJob, precision: str) -> VariantFile:
        path = job.version_dir / "model.int8.bin"
        path.write_bytes(b"x" * 25)
        self.rows_seen.append(job.validation.num_rows)
        return VariantFile(precision, {"model_file": "model.int8.bin"}, (path,), ("fake",))

    def fidelity(self, job: QuantizeJob, variant: ModelConfig) -> Fidelity:
        assert variant.parameters["model_file"] == "model.int8.bin"
        return Fidelity(0.995, "token_agreement")

    def measure(self, job: QuantizeJob, config: ModelConfig, options: ProfileOptions) -> Speed:
        is_variant = config.parameters.get("model_file") == "model.int8.bin"
        rps = 300.0 if is_variant else 100.0
        return Speed(5.0 if is_variant else 10.0, 4, rps, "test machine")


def test_the_dispatcher_drives_any_platform_quantizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    version = tmp_path / "repo" / "m" / "1"
    version.mkdir(parents=True)
    (version / "model.onnx").write_bytes(b"x" * 100)
    (version.parent / "config.toml").write_text('platform = "onnx"  # no inputs declared\n')
    fake = FakeQuantizer()
    monkeypatch.setattr(quantize, "quantizer_for", lambda platform: fake)
    report = quantize_model(tmp_path / "repo", "m", QuantizeOptions(precisions=("int8", "fp16")))
    base, int8, fp16 = report.rows
    assert base.verdict == "reference" and base.size_bytes == 100
    assert fake.rows_seen == [0]  # no declared inputs: the quantizer brings its own prompts
    assert (int8.size_ratio, int8.latency_gain, int8.throughput_gain) == (0.25, 2.0, 3.0)
    assert int8.verdict == "ok" and fp16.verdict.startswith("unsupported")
    config = load_model_config(version.parent / "config.toml", dir_name="m")
    figures = config.variants["int8"].figures
    assert figures.fidelity_metric == "token_agreement" and figures.machine == "test machine"
    assert config.variants["fp32"].figures.throughput_rps == 100.0
    assert set(config.variants) == {"fp32", "int8"}


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    quantize_cli.register(parser.add_subparsers())
    return parser.parse_args(argv)


def test_cli_exits_2_naming_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = _repository(tmp_path, classifier_graph(), "logits", 4)
    config = repo / "tiny" / "config.toml"
    config.write_text('platform = "echo"\nmax_batch_size = 8\n')
    args = _cli(["quantize", "tiny", "--repository", str(repo), "--no-measure"])
    assert args.func(args) == 2
    assert "platform 'echo'" in capsys.readouterr().err
    args = _cli(["quantize", "ghost", "--repository", str(repo)])
    assert args.func(args) == 2
    assert "no model 'ghost'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def minilm_run(
    example_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, int]:
    """One CLI run on a copy of minilm: int8, small measuring settings (a few seconds)."""
    repo = tmp_path_factory.mktemp("quantize") / "repo"
    shutil.copytree(example_repo / "minilm", repo / "minilm")
    out = repo.parent / "out"
    argv = ["quantize", "minilm", "--repository", str(repo), "--precisions", "int8"]
    argv += ["--rows", "16", "--batch-sizes", "1,4", "--repeats", "2"]
    argv += ["--seconds-per-point", "1", "--out", str(out)]
    args = _cli(argv)
    return repo, out, args.func(args)


def test_cli_on_minilm_writes_variant_figures_and_json(
    minilm_run: tuple[Path, Path, int],
) -> None:
    repo, out, code = minilm_run
    assert code == 0
    assert (repo / "minilm" / "1" / "model.int8.onnx").is_file()
    config = load_model_config(repo / "minilm" / "config.toml", dir_name="minilm")
    assert config.default_variant == "fp32"
    figures = config.variants["int8"].figures
    assert figures.fidelity_metric == "cosine"
    assert figures.fidelity is not None and figures.fidelity > 0.95
    assert figures.latency_ms is not None
    assert figures.knee_batch is not None and 1 <= figures.knee_batch <= 4
    report = json.loads((out / "quantize.json").read_text())
    assert [row["name"] for row in report["rows"]] == ["fp32", "int8"]
    assert report["rows"][1]["fidelity"] == pytest.approx(figures.fidelity)
