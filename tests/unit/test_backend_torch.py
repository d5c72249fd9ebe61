from __future__ import annotations

import collections
import io
import json
import logging
import shutil
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fulcrum.backends import create_backend
from fulcrum.backends.torch import TorchBackend, check_pt2_archive
from fulcrum.config import ModelConfig, TensorSpec, Tokenizer
from fulcrum.errors import ConfigError, InvalidInput, ModelError
from fulcrum.examples import minilm_source_dir

ParamValue = str | int | float | bool | list[str]
# Scripting and saving test models: TorchScript is deprecated in torch 2.13 but still supported.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning"
)


# A module-level class the restricted (weights_only) unpickler refuses.
Pair = collections.namedtuple("Pair", "a b")


class AddMul(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a * b


class Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((2,), 3.0))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * self.weight + b


def make_config(
    *, datatype: str = "FP32", outputs: tuple[str, ...] = ("sum", "product"), **params: ParamValue
) -> ModelConfig:
    return ModelConfig(
        name="addmul",
        platform="torch",
        max_batch_size=8,
        inputs=(
            TensorSpec(name="a", datatype=datatype, shape=(2,)),
            TensorSpec(name="b", datatype=datatype, shape=(2,)),
        ),
        outputs=tuple(TensorSpec(name=n, datatype=datatype, shape=(2,)) for n in outputs),
        parameters={"device": "cpu", **params},
    )


def ab(dtype: type[np.generic] = np.float32) -> dict[str, np.ndarray]:
    return {
        "a": np.array([[1, 2], [3, 4]], dtype=dtype),
        "b": np.array([[10, 20], [30, 40]], dtype),
    }


@pytest.fixture
def script_dir(tmp_path: Path) -> Path:
    torch.jit.save(torch.jit.script(AddMul()), str(tmp_path / "model.pt"))
    return tmp_path


def save_export(folder: Path, name: str = "model.pt2") -> Path:
    example = (torch.ones(2, 2), torch.ones(2, 2))
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(
        Scale(), example, dynamic_shapes={"a": {0: batch}, "b": {0: batch}}
    )
    path = folder / name
    torch.export.save(program, str(path))
    return path


def rewrite_archive(path: Path, edit: dict[str, bytes | None]) -> None:
    """Replace (or drop, for None) archive members whose path ends with a key of `edit`."""
    with zipfile.ZipFile(path) as src:
        members = [(info, src.read(info)) for info in src.infolist()]
    with zipfile.ZipFile(path, "w") as dst:
        for info, data in members:
            key = next((k for k in edit if info.filename.endswith(k)), None)
            if key is None:
                dst.writestr(info, data)
            elif edit[key] is not None:
                dst.writestr(info, edit[key])


def test_torchscript_outputs_follow_config_order(script_dir: Path) -> None:
    backend = create_backend(make_config(), script_dir)
    out = backend.execute(ab())
    assert list(out) == ["sum", "product"]
    np.testing.assert_array_equal(out["sum"], [[11, 22], [33, 44]])
    np.testing.assert_array_equal(out["product"], [[10, 40], [90, 160]])
    backend.close()


def test_inputs_are_positional_in_config_order(script_dir: Path) -> None:
    config = make_config()
    swapped = ModelConfig(
        name="addmul",
        platform="torch",
        inputs=tuple(reversed(config.inputs)),
        outputs=config.outputs,
        parameters=config.parameters,
    )
    backend = TorchBackend(swapped, script_dir)
    # a + b is symmetric, so feed a distinguishing shape: b is first now, a second.
    out = backend.execute({"a": np.ones((1, 2), np.float32), "b": np.zeros((1, 2), np.float32)})
    np.testing.assert_array_equal(out["product"], [[0, 0]])


def test_read_only_and_narrower_inputs_are_accepted(script_dir: Path) -> None:
    backend = TorchBackend(make_config(datatype="INT64"), script_dir)
    inputs = ab(np.int32)
    for array in inputs.values():
        array.flags.writeable = False
    out = backend.execute(inputs)
    assert out["sum"].dtype == np.int64
    np.testing.assert_array_equal(out["sum"], [[11, 22], [33, 44]])


def test_float_input_for_an_int_model_and_text_are_refused(script_dir: Path) -> None:
    backend = TorchBackend(make_config(datatype="INT64"), script_dir)
    with pytest.raises(InvalidInput, match="input 'a': datatype float32 cannot be fed as int64"):
        backend.execute(ab(np.float32))
    with pytest.raises(InvalidInput, match="missing input 'b'"):
        backend.execute({"a": np.ones((1, 2), np.int64)})
    with pytest.raises(InvalidInput, match="is text"):
        backend.execute({"a": np.array([[b"x", b"y"]], dtype=object), "b": ab()["b"]})


def test_a_failing_forward_is_a_model_error(script_dir: Path) -> None:
    bad = {"a": np.ones((2, 2), np.float32), "b": np.ones((2, 3), np.float32)}
    with pytest.raises(ModelError, match="model 'addmul' failed") as caught:
        TorchBackend(make_config(), script_dir).execute(bad)
    assert caught.value.__cause__ is not None


def test_output_count_mismatch_is_a_model_error(script_dir: Path) -> None:
    backend = TorchBackend(make_config(outputs=("only",)), script_dir)
    with pytest.raises(ModelError, match="returned 2 values"):
        backend.execute(ab())


def test_export_program_runs_with_dynamic_batch(tmp_path: Path) -> None:
    save_export(tmp_path)
    backend = TorchBackend(
        make_config(outputs=("y",), num_threads=torch.get_num_threads()), tmp_path
    )
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    out = backend.execute({"a": a, "b": np.ones((3, 2), np.float32)})
    np.testing.assert_array_equal(out["y"], a * 3 + 1)


def test_model_file_parameter_chooses_the_format(tmp_path: Path, script_dir: Path) -> None:
    save_export(script_dir, "other.pt2")  # model.pt is there too; the parameter wins
    backend = TorchBackend(make_config(outputs=("y",), model_file="other.pt2"), script_dir)
    out = backend.execute(ab())
    np.testing.assert_array_equal(out["y"], [[13, 26], [39, 52]])


def test_plain_export_archive_passes_the_pickle_check(tmp_path: Path) -> None:
    check_pt2_archive(save_export(tmp_path))  # raises if it would unpickle


def test_pickled_sample_inputs_are_refused_unless_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_export(tmp_path)
    payload = io.BytesIO()
    args = Pair(torch.ones(2, 2), torch.ones(2, 2))
    torch.save((args, {}), payload)  # weights_only refuses the class; the fallback unpickles it
    rewrite_archive(path, {"data/sample_inputs/model.pt": payload.getvalue()})
    with pytest.raises(ConfigError, match="allow_pickle = true"):
        TorchBackend(make_config(outputs=("y",)), tmp_path)
    # torch 2.13's fallback path logs with a malformed format string; pytest turns that into
    # an error, so that logger is silenced here.
    logger = logging.getLogger("torch._export.serde.serialize")
    monkeypatch.setattr(logger, "disabled", True)
    backend = TorchBackend(make_config(outputs=("y",), allow_pickle=True), tmp_path)
    assert backend.execute(ab())["y"].shape == (2, 2)


def test_pickled_weights_and_native_code_are_refused(tmp_path: Path) -> None:
    path = save_export(tmp_path)
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("model_weights_config.json"))
        weights = json.loads(archive.read(name))
    for meta in weights["config"].values():
        meta["use_pickle"] = True
    rewrite_archive(path, {"model_weights_config.json": json.dumps(weights).encode()})
    with pytest.raises(ConfigError, match="'weight' is a pickled object"):
        check_pt2_archive(path)
    path = save_export(tmp_path, "aoti.pt2")
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("aoti/data/aotinductor/model/model.so", b"\x7fELF")
    with pytest.raises(ConfigError, match="compiled native code"):
        check_pt2_archive(path)
    path = save_export(tmp_path, "legacy.pt2")
    rewrite_archive(path, {"archive_format": None})
    with pytest.raises(ConfigError, match="legacy format"):
        check_pt2_archive(path)


def test_a_pickled_whole_module_is_never_unpickled(tmp_path: Path) -> None:
    torch.save(AddMul(), str(tmp_path / "model.pt"))  # plain pickle, not TorchScript
    with pytest.raises(ModelError, match="cannot load"):
        TorchBackend(make_config(), tmp_path)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("device", "tpu", "expected 'cpu', 'cuda' or 'cuda:N'"),
        ("device", "cuda:x", "expected 'cpu', 'cuda' or 'cuda:N'"),
        ("num_threads", "4", "Expected `int`, got `str`"),
        ("allow_pickle", "yes", "Expected `bool`, got `str`"),
        ("model_file", "model.pkl", "expected a TorchScript '.pt'"),
        ("model_file", "../model.pt", "inside the version"),
        ("model_file", "missing.pt", "no model file"),
    ],
)
def test_bad_parameters_are_config_errors(
    script_dir: Path, key: str, value: ParamValue, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        TorchBackend(make_config(**{key: value}), script_dir)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_device_without_cuda_is_a_config_error(script_dir: Path) -> None:
    with pytest.raises(ConfigError, match="CUDA is not available"):
        TorchBackend(make_config(device="cuda"), script_dir)


def test_no_model_file_or_no_outputs_are_config_errors(script_dir: Path) -> None:
    empty = script_dir / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no model file"):
        TorchBackend(make_config(), empty)
    with pytest.raises(ConfigError, match=r"needs \[\[outputs\]\]"):
        TorchBackend(make_config(outputs=()), script_dir)


class CountTokens(torch.nn.Module):
    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor, type_ids: torch.Tensor
    ) -> torch.Tensor:
        return mask.sum(dim=1) + type_ids.sum(dim=1) + (ids[:, 0] == 101).long()


def test_text_input_goes_through_the_tokenizer_first(tmp_path: Path) -> None:
    torch.jit.save(torch.jit.script(CountTokens()), str(tmp_path / "model.pt"))
    shutil.copyfile(minilm_source_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    config = ModelConfig(
        name="count",
        platform="torch",
        inputs=(TensorSpec(name="text", datatype="BYTES", shape=(1,)),),
        outputs=(TensorSpec(name="n", datatype="INT64", shape=(1,)),),
        tokenizer=Tokenizer(),
        parameters={"device": "cpu"},
    )
    text = np.array([[b"one"], [b"one two three"]], dtype=object)
    out = TorchBackend(config, tmp_path).execute({"text": text})
    # [CLS] words [SEP] per row (padding excluded by the mask), plus 1 for the leading [CLS].
    assert out["n"].tolist() == [4, 6]


def test_num_threads_holds_for_its_own_model_only(script_dir: Path) -> None:
    """torch's pool size is set on each instance's own thread: one model's `num_threads` changes
    neither another model's nor the caller's (it was process-wide before)."""
    one = TorchBackend(make_config(num_threads=1), script_dir)
    three = TorchBackend(make_config(num_threads=3), script_dir)
    before = torch.get_num_threads()
    seen: dict[str, list[int]] = {"one": [], "three": []}

    def run(name: str, backend: TorchBackend, rounds: int, barrier: threading.Barrier) -> None:
        for _ in range(rounds):
            barrier.wait()  # interleave the two models' batches
            backend.execute(ab())
            seen[name].append(torch.get_num_threads())

    barrier = threading.Barrier(2)
    threads = [
        threading.Thread(target=run, args=("one", one, 3, barrier)),
        threading.Thread(target=run, args=("three", three, 3, barrier)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert seen == {"one": [1, 1, 1], "three": [3, 3, 3]}
    assert torch.get_num_threads() == before
