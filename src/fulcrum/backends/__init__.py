"""The `Backend` seam: run one batch of one model; and the factory that picks one by platform."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from fulcrum.config import ModelConfig
from fulcrum.errors import ConfigError
from fulcrum.extras import require_extra
from fulcrum.types import TensorMap


class Backend(Protocol):
    """One loaded copy of a model. `execute` blocks; it runs on its instance's own thread."""

    def execute(self, inputs: TensorMap) -> TensorMap:
        """Run a batch: every input and output is batched on axis 0 (when the model batches)."""
        ...

    def close(self) -> None:
        """Release the model's resources."""
        ...


@runtime_checkable
class LoneBatchBackend(Backend, Protocol):
    """A backend with a faster path for a batch that runs alone (nothing queued or running
    beside it): e.g. ONNX Runtime threads that spin, which pays only while the cores are idle."""

    def execute_lone(self, inputs: TensorMap) -> TensorMap:
        """Run a batch like `execute`, knowing nothing else waits for or runs beside it."""
        ...


def shared_between_instances(backend: Backend) -> bool:
    """Whether one loaded `backend` serves all of its model's instances, each instance thread
    calling `execute` on it (a backend whose attribute `shared_between_instances` is True)."""
    return getattr(backend, "shared_between_instances", False) is True


def distinct(backends: Sequence[Backend]) -> list[Backend]:
    """Each backend once, in order: a shared one sits at several instances."""
    return list({id(b): b for b in backends}.values())


class BackendFactory(Protocol):
    def __call__(self, config: ModelConfig, version_dir: Path) -> Backend: ...


# platform -> "module:callable"; imported lazily so `import fulcrum` stays light.
_FACTORIES = {
    "echo": "fulcrum.backends.echo:EchoBackend",
    "onnx": "fulcrum.backends.onnx:OnnxBackend",
    "torch": "fulcrum.backends.torch:TorchBackend",
    "python": "fulcrum.backends.python:load_python_backend",
}
# platform -> the install extra its backend needs; the others run on the core dependencies.
_EXTRAS = {"torch": "torch"}


def create_backend(config: ModelConfig, version_dir: Path) -> Backend:
    """Load one instance of `config`'s model from `version_dir`."""
    target = _FACTORIES.get(config.platform)
    if target is None:
        raise ConfigError(f"platform {config.platform!r} has no batch backend")
    extra = _EXTRAS.get(config.platform)
    if extra is not None:  # before the import, so the error names the extra to install
        require_extra(extra, feature=f"serving '{config.name}' (platform '{config.platform}')")
    module_name, _, attr = target.partition(":")
    factory: BackendFactory = getattr(importlib.import_module(module_name), attr)
    return factory(config, version_dir)
