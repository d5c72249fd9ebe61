"""The model repository: layout, version policy, load/unload/reload and name safety."""

from __future__ import annotations

from pathlib import Path

import pytest

from fulcrum.config import ModelConfig, VersionPolicy
from fulcrum.errors import ConfigError, InvalidInput, NotFound
from fulcrum.repository import ModelRepository, apply_override, select_versions

ECHO = """
platform = "echo"
max_batch_size = 4
[[inputs]]
name = "x"
datatype = "FP32"
shape = [2]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [2]
"""


class FakeServable:
    def __init__(self, config: ModelConfig, version: int) -> None:
        self.config, self.version = config, version
        self.stopped = False

    @property
    def is_ready(self) -> bool:
        return not self.stopped

    async def stop(self) -> None:
        self.stopped = True


class FakeLoader:
    def __init__(self) -> None:
        self.loaded: list[FakeServable] = []
        self.fail_versions: set[int] = set()
        self.missing_file = False  # raise as a backend does when its weights file is absent

    async def __call__(
        self, config: ModelConfig, version: int, path: Path, variant: str = "default"
    ) -> FakeServable:
        assert path.is_dir()
        if version in self.fail_versions:
            raise ConfigError(f"version {version} is broken")
        if self.missing_file:
            raise FileNotFoundError(f"[Errno 2] No such file or directory: '{path}/model.onnx'")
        servable = FakeServable(config, version)
        self.loaded.append(servable)
        return servable


def make_model(root: Path, name: str, versions: list[int], extra: str = "") -> Path:
    model = root / name
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.toml").write_text(ECHO + extra)
    for v in versions:
        (model / str(v)).mkdir(exist_ok=True)
    return model


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (VersionPolicy(), [3]),
        (VersionPolicy(latest=2), [2, 3]),
        (VersionPolicy(all=True), [1, 2, 3]),
        (VersionPolicy(specific=(1, 3)), [1, 3]),
    ],
)
def test_version_policy(policy: VersionPolicy, expected: list[int]) -> None:
    assert select_versions(policy, [1, 2, 3]) == expected


def test_specific_missing_version_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"missing versions \[4\]"):
        select_versions(VersionPolicy(specific=(4,)), [1, 2])


async def test_load_serves_highest_version_by_default(tmp_path: Path) -> None:
    make_model(tmp_path, "m", [1, 2], "[version_policy]\nall = true\n")
    repo = ModelRepository(tmp_path, FakeLoader())
    assert await repo.load_all() == []
    config, version, _ = repo.get("m")
    assert (config.name, version) == ("m", 2)
    assert repo.get("m", 1)[1] == 1
    with pytest.raises(NotFound, match="no loaded version 7"):
        repo.get("m", 7)
    assert [r["version"] for r in repo.index()] == ["1", "2"]


async def test_failed_reload_keeps_old_version_serving(tmp_path: Path) -> None:
    make_model(tmp_path, "m", [1])
    loader = FakeLoader()
    repo = ModelRepository(tmp_path, loader)
    await repo.load("m")
    old = repo.get("m")[2]
    (tmp_path / "m" / "2").mkdir()
    loader.fail_versions = {2}
    with pytest.raises(ConfigError, match="version 2 is broken"):
        await repo.load("m")
    assert repo.get("m")[2] is old
    assert repo.index()[0]["state"] == "READY"


async def test_reload_starts_new_before_stopping_old(tmp_path: Path) -> None:
    make_model(tmp_path, "m", [1])
    repo = ModelRepository(tmp_path, FakeLoader())
    await repo.load("m")
    old = repo.get("m")[2]
    (tmp_path / "m" / "2").mkdir()
    await repo.load("m")
    new = repo.get("m")[2]
    assert new is not old and repo.get("m")[1] == 2
    assert isinstance(old, FakeServable) and old.stopped


async def test_unload_then_not_found(tmp_path: Path) -> None:
    make_model(tmp_path, "m", [1])
    repo = ModelRepository(tmp_path, FakeLoader())
    await repo.load("m")
    servable = repo.get("m")[2]
    await repo.unload("m")
    assert isinstance(servable, FakeServable) and servable.stopped
    with pytest.raises(NotFound):
        repo.get("m")
    assert repo.index() == [{"name": "m", "state": "UNAVAILABLE", "reason": "unloaded"}]


@pytest.mark.parametrize(
    "name", ["..", "../etc", "a/b", "/abs", "%2e%2e", "a\x00", "", ".hidden", "m\n", "a\\b", "-m"]
)
async def test_names_that_escape_are_refused(tmp_path: Path, name: str) -> None:
    repo = ModelRepository(tmp_path, FakeLoader())
    with pytest.raises(InvalidInput, match="invalid model name"):
        await repo.load(name)


async def test_malformed_config_names_file_and_key(tmp_path: Path) -> None:
    make_model(tmp_path, "m", [1], '[dynamic_batching]\nmax_queue_delay_ms = "soon"\n')
    repo = ModelRepository(tmp_path, FakeLoader())
    with pytest.raises(ConfigError) as info:
        await repo.load("m")
    assert "config.toml" in info.value.message
    assert "dynamic_batching.max_queue_delay_ms" in info.value.message
    assert await repo.load_all() == ["m"]


async def test_missing_version_folder(tmp_path: Path) -> None:
    make_model(tmp_path, "m", [])
    with pytest.raises(ConfigError, match="no version folder"):
        await ModelRepository(tmp_path, FakeLoader()).load("m")


async def test_config_override_is_validated(tmp_path: Path) -> None:
    make_model(tmp_path, "m", [1])
    repo = ModelRepository(tmp_path, FakeLoader())
    await repo.load("m", {"max_batch_size": 2})
    assert repo.get("m")[0].max_batch_size == 2
    with pytest.raises(InvalidInput, match="config override"):
        await repo.load("m", {"max_batch_size": "big"})
    config = repo.get("m")[0]
    with pytest.raises(InvalidInput, match="platform"):
        apply_override(config, {"platform": "tea"})


async def test_load_of_a_model_not_in_the_repository_leaves_no_row(tmp_path: Path) -> None:
    make_model(tmp_path, "m", [1])
    repo = ModelRepository(tmp_path, FakeLoader())
    with pytest.raises(NotFound, match="ghost"):
        await repo.load("ghost")
    assert repo.index() == [{"name": "m", "state": "UNAVAILABLE", "reason": ""}]
    assert repo.model_names() == ["m"]


async def test_failed_load_of_a_real_model_keeps_its_row_and_reason(tmp_path: Path) -> None:
    make_model(tmp_path, "m", [1])
    loader = FakeLoader()
    loader.fail_versions = {1}
    repo = ModelRepository(tmp_path, loader)
    with pytest.raises(ConfigError):
        await repo.load("m")
    assert repo.index() == [{"name": "m", "state": "UNAVAILABLE", "reason": "version 1 is broken"}]


async def test_unloaded_model_whose_folder_is_gone_leaves_the_index(tmp_path: Path) -> None:
    make_model(tmp_path, "m", [1])
    repo = ModelRepository(tmp_path, FakeLoader())
    await repo.load("m")
    await repo.unload("m")
    (tmp_path / "m" / "config.toml").unlink()
    with pytest.raises(NotFound):
        await repo.load("m")
    assert repo.index() == []


async def test_name_with_dots_inside_is_a_model_name(tmp_path: Path) -> None:
    make_model(tmp_path, "model..1", [1])
    repo = ModelRepository(tmp_path, FakeLoader())
    await repo.load("model..1")
    assert repo.get("model..1")[0].name == "model..1"


async def test_load_errors_name_files_relative_to_the_repository(tmp_path: Path) -> None:
    root = tmp_path / "models"
    make_model(root, "bad", [1], "surprise = 1\n")
    make_model(root, "m", [1])
    loader = FakeLoader()
    loader.missing_file = True
    repo = ModelRepository(root, loader)
    with pytest.raises(ConfigError) as bad:
        await repo.load("bad")
    with pytest.raises(ConfigError) as missing:
        await repo.load("m")
    assert bad.value.message.startswith("bad/config.toml: ")
    assert "m/1/model.onnx" in missing.value.message
    for message in (bad.value.message, missing.value.message, *(r["reason"] for r in repo.index())):
        assert str(tmp_path) not in message


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ({"platform": "nope"}, "key 'platform' = 'nope'"),
        ({"max_batch_size": "x"}, "max_batch_size"),
        ({"instances": {"count": 0}}, "instances.count"),
        ({"instances": 2}, "instances"),
        ({"version_policy": {"specific": [9]}}, "missing versions [9]"),
    ],
)
async def test_bad_config_override_is_a_client_error(
    tmp_path: Path, override: dict[str, object], fragment: str
) -> None:
    make_model(tmp_path, "m", [1])
    repo = ModelRepository(tmp_path, FakeLoader())
    await repo.load("m")
    old = repo.get("m")[2]
    with pytest.raises(InvalidInput) as info:
        await repo.load("m", override)
    assert info.value.message.startswith("config override: ")
    assert fragment in info.value.message
    assert repo.get("m")[2] is old


async def test_override_the_backend_cannot_load_is_a_client_error(tmp_path: Path) -> None:
    make_model(tmp_path, "m", [1])
    loader = FakeLoader()
    loader.missing_file = True
    repo = ModelRepository(tmp_path, loader)
    with pytest.raises(InvalidInput, match="config override: model 'm' failed to load"):
        await repo.load("m", {"platform": "onnx"})
    with pytest.raises(ConfigError):  # the same failure with no override: the repository's fault
        await repo.load("m")
