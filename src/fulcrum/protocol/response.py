"""The v2 infer response: encoded on the server, decoded by clients; and the error body."""

from __future__ import annotations

from typing import Any

import msgspec

from fulcrum.errors import InvalidInput
from fulcrum.protocol.body import decode_json, decode_tensors, encode_tensor, header_of, join_body
from fulcrum.protocol.request import RequestedOutput
from fulcrum.protocol.wire import RESPONSE_DECODER, WireResponse
from fulcrum.types import TensorMap


def encode_infer_response(
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: TensorMap,
    requested: tuple[RequestedOutput, ...],
    binary_default: bool,
) -> tuple[bytes, dict[str, str]]:
    """Body and headers: JSON alone, or a JSON header then the binary outputs."""
    if requested:
        chosen = [(out.name, out.binary) for out in requested]
        unknown = [name for name, _ in chosen if name not in outputs]
        if unknown:
            raise InvalidInput(
                f"unknown output {unknown[0]!r}; model {model_name!r} has {sorted(outputs)}"
            )
    else:
        chosen = [(name, binary_default) for name in outputs]
    tail: list[bytes | memoryview] = []
    header: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        header["id"] = request_id
    header["outputs"] = [
        encode_tensor(f"output {name!r}", name, outputs[name], binary, tail)
        for name, binary in chosen
    ]
    return join_body(header, tail)


def decode_infer_response(body: bytes, header_length: int | None) -> tuple[str, TensorMap]:
    """Client side: the model name and the outputs (JSON data or binary slices)."""
    wire: WireResponse = decode_json(
        RESPONSE_DECODER, header_of(body, header_length), "inference response"
    )
    return wire.model_name, decode_tensors(wire.outputs, body, header_length, "output")


def encode_error(message: str) -> bytes:
    """The v2 error body: {"error": message}."""
    return msgspec.json.encode({"error": message})
