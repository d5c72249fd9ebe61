"""Triton's binary tensor extension, and compatibility with the official Triton HTTP client."""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np
import pytest
import tritonclient.http as triton
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fulcrum.errors import InvalidInput
from fulcrum.protocol import (
    RequestedOutput,
    decode_infer_request,
    decode_infer_response,
    encode_infer_request,
    encode_infer_response,
)
from fulcrum.types import Array

DATATYPES = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


@st.composite
def binary_arrays(draw: st.DrawFn, *, text_only: bool = False) -> Array:
    """Any datatype with any values (NaN, inf, arbitrary BYTES); text BYTES for JSON paths."""
    datatype = draw(st.sampled_from([*DATATYPES, "BYTES"]))
    shape = draw(shapes)
    if datatype != "BYTES":
        return draw(hnp.arrays(np.dtype(DATATYPES[datatype]), shape))
    size = int(np.prod(shape, dtype=np.int64))
    item = st.text(max_size=6).map(str.encode) if text_only else st.binary(max_size=6)
    arr = np.empty(size, dtype=object)
    arr[:] = draw(st.lists(item, min_size=size, max_size=size))
    return arr.reshape(shape)


def assert_same(got: Array, want: Array) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def header_length(headers: dict[str, str]) -> int | None:
    value = headers.get("Inference-Header-Content-Length")
    return None if value is None else int(value)


def split(body: bytes, headers: dict[str, str]) -> tuple[dict[str, Any], bytes]:
    length = header_length(headers)
    assert length is not None
    return msgspec.json.decode(body[:length]), body[length:]


# --- round trips -------------------------------------------------------------------------------


@settings(deadline=None, max_examples=150)
@given(st.dictionaries(st.sampled_from("abc"), binary_arrays(), min_size=1, max_size=3))
def test_binary_request_round_trip(inputs: dict[str, Array]) -> None:
    body, headers = encode_infer_request(inputs, binary=True)
    assert headers["Content-Type"] == "application/octet-stream"
    decoded = decode_infer_request(body, header_length(headers))
    assert decoded.binary_output_default is True
    for name, arr in inputs.items():
        got = decoded.inputs[name]
        assert_same(got, arr)
        assert got.flags.writeable


@settings(deadline=None, max_examples=150)
@given(
    st.dictionaries(st.sampled_from("xyz"), binary_arrays(), min_size=1, max_size=3),
    st.data(),
)
def test_mixed_binary_and_json_response_round_trip(
    outputs: dict[str, Array], data: st.DataObject
) -> None:
    requested = tuple(
        RequestedOutput(name, binary=arr.dtype != object or data.draw(st.booleans()))
        for name, arr in outputs.items()
    )
    # JSON cannot carry arbitrary bytes or NaN: outputs sent as JSON use text and finite values.
    outputs = {
        out.name: outputs[out.name] if out.binary else _json_safe(outputs[out.name])
        for out in requested
    }
    body, headers = encode_infer_response("m", "1", "q", outputs, requested, False)
    name, decoded = decode_infer_response(body, header_length(headers))
    assert name == "m"
    for key, arr in outputs.items():
        assert_same(decoded[key], arr)


def _json_safe(arr: Array) -> Array:
    if arr.dtype == object:
        safe = np.empty(arr.size, dtype=object)
        safe[:] = [item.decode("utf-8", "replace").encode() for item in arr.ravel().tolist()]
        return safe.reshape(arr.shape)
    if arr.dtype.kind == "f":
        return np.asarray(np.nan_to_num(arr, nan=0.0, posinf=1.0, neginf=-1.0))
    return arr


def test_binary_layout_matches_the_extension() -> None:
    inputs = {
        "f": np.array([1.5, -2.0], np.float32),
        "s": np.array([b"ab", b""], dtype=object),
        "j": np.array([7], np.int8),
    }
    body, headers = encode_infer_request(inputs, binary=True, request_id="r")
    header, tail = split(body, headers)
    assert [t["parameters"]["binary_data_size"] for t in header["inputs"]] == [8, 10, 1]
    assert "data" not in header["inputs"][0]
    assert tail == (
        np.array([1.5, -2.0], "<f4").tobytes()
        + struct.pack("<I", 2)
        + b"ab"
        + struct.pack("<I", 0)
        + b"\x07"
    )


def test_binary_response_headers_and_json_only_outputs() -> None:
    outputs = {"a": np.arange(3, dtype=np.int32), "b": np.ones(2, np.float64)}
    requested = (RequestedOutput("a", True), RequestedOutput("b", False))
    body, headers = encode_infer_response("m", "1", None, outputs, requested, False)
    assert headers["Content-Type"] == "application/octet-stream"
    header, tail = split(body, headers)
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 12}
    assert header["outputs"][1]["data"] == [1.0, 1.0]
    assert tail == np.arange(3, dtype="<i4").tobytes()


def test_non_contiguous_output_is_sent_row_major() -> None:
    arr = np.arange(12, dtype=np.int16).reshape(3, 4).T
    body, headers = encode_infer_response("m", "1", None, {"t": arr}, (), binary_default=True)
    assert_same(decode_infer_response(body, header_length(headers))[1]["t"], arr)


def test_bool_bytes_other_than_one_read_as_true() -> None:
    header = msgspec.json.encode(
        {
            "inputs": [
                {
                    "name": "b",
                    "datatype": "BOOL",
                    "shape": [3],
                    "parameters": {"binary_data_size": 3},
                }
            ]
        }
    )
    got = decode_infer_request(header + b"\x00\x01\x07", len(header)).inputs["b"]
    assert_same(got, np.array([False, True, True]))
    assert got.view(np.uint8).tolist() == [0, 1, 1]


# --- binary errors -----------------------------------------------------------------------------


def binary_body(*tensors: tuple[str, str, list[int], int | None], tail: bytes) -> tuple[bytes, int]:
    inputs = []
    for name, datatype, shape, size in tensors:
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
        if size is None:
            entry["data"] = [0] * int(np.prod(shape))
        else:
            entry["parameters"] = {"binary_data_size": size}
        inputs.append(entry)
    header = msgspec.json.encode({"inputs": inputs})
    return header + tail, len(header)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (binary_body(("x", "FP32", [3], 8), tail=b"\0" * 8), "binary_data_size is 8.*needs 12"),
        (binary_body(("x", "FP32", [2], 8), tail=b"\0" * 9), "1 bytes of binary data beyond"),
        (binary_body(("x", "FP32", [4], 16), tail=b"\0" * 8), "exceeds the 8 bytes"),
        (binary_body(("x", "FP32", [1], -4), tail=b""), "binary_data_size -4"),
        (
            binary_body(("x", "INT8", [2], None), ("y", "INT8", [2], 2), tail=b"\0\0\0"),
            "beyond",
        ),
        (binary_body(("s", "BYTES", [2], 6), tail=b"\2\0\0\0ab"), "cannot hold 2 elements"),
        (
            binary_body(("s", "BYTES", [2], 8), tail=b"\1\0\0\0a\2\0\0"),
            "ends after 1 of 2 elements",
        ),
        (binary_body(("s", "BYTES", [1], 5), tail=b"\x09\0\0\0a"), "runs past its data"),
        (binary_body(("s", "BYTES", [1], 6), tail=b"\1\0\0\0ab"), "1 bytes of BYTES data left"),
        (binary_body(("x", "FP32", [-1], 0), tail=b""), "invalid dimension -1"),
        (binary_body(("x", "FP32", [2**31, 2], 0), tail=b""), "at most 2\\*\\*31"),
        (binary_body(("x", "XX", [1], 1), tail=b"\0"), "unknown datatype 'XX'"),
    ],
)
def test_malformed_binary_body_names_the_problem(body: tuple[bytes, int], match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        decode_infer_request(*body)


def test_binary_data_without_header_length_is_refused() -> None:
    body, _ = binary_body(("x", "INT8", [1], 1), tail=b"")
    with pytest.raises(InvalidInput, match="Inference-Header-Content-Length is missing"):
        decode_infer_request(body, None)


@pytest.mark.parametrize("length", [0, -1, 10_000])
def test_header_length_outside_the_body_is_refused(length: int) -> None:
    body, _ = encode_infer_request({"x": np.zeros(2, np.int8)}, binary=True)
    with pytest.raises(InvalidInput, match=f"Inference-Header-Content-Length is {length}"):
        decode_infer_request(body, length)


def test_data_and_binary_size_together_are_refused() -> None:
    header = msgspec.json.encode(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "INT8",
                    "shape": [1],
                    "data": [1],
                    "parameters": {"binary_data_size": 1},
                }
            ]
        }
    )
    with pytest.raises(InvalidInput, match="both 'data' and binary_data_size"):
        decode_infer_request(header + b"\1", len(header))


# --- the official Triton client ----------------------------------------------------------------


def triton_request(
    inputs: dict[str, Array], *, binary: bool, **kwargs: Any
) -> tuple[bytes, int | None]:
    wire_inputs = []
    for name, arr in inputs.items():
        datatype = "BYTES" if arr.dtype == object else _v2(arr.dtype)
        wire = triton.InferInput(name, list(arr.shape), datatype)
        wire.set_data_from_numpy(arr, binary_data=binary)
        wire_inputs.append(wire)
    body, length = triton.InferenceServerClient.generate_request_body(wire_inputs, **kwargs)
    return body, length


def _v2(dtype: np.dtype[Any]) -> str:
    return next(name for name, t in DATATYPES.items() if np.dtype(t) == dtype)


@settings(deadline=None, max_examples=100)
@given(
    st.dictionaries(st.sampled_from("abc"), binary_arrays(text_only=True), min_size=1, max_size=3),
    st.booleans(),
)
def test_triton_client_requests_decode(inputs: dict[str, Array], binary: bool) -> None:
    if not binary:  # the client writes NaN/inf into JSON as non-standard tokens
        inputs = {k: _json_safe(v) for k, v in inputs.items()}
    body, length = triton_request(inputs, binary=binary)
    decoded = decode_infer_request(body, length)
    for name, arr in inputs.items():
        assert_same(decoded.inputs[name], arr)


def test_triton_client_request_options() -> None:
    outputs = [
        triton.InferRequestedOutput("y", binary_data=True),
        triton.InferRequestedOutput("z", binary_data=False),
    ]
    body, length = triton_request(
        {"x": np.arange(4, dtype=np.float32)},
        binary=True,
        outputs=outputs,
        request_id="req-1",
        sequence_id=9,
        priority=2,
        timeout=250_000,
        parameters={"tenant": "t1"},
    )
    req = decode_infer_request(body, length)
    assert req.id == "req-1"
    assert req.outputs == (RequestedOutput("y", True), RequestedOutput("z", False))
    assert (req.priority, req.timeout_s) == (2, 0.25)
    assert req.parameters == {
        "sequence_id": 9,
        "sequence_start": False,
        "sequence_end": False,
        "tenant": "t1",
    }


def test_triton_client_without_outputs_asks_for_binary() -> None:
    body, length = triton_request({"x": np.zeros(1, np.int32)}, binary=False)
    req = decode_infer_request(body, length)
    assert length is None
    assert req.outputs == ()
    assert req.binary_output_default is True


@settings(deadline=None, max_examples=100)
@given(
    st.dictionaries(st.sampled_from("xyz"), binary_arrays(), min_size=1, max_size=3),
    st.booleans(),
)
def test_triton_client_parses_our_responses(outputs: dict[str, Array], binary: bool) -> None:
    if not binary:
        outputs = {k: _json_safe(v) for k, v in outputs.items()}
    body, headers = encode_infer_response("m", "1", "r", outputs, (), binary_default=binary)
    result = triton.InferenceServerClient.parse_response_body(
        body, header_length=header_length(headers)
    )
    assert result.get_response()["model_name"] == "m"
    for name, arr in outputs.items():
        got = result.as_numpy(name)
        if arr.dtype == object and not binary:
            # The client leaves JSON strings as str.
            assert got.tolist() == np.vectorize(bytes.decode, otypes=[object])(arr).tolist()
        else:
            assert_same(got, arr)
