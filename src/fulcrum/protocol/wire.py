"""The JSON shapes of v2 infer requests and responses, as msgspec structs (decoded in one pass).

Unknown fields are ignored, as KServe v2 asks; `data` stays raw until its datatype is known.
"""

from __future__ import annotations

from typing import Any

import msgspec


class TensorParameters(msgspec.Struct, frozen=True):
    """Per-tensor parameters Fulcrum reads (the binary extension and shared memory)."""

    binary_data_size: int | None = None
    shared_memory_region: str | None = None


class WireTensor(msgspec.Struct, frozen=True):
    """An input of a request or an output of a response."""

    name: str
    shape: list[int]
    datatype: str
    parameters: TensorParameters | None = None
    data: msgspec.Raw = msgspec.Raw()


class OutputParameters(msgspec.Struct, frozen=True):
    """Parameters of one requested output."""

    binary_data: bool | None = None
    classification: int = 0
    shared_memory_region: str | None = None


class WireRequestedOutput(msgspec.Struct, frozen=True):
    """One entry of a request's `outputs`."""

    name: str
    parameters: OutputParameters | None = None


class WireRequest(msgspec.Struct, frozen=True):
    """`POST /v2/models/{m}/infer` body (the JSON header in binary mode)."""

    inputs: list[WireTensor]
    id: str | None = None
    outputs: list[WireRequestedOutput] | None = None
    parameters: dict[str, Any] | None = None


class WireResponse(msgspec.Struct, frozen=True):
    """The infer response body (the JSON header in binary mode)."""

    model_name: str
    outputs: list[WireTensor]
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None


REQUEST_DECODER = msgspec.json.Decoder(WireRequest)
RESPONSE_DECODER = msgspec.json.Decoder(WireResponse)
