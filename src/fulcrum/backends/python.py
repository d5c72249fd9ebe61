"""Python backend: a user's `model.py` in the version folder, loaded by path (never sys.path).

The user class (Triton python_backend style, one batch per call):

    class Model:
        def __init__(self, config, version_dir): ...      # or no arguments
        def initialize(self): ...                          # optional
        def execute(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...
        def close(self): ...                               # optional
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from fulcrum.backends.params import get_str, version_file
from fulcrum.config import ModelConfig
from fulcrum.errors import ConfigError, FulcrumError, ModelError
from fulcrum.types import TensorMap

# Each load gets its own module name, so two versions of one model never share module state.
_load_ids = itertools.count()


class PythonBackend:
    """Runs a user-written model class; its exceptions become `ModelError`."""

    def __init__(self, config: ModelConfig, version_dir: Path) -> None:
        params = config.parameters
        path = version_file(version_dir, get_str(params, "module", "model.py"), "module")
        class_name = get_str(params, "class", "Model")
        self.name = config.name
        self.output_names = [spec.name for spec in config.outputs]
        self.module = _import_file(config.name, path)
        try:
            cls = getattr(self.module, class_name, None)
            if not isinstance(cls, type):
                raise ConfigError(f"parameter 'class' = {class_name!r}: no such class in {path}")
            self.model = _call_user(
                config.name, "__init__", lambda: _construct(cls, config, version_dir)
            )
            self._execute = _required_method(self.model, "execute", path)
            initialize = _optional_method(self.model, "initialize")
            if initialize is not None:
                _call_user(config.name, "initialize", initialize)
        except FulcrumError:
            sys.modules.pop(self.module.__name__, None)  # a failed load leaves nothing behind
            raise

    def execute(self, inputs: TensorMap) -> TensorMap:
        """Run one batch through the user's `execute`; outputs filtered to the config's."""
        result = _call_user(self.name, "execute", lambda: self._execute(dict(inputs)))
        if not isinstance(result, Mapping):
            raise ModelError(
                f"model {self.name!r}: execute returned {type(result).__name__}, expected a dict"
            )
        names = self.output_names or [str(k) for k in result]
        missing = [n for n in names if n not in result]
        if missing:
            raise ModelError(f"model {self.name!r}: execute returned no output {missing}")
        return {name: np.asarray(result[name]) for name in names}

    def close(self) -> None:
        close = _optional_method(self.model, "close")
        sys.modules.pop(self.module.__name__, None)
        if close is not None:
            _call_user(self.name, "close", close)


def _import_file(model_name: str, path: Path) -> ModuleType:
    if not path.is_file():
        raise ConfigError(f"model {model_name!r}: no python model file {path}")
    module_name = f"fulcrum_user_model_{next(_load_ids)}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"model {model_name!r}: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    # Registered while it runs: dataclasses and pickling look a class's module up by name.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ModelError(f"model {model_name!r}: importing {path} failed: {exc}") from exc
    return module


def _construct(cls: type, config: ModelConfig, version_dir: Path) -> Any:
    try:
        inspect.signature(cls).bind(config, version_dir)
    except (TypeError, ValueError):  # ValueError: a signature inspect cannot read
        return cls()
    return cls(config, version_dir)


def _optional_method(model: object, name: str) -> Callable[..., Any] | None:
    method = getattr(model, name, None)
    return method if callable(method) else None


def _required_method(model: object, name: str, path: Path) -> Callable[..., Any]:
    method = _optional_method(model, name)
    if method is None:
        raise ConfigError(f"{path}: class {type(model).__name__} has no method {name!r}")
    return method


def _call_user(model_name: str, what: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except FulcrumError:
        raise  # the user's code chose the error (e.g. InvalidInput); keep it
    except Exception as exc:
        raise ModelError(f"model {model_name!r}: {what} raised {exc!r}") from exc
