"""The model repository: Triton's layout (`<root>/<model>/config.toml`, `<root>/<model>/<n>/`),
version policy, and the load / unload / reload lifecycle. What a loaded version *is* (a batched
model or an LLM engine) is decided by the injected loader, so this module stays generic.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec

from fulcrum.config import (
    ModelConfig,
    VersionPolicy,
    apply_profile,
    batching_keys_given,
    check_model_name,
    load_model_config,
)
from fulcrum.config import validate as validate_config
from fulcrum.errors import ConfigError, FulcrumError, InvalidInput, NotFound, Unavailable
from fulcrum.variants import default_variant, loaded_variant_names, resolve_variant

log = logging.getLogger(__name__)


class Servable(Protocol):
    """One loaded version of a model."""

    @property
    def is_ready(self) -> bool: ...

    async def stop(self) -> None: ...


# (the variant's resolved config, version, version folder, variant name) -> a started servable
Loader = Callable[[ModelConfig, int, Path, str], Awaitable[Servable]]


class VariantSet:
    """One version's loaded variants (a model without variants has one, "default"); started and
    stopped together, so a reload swaps a version's variants as one."""

    def __init__(self, variants: dict[str, Servable], default: str) -> None:
        self.variants = variants
        self.default = default

    @property
    def is_ready(self) -> bool:
        return all(s.is_ready for s in self.variants.values())

    async def stop(self) -> None:
        await _stop_all(self.variants.values())

    def get(self, config: ModelConfig, name: str | None) -> Servable:
        """The variant `name` (None: the default); InvalidInput names the loaded ones."""
        servable = self.variants.get(self.default if name is None else name)
        if servable is not None:
            return servable
        loaded = list(self.variants)
        declared = config.variants.get(name or "")
        if declared is not None and not declared.load:
            raise InvalidInput(
                f"model '{config.name}' variant {name!r} is declared with load = false "
                f"(loaded variants: {loaded})"
            )
        raise InvalidInput(f"model '{config.name}' has no variant {name!r} (variants: {loaded})")


@dataclass
class ModelEntry:
    """A model's current state: its config and its loaded versions (highest is the default)."""

    name: str
    config: ModelConfig | None = None
    versions: dict[int, VariantSet] = field(default_factory=dict)
    state: str = "UNAVAILABLE"
    reason: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Unloaded by the server (idle, memory budget), not by the user: its next request loads it.
    parked: bool = False
    override: dict[str, object] | None = None  # the last load's config override, kept for a wake


def available_versions(model_dir: Path) -> list[int]:
    """Version folders present on disk (positive integer names), ascending."""
    return sorted(
        int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name)
    )


def select_versions(policy: VersionPolicy, on_disk: list[int]) -> list[int]:
    """Apply Triton's version policy to the versions on disk."""
    if policy.all:
        chosen = list(on_disk)
    elif policy.specific:
        missing = sorted(set(policy.specific) - set(on_disk))
        if missing:
            raise ConfigError(f"version_policy.specific names missing versions {missing}")
        chosen = sorted(policy.specific)
    else:
        chosen = on_disk[-(policy.latest or 1) :]
    if not chosen:
        raise ConfigError("no version folder (1/, 2/, ...) to load")
    return chosen


class ModelRepository:
    """Scans a folder of models and keeps each model's chosen versions loaded."""

    def __init__(self, root: Path, loader: Loader) -> None:
        self.root = root
        self._loader = loader
        self._entries: dict[str, ModelEntry] = {}

    def model_names(self) -> list[str]:
        """Models on disk (folders holding a config.toml) plus any loaded or loading ones.

        An entry whose folder has gone and that serves nothing is not listed: a failed load of
        a name that is not in the repository must leave no row behind (Triton's index)."""
        on_disk = {p.parent.name for p in self.root.glob("*/config.toml")}
        live = {n for n, e in self._entries.items() if e.versions or e.state == "LOADING"}
        return sorted(on_disk | live)

    def index(self) -> list[dict[str, str]]:
        """The repository index: one row per model version (or per model when none loaded)."""
        rows: list[dict[str, str]] = []
        for name in self.model_names():
            entry = self._entries.get(name)
            if entry is None or not entry.versions:
                state = entry.state if entry else "UNAVAILABLE"
                rows.append({"name": name, "state": state, "reason": entry.reason if entry else ""})
                continue
            for version in sorted(entry.versions):
                rows.append(
                    {
                        "name": name,
                        "version": str(version),
                        "state": entry.state,
                        "reason": entry.reason,
                    }
                )
        return rows

    def get(
        self, name: str, version: int | None = None, variant: str | None = None
    ) -> tuple[ModelConfig, int, Servable]:
        """The config, version number and servable that serve `name` (default: the highest
        version, the model's default variant); the config is the model's, not the variant's."""
        entry = self._entries.get(name)
        if entry is None or entry.config is None or not entry.versions:
            if entry is not None and entry.state == "LOADING":
                raise Unavailable(f"model '{name}' is loading")
            if entry is not None and entry.parked:
                raise Unavailable(
                    f"model '{name}' is unloaded (idle or memory budget): a request to run it "
                    "loads it"
                )
            raise NotFound(f"model '{name}' is not loaded")
        if version is None:
            version = max(entry.versions)
        variants = entry.versions.get(version)
        if variants is None:
            raise NotFound(f"model '{name}' has no loaded version {version}")
        return entry.config, version, variants.get(entry.config, variant)

    def loaded(self) -> list[tuple[ModelConfig, int, Servable]]:
        """Every loaded (model config, version, servable), each variant of a version apart."""
        return [
            (e.config, v, s)
            for e in self._entries.values()
            if e.config is not None
            for v, variants in sorted(e.versions.items())
            for s in variants.variants.values()
        ]

    async def load_all(self) -> list[str]:
        """Load every model on disk; returns the names that failed (each is logged)."""
        failed: list[str] = []
        for name in self.model_names():
            try:
                await self.load(name)
            except FulcrumError as exc:
                log.error("model %s failed to load: %s", name, exc.message)
                failed.append(name)
        return failed

    async def load(
        self, name: str, config_override: dict[str, object] | None = None, *, wake: bool = False
    ) -> None:
        """Load or reload `name`. New versions start before old ones stop, so a reload under
        load fails no request; if any new version fails, the old versions keep serving.
        A parked model's reload only takes its new config, which its next request (`wake`) loads."""
        entry = self._entries.get(check_name(name))
        if entry is None:
            self._config_path(name)  # NotFound before any entry exists: no row for a stranger
            entry = self._entries.setdefault(name, ModelEntry(name))
        async with entry.lock:
            if entry.parked and not entry.versions and not wake:
                entry.config = self.read_config(name, config_override)
                entry.override = config_override
                return
            if wake:  # the config it was parked with, override and all
                config_override = entry.override
            previous_state = entry.state
            entry.state = "LOADING" if not entry.versions else entry.state
            try:
                config, started = await self._prepare(name, config_override)
            except FulcrumError as exc:
                entry.state = previous_state if entry.versions else "UNAVAILABLE"
                entry.reason = exc.message
                raise
            old = entry.versions
            entry.config, entry.versions = config, started
            entry.state, entry.reason = "READY", ""
            entry.parked, entry.override = False, config_override
        await _stop_all(v for k, v in old.items() if started.get(k) is not v)

    async def unload(self, name: str) -> None:
        """Stop every version of `name`; in-flight requests finish first."""
        entry = self._entries.get(check_name(name))
        if entry is None or not (entry.versions or entry.parked):
            raise NotFound(f"model '{name}' is not loaded")
        async with entry.lock:  # after a wake under way: what it loaded goes too
            old, entry.versions = entry.versions, {}
            entry.state, entry.reason = "UNAVAILABLE", "unloaded"
            entry.parked = False  # unloaded by the user: traffic no longer loads it
        await _stop_all(old.values())

    async def park(self, name: str, reason: str) -> bool:
        """Unload `name` so that its next request loads it again (scale to zero, the memory
        budget); False, with nothing done, while it is not loaded or a load of it runs."""
        entry = self._entries.get(name)
        if entry is None or not entry.versions or entry.lock.locked():
            return False
        # Swapped out before any await: a caller that saw nothing in flight sees no request
        # reach these servables in between.
        old, entry.versions = entry.versions, {}
        entry.parked = True
        entry.state, entry.reason = "UNAVAILABLE", f"unloaded ({reason})"
        await _stop_all(old.values())
        return True

    def park_unloaded(self, name: str, reason: str) -> None:
        """Register `name` as parked without loading it (it does not fit the memory budget at
        start-up): its config is read and checked now, its first request loads it."""
        config = self.read_config(check_name(name), None)
        entry = self._entries.setdefault(name, ModelEntry(name))
        entry.config, entry.parked = config, True
        entry.state, entry.reason = "UNAVAILABLE", f"unloaded ({reason})"

    def config_of(self, name: str) -> ModelConfig | None:
        """The config of a loaded or parked model (None: neither)."""
        entry = self._entries.get(name)
        return None if entry is None or not (entry.versions or entry.parked) else entry.config

    def is_loading(self, name: str) -> bool:
        """A load, reload or unload of `name` is under way."""
        entry = self._entries.get(name)
        return entry is not None and entry.lock.locked()

    def is_parked(self, name: str) -> bool:
        entry = self._entries.get(name)
        return entry is not None and entry.parked and not entry.versions

    def parked(self) -> list[ModelConfig]:
        """The configs of the parked models (their next request loads them)."""
        return [e.config for e in self._entries.values() if e.parked and e.config is not None]

    def version_folders(self, config: ModelConfig) -> list[Path]:
        """The folders of the versions a load of `config` would start."""
        return [self.root / config.name / str(v) for v in self._versions(config)]

    async def close(self) -> None:
        """Unload everything."""
        for name in list(self._entries):
            if self._entries[name].versions:
                await self.unload(name)

    def _config_path(self, name: str) -> Path:
        config_path = self.root / name / "config.toml"
        if not config_path.is_file():
            raise NotFound(f"model '{name}' has no config.toml in the repository")
        return config_path

    def read_config(self, name: str, override: dict[str, object] | None) -> ModelConfig:
        """The config a load would use, checked as far as possible without starting it."""
        config = load_model_config(self._config_path(name), dir_name=name)
        config = apply_override(config, override) if override else config
        self._versions(config)  # a missing version folder fails now, not at the wake
        return config

    async def _prepare(
        self, name: str, override: dict[str, object] | None
    ) -> tuple[ModelConfig, dict[int, VariantSet]]:
        """Read the config, apply the override, start the chosen versions."""
        config = load_model_config(self._config_path(name), dir_name=name)
        if not override:
            return config, await self._start_versions(config, self._versions(config))
        config = apply_override(config, override)
        try:
            return config, await self._start_versions(config, self._versions(config))
        except ConfigError as exc:
            # The file's own config was fine; what the override made of it is not: the load
            # request is at fault (400), not the repository (500).
            raise InvalidInput(f"config override: {exc.message}") from exc

    def _versions(self, config: ModelConfig) -> list[int]:
        return select_versions(config.version_policy, available_versions(self.root / config.name))

    async def _start_versions(
        self, config: ModelConfig, versions: list[int]
    ) -> dict[int, VariantSet]:
        started: dict[int, VariantSet] = {}
        try:
            for version in versions:
                started[version] = VariantSet({}, default_variant(config))
                folder = self.root / config.name / str(version)
                for name in loaded_variant_names(config):
                    variant_config = resolve_variant(config, name)
                    started[version].variants[name] = await self._loader(
                        variant_config, version, folder, name
                    )
        except FulcrumError as exc:
            await _stop_all(started.values())
            exc.message = self._relative(exc.message)
            exc.args = (exc.message,)
            raise
        except Exception as exc:
            await _stop_all(started.values())
            raise ConfigError(
                self._relative(f"model '{config.name}' failed to load: {exc}")
            ) from exc
        return started

    def _relative(self, text: str) -> str:
        """Name files relative to the repository root: error texts reach clients, and a backend's
        message (`No such file: '/srv/models/m/1/model.onnx'`) would show the server's layout."""
        for prefix in sorted({str(self.root.resolve()), str(self.root.absolute())}, key=len)[::-1]:
            text = text.replace(prefix + os.sep, "").replace(prefix, ".")
        return text


def check_name(name: str) -> str:
    """Refuse model names that could escape the repository, as a client error."""
    try:
        return check_model_name(name)
    except ConfigError as exc:
        raise InvalidInput(exc.message) from None


def apply_override(config: ModelConfig, override: dict[str, object]) -> ModelConfig:
    """Merge a (partial) config given with a load request over the file's config."""
    merged = msgspec.to_builtins(config)
    merged.update(override)
    merged["name"] = config.name
    try:
        result = msgspec.convert(merged, type=ModelConfig)
        result = apply_profile(result, batching_keys_given(override))
        validate_config(result)
    except msgspec.ValidationError as exc:
        raise InvalidInput(f"config override: {exc}") from exc
    except ConfigError as exc:
        raise InvalidInput(f"config override: {exc.message}") from exc
    return result


async def _stop_all(servables: object) -> None:
    items = list(servables)  # type: ignore[call-overload]
    if items:
        await asyncio.gather(*(s.stop() for s in items), return_exceptions=True)
