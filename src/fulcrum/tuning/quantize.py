"""`fulcrum quantize`'s core: write precision variants of a model next to its file, measure each
against the reference variant in the same run (size, batch-1 latency, throughput at the knee,
fidelity on the validation rows) and record the figures as `[variants.*]` in its config.

Platforms plug in through `QUANTIZERS`: "module:Class" of a `Quantizer`, imported lazily and
built with no arguments (its `__init__` checks its optional packages, so a missing one fails
before any work). Batch platforms subclass `quantize_batch.BatchQuantizer` for `fidelity` and
`measure`; a platform without a batch backend (the LLM engine) implements all three methods.
"""

from __future__ import annotations

import datetime
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec
import tomlkit

from fulcrum.config import ModelConfig, ParamValue, VariantFigures
from fulcrum.errors import ConfigError, FulcrumError
from fulcrum.tuning.config_file import edit_config, set_values, set_variant
from fulcrum.tuning.fidelity import Fidelity
from fulcrum.tuning.locate import locate_model
from fulcrum.tuning.profile import ProfileOptions
from fulcrum.tuning.validation_set import DEFAULT_NUM_ROWS, ValidationSet, load_validation
from fulcrum.variants import default_variant

PRECISIONS = ("fp16", "int8", "int8-static", "int4")
REFERENCE_PRECISION = "fp32"  # the name a model's own file gets when it declares no variants
# platform -> "module:Class" of its Quantizer; None: the platform has none (yet).
QUANTIZERS: dict[str, str | None] = {
    "onnx": "fulcrum.tuning.quantize_onnx:OnnxQuantizer",
    "torch": "fulcrum.tuning.quantize_torch:TorchQuantizer",
    "llm": "fulcrum.tuning.quantize_llm:LlmQuantizer",  # weight-only int8 / int4 safetensors
}


@dataclass(frozen=True)
class QuantizeOptions:
    """What to write and how to judge it."""

    precisions: tuple[str, ...] = PRECISIONS
    variant_from: str | None = None  # None: the default variant
    validation: Path | None = None  # None: generated rows
    num_rows: int = DEFAULT_NUM_ROWS  # generated rows
    min_fidelity: float = 0.99
    metric: str = "auto"
    measure: bool = True  # False: fidelity and size only, no latency or throughput
    profile: ProfileOptions = field(default_factory=ProfileOptions)
    version: int | None = None  # None: the highest version folder
    seed: int = 0


@dataclass(frozen=True)
class QuantizeJob:
    """What a quantizer works from: the reference variant, resolved, and its rows."""

    config: ModelConfig  # the reference variant's config (its parameters laid over the model's)
    reference: str
    version_dir: Path
    validation: ValidationSet
    min_fidelity: float
    metric: str


@dataclass(frozen=True)
class VariantFile:
    """A variant a quantizer wrote: the parameters that select it and the files it added."""

    precision: str
    parameters: dict[str, ParamValue]  # laid over the reference variant's
    files: tuple[Path, ...]
    notes: tuple[str, ...] = ()
    fidelity: Fidelity | None = None  # set when the quantizer measured it already


@dataclass(frozen=True)
class Speed:
    """Batch-1 latency and throughput at the knee of one variant."""

    latency_ms: float | None
    knee_batch: int
    throughput_rps: float
    machine: str
    output_tokens_per_s: float | None = None  # LLMs: generated tokens/s at knee_batch


class Quantizer(Protocol):
    """One platform's way to write variants and to run them for the figures."""

    supported: tuple[str, ...]  # the precisions it can write
    default_model_file: str  # the model file when the config names none

    def write(self, job: QuantizeJob, precision: str) -> VariantFile: ...

    def fidelity(self, job: QuantizeJob, variant: ModelConfig) -> Fidelity: ...

    def measure(self, job: QuantizeJob, config: ModelConfig, options: ProfileOptions) -> Speed: ...


@dataclass
class Row:
    """One line of the result table (the reference is the first)."""

    name: str
    precision: str
    model_file: str = ""
    parameters: dict[str, ParamValue] = field(default_factory=dict)  # the variant's
    written: bool = False  # the variant exists (the reference, or a file was written)
    size_bytes: int | None = None
    size_ratio: float | None = None  # variant / reference
    fidelity: float | None = None
    fidelity_metric: str = ""
    worst_row: float | None = None
    perplexity_ratio: float | None = None  # LLMs: variant / reference perplexity
    latency_ms: float | None = None
    knee_batch: int | None = None
    throughput_rps: float | None = None
    output_tokens_per_s: float | None = None  # LLMs
    latency_gain: float | None = None  # reference latency / variant latency (> 1: faster)
    throughput_gain: float | None = None  # variant throughput / reference throughput
    verdict: str = ""
    load: bool = True
    notes: list[str] = field(default_factory=list)


@dataclass
class QuantizeReport:
    """Everything `fulcrum quantize` found, as written to quantize.json."""

    model: str
    version: str
    reference: str
    validation: str
    num_rows: int
    min_fidelity: float
    machine: str
    measured_at: str
    rows: list[Row]
    config_diff: str = ""

    def to_json(self) -> str:
        return msgspec.json.format(msgspec.json.encode(self).decode(), indent=2)


def quantizer_for(platform: str) -> Quantizer:
    """The platform's quantizer; ConfigError when it has none."""
    target = QUANTIZERS.get(platform)
    if target is None:
        known = sorted(k for k, v in QUANTIZERS.items() if v is not None)
        raise ConfigError(f"platform {platform!r}: fulcrum quantize supports {known}")
    module_name, _, attr = target.partition(":")
    factory: Callable[[], Quantizer] = getattr(importlib.import_module(module_name), attr)
    return factory()


def model_path(config: ModelConfig, version_dir: Path, default: str) -> Path:
    """The reference variant's model file; ConfigError when it is missing."""
    path = version_dir / str(config.parameters.get("model_file", default))
    if not path.is_file():
        raise ConfigError(f"model {config.name!r}: no model file {path}")
    return path


def quantize_model(repository: Path, model: str, options: QuantizeOptions) -> QuantizeReport:
    """Write, measure and record each precision in `options`; the report of all of them."""
    unknown = [p for p in options.precisions if p not in PRECISIONS]
    if unknown or not options.precisions:
        raise ConfigError(f"precisions {unknown or []}: expected some of {list(PRECISIONS)}")
    config, version_dir = locate_model(repository, model, options.version)
    config_path = version_dir.parent / "config.toml"
    quantizer = quantizer_for(config.platform)
    reference, reference_params = _reference(config, options.variant_from, quantizer)
    ref_config = msgspec.structs.replace(
        config, parameters={**config.parameters, **reference_params}
    )
    model_path(ref_config, version_dir, quantizer.default_model_file)  # before any measuring
    validation = _validation(ref_config, quantizer, options)
    job = QuantizeJob(
        ref_config, reference, version_dir, validation, options.min_fidelity, options.metric
    )
    base, machine = _reference_row(job, quantizer, options, reference_params)
    rows = [base]
    for precision in options.precisions:
        rows.append(_variant_row(job, quantizer, options, precision, base, reference_params))
    today = datetime.date.today().isoformat()
    diff = _record(config_path, config, rows, reference, today, machine)
    return QuantizeReport(
        model=model,
        version=version_dir.name,
        reference=reference,
        validation=validation.source,
        num_rows=validation.num_rows,
        min_fidelity=options.min_fidelity,
        machine=machine,
        measured_at=today,
        rows=rows,
        config_diff=diff,
    )


def _validation(
    config: ModelConfig, quantizer: Quantizer, options: QuantizeOptions
) -> ValidationSet:
    """The rows to judge variants on. A model without declared inputs (the LLM engine takes
    prompts its quantizer brings) gets none, unless it runs through a batch backend."""
    from fulcrum.tuning.quantize_batch import BatchQuantizer  # it imports this module

    if config.inputs or options.validation or isinstance(quantizer, BatchQuantizer):
        return load_validation(
            config, options.validation, num_rows=options.num_rows, seed=options.seed
        )
    return ValidationSet({}, None, "none")


def _reference(
    config: ModelConfig, variant_from: str | None, quantizer: Quantizer
) -> tuple[str, dict[str, ParamValue]]:
    """The reference variant's name and its parameters (declared first if there is none)."""
    if not config.variants:
        if variant_from not in (None, REFERENCE_PRECISION, "default"):
            raise ConfigError(f"model {config.name!r} has no variant {variant_from!r}")
        model_file = config.parameters.get("model_file", quantizer.default_model_file)
        return REFERENCE_PRECISION, {"model_file": model_file} if model_file else {}
    name = variant_from or default_variant(config)
    if name not in config.variants:
        raise ConfigError(
            f"model {config.name!r} has no variant {name!r} (variants: {list(config.variants)})"
        )
    return name, dict(config.variants[name].parameters)


def _reference_row(
    job: QuantizeJob,
    quantizer: Quantizer,
    options: QuantizeOptions,
    params: dict[str, ParamValue],
) -> tuple[Row, str]:
    """The reference's row, and the machine it was measured on."""
    model_file = str(params.get("model_file", quantizer.default_model_file))
    row = Row(job.reference, _precision_of(job), model_file, dict(params), written=True)
    row.verdict = "reference"
    row.size_bytes = _size(job.version_dir / model_file) or None  # None: no single file
    if not options.measure:
        return row, _machine()
    speed = quantizer.measure(job, job.config, options.profile)
    row.latency_ms, row.knee_batch = speed.latency_ms, speed.knee_batch
    row.throughput_rps, row.output_tokens_per_s = speed.throughput_rps, speed.output_tokens_per_s
    return row, speed.machine


def _precision_of(job: QuantizeJob) -> str:
    if job.reference in PRECISIONS or job.reference == REFERENCE_PRECISION:
        return job.reference
    return REFERENCE_PRECISION


def _variant_row(
    job: QuantizeJob,
    quantizer: Quantizer,
    options: QuantizeOptions,
    precision: str,
    base: Row,
    reference_params: dict[str, ParamValue],
) -> Row:
    row = Row(precision, precision)
    if precision not in quantizer.supported:
        row.verdict = f"unsupported on platform {job.config.platform!r}"
        row.load = False
        return row
    try:
        written = quantizer.write(job, precision)
        row.notes.extend(written.notes)
        params = {**reference_params, **written.parameters}
        row.parameters, row.written = params, True
        row.model_file = str(params.get("model_file", ""))
        variant = msgspec.structs.replace(
            job.config, parameters={**job.config.parameters, **params}
        )
        row.size_bytes = sum(_size(p) for p in written.files) or None
        found = written.fidelity or quantizer.fidelity(job, variant)
        row.fidelity, row.fidelity_metric, row.worst_row = (
            found.value,
            found.metric,
            found.worst_row,
        )
        row.perplexity_ratio = found.perplexity_ratio
        if options.measure:
            speed = quantizer.measure(job, variant, options.profile)
            row.latency_ms, row.knee_batch = speed.latency_ms, speed.knee_batch
            row.throughput_rps = speed.throughput_rps
            row.output_tokens_per_s = speed.output_tokens_per_s
    except (FulcrumError, OSError) as exc:  # one precision failing leaves the others to run
        row.verdict = f"failed: {exc}"
        row.load = False
        return row
    _judge(row, base, job.min_fidelity)
    return row


def _judge(row: Row, base: Row, min_fidelity: float) -> None:
    """Ratios against the reference and the verdict; a failing variant is kept, unloaded."""
    if row.size_bytes and base.size_bytes:
        row.size_ratio = row.size_bytes / base.size_bytes
    if row.latency_ms and base.latency_ms:
        row.latency_gain = base.latency_ms / row.latency_ms
    if row.throughput_rps and base.throughput_rps:
        row.throughput_gain = row.throughput_rps / base.throughput_rps
    problems = []
    if row.fidelity is not None and row.fidelity < min_fidelity:
        problems.append(f"below fidelity bound {min_fidelity:g}")
    gains = [g for g in (row.latency_gain, row.throughput_gain) if g is not None]
    if gains and max(gains) < 1.0:
        problems.append("slower than the reference")
    row.load = not problems
    if problems:
        row.verdict = "; ".join(problems)
    else:
        row.verdict = "ok" if gains else "ok (speed not measured)"


def _size(path: Path) -> int:
    """A model file's bytes, with its external-data files (`<file>.data`) when it has them."""
    total = path.stat().st_size if path.is_file() else 0
    for extra in (path.with_name(path.name + ".data"), path.with_suffix(".data")):
        if extra.is_file():
            total += extra.stat().st_size
    return total


def _figures(row: Row, reference: str, today: str, machine: str) -> VariantFigures:
    return VariantFigures(
        size_bytes=row.size_bytes,
        latency_ms=row.latency_ms,
        knee_batch=row.knee_batch,
        throughput_rps=row.throughput_rps,
        fidelity=row.fidelity,
        fidelity_metric=row.fidelity_metric,
        perplexity_ratio=row.perplexity_ratio,
        output_tokens_per_s=row.output_tokens_per_s,
        reference="" if row.name == reference else reference,
        measured_at=today,
        machine=machine if row.latency_ms is not None else "",
    )


def _record(
    path: Path,
    config: ModelConfig,
    rows: list[Row],
    reference: str,
    today: str,
    machine: str,
) -> str:
    """Write the reference (declared first when the model had no variants) and every written
    variant, with figures, into the config; the diff of the edit."""

    def apply(document: tomlkit.TOMLDocument) -> None:
        if not config.variants:
            set_values({"default_variant": reference})(document)
        for row in rows:
            if not row.written:
                continue  # unsupported, or failed before its file existed
            set_variant(
                row.name,
                parameters=row.parameters,
                precision=row.precision,
                figures=_figures(row, reference, today, machine),
                load=None if row.name == reference else row.load,
            )(document)

    return edit_config(path, apply).diff


def _machine() -> str:
    from fulcrum.tuning.resources import machine_description

    return machine_description()
