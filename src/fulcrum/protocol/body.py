"""A whole v2 body: the JSON header, then the binary tensors in tensor order (binary extension).

`Inference-Header-Content-Length` says where the JSON ends; each binary tensor carries
`parameters.binary_data_size`, and the sizes must account for every trailing byte.
"""

from __future__ import annotations

from typing import Any

import msgspec

from fulcrum.datatypes import from_numpy
from fulcrum.errors import InvalidInput
from fulcrum.protocol.tensors import array_from_binary, array_from_json, binary_data, json_data
from fulcrum.protocol.wire import WireTensor
from fulcrum.types import Array, TensorMap

HEADER_LENGTH = "Inference-Header-Content-Length"
CONTENT_TYPE = "Content-Type"
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"


def header_of(body: bytes, header_length: int | None) -> memoryview:
    """The JSON part of `body` (a view, no copy)."""
    view = memoryview(body)
    if header_length is None:
        return view
    if not 0 < header_length <= len(body):
        raise InvalidInput(f"{HEADER_LENGTH} is {header_length} but the body has {len(body)} bytes")
    return view[:header_length]


def decode_json(decoder: msgspec.json.Decoder[Any], header: memoryview, what: str) -> Any:
    """Decode the JSON header; every failure is InvalidInput naming the problem."""
    try:
        return decoder.decode(header)
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"invalid {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput(f"{what} is nested too deeply") from None


def decode_tensors(
    tensors: list[WireTensor], body: bytes, header_length: int | None, kind: str
) -> TensorMap:
    """Arrays by name from JSON `data` or binary slices, in order; `kind` is input/output."""
    arrays: TensorMap = {}
    offset = len(body) if header_length is None else header_length
    for tensor in tensors:
        label = f"{kind} {tensor.name!r}"
        if tensor.name in arrays:
            raise InvalidInput(f"{label} appears twice")
        size = tensor.parameters.binary_data_size if tensor.parameters else None
        if tensor.parameters is not None and tensor.parameters.shared_memory_region is not None:
            raise InvalidInput(f"{label}: shared memory is not supported; send the data")
        if size is None:
            arrays[tensor.name] = _from_json(label, tensor)
            continue
        if len(tensor.data):
            raise InvalidInput(f"{label} has both 'data' and binary_data_size")
        if header_length is None:
            raise InvalidInput(f"{label} has binary_data_size but the {HEADER_LENGTH} is missing")
        if size < 0 or offset + size > len(body):
            raise InvalidInput(
                f"{label}: binary_data_size {size} exceeds the {len(body) - offset} bytes of "
                "binary data left in the body"
            )
        arrays[tensor.name] = array_from_binary(
            label, tensor.datatype, tensor.shape, body, offset, size
        )
        offset += size
    if offset != len(body):
        raise InvalidInput(
            f"the body has {len(body) - offset} bytes of binary data beyond the binary_data_size "
            f"of its {kind}s"
        )
    return arrays


def _from_json(label: str, tensor: WireTensor) -> Array:
    if not len(tensor.data):
        raise InvalidInput(f"{label} has neither 'data' nor binary_data_size")
    return array_from_json(label, tensor.datatype, tensor.shape, tensor.data)


def encode_tensor(
    label: str, name: str, arr: Array, binary: bool, tail: list[bytes | memoryview]
) -> dict[str, Any]:
    """The JSON entry of one tensor; in binary mode its bytes are appended to `tail`."""
    entry: dict[str, Any] = {
        "name": name,
        "datatype": from_numpy(arr.dtype),
        "shape": list(arr.shape),
    }
    if binary:
        data = binary_data(arr)
        tail.append(data)
        entry["parameters"] = {"binary_data_size": len(data)}
    else:
        entry["data"] = json_data(label, arr)
    return entry


def join_body(
    header: dict[str, Any], tail: list[bytes | memoryview]
) -> tuple[bytes, dict[str, str]]:
    """One msgspec encode of the header, then the binary tensors; with the matching headers."""
    head = msgspec.json.encode(header)
    if not tail:
        return head, {CONTENT_TYPE: JSON_TYPE}
    return b"".join([head, *tail]), {HEADER_LENGTH: str(len(head)), CONTENT_TYPE: BINARY_TYPE}
