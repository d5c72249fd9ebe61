"""ONNX variants with ONNX Runtime's tools: FP16 (inputs and outputs kept FP32), INT8 dynamic,
INT8 static (QDQ, calibrated on the validation rows through the server's text front end) and
INT4 weight-only (MatMulNBits, blocks of 32). Each goes next to the model as `model.<p>.onnx`.

Weights are QInt8: ORT's x86 integer GEMM is u8 activations x s8 weights (VNNI's `vpdpbusd`);
QUInt8 weights take a slower u8 x u8 path (minilm, Zen 4: x1.1-1.4 against x1.6-2.9 for s8).
On x86 without VNNI that u8 x s8 product can saturate, so weights get 7 bits (`reduce_range`).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from fulcrum.config import ModelConfig
from fulcrum.errors import ModelError
from fulcrum.extras import require
from fulcrum.tuning.fidelity import Fidelity
from fulcrum.tuning.quantize import (
    PRECISIONS,
    QuantizeJob,
    VariantFile,
    model_path,
)
from fulcrum.tuning.quantize_batch import BatchQuantizer
from fulcrum.types import TensorMap

INT4_BLOCK_SIZE = 32
# Ops whose output feeds an FFN down-projection: GELU's activations have a long positive tail
# that one per-tensor int8 scale flattens. On minilm, quantizing those 6 MatMuls alone cost
# cosine 0.999 -> 0.969; keeping them in float lifts the whole int8 model from 0.993 to 0.996.
_GELU_OPS = ("Erf", "Gelu", "FastGelu", "BiasGelu", "QuickGelu")
# The erf form of GELU, (x * 0.5) * (1 + erf(x / sqrt 2)), puts Erf four producers above the
# MatMul: Mul <- Mul <- Add <- Erf. A fused Gelu op is one producer above it.
_GELU_SEARCH_DEPTH = 4
_ELEMENTWISE_OPS = ("Mul", "Add", "Div", "Sub", "Cast", "Identity")  # searched through
_CALIBRATION_BATCH = 8
_LARGE_MODEL_BYTES = 1_500_000_000  # protobuf's 2 GB limit, with room: write external data


@dataclass(frozen=True)
class Attempt:
    """One way to quantize: what it keeps in float, and its note for the table."""

    exclude: tuple[str, ...]
    note: str


class OnnxQuantizer(BatchQuantizer):
    """Writes the four ONNX precisions; each int8 kind retries with GELU-fed MatMuls in float
    when quantizing every weight misses the fidelity bound."""

    supported = PRECISIONS
    default_model_file = "model.onnx"

    def __init__(self) -> None:
        super().__init__()
        require("tune", "onnx", feature="fulcrum quantize (ONNX models)")  # fail before any work

    def write(self, job: QuantizeJob, precision: str) -> VariantFile:
        import onnx

        source = model_path(job.config, job.version_dir, self.default_model_file)
        target = source.with_name(f"{source.name.split('.')[0]}.{precision}.onnx")
        with tempfile.TemporaryDirectory(prefix="fulcrum-quantize-") as scratch:
            if precision == "fp16":
                return self._done(job, precision, target, _fp16(source, target), None)
            if precision == "int4":
                return self._done(job, precision, target, _int4(source, target), None)
            # ORT's symbolic shape inference, when it gives up, saves a debug copy of the model
            # (and a ~90 MB external data file) into the working directory: keep it in scratch.
            with contextlib.chdir(scratch):
                prepared, notes = _pre_process(source, Path(scratch) / "prepared.onnx")
            named = Path(scratch) / "named.onnx"
            model = onnx.load(str(prepared))
            name_nodes(model)  # after pre-processing, whose fusions may add unnamed nodes
            onnx.save(model, str(named), save_as_external_data=_is_large(prepared))
            quantize = _dynamic if precision == "int8" else _static_with(job, source)
            return self._best(job, precision, target, named, quantize, notes)

    def _best(
        self,
        job: QuantizeJob,
        precision: str,
        target: Path,
        prepared: Path,
        quantize: Callable[[Path, Path, tuple[str, ...]], None],
        notes: list[str],
    ) -> VariantFile:
        """The first attempt that meets the bound, else the last one (reported as failing)."""
        found: Fidelity | None = None
        for attempt in attempts(prepared):
            with _quiet():
                quantize(prepared, target, attempt.exclude)
            found = self.fidelity(job, _variant(job, target))
            notes.append(f"{attempt.note}: {found.metric} {found.value:.4f}")
            if found.value >= job.min_fidelity:
                break
        return self._done(job, precision, target, notes, found)

    def _done(
        self,
        job: QuantizeJob,
        precision: str,
        target: Path,
        notes: list[str],
        found: Fidelity | None,
    ) -> VariantFile:
        relative = str(target.relative_to(job.version_dir))
        return VariantFile(precision, {"model_file": relative}, (target,), tuple(notes), found)


def _variant(job: QuantizeJob, target: Path) -> ModelConfig:
    relative = str(target.relative_to(job.version_dir))
    parameters = {**job.config.parameters, "model_file": relative}
    return msgspec.structs.replace(job.config, parameters=parameters)


def name_nodes(model: Any) -> None:
    """Give unnamed nodes unique names: ORT's quantizers exclude nodes by name only."""
    taken = {node.name for node in model.graph.node if node.name}
    for index, node in enumerate(model.graph.node):
        if not node.name:
            name = f"{node.op_type}_{index}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)


def gelu_fed_matmuls(model: Any) -> list[str]:
    """MatMuls with a constant weight whose activation is a GELU's output, directly or through a
    few elementwise ops."""
    producers = {out: node for node in model.graph.node for out in node.output}
    weights = {init.name for init in model.graph.initializer}

    def from_gelu(tensor: str, depth: int) -> bool:
        node = producers.get(tensor)
        if node is None or depth == 0:
            return False
        if node.op_type in _GELU_OPS:
            return True
        if node.op_type not in _ELEMENTWISE_OPS:
            return False  # a MatMul, norm or attention in between: another distribution
        return any(from_gelu(i, depth - 1) for i in node.input if i not in weights)

    return [
        node.name
        for node in model.graph.node
        if node.op_type == "MatMul"
        and len(node.input) == 2
        and node.input[1] in weights
        and from_gelu(node.input[0], _GELU_SEARCH_DEPTH)
    ]


def attempts(model_file: Path) -> list[Attempt]:
    """Every weight first; then, if the graph has GELU-fed MatMuls, those kept in float."""
    import onnx

    first = Attempt((), "every weight int8")
    excluded = tuple(gelu_fed_matmuls(onnx.load(str(model_file), load_external_data=False)))
    if not excluded:
        return [first]
    return [first, Attempt(excluded, f"{len(excluded)} GELU-fed MatMuls kept in float")]


def cpu_has_vnni() -> bool:
    """Whether this x86 CPU has VNNI (AVX512-VNNI or AVX-VNNI); True elsewhere (ARM: no issue)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i686"):
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


def _pre_process(source: Path, target: Path) -> tuple[Path, list[str]]:
    """ORT's recommended preparation (shape inference, basic graph fusions); without symbolic
    shape inference when it cannot follow the graph (it gives up on minilm's dynamic
    reshapes); the model as it was, with a note, when neither works."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    notes: list[str] = []
    for skip_symbolic in (False, True):
        try:
            with _quiet():
                quant_pre_process(str(source), str(target), skip_symbolic_shape=skip_symbolic)
        except Exception as exc:  # shape inference raises bare exceptions on unusual graphs
            notes.append(f"pre-processing failed ({type(exc).__name__}: {exc})")
            continue
        if skip_symbolic:
            notes.append("pre-processed without symbolic shape inference")
        return target, notes[-1:]
    return source, notes[-1:]


def _is_large(path: Path) -> bool:
    return path.stat().st_size > _LARGE_MODEL_BYTES


def _dynamic(source: Path, target: Path, exclude: tuple[str, ...]) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        str(source),
        str(target),
        weight_type=QuantType.QInt8,
        per_channel=True,  # minilm: cosine 0.963 per tensor, 0.993 per channel
        reduce_range=not cpu_has_vnni(),
        nodes_to_exclude=list(exclude),
        use_external_data_format=_is_large(source),
    )


def _static_with(job: QuantizeJob, source: Path) -> Callable[[Path, Path, tuple[str, ...]], None]:
    def run(prepared: Path, target: Path, exclude: tuple[str, ...]) -> None:
        from onnxruntime.quantization import (
            CalibrationMethod,
            QuantFormat,
            QuantType,
            quantize_static,
        )

        quantize_static(
            str(prepared),
            str(target),
            _Calibration(job, source),
            quant_format=QuantFormat.QDQ,
            # The compute ops only: Add, Softmax and LayerNorm stay float, their int8 kernels
            # would add Q/DQ pairs around every residual for little speed on CPU.
            op_types_to_quantize=["MatMul", "Gemm", "Conv"],
            per_channel=True,
            reduce_range=not cpu_has_vnni(),
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=list(exclude),
            calibrate_method=CalibrationMethod.MinMax,
            extra_options={"MatMulConstBOnly": True},
            use_external_data_format=_is_large(prepared),
        )

    return run


class _Calibration:
    """ORT's CalibrationDataReader: the validation rows, encoded by the text front end the
    server uses, cast to the graph's input types, in batches of a few rows."""

    def __init__(self, job: QuantizeJob, source: Path) -> None:
        import onnx

        from fulcrum.backends.text import TextFrontEnd

        graph = onnx.load(str(source), load_external_data=False).graph
        self.types = {
            i.name: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
            for i in graph.input
        }
        tokenizer = job.config.tokenizer
        self.front = TextFrontEnd(tokenizer, job.version_dir) if tokenizer else None
        self.batches = self._batches(job.validation.inputs)

    def _batches(self, inputs: TensorMap) -> Iterator[dict[str, np.ndarray[Any, Any]]]:
        num_rows = len(next(iter(inputs.values())))
        for start in range(0, num_rows, _CALIBRATION_BATCH):
            rows = {k: v[start : start + _CALIBRATION_BATCH] for k, v in inputs.items()}
            if self.front is not None:
                rows.update(self.front.encode(rows.pop(self.front.spec.input)))
            yield {k: v.astype(self.types[k]) for k, v in rows.items() if k in self.types}

    def get_next(self) -> dict[str, np.ndarray[Any, Any]] | None:
        return next(self.batches, None)


def _fp16(source: Path, target: Path) -> list[str]:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(source))
    try:
        with _quiet():
            # keep_io_types: the served inputs and outputs stay FP32, casts sit inside the graph.
            converted = convert_float_to_float16(model, keep_io_types=True)
    except Exception as exc:  # the converter raises bare exceptions on graphs it cannot follow
        raise ModelError(f"FP16 conversion failed: {exc}") from exc
    onnx.save(converted, str(target))
    return ["FP16 weights and compute, FP32 inputs and outputs"]


def _int4(source: Path, target: Path) -> list[str]:
    import onnx

    # ORT's n-bit quantizer imports onnx_ir, which onnxruntime does not itself require.
    require("tune", "onnx_ir", feature="fulcrum quantize --precisions int4")
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(source))
    # Asymmetric: a zero point per block fits skewed blocks better (minilm: cosine 0.969
    # against 0.960 symmetric). Accuracy level 4 computes in int8, ORT's fastest CPU path.
    quantizer = MatMulNBitsQuantizer(
        model, bits=4, block_size=INT4_BLOCK_SIZE, is_symmetric=False, accuracy_level=4
    )
    with _quiet():
        quantizer.process()
    quantizer.model.save_model_to_file(str(target), use_external_data_format=_is_large(source))
    return [
        f"INT4 weight-only MatMuls (MatMulNBits, block {INT4_BLOCK_SIZE}, asymmetric; "
        "accuracy level 4: int8 compute)"
    ]


@contextmanager
def _quiet() -> Iterator[None]:
    """ORT's quantization tools log advice at WARNING through the root logger and raise
    deprecation warnings from their own imports; neither concerns the user here."""
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        logger.setLevel(level)
