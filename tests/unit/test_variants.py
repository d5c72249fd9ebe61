"""Variants in config.toml: validation that names the key, the implicit variant, the merge of a
variant's parameters over the model's, and the repository loading each variant."""

from __future__ import annotations

from pathlib import Path

import pytest

from fulcrum.config import ModelConfig, load_model_config
from fulcrum.errors import ConfigError, InvalidInput
from fulcrum.repository import ModelRepository
from fulcrum.variants import (
    default_variant,
    loaded_variant_names,
    resolve_variant,
    variant_names,
)

BASE = """platform = "echo"
max_batch_size = 4
[parameters]
latency_a_ms = 1.0
"""
VARIANTS = """
[variants.fp32]
[variants.int8]
precision = "int8"
parameters = { latency_a_ms = 0.5 }
[variants.int8.figures]
fidelity = 0.995
fidelity_metric = "cosine"
[variants.int4]
load = false
parameters = { latency_a_ms = 0.25 }
"""


def read(tmp_path: Path, text: str) -> ModelConfig:
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    (folder / "config.toml").write_text(text)
    return load_model_config(folder / "config.toml", dir_name="m")


def test_a_model_without_variants_has_the_implicit_one(tmp_path: Path) -> None:
    config = read(tmp_path, BASE)
    assert variant_names(config) == loaded_variant_names(config) == ["default"]
    assert default_variant(config) == "default"
    assert resolve_variant(config) is config
    with pytest.raises(ConfigError, match=r"no variant 'int8' \(variants: \['default'\]\)"):
        resolve_variant(config, "int8")


def test_variants_merge_their_parameters_and_keep_their_figures(tmp_path: Path) -> None:
    config = read(tmp_path, BASE + VARIANTS)
    assert variant_names(config) == ["fp32", "int8", "int4"]
    assert loaded_variant_names(config) == ["fp32", "int8"]
    assert default_variant(config) == "fp32"  # the first loaded one when none is named
    assert resolve_variant(config).parameters == {"latency_a_ms": 1.0}
    assert resolve_variant(config, "int8").parameters == {"latency_a_ms": 0.5}
    assert config.variants["int8"].figures.fidelity == 0.995
    with pytest.raises(ConfigError, match=r"no variant 'fp8' \(variants: \['fp32', 'int8', 'int4'"):
        resolve_variant(config, "fp8")


@pytest.mark.parametrize(
    ("head", "tail", "message"),
    [
        ('default_variant = "fp8"', VARIANTS, "key 'default_variant' = 'fp8': not one of"),
        ('default_variant = "int4"', VARIANTS, "that variant has load = false"),
        ("", "[variants.a]\nload = false", "every variant has load = false"),
        ("", '[variants."../x"]', r"key 'variants.../x': use letters"),
        ("", "[variants.a]\nparameters = { latency_a_ms = -1 }",
         "variant 'a': key 'parameters.latency_a_ms' = -1"),
        ("", "[variants.a]\nparameters = { speed = 2 }",
         "variant 'a': key 'parameters.speed': unknown"),
        ("", "[variants.a]\nprecison = 'int8'", "unknown field `precison`"),
    ],
)  # fmt: skip
def test_bad_variants_are_refused_naming_the_key(
    tmp_path: Path, head: str, tail: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        read(tmp_path, f"{head}\n{BASE}\n{tail}\n")


class Started:
    def __init__(self, variant: str, latency: object) -> None:
        self.variant, self.latency, self.stopped = variant, latency, False

    @property
    def is_ready(self) -> bool:
        return not self.stopped

    async def stop(self) -> None:
        self.stopped = True


async def test_the_repository_loads_each_variant_and_serves_the_one_asked(tmp_path: Path) -> None:
    read(tmp_path, BASE + VARIANTS)
    (tmp_path / "m" / "1").mkdir()
    calls: list[tuple[str, object]] = []

    async def loader(config: ModelConfig, version: int, path: Path, variant: str) -> Started:
        calls.append((variant, config.parameters["latency_a_ms"]))
        return Started(variant, config.parameters["latency_a_ms"])

    repo = ModelRepository(tmp_path, loader)
    await repo.load("m")
    assert calls == [("fp32", 1.0), ("int8", 0.5)]  # int4 has load = false
    config, version, servable = repo.get("m")
    assert (config.name, version, servable.variant) == ("m", 1, "fp32")  # type: ignore[attr-defined]
    assert repo.get("m", None, "int8")[2].variant == "int8"  # type: ignore[attr-defined]
    assert len(repo.loaded()) == 2
    with pytest.raises(InvalidInput, match=r"no variant 'x' \(variants: \['fp32', 'int8'\]\)"):
        repo.get("m", None, "x")
    servables = [s for _, _, s in repo.loaded()]
    await repo.unload("m")
    assert all(s.stopped for s in servables)  # type: ignore[attr-defined]
