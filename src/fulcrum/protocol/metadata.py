"""Model metadata and the model config as JSON, in the key names Triton's tools read.

The config JSON is derived from the `ModelConfig` struct by renaming keys (Triton's singular
`input`, `dims`, `*_microseconds`, ...); fields Triton lacks keep their Fulcrum names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from fulcrum.config import ModelConfig, TensorSpec

# Fulcrum platform -> (Triton platform, Triton backend); others keep their own name for both.
_TRITON_PLATFORMS = {
    "onnx": ("onnxruntime_onnx", "onnxruntime"),
    "torch": ("pytorch_libtorch", "pytorch"),
}
_RENAMED = {
    "inputs": "input",
    "outputs": "output",
    "shape": "dims",
    "preferred_batch_sizes": "preferred_batch_size",
}


def triton_platform(platform: str) -> str:
    """Triton's platform name for a Fulcrum platform (the same name where Triton has none)."""
    return _TRITON_PLATFORMS.get(platform, (platform, platform))[0]


def model_metadata(config: ModelConfig, versions: list[int]) -> dict[str, object]:
    """`GET /v2/models/{m}`: shapes carry a leading -1 when the model batches (as Triton's do)."""
    batch_dims = (-1,) if config.max_batch_size > 0 else ()

    def tensor(spec: TensorSpec) -> dict[str, object]:
        return {
            "name": spec.name,
            "datatype": spec.datatype,
            "shape": [*batch_dims, *spec.shape],
        }

    return {
        "name": config.name,
        "versions": [str(v) for v in versions],
        "platform": triton_platform(config.platform),
        "inputs": [tensor(spec) for spec in config.inputs],
        "outputs": [tensor(spec) for spec in config.outputs],
    }


def model_config_json(config: ModelConfig) -> dict[str, object]:
    """`GET /v2/models/{m}/config`: the whole config, keyed like Triton's model config JSON."""
    converted: dict[str, object] = _convert_dict(msgspec.to_builtins(config))
    platform, backend = _TRITON_PLATFORMS.get(config.platform, (config.platform, config.platform))
    converted["platform"] = platform
    converted["backend"] = backend
    return converted


def _convert_dict(raw: dict[str, Any]) -> dict[str, Any]:
    converted: dict[str, Any] = {}
    for key, value in raw.items():
        if value is None:
            continue  # Triton leaves unset sections out
        special = _SPECIAL.get(key)
        if special is not None:
            new_key, new_value = special(value)
        elif key.endswith("_ms"):
            new_key, new_value = key[: -len("_ms")] + "_microseconds", round(value * 1000)
        else:
            new_key, new_value = _RENAMED.get(key, key), _convert(value)
        converted[new_key] = new_value
    return converted


def _convert(value: Any) -> Any:
    if isinstance(value, dict):
        return _convert_dict(value)
    if isinstance(value, list | tuple):
        return [_convert(item) for item in value]
    return value


def _data_type(datatype: str) -> tuple[str, Any]:
    return "data_type", "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def _instance_group(instances: dict[str, Any]) -> tuple[str, Any]:
    # Fulcrum picks the device per backend, so the kind is Triton's "decide for me".
    return "instance_group", [{**_convert_dict(instances), "kind": "KIND_AUTO"}]


def _version_policy(policy: dict[str, Any]) -> tuple[str, Any]:
    if policy["all"]:
        return "version_policy", {"all": {}}
    if policy["specific"]:
        return "version_policy", {"specific": {"versions": list(policy["specific"])}}
    return "version_policy", {"latest": {"num_versions": policy["latest"] or 1}}


def _timeout_action(action: str) -> tuple[str, Any]:
    return "timeout_action", action.upper()


def _parameters(params: dict[str, Any]) -> tuple[str, Any]:
    def text(value: Any) -> str:
        return value if isinstance(value, str) else msgspec.json.encode(value).decode()

    return "parameters", {key: {"string_value": text(value)} for key, value in params.items()}


_SPECIAL: dict[str, Callable[[Any], tuple[str, Any]]] = {
    "datatype": _data_type,
    "instances": _instance_group,
    "version_policy": _version_policy,
    "timeout_action": _timeout_action,
    "parameters": _parameters,
}
