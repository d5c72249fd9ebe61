"""Finding a model in a repository folder, for the tools that read it directly (profile,
quantize): its validated config and the version folder to work on."""

from __future__ import annotations

from pathlib import Path

from fulcrum.config import ModelConfig, check_model_name, load_model_config
from fulcrum.errors import NotFound


def locate_model(
    repository: Path, model: str, version: int | None = None
) -> tuple[ModelConfig, Path]:
    """The model's validated config and its version folder (the highest unless `version`);
    NotFound names what is missing and what there is."""
    check_model_name(model)
    if not repository.is_dir():
        raise NotFound(f"no model repository at {repository}")
    model_dir = repository / model
    if not (model_dir / "config.toml").is_file():
        known = sorted(p.name for p in repository.iterdir() if (p / "config.toml").is_file())
        raise NotFound(f"no model {model!r} in {repository} (models: {known})")
    config = load_model_config(model_dir / "config.toml", dir_name=model)
    versions = sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
    if not versions:
        raise NotFound(f"model {model!r} has no version folder (such as {model_dir / '1'})")
    chosen = versions[-1] if version is None else version
    if chosen not in versions:
        raise NotFound(f"model {model!r} has no version {chosen} (versions: {versions})")
    return config, model_dir / str(chosen)
