"""Python backend: a user's `model.py` in the version folder, loaded by path (never sys.path).

The user class (Triton python_backend style, one batch per call):

    class Model:
        def __init__(self, config, version_dir): ...      # or no arguments
        def initialize(self): ...                          # optional
        def execute(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...
        def close(self): ...                               # optional

`[parameters] isolation` picks where it runs: "thread" (the default) in the server process, on
its instance's thread; "process" in a process of its own per instance (`backends/process.py`).
Either way its outputs are checked against the config before they are served.
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

from fulcrum.backends import Backend
from fulcrum.backends.params import version_file
from fulcrum.config import ModelConfig
from fulcrum.datatypes import to_numpy
from fulcrum.errors import ConfigError, FulcrumError, ModelError
from fulcrum.parameters import PythonParameters, decode_parameters
from fulcrum.types import Array, TensorMap

# Each load gets its own module name, so two versions of one model never share module state.
_load_ids = itertools.count()


def load_python_backend(config: ModelConfig, version_dir: Path) -> Backend:
    """The factory for platform "python": in-thread or in its own process, per `isolation`."""
    params = decode_parameters(dict(config.parameters), PythonParameters)
    if params.isolation == "process":
        from fulcrum.backends.process import ProcessBackend  # lazily: it imports this module

        return ProcessBackend(config, version_dir)
    return PythonBackend(config, version_dir)


class PythonBackend:
    """Runs a user-written model class; its exceptions become `ModelError`."""

    def __init__(self, config: ModelConfig, version_dir: Path) -> None:
        params = decode_parameters(dict(config.parameters), PythonParameters)
        path = version_file(version_dir, params.module, "module")
        class_name = params.class_
        self.name = config.name
        self.config = config
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
        """Run one batch through the user's `execute`; outputs filtered to and checked against
        the config's."""
        result = _call_user(self.name, "execute", lambda: self._execute(dict(inputs)))
        if not isinstance(result, Mapping):
            raise ModelError(
                f"model {self.name!r}: execute returned {type(result).__name__}, expected a dict"
            )
        names = self.output_names or [str(k) for k in result]
        missing = [n for n in names if n not in result]
        if missing:
            raise ModelError(f"model {self.name!r}: execute returned no output {missing}")
        outputs = {name: np.asarray(result[name]) for name in names}
        check_outputs(self.config, outputs, _num_rows(self.config, inputs))
        return outputs

    def close(self) -> None:
        close = _optional_method(self.model, "close")
        sys.modules.pop(self.module.__name__, None)
        if close is not None:
            _call_user(self.name, "close", close)


def check_outputs(config: ModelConfig, outputs: TensorMap, num_rows: int | None) -> None:
    """Refuse outputs the server would misserve: a datatype other than the declared one (as
    Triton refuses it), or, when batching, a row count other than the batch's (the batcher
    splits outputs by row, so a short output would hand one request another's rows)."""
    for spec in config.outputs:
        array = outputs.get(spec.name)
        if array is not None and not _matches(array, spec.datatype):
            raise ModelError(
                f"model {config.name!r}: output {spec.name!r} has dtype {array.dtype}, "
                f"expected {spec.datatype} ({to_numpy(spec.datatype)})"
            )
    if num_rows is None:
        return
    for name, array in outputs.items():
        rows = array.shape[0] if array.ndim else None
        if rows != num_rows:
            raise ModelError(
                f"model {config.name!r}: output {name!r} has shape {array.shape}, "
                f"expected {num_rows} rows (one per row of the batch)"
            )


def _matches(array: Array, datatype: str) -> bool:
    if datatype == "BYTES":
        return array.dtype.kind in ("O", "S", "U")  # the encoder sends all three as BYTES
    return array.dtype == to_numpy(datatype)


def _num_rows(config: ModelConfig, inputs: TensorMap) -> int | None:
    """The batch's row count when the model batches (every input has it on axis 0)."""
    if config.max_batch_size <= 0:
        return None
    first = next(iter(inputs.values()), None)
    return first.shape[0] if first is not None and first.ndim else None


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
