"""Edits to a model's `config.toml` that keep the user's comments and layout (tomlkit).

Every write is checked first: the edited text must still be a valid model config (the same
`load_model_config` the server uses), and it replaces the file atomically, so a tool never leaves
a config the server would refuse. `ConfigEdit.diff` shows what changed, for `--apply`-less runs.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import tomlkit
from tomlkit.items import Table

from fulcrum.config import ModelConfig, VariantFigures, load_model_config
from fulcrum.errors import ConfigError

Edit = Callable[[tomlkit.TOMLDocument], None]


@dataclass(frozen=True, slots=True)
class ConfigEdit:
    """The file before and after an edit, and the validated config after it."""

    path: Path
    old_text: str
    new_text: str
    config: ModelConfig

    @property
    def changed(self) -> bool:
        return self.old_text != self.new_text

    @property
    def diff(self) -> str:
        """A unified diff of the edit (empty when nothing changed)."""
        name = f"{self.path.parent.name}/{self.path.name}"
        lines = difflib.unified_diff(
            self.old_text.splitlines(keepends=True),
            self.new_text.splitlines(keepends=True),
            fromfile=f"a/{name}",
            tofile=f"b/{name}",
        )
        return "".join(lines)


def edit_config(path: Path, edit: Edit, *, write: bool = True) -> ConfigEdit:
    """Apply `edit` to the parsed document; validate; write atomically when `write`."""
    try:
        old_text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    document = tomlkit.parse(old_text)
    edit(document)
    new_text = tomlkit.dumps(document)
    config = _validated(path, new_text)
    if write and new_text != old_text:
        _write_atomic(path, new_text)
    return ConfigEdit(path, old_text, new_text, config)


def set_values(changes: Mapping[str, object]) -> Edit:
    """An edit setting dotted keys (`dynamic_batching.max_queue_delay_ms`), creating tables that
    are missing; a value of None removes the key."""

    def apply(document: tomlkit.TOMLDocument) -> None:
        for dotted, value in changes.items():
            *tables, key = dotted.split(".")
            container: Any = document
            for name in tables:
                if name not in container:
                    container.add(name, tomlkit.table())
                container = container[name]
            if value is None:
                container.pop(key, None)
            else:
                container[key] = value

    return apply


def set_variant(
    name: str,
    *,
    parameters: Mapping[str, object],
    precision: str = "",
    figures: VariantFigures | None = None,
    load: bool | None = None,
    description: str = "",
) -> Edit:
    """An edit adding or updating `[variants.<name>]`; keys the user wrote and this edit does not
    name (comments, a hand-set `load`) stay as they were."""

    def apply(document: tomlkit.TOMLDocument) -> None:
        if "variants" not in document:
            document.add(tomlkit.nl())
            document.add("variants", tomlkit.table(is_super_table=True))
        variants: Any = document["variants"]
        if name not in variants:
            variants.add(name, tomlkit.table())
        table: Table = variants[name]
        if precision:
            table["precision"] = precision
        if description:
            table["description"] = description
        if load is not None:
            table["load"] = load
        inline = tomlkit.inline_table()
        inline.update(dict(parameters))
        table["parameters"] = inline
        if figures is not None:
            builtins = msgspec.to_builtins(figures)
            measured = {k: v for k, v in builtins.items() if v not in (None, "")}
            if "figures" in table:
                del table["figures"]
            figures_table = tomlkit.table()
            figures_table.update(measured)
            table.add("figures", figures_table)

    return apply


def _validated(path: Path, text: str) -> ModelConfig:
    """Check the edited text exactly as the server will read it."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / path.parent.name
        folder.mkdir()
        (folder / path.name).write_text(text)
        try:
            return load_model_config(folder / path.name, dir_name=path.parent.name)
        except ConfigError as exc:
            raise ConfigError(f"the edited config would not load: {exc.message}") from exc


def _write_atomic(path: Path, text: str) -> None:
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
