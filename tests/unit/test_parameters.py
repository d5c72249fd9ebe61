"""Typed `[parameters]` per platform: decoded once, errors name the key and the value."""

from __future__ import annotations

import pytest

from fulcrum.errors import ConfigError
from fulcrum.parameters import (
    EchoParameters,
    OnnxParameters,
    PythonParameters,
    TorchParameters,
    check_parameters,
    decode_parameters,
)


def test_defaults_and_typed_values() -> None:
    onnx = decode_parameters(
        {"intra_op_threads": 2, "execution_providers": ["CPU"]}, OnnxParameters
    )
    assert (onnx.model_file, onnx.intra_op_threads, onnx.execution_providers) == (
        "model.onnx",
        2,
        ("CPU",),
    )
    assert decode_parameters({}, TorchParameters).num_threads == 0
    assert decode_parameters({"latency_a_ms": 2}, EchoParameters).latency_a_ms == 2.0


@pytest.mark.parametrize(
    ("platform", "parameters", "message"),
    [
        ("onnx", {"intra_op_threads": "2"}, "'parameters.intra_op_threads' = '2': Expected `int`"),
        ("onnx", {"graph_optimization_level": "max"}, r"expected one of \['all', 'basic'"),
        ("onnx", {"model_fle": "x.onnx"}, r"'parameters.model_fle': unknown; expected one of"),
        ("torch", {"num_threads": -2}, "'parameters.num_threads' = -2: Expected `int` >= 0"),
        ("echo", {"latency_a_ms": "fast"}, "'parameters.latency_a_ms' = 'fast'"),
        ("python", {"isolation": "fork"}, r"expected one of \['process', 'thread'\]"),
        ("llm", {"max_num_seqs": 0}, "max_num_seqs"),
        ("llm", {"max_num_sqs": 4}, "max_num_sqs"),
    ],
)  # fmt: skip
def test_bad_parameters_name_the_key(
    platform: str, parameters: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_parameters(platform, parameters)


def test_python_models_keep_keys_of_their_own() -> None:
    params = decode_parameters({"class": "Net", "labels": "a,b"}, PythonParameters)
    assert params.class_ == "Net"
    check_parameters("python", {"my_threshold": 0.5})  # the user's code reads it
