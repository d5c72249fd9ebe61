"""The v2 infer request: decoded on the server, encoded by clients (our load generator)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fulcrum.errors import InvalidInput
from fulcrum.protocol.body import decode_json, decode_tensors, encode_tensor, header_of, join_body
from fulcrum.protocol.wire import REQUEST_DECODER, WireRequest, WireRequestedOutput
from fulcrum.types import TensorMap

_MICROSECONDS_PER_S = 1_000_000
# Parameters parsed into InferRequest fields; the rest stay in `parameters`.
_PARSED_PARAMETERS = frozenset({"binary_data_output", "priority", "timeout"})


@dataclass(frozen=True, slots=True)
class RequestedOutput:
    """An output the client asked for, and whether it wants it as binary data."""

    name: str
    binary: bool


@dataclass(frozen=True, slots=True)
class InferRequest:
    """A decoded infer request: arrays by name plus what the client asked of the response."""

    id: str | None
    inputs: TensorMap  # BYTES: object array of bytes
    outputs: tuple[RequestedOutput, ...]  # empty: all outputs
    binary_output_default: bool  # parameters.binary_data_output
    priority: int | None  # parameters.priority; None when absent (0 also means default)
    timeout_s: float | None  # parameters.timeout in microseconds; None when absent or 0
    parameters: dict[str, object]  # the request's other parameters


def decode_infer_request(body: bytes, header_length: int | None) -> InferRequest:
    """Decode a JSON or binary body; `header_length` is Inference-Header-Content-Length or None."""
    wire: WireRequest = decode_json(
        REQUEST_DECODER, header_of(body, header_length), "inference request"
    )
    params = wire.parameters or {}
    binary_default = _bool_parameter(params, "binary_data_output")
    return InferRequest(
        id=wire.id,
        inputs=decode_tensors(wire.inputs, body, header_length, "input"),
        outputs=_requested_outputs(wire.outputs or [], binary_default),
        binary_output_default=binary_default,
        priority=_priority(params),
        timeout_s=_timeout_s(params),
        parameters={k: v for k, v in params.items() if k not in _PARSED_PARAMETERS},
    )


def _bool_parameter(params: dict[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise InvalidInput(f"parameter {key!r} must be true or false, got {value!r}")
    return value


def _priority(params: dict[str, Any]) -> int | None:
    value = params.get("priority")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"parameter 'priority' must be an integer >= 0, got {value!r}")
    return value


def _timeout_s(params: dict[str, Any]) -> float | None:
    value = params.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise InvalidInput(f"parameter 'timeout' must be microseconds >= 0, got {value!r}")
    # Triton: a timeout of 0 means "no timeout of its own", not "expire at once".
    return value / _MICROSECONDS_PER_S if value else None


def _requested_outputs(
    wire_outputs: list[WireRequestedOutput], binary_default: bool
) -> tuple[RequestedOutput, ...]:
    outputs: list[RequestedOutput] = []
    seen: set[str] = set()
    for out in wire_outputs:
        if out.name in seen:
            raise InvalidInput(f"output {out.name!r} is requested twice")
        seen.add(out.name)
        params = out.parameters
        binary = binary_default
        if params is not None:
            if params.classification:
                raise InvalidInput(f"output {out.name!r}: classification is not supported")
            if params.shared_memory_region is not None:
                raise InvalidInput(f"output {out.name!r}: shared memory is not supported")
            if params.binary_data is not None:
                binary = params.binary_data
        outputs.append(RequestedOutput(out.name, binary))
    return tuple(outputs)


def encode_infer_request(
    inputs: TensorMap,
    *,
    binary: bool,
    outputs: tuple[RequestedOutput, ...] = (),
    request_id: str | None = None,
    parameters: dict[str, object] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """Client side: a JSON or binary body and its headers (no `outputs`: all, in the same mode)."""
    tail: list[bytes | memoryview] = []
    header: dict[str, Any] = {}
    if request_id is not None:
        header["id"] = request_id
    header["inputs"] = [
        encode_tensor(f"input {name!r}", name, arr, binary, tail) for name, arr in inputs.items()
    ]
    params: dict[str, object] = dict(parameters or {})
    if outputs:
        header["outputs"] = [
            {"name": out.name, "parameters": {"binary_data": out.binary}} for out in outputs
        ]
    else:
        params.setdefault("binary_data_output", binary)
    header["parameters"] = params
    return join_body(header, tail)
