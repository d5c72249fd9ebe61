"""Server-sent events of a streamed v2 response (`/infer_stream`, Triton's generate_stream shape).

Each event's data is a v2 infer response for a contiguous slice of the request's rows, with
`parameters: {"row_offset": i, "num_rows": n, "final": bool}`; an error ends the stream with
`{"error": message, "code": status}`. SSE is text, so outputs are JSON tensors only.
"""

from __future__ import annotations

from typing import Any

import msgspec

from fulcrum.errors import InvalidInput
from fulcrum.protocol.body import encode_tensor
from fulcrum.protocol.request import InferRequest, RequestedOutput
from fulcrum.types import TensorMap

EVENT_STREAM_TYPE = "text/event-stream"
_json = msgspec.json.Encoder()


def check_json_outputs(request: InferRequest) -> None:
    """A stream carries JSON tensors only: binary outputs are refused before it starts."""
    binary = [out.name for out in request.outputs if out.binary]
    if binary or (request.binary_output_default and not request.outputs):
        what = f"output {binary[0]!r}" if binary else "binary_data_output"
        raise InvalidInput(
            f"{what}: a streamed response carries JSON tensors only; ask for binary_data false"
        )


def encode_rows_event(
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: TensorMap,
    requested: tuple[RequestedOutput, ...],
    *,
    row_offset: int,
    num_rows: int,
    final: bool,
) -> bytes:
    """One `data:` event: the v2 response for rows [row_offset, row_offset + num_rows)."""
    names = [out.name for out in requested] if requested else list(outputs)
    unknown = [name for name in names if name not in outputs]
    if unknown:
        raise InvalidInput(
            f"unknown output {unknown[0]!r}; model {model_name!r} has {sorted(outputs)}"
        )
    tail: list[bytes | memoryview] = []  # stays empty: JSON tensors only
    response: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        response["id"] = request_id
    response["parameters"] = {"row_offset": row_offset, "num_rows": num_rows, "final": final}
    response["outputs"] = [
        encode_tensor(f"output {name!r}", name, outputs[name], False, tail) for name in names
    ]
    return _event(response)


def encode_error_event(message: str, status_code: int) -> bytes:
    """The event that ends a stream which failed after it started."""
    return _event({"error": message, "code": status_code})


def _event(payload: object) -> bytes:
    # msgspec writes JSON on one line, so one `data:` line holds the whole payload.
    return b"data: " + _json.encode(payload) + b"\n\n"
