"""PyTorch backend: a TorchScript module (`model.pt`) or a `torch.export` program (`model.pt2`).

Never a pickled module. `torch.export.load` is not pickle-free in torch 2.13: it unpickles the
archive's sample inputs (falling back to `weights_only=False` when the safe load fails), tensor
subclasses and opaque constants, and would load AOTInductor shared libraries; so an archive is
inspected first and refused if any of that could happen, unless the model sets `allow_pickle`.
"""

from __future__ import annotations

import io
import json
import warnings
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fulcrum.backends.casting import cast_to
from fulcrum.backends.params import version_file
from fulcrum.backends.text import TextFrontEnd
from fulcrum.config import ModelConfig
from fulcrum.datatypes import to_numpy
from fulcrum.errors import ConfigError, InvalidInput, ModelError
from fulcrum.extras import check_torch_version, release
from fulcrum.parameters import TorchParameters, decode_parameters
from fulcrum.types import TensorMap

if TYPE_CHECKING:
    import torch

_FORMATS = {".pt": "torchscript", ".pt2": "export"}
# The torch whose `torch.export` archive layout `check_pt2_archive` was written against: other
# releases may unpickle other entries, so their archives load only with `allow_pickle`.
PT2_CHECKED_TORCH = (2, 13)


class TorchBackend:
    """Runs a TorchScript or exported program; inputs positional in `config.inputs` order."""

    def __init__(self, config: ModelConfig, version_dir: Path) -> None:
        import torch

        check_torch_version(torch.__version__, extra="torch", feature=f"serving '{config.name}'")
        params = decode_parameters(dict(config.parameters), TorchParameters)
        self.name = config.name
        self.device = torch.device(_device(params.device or _default_device()))
        self.num_threads = params.num_threads or _default_threads()
        path = _model_path(config, version_dir, params.model_file)
        self.module = _load(path, self.device, allow_pickle=params.allow_pickle)
        self.front = TextFrontEnd(config.tokenizer, version_dir) if config.tokenizer else None
        self.input_names = self._input_names(config)
        self.input_dtypes = {
            spec.name: to_numpy(spec.datatype) for spec in config.inputs if spec.datatype != "BYTES"
        }
        self.output_names = [spec.name for spec in config.outputs]
        if not self.output_names:
            raise ConfigError(f"model {config.name!r}: a torch model needs [[outputs]] in order")

    def _input_names(self, config: ModelConfig) -> list[str]:
        names: list[str] = []
        for spec in config.inputs:
            if self.front is not None and spec.name == self.front.spec.input:
                names.extend(self.front.output_names)  # the text becomes ids, mask, type ids
            else:
                names.append(spec.name)
        return names

    def execute(self, inputs: TensorMap) -> TensorMap:
        """Run one batch under `torch.inference_mode()`; torch ops release the GIL."""
        import torch

        tensors = dict(inputs)
        if self.front is not None and self.front.spec.input in tensors:
            tensors.update(self.front.encode(tensors.pop(self.front.spec.input)))
        args = [self._tensor(name, tensors) for name in self.input_names]
        if torch.get_num_threads() != self.num_threads:
            # torch's OpenMP pool size is per calling thread once set there: set on this
            # instance's own thread, it holds for this model alone (not other models, not the
            # LLM engine), where a set in __init__ would change every thread's default.
            torch.set_num_threads(self.num_threads)
        try:
            with torch.inference_mode():
                result = self.module(*args)
        except Exception as exc:
            raise ModelError(f"model {self.name!r} failed: {exc}") from exc
        return self._outputs(result)

    def _tensor(self, name: str, tensors: TensorMap) -> torch.Tensor:
        import torch

        array = tensors.get(name)
        if array is None:
            raise InvalidInput(f"model {self.name!r}: missing input {name!r}")
        if array.dtype.kind in "OSU":
            raise InvalidInput(f"model {self.name!r}: input {name!r} is text; torch takes numbers")
        if name in self.input_dtypes:
            array = cast_to(name, array, self.input_dtypes[name])
        # from_numpy shares memory but warns on read-only arrays; copy only those.
        array = np.ascontiguousarray(array if array.flags.writeable else array.copy())
        return torch.from_numpy(array).to(self.device)

    def _outputs(self, result: Any) -> TensorMap:
        import torch

        values = tuple(result) if isinstance(result, tuple | list) else (result,)
        if len(values) != len(self.output_names) or not all(
            isinstance(v, torch.Tensor) for v in values
        ):
            raise ModelError(
                f"model {self.name!r} returned {len(values)} values; "
                f"config names {len(self.output_names)} tensor outputs {self.output_names}"
            )
        return {
            name: value.detach().cpu().numpy()
            for name, value in zip(self.output_names, values, strict=True)
        }

    def close(self) -> None:
        self.__dict__.pop("module", None)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _device(name: str) -> str:
    import torch

    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise ConfigError(f"parameter 'device' = {name!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"parameter 'device' = {name!r}: CUDA is not available here")
    return name


def _default_threads() -> int:
    """torch's thread count before any model set its own: what a model without `num_threads`
    runs with, whatever other models chose."""
    global _DEFAULT_THREADS
    if _DEFAULT_THREADS is None:
        import torch

        _DEFAULT_THREADS = torch.get_num_threads()
    return _DEFAULT_THREADS


_DEFAULT_THREADS: int | None = None


def _model_path(config: ModelConfig, version_dir: Path, model_file: str) -> Path:
    if model_file:
        path = version_file(version_dir, model_file, "model_file")
        if path.suffix not in _FORMATS:
            raise ConfigError(
                f"parameter 'model_file' = {path.name!r}: expected a TorchScript '.pt' "
                "or torch.export '.pt2' file"
            )
    else:
        found = [version_dir / f"model{suffix}" for suffix in _FORMATS]
        path = next((p for p in found if p.is_file()), found[0])
    if not path.is_file():
        raise ConfigError(f"model {config.name!r}: no model file {path}")
    return path


def _load(path: Path, device: torch.device, *, allow_pickle: bool) -> Any:
    import torch

    try:
        if _FORMATS[path.suffix] == "torchscript":
            # TorchScript is deprecated in torch 2.13 but still loads; users' files still exist.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
            return module.eval()
        if not allow_pickle:
            check_pt2_torch(path, torch.__version__)
            check_pt2_archive(path)
        program = torch.export.load(str(path))
        return program.module().to(device)
    except ConfigError:
        raise
    except Exception as exc:  # torch raises many types for a corrupt or foreign file
        raise ModelError(f"cannot load {path}: {exc}") from exc


def check_pt2_torch(path: Path, version: str) -> None:
    """Refuse to vouch for a `.pt2` archive under a torch whose loader was not inspected."""
    if release(version)[:2] != PT2_CHECKED_TORCH:
        checked = ".".join(map(str, PT2_CHECKED_TORCH))
        raise ConfigError(
            f"{path}: refused, the pickle check of .pt2 archives is written for torch {checked} "
            f"and torch {version} may load them differently; set allow_pickle = true to trust it"
        )


def check_pt2_archive(path: Path) -> None:
    """Refuse a `.pt2` archive whose loading would unpickle objects or load native code."""
    try:
        with zipfile.ZipFile(path) as archive:
            files = {_archive_relative(n): n for n in archive.namelist()}
            _check_pt2_files(path, archive, files)
    except zipfile.BadZipFile as exc:
        raise ConfigError(f"{path}: not a torch.export archive") from exc


def _archive_relative(name: str) -> str:
    # Entries sit under one top folder named after the archive: "<stem>/data/weights/...".
    return name.split("/", 1)[1] if "/" in name else name


def _check_pt2_files(path: Path, archive: zipfile.ZipFile, files: dict[str, str]) -> None:
    refuse = f"{path}: refused, loading it may run pickled code; set allow_pickle = true to trust"
    if "archive_format" not in files or any(
        f.startswith(("data/aotinductor/", "data/executorch/")) for f in files
    ):
        raise ConfigError(f"{refuse} (legacy format or compiled native code)")
    for rel, name in files.items():
        if rel.startswith(("data/weights/", "data/constants/")) and rel.endswith("_config.json"):
            _check_payload_config(refuse, archive.read(name))
        elif rel.startswith(("data/weights/", "data/constants/")) and rel.endswith(".pt"):
            raise ConfigError(f"{refuse} (legacy pickled weights {rel})")
        elif rel.startswith("data/sample_inputs/"):
            _check_weights_only(refuse, archive.read(name))


def _check_payload_config(refuse: str, raw: bytes) -> None:
    entries = json.loads(raw).get("config", {})
    for fqn, meta in entries.items():
        pickled = meta.get("use_pickle", False)
        if pickled or not str(meta.get("path_name", "")).startswith(("weight_", "tensor_")):
            raise ConfigError(f"{refuse} (entry {fqn!r} is a pickled object)")


def _check_weights_only(refuse: str, raw: bytes) -> None:
    import torch

    # torch.export.load tries weights_only=True and falls back to a full unpickle on failure;
    # when the restricted load succeeds here, the fallback can never run.
    try:
        torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:
        raise ConfigError(f"{refuse} (sample inputs need a full unpickle)") from exc
