"""Frozen model configuration read from `<repo>/<model>/config.toml`, validated once at load.

Every error names the file, the key and the bad value. Times are milliseconds in the file
(`*_ms`) and seconds (`*_s`) in code.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import msgspec

from fulcrum.cache.settings import CacheSettings, validate_cache
from fulcrum.datatypes import DATATYPES
from fulcrum.errors import ConfigError
from fulcrum.lifecycle.settings import LifecycleSettings, validate_lifecycle
from fulcrum.parameters import check_parameters
from fulcrum.routing.settings import RoutingSettings, validate_routing
from fulcrum.scale import ScaleSettings, validate_scale

PLATFORMS = ("onnx", "torch", "python", "echo", "llm")
# Matched whole (`fullmatch`): `$` would accept a trailing newline. The leading letter or digit
# already refuses `.`, `..`, `.hidden` and `-flag`; `/`, `\` and control characters never match.
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
# Beyond these a value is a typo, not a setting: a 2**30-row batch or an hour's added wait.
MAX_BATCH_SIZE = 1 << 20
MAX_DELAY_MS = 3_600_000.0
VARIANT_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


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

    # None: a finite bound the policy derives (see fulcrum.policy.default_queue_bound and the
    # adaptive policy); 0 (Triton's meaning) or -1: unbounded, the old behaviour.
    max_queue_size: int | None = None
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
    policy: Literal["triton", "adaptive"] = "triton"
    slo_p99_ms: float = 0.0  # 0: none; adaptive needs one
    # Share of the SLO one batch's run time may take: a request that arrives just after a batch
    # left waits for it and then for its own, so 0.5 keeps both within the SLO.
    slo_batch_fraction: float = 0.5
    profile: Literal["", "realtime", "throughput", "mixed"] = ""


# What each scenario profile sets when the model's file leaves the key out (see README).
PROFILES: dict[str, dict[str, object]] = {
    "realtime": {"policy": "adaptive", "max_queue_delay_ms": 0.0, "slo_batch_fraction": 0.25},
    "throughput": {"max_queue_delay_ms": 5.0, "slo_batch_fraction": 1.0},
    "mixed": {"policy": "adaptive", "max_queue_delay_ms": 0.0, "slo_batch_fraction": 0.5},
}
THROUGHPUT_QUEUE_FACTOR = 256  # "deep queue": rows waiting per max batch per instance


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


ParamValue = str | int | float | bool | list[str]


class VariantFigures(_Frozen, frozen=True):
    """What `fulcrum quantize` (or `fulcrum profile`) measured for a variant; None: not measured."""

    size_bytes: int | None = None  # the variant's model file(s) on disk
    latency_ms: float | None = None  # median latency of one row alone (batch 1)
    knee_batch: int | None = None  # the batch size the knee rule chose
    throughput_rps: float | None = None  # rows per second at the knee
    fidelity: float | None = None  # agreement with the reference variant (metric below)
    fidelity_metric: str = ""  # "cosine", "top1", "accuracy", "token_agreement", ...
    perplexity_ratio: float | None = None  # LLMs: variant / reference perplexity on a text
    output_tokens_per_s: float | None = None  # LLMs: generated tokens/s at knee_batch sequences
    reference: str = ""  # the variant the fidelity was measured against
    measured_at: str = ""  # ISO date of the measurement
    machine: str = ""  # where it was measured (CPU model, GPU)


class Variant(_Frozen, frozen=True):
    """One precision (or build) of the same model: its parameters override the model's own
    `[parameters]` (typically `model_file`); every other setting is the model's."""

    parameters: dict[str, ParamValue] = {}
    precision: str = ""  # "fp32", "fp16", "int8", "int4", ... (informational)
    load: bool = True  # False: declared (and measured) but not loaded by the repository
    description: str = ""
    figures: VariantFigures = VariantFigures()


class Lane(_Frozen, frozen=True):
    """A lane (`[lanes.<name>]`): its own instances and batcher over one variant; a key left
    out takes the model's value (see `fulcrum.lanes`)."""

    variant: str = ""  # "": the model's default variant
    instances: Instances | None = None
    threads: int = 0  # intra-op threads of each instance; 0: the variant's own setting
    dynamic_batching: DynamicBatching | None = None


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
    parameters: dict[str, ParamValue] = {}
    # Variants of this model; none declared: one implicit variant named "default".
    variants: dict[str, Variant] = {}
    default_variant: str = ""  # "": the first variant listed
    cache: CacheSettings | None = None  # no `[cache]` table: no result caching
    scale: ScaleSettings = ScaleSettings()  # replicas on Ray Serve (fulcrum.ray)
    lifecycle: LifecycleSettings = LifecycleSettings()  # scale to zero; none: always loaded
    lanes: dict[str, Lane] = {}  # none: one batcher per variant, as before
    default_lane: str = ""  # "": the first lane listed
    routing: RoutingSettings = RoutingSettings()  # A/B, shadow, cascade (fulcrum.routing)

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
        config = apply_profile(config, batching_keys_given(msgspec.toml.decode(raw)))
        validate(config)
    except ConfigError as exc:
        raise ConfigError(f"{shown}: {exc.message}") from exc
    return config


def apply_profile(config: ModelConfig, given: frozenset[str]) -> ModelConfig:
    """Fill the `[dynamic_batching]` keys not in `given` from the model's scenario profile."""
    batching = config.dynamic_batching
    if batching is None or not batching.profile:
        return config
    preset = {k: v for k, v in PROFILES[batching.profile].items() if k not in given}
    if batching.profile == "throughput":
        if "policy" not in given and batching.slo_p99_ms > 0:
            preset["policy"] = "adaptive"
        queue = batching.default_queue_policy
        if queue.max_queue_size is None:
            deep = THROUGHPUT_QUEUE_FACTOR * config.max_batch_size * config.instances.count
            preset["default_queue_policy"] = msgspec.structs.replace(queue, max_queue_size=deep)
    batching = msgspec.structs.replace(batching, **preset)
    return msgspec.structs.replace(config, dynamic_batching=batching)


def batching_keys_given(document: dict[str, object]) -> frozenset[str]:
    """The `[dynamic_batching]` keys a config document (a file, a load override) sets itself."""
    table = document.get("dynamic_batching")
    return frozenset(table) if isinstance(table, dict) else frozenset()


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
    if not 0 <= config.max_batch_size <= MAX_BATCH_SIZE:
        raise ConfigError(
            f"key 'max_batch_size' = {config.max_batch_size}: must lie in 0..{MAX_BATCH_SIZE}"
        )
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
    _validate_variants(config)
    if config.cache is not None:
        validate_cache(config.cache)
    validate_scale(config.scale)
    validate_lifecycle(config.lifecycle)
    validate_routing(config)
    if config.lanes or config.default_lane:
        from fulcrum.lanes.settings import validate_lanes  # it imports this module

        validate_lanes(config)


def _validate_variants(config: ModelConfig) -> None:
    for name in config.variants:
        if not VARIANT_NAME_RE.fullmatch(name):
            raise ConfigError(f"key 'variants.{name}': use letters, digits, '_', '-', '.'")
    if config.default_variant:
        if config.default_variant not in config.variants:
            raise ConfigError(
                f"key 'default_variant' = {config.default_variant!r}: not one of the variants "
                f"{sorted(config.variants)}"
            )
        if not config.variants[config.default_variant].load:
            raise ConfigError(
                f"key 'default_variant' = {config.default_variant!r}: that variant has load = false"
            )
    if config.variants and not any(v.load for v in config.variants.values()):
        raise ConfigError("key 'variants': every variant has load = false; nothing would serve")
    if not config.variants:
        check_parameters(config.platform, dict(config.parameters))
    for name, variant in config.variants.items():
        try:
            check_parameters(config.platform, {**config.parameters, **variant.parameters})
        except ConfigError as exc:
            raise ConfigError(f"variant {name!r}: {exc.message}") from None


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
    if not 0 <= batching.max_queue_delay_ms <= MAX_DELAY_MS:  # NaN and inf too
        raise ConfigError(
            f"key 'dynamic_batching.max_queue_delay_ms' = {batching.max_queue_delay_ms}: "
            f"must lie in 0..{MAX_DELAY_MS:g}"
        )
    bad = [s for s in batching.preferred_batch_sizes if not 1 <= s <= max_batch_size]
    if bad:
        raise ConfigError(
            f"key 'dynamic_batching.preferred_batch_sizes' = {bad}: "
            f"must lie in 1..max_batch_size ({max_batch_size})"
        )
    _validate_slo(batching)
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


def _validate_slo(batching: DynamicBatching) -> None:
    if not 0 <= batching.slo_p99_ms <= MAX_DELAY_MS:
        raise ConfigError(
            f"key 'dynamic_batching.slo_p99_ms' = {batching.slo_p99_ms}: "
            f"must lie in 0..{MAX_DELAY_MS:g}"
        )
    if batching.policy == "adaptive" and not batching.slo_p99_ms > 0:
        why = f" (profile {batching.profile!r})" if batching.profile else ""
        raise ConfigError(
            f"key 'dynamic_batching.slo_p99_ms' = {batching.slo_p99_ms}: policy 'adaptive'{why} "
            "needs a latency target > 0"
        )
    if not 0 < batching.slo_batch_fraction <= 1:
        raise ConfigError(
            f"key 'dynamic_batching.slo_batch_fraction' = {batching.slo_batch_fraction}: "
            "must lie in (0, 1]"
        )


def _validate_queue_policy(key: str, policy: QueuePolicy) -> None:
    size = policy.max_queue_size
    if size is not None and size < -1:
        raise ConfigError(f"key '{key}.max_queue_size' = {size}: must be >= -1 (-1: unbounded)")
    if not 0 <= policy.default_timeout_ms < float("inf"):  # NaN too
        raise ConfigError(
            f"key '{key}.default_timeout_ms' = {policy.default_timeout_ms}: must be >= 0"
        )
