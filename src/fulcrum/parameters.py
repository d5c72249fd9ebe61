"""Each platform's `[parameters]` as a typed structure, decoded once with errors naming the key.

`config.validate` decodes the parameters of every variant when the config is read, so a typo or a
wrongly typed value fails the load with `key 'parameters.intra_op_threads': Expected int >= 0`,
and backends read plain attributes. Unknown keys are refused for every platform but "python",
whose user code may read keys of its own from `config.parameters`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
import msgspec.inspect

from fulcrum.errors import ConfigError

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
T = TypeVar("T", bound=msgspec.Struct)


class _Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class OnnxParameters(_Params, frozen=True):
    """ONNX Runtime session settings (threads are per session, so per model and instance)."""

    model_file: str = "model.onnx"
    intra_op_threads: NonNegInt = 0  # 0: ONNX Runtime's default (one per core)
    inter_op_threads: NonNegInt = 0
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"
    allow_spinning: bool = False
    # A spinning session's pool goes on spinning ~50 ms after a run (ORT's default) unless False
    # (`session.force_spinning_stop`): measured, the run after a forced stop is no faster than
    # without spinning at all, so None (unset) keeps ORT's default. Moot without spinning.
    spin_between_runs: bool | None = None
    spin_when_idle: bool = False  # True: a second, spinning session runs lone batches when sparse
    # (CPU only: on CUDA the setting is ignored)
    # ... while the instance idles at least this long between runs (smoothed; end to start)
    spin_idle_gap_ms: NonNegFloat = 50.0
    # > 0: ORT's parallel-for splits work into shrinking blocks handed out as threads come free
    # (`session.dynamic_block_base`), so one preempted pool thread stalls less of a run. 0: static.
    dynamic_block_base: NonNegInt = 0
    execution_providers: tuple[str, ...] | None = None  # None: CUDA when present, then CPU
    length_bucket_rows: NonNegInt = 0  # 0: a batch runs whole, padded to its longest row
    # True: the model's instances run their batches on one session (ORT's Run is thread-safe),
    # as Triton's ONNX Runtime backend does with the same parameter: one copy of the weights and
    # one `spin_when_idle` session however many instances; each instance still has its thread.
    share_session_between_instances: bool = False


class TorchParameters(_Params, frozen=True):
    """A TorchScript or exported program; `num_threads` holds for this model's instances only."""

    model_file: str = ""  # "": model.pt or model.pt2
    device: str = ""  # "": cuda when available, else cpu
    num_threads: NonNegInt = 0  # 0: torch's default
    allow_pickle: bool = False


class PythonParameters(msgspec.Struct, frozen=True, kw_only=True):
    """A user's model class; other keys are the user's own (read from `config.parameters`)."""

    module: str = "model.py"
    class_: str = msgspec.field(default="Model", name="class")
    isolation: Literal["thread", "process"] = "thread"
    process_start_timeout_s: NonNegFloat = 300.0
    execute_timeout_s: NonNegFloat = 0.0  # 0: none
    max_restarts: NonNegInt = 5
    restart_window_s: NonNegFloat = 60.0


class EchoParameters(_Params, frozen=True):
    """The echo backend's known latency model: `latency_a_ms + latency_b_ms * batch_size`."""

    latency_a_ms: NonNegFloat = 0.0
    latency_b_ms: NonNegFloat = 0.0
    fail_value: float | None = None  # a batch holding this number fails (tests)


_TYPES: dict[str, type[msgspec.Struct]] = {
    "onnx": OnnxParameters,
    "torch": TorchParameters,
    "python": PythonParameters,
    "echo": EchoParameters,
}


def decode_parameters(parameters: dict[str, Any], kind: type[T]) -> T:
    """`parameters` as `kind`; ConfigError names the key: `key 'parameters.x': ...`."""
    try:
        return msgspec.convert(parameters, type=kind, str_keys=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_describe(exc, kind, parameters)) from None


def check_parameters(platform: str, parameters: dict[str, Any]) -> None:
    """Decode a platform's parameters to check them (the LLM engine's own reader for "llm")."""
    if platform == "llm":
        from fulcrum.llm.params import EngineParams  # light: no torch

        EngineParams.from_parameters(dict(parameters))
        return
    kind = _TYPES.get(platform)
    if kind is not None:
        decode_parameters(parameters, kind)


def _describe(
    exc: msgspec.ValidationError, kind: type[msgspec.Struct], parameters: dict[str, Any]
) -> str:
    text = str(exc)
    message, _, where = text.partition(" - at `$.")
    key = where.rstrip("`") if where else ""
    if message.startswith("Object contains unknown field"):
        key = message.split("`")[1]
        known = sorted(f.encode_name for f in msgspec.structs.fields(kind))
        return f"key 'parameters.{key}': unknown; expected one of {known}"
    if not key:
        return f"key 'parameters': {message}"
    shown = f" = {parameters[key]!r}" if key in parameters else ""
    if message.startswith("Invalid enum value"):
        message = f"expected one of {_choices(kind, key)}"
    return f"key 'parameters.{key}'{shown}: {message}"


def _choices(kind: type[msgspec.Struct], key: str) -> list[object]:
    info = msgspec.inspect.type_info(kind)
    assert isinstance(info, msgspec.inspect.StructType)
    field = next(f for f in info.fields if f.encode_name == key)
    literal = field.type
    return list(literal.values) if isinstance(literal, msgspec.inspect.LiteralType) else []
