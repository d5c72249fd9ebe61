from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fulcrum.backends import create_backend
from fulcrum.backends.python import PythonBackend
from fulcrum.config import ModelConfig, TensorSpec
from fulcrum.errors import ConfigError, InvalidInput, ModelError

ParamValue = str | int | float | bool | list[str]

DOUBLER = """
import numpy as np
from fulcrum.errors import InvalidInput

calls = []

class Model:
    def __init__(self, config, version_dir):
        self.name = config.name
        self.version_dir = version_dir
        calls.append("init")

    def initialize(self):
        calls.append("initialize")

    def execute(self, batch):
        x = batch["x"]
        if np.any(x < 0):
            raise InvalidInput("x must be >= 0")
        if np.any(x == 13):
            raise RuntimeError("unlucky")
        return {"doubled": x * 2, "extra": x, "name": np.array([self.name])}

    def close(self):
        calls.append("close")
"""


def make_config(*, outputs: tuple[str, ...] = ("doubled",), **params: ParamValue) -> ModelConfig:
    return ModelConfig(
        name="doubler",
        platform="python",
        max_batch_size=4,
        inputs=(TensorSpec(name="x", datatype="INT64", shape=(1,)),),
        outputs=tuple(TensorSpec(name=n, datatype="INT64", shape=(1,)) for n in outputs),
        parameters=dict(params),
    )


def write(folder: Path, source: str, name: str = "model.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return folder


def x(*values: int) -> dict[str, np.ndarray]:
    return {"x": np.array(values, dtype=np.int64).reshape(-1, 1)}


def test_runs_the_user_class_and_keeps_only_config_outputs(tmp_path: Path) -> None:
    backend = create_backend(make_config(), write(tmp_path, DOUBLER))
    out = backend.execute(x(1, 2, 3))
    assert list(out) == ["doubled"]
    np.testing.assert_array_equal(out["doubled"], [[2], [4], [6]])


def test_constructor_gets_config_and_version_dir_and_lifecycle_hooks_run(tmp_path: Path) -> None:
    backend = PythonBackend(make_config(outputs=()), write(tmp_path, DOUBLER))
    calls = backend.module.calls
    assert calls == ["init", "initialize"]
    assert backend.model.version_dir == tmp_path
    out = backend.execute(x(5))
    assert sorted(out) == ["doubled", "extra", "name"]  # no config outputs: all of them
    assert out["name"].tolist() == ["doubler"]
    module_name = backend.module.__name__
    assert module_name in sys.modules
    backend.close()
    assert calls[-1] == "close" and module_name not in sys.modules


def test_a_class_without_init_arguments_is_built_bare(tmp_path: Path) -> None:
    source = """
    class Model:
        def execute(self, batch):
            return {"doubled": batch["x"] + 100}
    """
    out = PythonBackend(make_config(), write(tmp_path, source)).execute(x(1))
    assert out["doubled"].tolist() == [[101]]


def test_module_and_class_parameters_pick_the_file_and_class(tmp_path: Path) -> None:
    source = """
    class Other:
        def execute(self, batch):
            return {"doubled": batch["x"] * 0}
    """
    write(tmp_path, source, "custom.py")
    backend = PythonBackend(make_config(module="custom.py", **{"class": "Other"}), tmp_path)
    assert backend.execute(x(7))["doubled"].tolist() == [[0]]


def test_loaded_by_path_not_from_sys_path(tmp_path: Path) -> None:
    # A file named like a stdlib module must not shadow or be shadowed by it.
    write(tmp_path, DOUBLER, "json.py")
    backend = PythonBackend(make_config(module="json.py"), tmp_path)
    import json

    assert backend.module is not json and backend.module.__name__ != "json"
    assert hasattr(json, "dumps")


def test_each_load_gets_its_own_module_state(tmp_path: Path) -> None:
    first = PythonBackend(make_config(), write(tmp_path, DOUBLER))
    second = PythonBackend(make_config(), tmp_path)
    assert first.module is not second.module
    assert first.module.calls == ["init", "initialize"] == second.module.calls


def test_user_exceptions_become_model_errors_but_fulcrum_errors_pass(tmp_path: Path) -> None:
    backend = PythonBackend(make_config(), write(tmp_path, DOUBLER))
    with pytest.raises(ModelError, match="execute raised RuntimeError") as caught:
        backend.execute(x(13))
    assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(InvalidInput, match="x must be >= 0"):
        backend.execute(x(-1))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("return [1, 2]", "returned list, expected a dict"),
        ("return {'other': batch['x']}", r"returned no output \['doubled'\]"),
    ],
)
def test_malformed_results_are_model_errors(tmp_path: Path, body: str, message: str) -> None:
    source = f"""
    class Model:
        def execute(self, batch):
            {body}
    """
    backend = PythonBackend(make_config(), write(tmp_path, source))
    with pytest.raises(ModelError, match=message):
        backend.execute(x(1))


@pytest.mark.parametrize(
    ("source", "params", "error", "message"),
    [
        (DOUBLER, {"module": "missing.py"}, ConfigError, "no python model file"),
        (DOUBLER, {"module": "../model.py"}, ConfigError, "inside the version"),
        (DOUBLER, {"class": "Missing"}, ConfigError, "'class' = 'Missing': no such class"),
        (DOUBLER, {"module": 3}, ConfigError, "'parameters.module' = 3: Expected `str`"),
        ("class Model:\n    pass\n", {}, ConfigError, "has no method 'execute'"),
        ("raise ImportError('no deps')\n", {}, ModelError, "importing .* failed: no deps"),
        (
            "class Model:\n    def __init__(self):\n        raise ValueError('boom')\n",
            {},
            ModelError,
            "__init__ raised ValueError",
        ),
        (
            "class Model:\n    def initialize(self):\n        1 / 0\n"
            "    def execute(self, batch):\n        return batch\n",
            {},
            ModelError,
            "initialize raised ZeroDivisionError",
        ),
    ],
)
def test_load_failures_name_the_problem(
    tmp_path: Path,
    source: str,
    params: dict[str, ParamValue],
    error: type[Exception],
    message: str,
) -> None:
    before = set(sys.modules)
    with pytest.raises(error, match=message):
        PythonBackend(make_config(**params), write(tmp_path, source))
    assert set(sys.modules) == before  # a failed load leaves no module behind


def typed_config(datatype: str, *, max_batch_size: int = 4) -> ModelConfig:
    return ModelConfig(
        name="typed",
        platform="python",
        max_batch_size=max_batch_size,
        inputs=(TensorSpec(name="x", datatype="INT64", shape=(1,)),),
        outputs=(TensorSpec(name="y", datatype=datatype, shape=(1,)),),
    )


def returning(folder: Path, expression: str) -> Path:
    source = f"""
    import numpy as np

    class Model:
        def execute(self, batch):
            x = batch["x"]
            return {{"y": {expression}}}
    """
    return write(folder, source)


@pytest.mark.parametrize(
    ("datatype", "expression", "message"),
    [
        ("FP32", "x * 0.5", r"output 'y' has dtype float64, expected FP32 \(float32\)"),
        ("INT64", "x.astype(np.int32)", r"output 'y' has dtype int32, expected INT64 \(int64\)"),
        ("INT64", "x.astype(object)", r"output 'y' has dtype object, expected INT64"),
        ("BYTES", "x", r"output 'y' has dtype int64, expected BYTES"),
        ("INT64", "x[:1]", r"output 'y' has shape \(1, 1\), expected 2 rows"),
        ("INT64", "np.int64(1)", r"output 'y' has shape \(\), expected 2 rows"),
    ],
)
def test_outputs_that_disagree_with_the_config_are_model_errors(
    tmp_path: Path, datatype: str, expression: str, message: str
) -> None:
    backend = create_backend(typed_config(datatype), returning(tmp_path, expression))
    with pytest.raises(ModelError, match=message):
        backend.execute(x(1, 2))


@pytest.mark.parametrize(
    ("datatype", "expression", "max_batch_size", "expected"),
    [
        ("BYTES", "np.array([b'a', b'b'], dtype=object)", 4, [b"a", b"b"]),
        ("BYTES", "np.array(['a', 'b'])", 4, ["a", "b"]),  # str and bytes arrays: BYTES too
        ("BYTES", "np.array([b'a', b'b'])", 4, [b"a", b"b"]),
        ("FP32", "(x * 0.5).astype(np.float32)", 4, [[0.5], [1.0]]),
        ("INT64", "x[:1]", 0, [[1]]),  # a model that does not batch has no rows to match
    ],
)
def test_outputs_that_match_the_config_are_served(
    tmp_path: Path, datatype: str, expression: str, max_batch_size: int, expected: list[object]
) -> None:
    config = typed_config(datatype, max_batch_size=max_batch_size)
    backend = create_backend(config, returning(tmp_path, expression))
    assert backend.execute(x(1, 2))["y"].tolist() == expected


def test_isolation_defaults_to_thread_and_is_checked(tmp_path: Path) -> None:
    write(tmp_path, DOUBLER)
    assert isinstance(create_backend(make_config(), tmp_path), PythonBackend)
    with pytest.raises(ConfigError, match=r"'parameters\.isolation' = 'fork': expected one of"):
        create_backend(make_config(isolation="fork"), tmp_path)
