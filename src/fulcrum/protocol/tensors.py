"""One tensor on the wire: JSON `data` or a binary slice <-> numpy, with the size guards.

BYTES elements are `bytes` in an object array; in binary form each is a 4-byte little-endian
length followed by its bytes (Triton's layout); in JSON each is a UTF-8 string.
"""

from __future__ import annotations

import functools
import re
import struct
from typing import Any

import msgspec
import numpy as np

from fulcrum.datatypes import to_numpy
from fulcrum.errors import InvalidInput
from fulcrum.types import Array

MAX_NUM_ELEMENTS = 2**31
MAX_NUM_DIMS = 32
_NESTED_RE = re.compile(rb"\s*\[\s*\[")
_LENGTH = struct.Struct("<I")
_NUM_LENGTH_BYTES = _LENGTH.size


def dtype_of(label: str, datatype: str) -> np.dtype[np.generic]:
    """The numpy dtype of `datatype`, or InvalidInput naming the tensor."""
    try:
        return to_numpy(datatype)
    except InvalidInput as exc:
        raise InvalidInput(f"{label}: {exc.message}") from None


def num_elements(label: str, shape: list[int]) -> int:
    """Element count of `shape`; refuses negative, too many or absurd dimensions."""
    if len(shape) > MAX_NUM_DIMS:
        raise InvalidInput(f"{label}: shape has {len(shape)} dimensions; at most {MAX_NUM_DIMS}")
    count = 1
    for dim in shape:
        if dim < 0 or dim > MAX_NUM_ELEMENTS:
            raise InvalidInput(f"{label}: shape {shape} has an invalid dimension {dim}")
        count *= dim
    if count > MAX_NUM_ELEMENTS:
        raise InvalidInput(f"{label}: shape {shape} has {count} elements; at most 2**31")
    return count


def _element_type(datatype: str) -> Any:
    if datatype == "BYTES":
        return str
    if datatype == "BOOL":
        return bool
    if datatype.startswith("FP"):
        # JSON cannot spell NaN or infinity: encoders write null, so null decodes to NaN.
        return float | None
    return int


@functools.cache
def _data_decoder(datatype: str, depth: int) -> msgspec.json.Decoder[Any]:
    kind: Any = _element_type(datatype)
    for _ in range(depth):
        kind = list[kind]
    return msgspec.json.Decoder(kind)


def array_from_json(label: str, datatype: str, shape: list[int], raw: msgspec.Raw) -> Array:
    """Decode JSON `data` (flat row-major or nested to the shape's depth) into an array."""
    dtype = dtype_of(label, datatype)
    count = num_elements(label, shape)
    nested = len(shape) > 1 and _NESTED_RE.match(memoryview(raw)) is not None
    try:
        data = _data_decoder(datatype, len(shape) if nested else 1).decode(raw)
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"{label}: 'data' does not hold {datatype} values: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"{label}: 'data' is not valid JSON: {exc}") from None
    if not nested and len(data) != count:
        raise InvalidInput(
            f"{label}: shape {shape} has {count} elements but 'data' holds {len(data)}"
        )
    if datatype == "BYTES":
        return _bytes_from_strings(label, data, shape, nested).reshape(shape)
    arr = _numeric_array(label, datatype, data, dtype)
    if nested and arr.shape != tuple(shape):
        raise InvalidInput(f"{label}: nested 'data' does not have shape {shape}")
    return arr.reshape(shape)


def _numeric_array(label: str, datatype: str, data: list[Any], dtype: np.dtype[Any]) -> Array:
    try:
        if datatype not in ("FP16", "FP32"):
            return np.asarray(data, dtype=dtype)  # integers raise OverflowError themselves
        with np.errstate(over="raise"):  # a float beyond the type's range
            return np.asarray(data, dtype=dtype)
    except (OverflowError, FloatingPointError) as exc:
        raise InvalidInput(f"{label}: a value is out of range for {datatype}: {exc}") from None
    except ValueError:
        raise InvalidInput(f"{label}: nested 'data' is ragged") from None


def _bytes_from_strings(label: str, data: list[Any], shape: list[int], nested: bool) -> Array:
    if nested:
        grid = np.array(data, dtype=np.object_)
        if grid.shape != tuple(shape):
            raise InvalidInput(f"{label}: nested 'data' does not have shape {shape}")
        data = grid.ravel().tolist()
    try:
        return bytes_array([text.encode("utf-8") for text in data])
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{label}: a string is not encodable as UTF-8: {exc}") from None


def bytes_array(items: list[bytes]) -> Array:
    """A 1-D object array of `items`, filled by assignment so numpy never looks inside them."""
    arr = np.empty(len(items), dtype=np.object_)
    arr[:] = items
    return arr


def array_from_binary(
    label: str, datatype: str, shape: list[int], body: bytes, offset: int, size: int
) -> Array:
    """Decode `size` bytes of `body` at `offset`; the caller checked they lie within `body`."""
    dtype = dtype_of(label, datatype)
    count = num_elements(label, shape)
    if datatype == "BYTES":
        return deserialize_bytes(label, body[offset : offset + size], count).reshape(shape)
    expected = count * dtype.itemsize
    if size != expected:
        raise InvalidInput(
            f"{label}: binary_data_size is {size} bytes but shape {shape} of {datatype} "
            f"needs {expected}"
        )
    if count == 0:
        return np.empty(shape, dtype=dtype)
    arr = np.frombuffer(body, dtype=dtype, count=count, offset=offset)
    # Copy out of the body: the result is aligned, writable and does not pin the whole body.
    arr = arr.view(np.uint8) != 0 if datatype == "BOOL" else arr.copy()
    return arr.reshape(shape)


def deserialize_bytes(label: str, buf: bytes, count: int) -> Array:
    """Split length-prefixed BYTES elements; exactly `count` of them must fill `buf`."""
    if count * _NUM_LENGTH_BYTES > len(buf):
        raise InvalidInput(f"{label}: {len(buf)} bytes of BYTES data cannot hold {count} elements")
    items: list[bytes] = []
    offset = 0
    end = len(buf)
    for _ in range(count):
        if offset + _NUM_LENGTH_BYTES > end:
            raise InvalidInput(f"{label}: BYTES data ends after {len(items)} of {count} elements")
        (length,) = _LENGTH.unpack_from(buf, offset)
        offset += _NUM_LENGTH_BYTES
        if offset + length > end:
            raise InvalidInput(f"{label}: BYTES element {len(items)} runs past its data")
        items.append(buf[offset : offset + length])
        offset += length
    if offset != end:
        raise InvalidInput(
            f"{label}: {end - offset} bytes of BYTES data left after {count} elements"
        )
    return bytes_array(items)


def _element_bytes(item: object) -> bytes:
    return item if isinstance(item, bytes) else str(item).encode("utf-8")


def serialize_bytes(arr: Array) -> bytes:
    """Length-prefixed elements in row-major order (Triton's BYTES layout)."""
    parts: list[bytes] = []
    for item in arr.ravel().tolist():
        data = _element_bytes(item)
        parts.append(_LENGTH.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def binary_data(arr: Array) -> bytes | memoryview:
    """The tensor's bytes in row-major little-endian order, without a copy where possible."""
    if arr.dtype.kind in "OSU":
        return serialize_bytes(arr)
    if arr.size == 0:
        return b""
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return arr.data.cast("B")


def json_data(label: str, arr: Array) -> list[Any]:
    """The tensor as a flat row-major JSON list; BYTES as UTF-8 strings."""
    items: list[Any] = arr.ravel().tolist()
    if arr.dtype.kind not in "OSU":
        return items
    try:
        return [item.decode("utf-8") if isinstance(item, bytes) else str(item) for item in items]
    except UnicodeDecodeError:
        raise InvalidInput(
            f"{label}: a BYTES element is not valid UTF-8, so JSON cannot carry it; "
            "ask for it as binary data (binary_data: true)"
        ) from None
