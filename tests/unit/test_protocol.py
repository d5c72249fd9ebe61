"""KServe v2 JSON wire format: request/response round trips, errors, validation, metadata."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fulcrum.config import (
    DynamicBatching,
    Instances,
    ModelConfig,
    QueuePolicy,
    TensorSpec,
    Tokenizer,
    VersionPolicy,
)
from fulcrum.errors import InvalidInput
from fulcrum.protocol import (
    InferRequest,
    RequestedOutput,
    decode_infer_request,
    decode_infer_response,
    encode_error,
    encode_infer_request,
    encode_infer_response,
    model_config_json,
    model_metadata,
    validate_inputs,
    validate_requested_outputs,
)
from fulcrum.protocol.validation import validate_content
from fulcrum.types import Array

NUMERIC = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"]
FLOATS: dict[str, Literal[16, 32, 64]] = {"FP16": 16, "FP32": 32, "FP64": 64}
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


@st.composite
def json_arrays(draw: st.DrawFn) -> Array:
    """Any datatype JSON can carry exactly: finite floats, UTF-8 text for BYTES."""
    datatype = draw(st.sampled_from([*NUMERIC, *FLOATS, "BYTES"]))
    shape = draw(shapes)
    if datatype == "BYTES":
        texts = draw(st.lists(st.text(max_size=8), min_size=_size(shape), max_size=_size(shape)))
        arr = np.empty(len(texts), dtype=object)
        arr[:] = [t.encode() for t in texts]
        return arr.reshape(shape)
    if datatype in FLOATS:
        elements = st.floats(allow_nan=False, allow_infinity=False, width=FLOATS[datatype])
        return draw(hnp.arrays(_dtype(datatype), shape, elements=elements))
    return draw(hnp.arrays(_dtype(datatype), shape))


def _size(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _dtype(datatype: str) -> np.dtype[Any]:
    return np.dtype("bool" if datatype == "BOOL" else datatype.lower().replace("fp", "float"))


def assert_same(got: Array, want: Array) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def request(*inputs: dict[str, Any], **fields: Any) -> bytes:
    return msgspec.json.encode({"inputs": list(inputs), **fields})


def tensor(name: str, datatype: str, shape: list[int], data: Any) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


# --- round trips -------------------------------------------------------------------------------


@settings(deadline=None, max_examples=150)
@given(st.dictionaries(st.sampled_from("abc"), json_arrays(), max_size=3))
def test_json_request_round_trip(inputs: dict[str, Array]) -> None:
    body, headers = encode_infer_request(inputs, binary=False, request_id="r")
    assert headers == {"Content-Type": "application/json"}
    decoded = decode_infer_request(body, None)
    assert decoded.id == "r"
    assert decoded.inputs.keys() == inputs.keys()
    for name, arr in inputs.items():
        assert_same(decoded.inputs[name], arr)


@settings(deadline=None, max_examples=150)
@given(st.dictionaries(st.sampled_from("xyz"), json_arrays(), min_size=1, max_size=3))
def test_json_response_round_trip(outputs: dict[str, Array]) -> None:
    body, headers = encode_infer_response("m", "2", None, outputs, (), binary_default=False)
    assert "Inference-Header-Content-Length" not in headers
    name, decoded = decode_infer_response(body, None)
    assert name == "m"
    for key, arr in outputs.items():
        assert_same(decoded[key], arr)


def test_nested_json_data_is_row_major() -> None:
    body = request(tensor("x", "INT32", [2, 3], [[1, 2, 3], [4, 5, 6]]))
    got = decode_infer_request(body, None).inputs["x"]
    assert_same(got, np.arange(1, 7, dtype=np.int32).reshape(2, 3))


def test_nested_bytes_and_bool_data() -> None:
    body = request(
        tensor("s", "BYTES", [2, 1], [["héllo"], [""]]),
        tensor("b", "BOOL", [1, 2], [[True, False]]),
    )
    inputs = decode_infer_request(body, None).inputs
    assert inputs["s"].tolist() == [["héllo".encode()], [b""]]
    assert_same(inputs["b"], np.array([[True, False]]))


def test_fp_accepts_integers_and_null_as_nan() -> None:
    body = request(tensor("x", "FP16", [3], [1, 2.5, None]))
    got = decode_infer_request(body, None).inputs["x"]
    assert got.dtype == np.float16
    assert got[:2].tolist() == [1.0, 2.5]
    assert np.isnan(got[2])


def test_non_finite_floats_become_null_in_json_and_nan_back() -> None:
    outputs = {"y": np.array([np.nan, np.inf, 1.0], dtype=np.float32)}
    body, _ = encode_infer_response("m", "1", None, outputs, (), binary_default=False)
    assert b"[null,null,1.0]" in body
    got = decode_infer_response(body, None)[1]["y"]
    assert np.isnan(got[:2]).all()
    assert got[2] == 1.0


def test_uint64_keeps_full_range() -> None:
    big = np.array([2**64 - 1, 0], dtype=np.uint64)
    body, _ = encode_infer_request({"x": big}, binary=False)
    assert_same(decode_infer_request(body, None).inputs["x"], big)


# --- request fields ----------------------------------------------------------------------------


def test_request_fields_and_parameters() -> None:
    body = request(
        tensor("x", "FP32", [1], [1.0]),
        id="abc",
        outputs=[{"name": "y", "parameters": {"binary_data": True}}, {"name": "z"}],
        parameters={"priority": 2, "timeout": 1500, "binary_data_output": False, "user": "u"},
    )
    req = decode_infer_request(body, None)
    assert req == InferRequest(
        id="abc",
        inputs=req.inputs,
        outputs=(RequestedOutput("y", True), RequestedOutput("z", False)),
        binary_output_default=False,
        priority=2,
        timeout_s=0.0015,
        parameters={"user": "u"},
    )


def test_binary_data_output_is_the_default_for_requested_outputs() -> None:
    body = request(
        tensor("x", "FP32", [1], [1.0]),
        outputs=[{"name": "y"}, {"name": "z", "parameters": {"binary_data": False}}],
        parameters={"binary_data_output": True},
    )
    req = decode_infer_request(body, None)
    assert req.binary_output_default is True
    assert req.outputs == (RequestedOutput("y", True), RequestedOutput("z", False))


def test_absent_parameters_and_zero_timeout_mean_defaults() -> None:
    req = decode_infer_request(request(tensor("x", "INT8", [0], [])), None)
    assert (req.id, req.outputs, req.priority, req.timeout_s) == (None, (), None, None)
    req = decode_infer_request(
        request(tensor("x", "INT8", [0], []), parameters={"timeout": 0}), None
    )
    assert req.timeout_s is None


# --- request errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "Expected `object`"),
        (b"{}", "missing required field `inputs`"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "data": [1]}]}', "field `shape`"),
        (request(tensor("x", "FP8", [1], [1])), "input 'x'.*unknown datatype 'FP8'"),
        (request(tensor("x", "FP32", [2, 2], [1, 2, 3])), "4 elements but 'data' holds 3"),
        (request(tensor("x", "FP32", [2], ["a", "b"])), "input 'x'.*does not hold FP32"),
        (request(tensor("x", "INT32", [2], [1, 2.5])), "does not hold INT32"),
        (request(tensor("x", "BOOL", [1], [1])), "does not hold BOOL"),
        (request(tensor("x", "BYTES", [1], [1])), "does not hold BYTES"),
        (request(tensor("x", "UINT8", [2], [1, 300])), "out of range for UINT8"),
        (request(tensor("x", "INT8", [1], [-129])), "out of range for INT8"),
        (request(tensor("x", "FP16", [1], [1e6])), "out of range for FP16"),
        (request(tensor("x", "INT32", [2, 2], [[1, 2], [3]])), "ragged"),
        (request(tensor("x", "BYTES", [2, 2], [["a", "b"], ["c"]])), "does not have shape"),
        (request(tensor("x", "INT32", [2, 2], [[1, 2, 3, 4]])), "does not have shape"),
        (request(tensor("x", "INT32", [2, -1], [1, 2])), "invalid dimension -1"),
        (request(tensor("x", "INT32", [2**16, 2**16], [1])), "at most 2\\*\\*31"),
        (request(tensor("x", "INT32", [0, 2**40], [])), "invalid dimension"),
        (request(tensor("x", "INT32", [1] * 33, [1])), "at most 32"),
        (request(tensor("x", "FP32", [1], {"a": 1})), "does not hold FP32"),
        (request({"name": "x", "datatype": "FP32", "shape": [1]}), "neither 'data' nor"),
        (request(tensor("x", "FP32", [1], [1]), tensor("x", "FP32", [1], [1])), "twice"),
        (request(tensor("x", "FP32", [1], [1]), parameters={"priority": "high"}), "priority"),
        (request(tensor("x", "FP32", [1], [1]), parameters={"priority": True}), "priority"),
        (request(tensor("x", "FP32", [1], [1]), parameters={"timeout": -5}), "timeout"),
        (
            request(tensor("x", "FP32", [1], [1]), parameters={"binary_data_output": 1}),
            "binary_data_output",
        ),
        (
            request(tensor("x", "FP32", [1], [1]), outputs=[{"name": "y"}, {"name": "y"}]),
            "output 'y' is requested twice",
        ),
        (
            request(
                tensor("x", "FP32", [1], [1]),
                outputs=[{"name": "y", "parameters": {"classification": 3}}],
            ),
            "classification is not supported",
        ),
        (
            request(
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [1],
                    "parameters": {"shared_memory_region": "r"},
                }
            ),
            "shared memory",
        ),
    ],
)
def test_malformed_request_names_the_problem(body: bytes, match: str) -> None:
    with pytest.raises(InvalidInput, match=match) as info:
        decode_infer_request(body, None)
    assert "Traceback" not in info.value.message


def test_deeply_nested_data_is_refused() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    body = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ' + deep + b"}]}"
    with pytest.raises(InvalidInput):
        decode_infer_request(body, None)


# --- responses ---------------------------------------------------------------------------------


def test_response_carries_only_requested_outputs_in_order() -> None:
    outputs = {"a": np.zeros(2, np.float32), "b": np.ones(1, np.int64)}
    requested = (RequestedOutput("b", False),)
    body, headers = encode_infer_response("m", "3", "id7", outputs, requested, False)
    assert headers == {"Content-Type": "application/json"}
    assert msgspec.json.decode(body) == {
        "model_name": "m",
        "model_version": "3",
        "id": "id7",
        "outputs": [{"name": "b", "datatype": "INT64", "shape": [1], "data": [1]}],
    }


def test_unknown_requested_output_is_invalid_input() -> None:
    with pytest.raises(InvalidInput, match=r"unknown output 'nope'.*'a'"):
        encode_infer_response(
            "m", "1", None, {"a": np.zeros(1)}, (RequestedOutput("nope", False),), False
        )


def test_non_utf8_bytes_cannot_go_as_json() -> None:
    arr = np.array([b"\xff"], dtype=object)
    with pytest.raises(InvalidInput, match=r"output 'y'.*binary_data"):
        encode_infer_response("m", "1", None, {"y": arr}, (), binary_default=False)
    with pytest.raises(InvalidInput, match=r"input 'x'.*not valid UTF-8"):
        encode_infer_request({"x": arr}, binary=False)


def test_str_and_unicode_arrays_encode_as_bytes() -> None:
    outputs = {"u": np.array(["ab", "ç"]), "o": np.array(["x", b"y"], dtype=object)}
    body, _ = encode_infer_response("m", "1", None, outputs, (), binary_default=False)
    decoded = decode_infer_response(body, None)[1]
    assert decoded["u"].tolist() == [b"ab", "ç".encode()]
    assert decoded["o"].tolist() == [b"x", b"y"]


def test_encode_error_body() -> None:
    assert msgspec.json.decode(encode_error('bad "x"')) == {"error": 'bad "x"'}


def test_malformed_response_is_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="missing required field `model_name`"):
        decode_infer_response(b'{"outputs": []}', None)


# --- validation against the config -------------------------------------------------------------


def batched_config(**changes: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "name": "m",
        "platform": "onnx",
        "max_batch_size": 4,
        "inputs": (
            TensorSpec(name="ids", datatype="INT64", shape=(-1,)),
            TensorSpec(name="text", datatype="BYTES", shape=(1,)),
            TensorSpec(name="mask", datatype="INT64", shape=(-1,), optional=True),
        ),
        "outputs": (TensorSpec(name="emb", datatype="FP32", shape=(3,)),),
    }
    return ModelConfig(**{**fields, **changes})


def ok_inputs(num_rows: int = 2) -> dict[str, Array]:
    return {
        "ids": np.zeros((num_rows, 5), np.int64),
        "text": np.array([[b"a"]] * num_rows, dtype=object),
    }


def test_valid_batched_inputs_pass_unchanged() -> None:
    for inputs in (ok_inputs(1), ok_inputs(4), {**ok_inputs(2), "mask": np.ones((2, 7), np.int64)}):
        got = validate_inputs(batched_config(), inputs)
        assert sorted(got) == sorted(inputs)
        assert all(got[name] is inputs[name] for name in inputs)  # already canonical: no copy


def test_scalar_rows_are_reshaped_to_the_configs_row_shape() -> None:
    inputs = {**ok_inputs(3), "text": np.array([b"a", b"b", b"c"], dtype=object)}
    got = validate_inputs(batched_config(), inputs)
    assert got["text"].shape == (3, 1)  # as if sent as [3, 1]: same compat key, concatenates
    assert got["text"][:, 0].tolist() == [b"a", b"b", b"c"]
    assert inputs["text"].shape == (3,)  # the caller's map is left alone
    nested = batched_config(
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(1, 1)),), outputs=()
    )
    assert validate_inputs(nested, {"x": np.zeros(2, np.float32)})["x"].shape == (2, 1, 1)


def test_a_row_without_its_axis_is_not_guessed_for_a_dynamic_dim() -> None:
    config = batched_config(inputs=(TensorSpec(name="ids", datatype="INT64", shape=(-1,)),))
    with pytest.raises(InvalidInput, match=r"'ids': shape \[3\], expected \['rows', -1\]"):
        validate_inputs(config, {"ids": np.zeros(3, np.int64)})


def test_optional_inputs_left_out_stay_out() -> None:
    assert "mask" not in validate_inputs(batched_config(), ok_inputs(2))


def test_text_sent_to_a_tensor_input_is_refused_clearly() -> None:
    inputs = {**ok_inputs(2), "ids": np.array([b"1 2", b"3"], dtype=object)}
    with pytest.raises(InvalidInput, match=r"'ids': got text \(BYTES\).*tensor of INT64"):
        validate_inputs(batched_config(), inputs)


def tokenized_config() -> ModelConfig:
    return batched_config(
        inputs=(TensorSpec(name="text", datatype="BYTES", shape=(1,)),),
        tokenizer=Tokenizer(input="text"),
    )


def text_rows(*rows: object) -> Array:
    arr = np.empty(len(rows), dtype=object)
    arr[:] = rows
    return arr


def test_tokenized_text_must_be_utf8_and_the_error_names_its_row() -> None:
    config = tokenized_config()
    validate_inputs(config, {"text": text_rows(b"caf\xc3\xa9", "tea", b"")})
    with pytest.raises(InvalidInput, match=r"input 'text' row 2: not valid UTF-8"):
        validate_inputs(config, {"text": text_rows(b"ok", b"fine", b"\xff\xfe bad")})
    with pytest.raises(InvalidInput, match=r"input 'text' row 1: not valid UTF-8"):  # [N, 1] too
        validate_inputs(config, {"text": text_rows(b"ok", b"caf\xc3").reshape(2, 1)})


def test_untokenized_bytes_are_not_checked_as_text() -> None:
    config = batched_config(inputs=(TensorSpec(name="blob", datatype="BYTES", shape=(1,)),))
    got = validate_inputs(config, {"blob": text_rows(b"\xff\x00", b"\x89PNG")})
    assert got["blob"].shape == (2, 1)


@pytest.mark.parametrize(
    ("texts", "match"),
    [
        (text_rows(b"a", 3), "row 1: expected text, got int"),
        (text_rows(b"a", b"b", b"c", b"d").reshape(2, 2), r"shape \[N\] or \[N, 1\]"),
    ],
)
def test_validate_content_refuses_what_the_tokenizer_cannot_take(texts: Array, match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        validate_content(tokenized_config(), {"text": texts})


def test_unbatched_model_checks_the_full_shape() -> None:
    config = ModelConfig(
        name="u",
        platform="echo",
        inputs=(TensorSpec(name="x", datatype="FP32", shape=(2, -1)),),
    )
    validate_inputs(config, {"x": np.zeros((2, 9), np.float32)})
    with pytest.raises(InvalidInput, match=r"input 'x': shape \[3, 9\], expected \[2, -1\]"):
        validate_inputs(config, {"x": np.zeros((3, 9), np.float32)})


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        ({**ok_inputs(), "extra": np.zeros(2)}, "unknown input 'extra'.*'ids'"),
        ({"ids": ok_inputs()["ids"]}, "missing input 'text'"),
        ({**ok_inputs(), "ids": np.zeros((2, 5), np.int32)}, "'ids': datatype INT32.*INT64"),
        ({**ok_inputs(), "text": np.zeros((2, 1), np.float32)}, "datatype FP32.*BYTES"),
        ({**ok_inputs(), "text": np.array([[b"a", b"b"]] * 2, dtype=object)}, "'text': shape"),
        ({**ok_inputs(), "ids": np.zeros((2, 5, 1), np.int64)}, r"expected \['rows', -1\]"),
        ({**ok_inputs(), "ids": np.zeros((), np.int64)}, "a scalar"),
        (ok_inputs(5), "5 rows, more than max_batch_size 4"),
        ({"ids": np.zeros((0, 5), np.int64), "text": np.zeros((0, 1), object)}, "0 rows"),
        ({**ok_inputs(2), "ids": np.zeros((3, 5), np.int64)}, "disagree on the number of rows"),
    ],
)
def test_invalid_inputs_name_the_problem(inputs: dict[str, Array], match: str) -> None:
    with pytest.raises(InvalidInput, match=match):
        validate_inputs(batched_config(), inputs)


def test_requested_outputs_must_be_declared() -> None:
    validate_requested_outputs(batched_config(), (RequestedOutput("emb", True),))
    with pytest.raises(InvalidInput, match=r"unknown output 'x'.*'emb'"):
        validate_requested_outputs(batched_config(), (RequestedOutput("x", True),))
    validate_requested_outputs(batched_config(outputs=()), (RequestedOutput("x", True),))


# --- metadata and config -----------------------------------------------------------------------


def test_model_metadata_reports_batch_axis_as_minus_one() -> None:
    meta = model_metadata(batched_config(), [1, 3])
    assert meta == {
        "name": "m",
        "versions": ["1", "3"],
        "platform": "onnxruntime_onnx",
        "inputs": [
            {"name": "ids", "datatype": "INT64", "shape": [-1, -1]},
            {"name": "text", "datatype": "BYTES", "shape": [-1, 1]},
            {"name": "mask", "datatype": "INT64", "shape": [-1, -1]},
        ],
        "outputs": [{"name": "emb", "datatype": "FP32", "shape": [-1, 3]}],
    }
    unbatched = model_metadata(batched_config(max_batch_size=0, platform="python"), [1])
    assert unbatched["platform"] == "python"
    assert unbatched["outputs"] == [{"name": "emb", "datatype": "FP32", "shape": [3]}]


def test_model_config_json_uses_triton_keys() -> None:
    config = batched_config(
        dynamic_batching=DynamicBatching(
            max_queue_delay_ms=2.5,
            preferred_batch_sizes=(2, 4),
            priority_levels=2,
            default_queue_policy=QueuePolicy(max_queue_size=8, default_timeout_ms=100),
            priority_queue_policy={"1": QueuePolicy(timeout_action="delay")},
        ),
        instances=Instances(count=2),
        version_policy=VersionPolicy(specific=(1, 3)),
        tokenizer=Tokenizer(max_length=64),
        parameters={"threads": 2, "spin": False, "mode": "fast"},
    )
    got = model_config_json(config)
    msgspec.json.encode(got)  # must be JSON as it stands
    assert got["name"] == "m"
    assert (got["platform"], got["backend"], got["max_batch_size"]) == (
        "onnxruntime_onnx",
        "onnxruntime",
        4,
    )
    assert got["input"][1] == {
        "name": "text",
        "data_type": "TYPE_STRING",
        "dims": [1],
        "pad_value": 0.0,
        "optional": False,
    }
    assert got["output"] == [
        {"name": "emb", "data_type": "TYPE_FP32", "dims": [3], "pad_value": 0.0, "optional": False}
    ]
    batching: Any = got["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 2500
    assert batching["preferred_batch_size"] == [2, 4]
    assert batching["priority_levels"] == 2
    assert batching["default_queue_policy"] == {
        "max_queue_size": 8,
        "default_timeout_microseconds": 100000,
        "timeout_action": "REJECT",
        "allow_timeout_override": True,
    }
    assert batching["priority_queue_policy"]["1"]["timeout_action"] == "DELAY"
    assert got["instance_group"] == [
        {"count": 2, "execution_timeout_microseconds": 60_000_000, "kind": "KIND_AUTO"}
    ]
    assert got["version_policy"] == {"specific": {"versions": [1, 3]}}
    assert got["parameters"] == {
        "threads": {"string_value": "2"},
        "spin": {"string_value": "false"},
        "mode": {"string_value": "fast"},
    }
    assert got["tokenizer"]["max_length"] == 64


def test_model_config_json_defaults() -> None:
    got = model_config_json(batched_config(max_batch_size=0, platform="echo"))
    assert "dynamic_batching" not in got
    assert "tokenizer" not in got
    assert got["version_policy"] == {"latest": {"num_versions": 1}}
    assert (got["platform"], got["backend"]) == ("echo", "echo")
    all_versions = model_config_json(batched_config(version_policy=VersionPolicy(all=True)))
    assert all_versions["version_policy"] == {"all": {}}


# --- fuzz: whatever arrives, the only error is InvalidInput ------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=12,
)
fuzz_tensors = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["a", "b"]),
        "datatype": st.sampled_from(["FP32", "FP16", "INT8", "UINT64", "BOOL", "BYTES", "XX"]),
        "shape": st.lists(st.integers(-2, 4), max_size=3),
    },
    optional={
        "data": json_values,
        "parameters": st.fixed_dictionaries(
            {}, optional={"binary_data_size": st.integers(-1, 24) | json_values}
        ),
    },
)
fuzz_requests = st.fixed_dictionaries(
    {"inputs": st.lists(fuzz_tensors, max_size=3)},
    optional={
        "id": json_values,
        "outputs": st.lists(
            st.fixed_dictionaries(
                {"name": st.text(max_size=2)}, optional={"parameters": json_values}
            )
        ),
        "parameters": st.dictionaries(
            st.sampled_from(["priority", "timeout", "binary_data_output", "x"]), json_values
        ),
    },
)


@settings(deadline=None, max_examples=300)
@given(st.one_of(fuzz_requests, json_values), st.binary(max_size=24), st.booleans())
def test_fuzzed_requests_raise_only_invalid_input(value: Any, tail: bytes, binary: bool) -> None:
    header = msgspec.json.encode(value)
    try:
        decode_infer_request(header + tail if binary else header, len(header) if binary else None)
    except InvalidInput as exc:
        assert exc.message


@settings(deadline=None, max_examples=100)
@given(st.binary(max_size=64), st.integers(-2, 80) | st.none())
def test_random_bytes_raise_only_invalid_input(body: bytes, length: int | None) -> None:
    try:
        decode_infer_request(body, length)
    except InvalidInput as exc:
        assert exc.message
