"""The `[cache]` table: defaults when present, absent means no cache, and each bad value is
refused at load naming the key and the value."""

from __future__ import annotations

from pathlib import Path

import pytest

from fulcrum.cache.settings import CacheSettings
from fulcrum.config import load_model_config
from fulcrum.errors import ConfigError

BASE = 'platform = "echo"\n'


def load(tmp_path: Path, text: str) -> CacheSettings | None:
    (tmp_path / "m").mkdir(exist_ok=True)
    path = tmp_path / "m" / "config.toml"
    path.write_text(BASE + text)
    return load_model_config(path, dir_name="m").cache


def test_no_table_no_cache(tmp_path: Path) -> None:
    assert load(tmp_path, "") is None


def test_an_empty_table_takes_the_defaults(tmp_path: Path) -> None:
    settings = load(tmp_path, "[cache]\n")
    assert settings == CacheSettings()
    assert settings is not None
    assert (settings.exact, settings.semantic, settings.backend) == (True, False, "memory")
    assert (settings.max_bytes, settings.ttl_s, settings.redis_timeout_ms) == (64 << 20, 3600, 5)
    assert settings.ttl == 3600 and settings.max_value_bytes == 8 << 20


def test_every_key_is_read(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        '[cache]\nexact = true\nsemantic = true\nbackend = "redis://127.0.0.1:6379/0"\n'
        "max_bytes = 1024\nttl_s = 0\nredis_timeout_ms = 2.5\nsemantic_threshold = 0.9\n"
        'semantic_embedder = "minilm"\nsemantic_verifier = "off"\nsemantic_max_entries = 5\n'
        "semantic_sampled = true\n",
    )
    assert settings is not None
    assert settings.is_redis and settings.redis_timeout_s == 0.0025 and settings.ttl is None
    assert (settings.semantic_threshold, settings.semantic_max_entries) == (0.9, 5)
    assert settings.semantic_sampled and settings.semantic_verifier == "off"


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("max_bytes = 0", "cache.max_bytes' = 0"),
        ("ttl_s = -1.0", "cache.ttl_s' = -1.0"),
        ("ttl_s = nan", "cache.ttl_s' = nan"),
        ("redis_timeout_ms = 0", "cache.redis_timeout_ms' = 0"),
        ("semantic_threshold = 1.5", "cache.semantic_threshold' = 1.5"),
        ("semantic_max_entries = 0", "cache.semantic_max_entries' = 0"),
        ('backend = "disk"', "cache.backend' = 'disk'"),
        ('backend = "redis://"', "cache.backend' = 'redis://'"),
        ('semantic_embedder = "../etc"', "cache.semantic_embedder' = '../etc'"),
        ("exact = false", "exact and semantic are both false"),
        ("colour = 1", "colour"),
    ],
)
def test_a_bad_value_is_refused_by_name(tmp_path: Path, line: str, named: str) -> None:
    with pytest.raises(ConfigError, match=r"m/config\.toml") as info:
        load(tmp_path, f"[cache]\n{line}\n")
    assert named in info.value.message
