"""The weights that two ONNX Runtime sessions of one model can share: embedding tables.

Read straight from the model file's protobuf wire format (the `onnx` package is not a serving
dependency). Only tensors that every node reads through a Gather are shared: ORT's MatMul, Gemm
and Conv kernels pre-pack their constant weights into a layout of their own, a per-session copy
after which ORT frees the original, so sharing those would keep one more copy, not one fewer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# ONNX TensorProto.DataType -> numpy, little-endian as raw_data is stored.
_DTYPES: dict[int, str] = {
    1: "<f4", 2: "u1", 3: "i1", 4: "<u2", 5: "<i2", 6: "<i4", 7: "<i8", 9: "?", 10: "<f2",
    11: "<f8", 12: "<u4", 13: "<u8",
}  # fmt: skip
# Smaller tensors are not worth it (and graph fusions may fold small constants).
MIN_SHARED_BYTES = 64 * 1024
_GATHERS = {"Gather", "GatherElements", "GatherND"}
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def shared_weights(path: Path) -> dict[str, np.ndarray]:
    """The model's embedding tables (initializers of at least MIN_SHARED_BYTES held inline and
    read only by Gather nodes), as arrays of their own: name -> array."""
    data = memoryview(path.read_bytes())
    graph = next((value for field, value in _fields(data) if field == 7), None)  # Model.graph
    if not isinstance(graph, memoryview):
        return {}
    consumers: dict[str, set[str]] = {}
    graph_inputs: set[str] = set()
    tensors: list[memoryview] = []
    for field, value in _fields(graph):
        if field == 1 and isinstance(value, memoryview):  # Graph.node
            op_type, inputs = _node(value)
            for name in inputs:
                consumers.setdefault(name, set()).add(op_type)
        elif field == 5 and isinstance(value, memoryview):  # Graph.initializer
            tensors.append(value)
        elif field == 11 and isinstance(value, memoryview):  # Graph.input (an overridable one)
            graph_inputs.update(bytes(v).decode() for f, v in _fields(value) if f == 1)
    shared: dict[str, np.ndarray] = {}
    for tensor in tensors:
        found = _tensor(tensor)
        if found is None:
            continue
        name, array = found
        readers = consumers.get(name, set())
        if readers and readers <= _GATHERS and name not in graph_inputs:
            shared[name] = array
    return shared


def _tensor(message: memoryview) -> tuple[str, np.ndarray] | None:
    """(name, a copy of its data) for a tensor held inline as raw_data, else None."""
    dims: list[int] = []
    name, dtype, raw = "", 0, None
    for field, value in _fields(message):
        if field == 1:  # dims: packed or one varint per entry
            dims.extend(_varints(value) if isinstance(value, memoryview) else [int(value)])
        elif field == 2 and isinstance(value, int):
            dtype = value
        elif field == 8 and isinstance(value, memoryview):
            name = bytes(value).decode()
        elif field == 9 and isinstance(value, memoryview):
            raw = value
        elif field == 14 and value == 1:  # data_location EXTERNAL: ORT reads it itself
            return None
    kind = _DTYPES.get(dtype)
    if raw is None or kind is None or len(raw) < MIN_SHARED_BYTES:
        return None
    count = int(np.prod(dims)) if dims else 1
    if count * np.dtype(kind).itemsize != len(raw):
        return None
    # A copy: aligned, owned, native order; the file's bytes are dropped after loading.
    view = np.frombuffer(raw, dtype=kind, count=count).reshape(dims)
    return name, view.astype(np.dtype(kind).newbyteorder("="))


def _node(message: memoryview) -> tuple[str, list[str]]:
    op_type, inputs = "", []
    for field, value in _fields(message):
        if field == 1 and isinstance(value, memoryview):
            inputs.append(bytes(value).decode())
        elif field == 4 and isinstance(value, memoryview):
            op_type = bytes(value).decode()
    return op_type, inputs


def _fields(message: memoryview) -> list[tuple[int, int | memoryview]]:
    """The (field number, value) pairs of one protobuf message: varints as ints, length-
    delimited fields as views (not copies), fixed-width fields skipped as 0."""
    found: list[tuple[int, int | memoryview]] = []
    pos, end = 0, len(message)
    while pos < end:
        key, pos = _varint(message, pos)
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _varint(message, pos)
            found.append((field, value))
        elif wire == _LEN:
            size, pos = _varint(message, pos)
            found.append((field, message[pos : pos + size]))
            pos += size
        elif wire in (_I64, _I32):
            pos += 8 if wire == _I64 else 4
            found.append((field, 0))
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
    return found


def _varints(packed: memoryview) -> list[int]:
    values, pos = [], 0
    while pos < len(packed):
        value, pos = _varint(packed, pos)
        values.append(value)
    return values


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
