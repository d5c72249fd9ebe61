"""Files inside a model's version folder, named by a parameter (typed in `fulcrum.parameters`)."""

from __future__ import annotations

from pathlib import Path

from fulcrum.errors import ConfigError


def version_file(version_dir: Path, name: str, key: str) -> Path:
    """`version_dir / name`, refusing names that would leave the version folder."""
    path = Path(name)
    if not name or path.is_absolute() or ".." in path.parts:
        raise ConfigError(f"parameter {key!r} = {name!r}: must name a file inside the version")
    return version_dir / path
