"""KServe v2 / Open Inference Protocol wire layer: pure encode/decode, no HTTP framework.

JSON tensors and Triton's binary tensor extension, both ways (server and client side), input
validation against a model's config, model metadata and config JSON, and the error body.
"""

from __future__ import annotations

from fulcrum.protocol.body import BINARY_TYPE, CONTENT_TYPE, HEADER_LENGTH, JSON_TYPE
from fulcrum.protocol.metadata import model_config_json, model_metadata, triton_platform
from fulcrum.protocol.request import (
    InferRequest,
    RequestedOutput,
    decode_infer_request,
    encode_infer_request,
)
from fulcrum.protocol.response import decode_infer_response, encode_error, encode_infer_response
from fulcrum.protocol.tensors import MAX_NUM_DIMS, MAX_NUM_ELEMENTS
from fulcrum.protocol.validation import validate_inputs, validate_requested_outputs

__all__ = [
    "BINARY_TYPE",
    "CONTENT_TYPE",
    "HEADER_LENGTH",
    "JSON_TYPE",
    "MAX_NUM_DIMS",
    "MAX_NUM_ELEMENTS",
    "InferRequest",
    "RequestedOutput",
    "decode_infer_request",
    "decode_infer_response",
    "encode_error",
    "encode_infer_request",
    "encode_infer_response",
    "model_config_json",
    "model_metadata",
    "triton_platform",
    "validate_inputs",
    "validate_requested_outputs",
]
