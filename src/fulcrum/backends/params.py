"""Typed reads of a model's `[parameters]` table and of files inside its version folder.

Every reader raises `ConfigError` naming the key and the bad value, so backends validate once at
load and never see a wrongly typed parameter at run time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from fulcrum.errors import ConfigError

ParamValue = str | int | float | bool | list[str]
Params = Mapping[str, ParamValue]


def get_str(params: Params, key: str, default: str, *, choices: Sequence[str] | None = None) -> str:
    """A string parameter, optionally one of `choices`."""
    value = params.get(key, default)
    if not isinstance(value, str):
        raise ConfigError(f"parameter {key!r} = {value!r}: expected a string")
    if choices is not None and value not in choices:
        raise ConfigError(f"parameter {key!r} = {value!r}: expected one of {list(choices)}")
    return value


def get_int(params: Params, key: str, default: int, *, min_value: int = 0) -> int:
    """An integer parameter >= `min_value` (a bool is not an integer here)."""
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"parameter {key!r} = {value!r}: expected an integer")
    if value < min_value:
        raise ConfigError(f"parameter {key!r} = {value!r}: must be >= {min_value}")
    return value


def get_float(params: Params, key: str, default: float, *, min_value: float = 0.0) -> float:
    """A number parameter >= `min_value`; TOML integers are accepted (`60` for `60.0`)."""
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"parameter {key!r} = {value!r}: expected a number")
    if not value >= min_value:  # `not >=` also refuses NaN
        raise ConfigError(f"parameter {key!r} = {value!r}: must be >= {min_value}")
    return float(value)


def get_bool(params: Params, key: str, default: bool) -> bool:
    """A boolean parameter (TOML `true`/`false`, not strings or numbers)."""
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"parameter {key!r} = {value!r}: expected true or false")
    return value


def get_str_list(params: Params, key: str, default: Sequence[str]) -> list[str]:
    """A list-of-strings parameter."""
    value = params.get(key, list(default))
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"parameter {key!r} = {value!r}: expected a list of strings")
    return list(value)


def version_file(version_dir: Path, name: str, key: str) -> Path:
    """`version_dir / name`, refusing names that would leave the version folder."""
    path = Path(name)
    if not name or path.is_absolute() or ".." in path.parts:
        raise ConfigError(f"parameter {key!r} = {name!r}: must name a file inside the version")
    return version_dir / path
