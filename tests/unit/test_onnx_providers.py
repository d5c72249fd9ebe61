"""A CUDA provider that does not start is named, not silently replaced by the CPU.

The tests make onnxruntime claim a CUDA provider and bring every session up on the CPU, as ORT
does on a GPU machine whose CUDA or cuDNN libraries are missing (it logs an error and carries on
without CUDA); so they hold on any machine. tests/gpu/test_onnx_cuda.py checks the working case.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import onnxruntime as ort
import pytest
from test_backend_onnx import make_config, write_add_graph

from fulcrum.backends import onnx_providers
from fulcrum.backends.onnx import OnnxBackend
from fulcrum.backends.onnx_providers import CPU, CUDA
from fulcrum.config import ModelConfig
from fulcrum.errors import ModelError


def unpinned(**parameters: bool) -> ModelConfig:
    """The test model with no `execution_providers`: the machine's default (here, "CUDA")."""
    config = make_config(**parameters)
    params = {k: v for k, v in config.parameters.items() if k != "execution_providers"}
    return msgspec.structs.replace(config, parameters=params)


@pytest.fixture
def version_dir(tmp_path: Path) -> Path:
    write_add_graph(tmp_path / "model.onnx")
    return tmp_path


@pytest.fixture
def preloads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A claimed CUDA provider whose libraries fail to preload; counts the preloads."""
    calls: list[int] = []

    def preload_dlls() -> None:
        calls.append(1)
        print("\033[33mFailed to load /nv/cublas/lib/libcublasLt.so.13: no such file\033[0m")

    real_session = ort.InferenceSession

    def session(path: str, options: ort.SessionOptions, providers: list[str]) -> object:
        return real_session(path, options, providers=[CPU])

    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(ort, "InferenceSession", session)
    monkeypatch.setattr(ort, "preload_dlls", preload_dlls, raising=False)
    monkeypatch.setattr(onnx_providers, "_preload_report", None)
    return calls


def test_a_named_cuda_provider_that_does_not_start_fails_the_load_with_the_reason(
    version_dir: Path, preloads: list[int]
) -> None:
    with pytest.raises(ModelError) as caught:
        OnnxBackend(make_config(execution_providers=[CUDA, CPU]), version_dir)
    message = caught.value.message
    assert f"could not start {CUDA}" in message and "libcublasLt.so.13" in message
    assert f"execution_providers = [{CPU!r}]" in message and "\033" not in message
    assert preloads == [1]


def test_a_default_cuda_provider_that_does_not_start_serves_on_the_cpu_with_a_warning(
    version_dir: Path, preloads: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="fulcrum.backends.onnx_providers"):
        first = OnnxBackend(unpinned(spin_when_idle=True), version_dir)
        second = OnnxBackend(unpinned(), version_dir)
    assert first.session.get_providers() == [CPU]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("serving on the CPU" in w for w in warnings)
    assert "libcublasLt.so.13" in warnings[0]
    assert preloads == [1]  # once per process
    # The spinning second session is a CPU matter: a model given CUDA does not build one.
    assert first.lone_session is None
    first.close()
    second.close()


def test_cpu_only_providers_preload_nothing(version_dir: Path, preloads: list[int]) -> None:
    backend = OnnxBackend(make_config(execution_providers=[CPU]), version_dir)
    assert backend.session.get_providers() == [CPU] and preloads == []
    backend.close()
