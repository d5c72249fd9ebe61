"""Frozen model configuration read from `<repo>/<model>/config.toml`, validated once at load.

Every error names the file, the key and the bad value. Times are milliseconds in the file
(`*_ms`) and seconds (`*_s`) in code.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import msgspec

from fulcrum.datatypes import DATATYPES
from fulcrum.errors import ConfigError

PLATFORMS = ("onnx", "torch", "python", "echo", "llm")
# Matched whole (`fullmatch`): `$` would accept a trailing newline. The leading letter or digit
# already refuses `.`, `..`, `.hidden` and `-flag`; `/`, `\` and control characters never match.
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


class _Frozen(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class TensorSpec(_Frozen, frozen=True):
    """One input or output: per-row shape (batch axis excluded when batching), -1 is dynamic."""

    name: str
    datatype: str
    shape: tuple[int, ...] = ()
    pad_value: float = 0.0
    optional: bool = False


class VersionPolicy(_Frozen, frozen=True):
    """Triton's version policy: the latest N (default 1), all, or specific versions."""

    latest: int | None = None
    all: bool = False
    specific: tuple[int, ...] = ()


class QueuePolicy(_Frozen, frozen=True):
    """Triton's per-priority-level queue policy."""

    max_queue_size: int = 0  # 0: unbounded
    default_timeout_ms: float = 0.0  # 0: no timeout
    timeout_action: Literal["reject", "delay"] = "reject"
    allow_timeout_override: bool = True


class DynamicBatching(_Frozen, frozen=True):
    """Triton's dynamic batcher settings."""

    max_queue_delay_ms: float = 0.0
    preferred_batch_sizes: tuple[int, ...] = ()
    priority_levels: int = 1
    default_priority_level: int = 0  # 0: the lowest level
    default_queue_policy: QueuePolicy = QueuePolicy()
    priority_queue_policy: dict[str, QueuePolicy] = {}


class Instances(_Frozen, frozen=True):
    """How many copies of the model run, each on its own executor thread."""

    count: int = 1
    # A backend call running longer is failed and its instance marked hung; 0: no limit.
    # 60 s, like vLLM's engine iteration timeout: far beyond a sane batch, short of forever.
    execution_timeout_ms: float = 60000.0


class Tokenizer(_Frozen, frozen=True):
    """Text front end: turns a BYTES input into token tensors padded to the batch's longest."""

    file: str = "tokenizer.json"
    input: str = "text"
    max_length: int = 256
    ids: str = "input_ids"
    mask: str = "attention_mask"
    type_ids: str | None = "token_type_ids"


class ModelConfig(_Frozen, frozen=True, kw_only=True):
    """Everything `config.toml` may say about one model."""

    name: str = ""
    platform: str
    max_batch_size: int = 0
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    version_policy: VersionPolicy = VersionPolicy()
    dynamic_batching: DynamicBatching | None = None
    instances: Instances = Instances()
    tokenizer: Tokenizer | None = None
    parameters: dict[str, str | int | float | bool | list[str]] = {}

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def queue_policy(self, level: int) -> QueuePolicy:
        """The queue policy of a priority level (1 is highest)."""
        batching = self.dynamic_batching or DynamicBatching()
        return batching.priority_queue_policy.get(str(level), batching.default_queue_policy)

    @property
    def num_priority_levels(self) -> int:
        return max(1, self.dynamic_batching.priority_levels if self.dynamic_batching else 1)

    @property
    def default_priority(self) -> int:
        level = self.dynamic_batching.default_priority_level if self.dynamic_batching else 0
        return level or self.num_priority_levels


def check_model_name(name: str) -> str:
    """Refuse names that could escape the repository (`..`, `/`, absolute, encoded, control);
    `..` inside a name (`model..1`) is no path segment and is allowed."""
    if not MODEL_NAME_RE.fullmatch(name):
        raise ConfigError(f"invalid model name {name!r}: use letters, digits, '_', '-', '.'")
    return name


def load_model_config(path: Path, *, dir_name: str | None = None) -> ModelConfig:
    """Read and validate one `config.toml`; `dir_name` is the model's folder name. Errors name
    the file as `<model>/config.toml`, never by its absolute path (they reach clients)."""
    shown = f"{path.parent.name}/{path.name}"
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{shown}: cannot read: {exc.strerror}") from exc
    try:
        config = msgspec.toml.decode(raw, type=ModelConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{shown}: {_describe(exc)}") from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{shown}: not valid TOML: {exc}") from exc
    if dir_name is not None:
        if config.name and config.name != dir_name:
            raise ConfigError(f"{shown}: key 'name' = {config.name!r} differs from its folder")
        config = msgspec.structs.replace(config, name=dir_name)
    try:
        validate(config)
    except ConfigError as exc:
        raise ConfigError(f"{shown}: {exc.message}") from exc
    return config


def _describe(exc: msgspec.ValidationError) -> str:
    # msgspec says "... - at `$.dynamic_batching.max_queue_delay_ms`"; name the key plainly.
    text = str(exc)
    if " - at `$." in text:
        message, _, where = text.partition(" - at `$.")
        return f"key {where.rstrip('`')!r}: {message}"
    return text


def validate(config: ModelConfig) -> None:
    """Semantic checks msgspec's types cannot express."""
    check_model_name(config.name)
    if config.platform not in PLATFORMS:
        raise ConfigError(f"key 'platform' = {config.platform!r}: expected one of {PLATFORMS}")
    if config.max_batch_size < 0:
        raise ConfigError(f"key 'max_batch_size' = {config.max_batch_size}: must be >= 0")
    _validate_tensors("inputs", config.inputs)
    _validate_tensors("outputs", config.outputs)
    _validate_versions(config.version_policy)
    if config.instances.count < 1:
        raise ConfigError(f"key 'instances.count' = {config.instances.count}: must be >= 1")
    if not config.instances.execution_timeout_ms >= 0:  # NaN too
        raise ConfigError(
            f"key 'instances.execution_timeout_ms' = {config.instances.execution_timeout_ms}: "
            "must be >= 0"
        )
    if config.dynamic_batching is not None:
        _validate_batching(config.dynamic_batching, config.max_batch_size)


def _validate_tensors(key: str, specs: tuple[TensorSpec, ...]) -> None:
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        where = f"{key}[{i}]"
        if not spec.name or spec.name in seen:
            raise ConfigError(f"key '{where}.name' = {spec.name!r}: empty or duplicate")
        seen.add(spec.name)
        if spec.datatype not in DATATYPES:
            raise ConfigError(
                f"key '{where}.datatype' = {spec.datatype!r}: expected one of {sorted(DATATYPES)}"
            )
        if any(d == 0 or d < -1 for d in spec.shape):
            raise ConfigError(f"key '{where}.shape' = {list(spec.shape)}: use sizes >= 1 or -1")


def _validate_versions(policy: VersionPolicy) -> None:
    chosen = sum([policy.latest is not None, policy.all, bool(policy.specific)])
    if chosen > 1:
        raise ConfigError("key 'version_policy': choose one of latest, all, specific")
    if policy.latest is not None and policy.latest < 1:
        raise ConfigError(f"key 'version_policy.latest' = {policy.latest}: must be >= 1")
    if any(v < 1 for v in policy.specific):
        raise ConfigError(f"key 'version_policy.specific' = {list(policy.specific)}: must be >= 1")


def _validate_batching(batching: DynamicBatching, max_batch_size: int) -> None:
    if max_batch_size < 1:
        raise ConfigError("key 'dynamic_batching': needs max_batch_size >= 1")
    if batching.max_queue_delay_ms < 0:
        raise ConfigError(
            f"key 'dynamic_batching.max_queue_delay_ms' = {batching.max_queue_delay_ms}: "
            "must be >= 0"
        )
    bad = [s for s in batching.preferred_batch_sizes if not 1 <= s <= max_batch_size]
    if bad:
        raise ConfigError(
            f"key 'dynamic_batching.preferred_batch_sizes' = {bad}: "
            f"must lie in 1..max_batch_size ({max_batch_size})"
        )
    levels = batching.priority_levels
    if levels < 1:
        raise ConfigError(f"key 'dynamic_batching.priority_levels' = {levels}: must be >= 1")
    if not 0 <= batching.default_priority_level <= levels:
        raise ConfigError(
            f"key 'dynamic_batching.default_priority_level' = {batching.default_priority_level}: "
            f"must lie in 1..priority_levels ({levels})"
        )
    for key, policy in batching.priority_queue_policy.items():
        if not key.isdigit() or not 1 <= int(key) <= levels:
            raise ConfigError(
                f"key 'dynamic_batching.priority_queue_policy.{key}': not a level in 1..{levels}"
            )
        _validate_queue_policy(f"dynamic_batching.priority_queue_policy.{key}", policy)
    _validate_queue_policy("dynamic_batching.default_queue_policy", batching.default_queue_policy)


def _validate_queue_policy(key: str, policy: QueuePolicy) -> None:
    if policy.max_queue_size < 0:
        raise ConfigError(f"key '{key}.max_queue_size' = {policy.max_queue_size}: must be >= 0")
    if policy.default_timeout_ms < 0:
        raise ConfigError(
            f"key '{key}.default_timeout_ms' = {policy.default_timeout_ms}: must be >= 0"
        )
