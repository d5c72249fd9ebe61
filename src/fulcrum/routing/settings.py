"""The `[routing]` table of a model's `config.toml`: an A/B split, shadow traffic and a cascade,
checked at load with errors naming the key (`key 'routing.ab.arms.int8'`)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Literal

import msgspec

from fulcrum.errors import ConfigError

if TYPE_CHECKING:
    from fulcrum.config import ModelConfig

MAX_SHADOW_IN_FLIGHT = 1024  # beyond this a bound is no bound
MAX_SHADOW_TIMEOUT_MS = 3_600_000.0
_MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")  # as config.MODEL_NAME_RE


class _Table(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class AbSettings(_Table, frozen=True):
    """`[routing.ab]`: weights of the arms (variant names, or version numbers with `by`)."""

    arms: dict[str, float] = {}
    by: Literal["variant", "version"] = "variant"


class ShadowSettings(_Table, frozen=True):
    """`[routing.shadow]`: a fraction of requests also sent to a reference, in the background."""

    variant: str = ""  # the reference variant; or:
    version: int = 0  # the reference version (0: by variant)
    fraction: float = 0.0
    max_in_flight: int = 4  # shadows running at once; more are dropped (and counted)
    # "": cosine for a batch model, exact token ids for a generative one (greedy requests only)
    compare: Literal["", "cosine", "top1", "exact"] = ""
    output: str = ""  # the output compared; "": the model's first output
    timeout_ms: float = 30_000.0  # a shadow that takes longer is abandoned (counted as failed)


CascadeScore = Literal["mean_logprob", "min_logprob"]


class CascadeSettings(_Table, frozen=True):
    """`[routing.cascade]`: this model answers first; a request with a row (a batch model) or a
    choice (a generative model) whose score is not confident runs whole on model `then`, whose
    answer is returned."""

    then: str
    threshold: float
    score_output: str = ""  # a batch model: the output holding each row's score
    # A generative model: how its answer's token logprobs make one score ("": mean_logprob)
    score: Literal["", "mean_logprob", "min_logprob"] = ""
    higher_is_confident: bool = True

    @property
    def generation_score(self) -> CascadeScore:
        return self.score or "mean_logprob"


class RoutingSettings(_Table, frozen=True):
    """`[routing]`: each part optional."""

    ab: AbSettings | None = None
    shadow: ShadowSettings | None = None
    cascade: CascadeSettings | None = None


def validate_routing(config: ModelConfig) -> None:
    """Checks msgspec's types cannot express; each error names the key and the bad value."""
    routing = config.routing
    if routing.ab is not None:
        _validate_ab(config, routing.ab)
    if routing.shadow is not None:
        _validate_shadow(config, routing.shadow)
    if routing.cascade is not None:
        _validate_cascade(config, routing.cascade)


def _variants(config: ModelConfig) -> list[str]:
    from fulcrum.variants import loaded_variant_names  # it imports the config module

    return loaded_variant_names(config)


def _validate_ab(config: ModelConfig, ab: AbSettings) -> None:
    if not ab.arms:
        raise ConfigError(
            "key 'routing.ab.arms': name at least one arm, e.g. {fp32 = 0.9, int8 = 0.1}"
        )
    for arm, weight in ab.arms.items():
        key = f"routing.ab.arms.{arm}"
        if not (math.isfinite(weight) and weight >= 0):
            raise ConfigError(f"key '{key}' = {weight}: a weight must be finite and >= 0")
        if ab.by == "variant" and arm not in _variants(config):
            raise ConfigError(f"key '{key}': not a loaded variant {_variants(config)}")
        if ab.by == "version" and not (arm.isascii() and arm.isdigit() and int(arm) > 0):
            raise ConfigError(f"key '{key}': with by = 'version' an arm is a version number")
    if sum(ab.arms.values()) <= 0:
        raise ConfigError("key 'routing.ab.arms': the weights sum to 0; no arm would serve")
    if config.platform == "llm" and ab.by == "version":
        raise ConfigError("key 'routing.ab.by' = 'version': a generative model splits by variant")


def _validate_shadow(config: ModelConfig, shadow: ShadowSettings) -> None:
    if bool(shadow.variant) == bool(shadow.version):
        raise ConfigError("key 'routing.shadow': name the reference: `variant` or `version`")
    if shadow.variant and shadow.variant not in _variants(config):
        raise ConfigError(
            f"key 'routing.shadow.variant' = {shadow.variant!r}: not a loaded variant "
            f"{_variants(config)}"
        )
    if shadow.version < 0:
        raise ConfigError(f"key 'routing.shadow.version' = {shadow.version}: must be > 0")
    if not (math.isfinite(shadow.fraction) and 0 <= shadow.fraction <= 1):
        raise ConfigError(f"key 'routing.shadow.fraction' = {shadow.fraction}: must lie in 0..1")
    if not 1 <= shadow.max_in_flight <= MAX_SHADOW_IN_FLIGHT:
        raise ConfigError(
            f"key 'routing.shadow.max_in_flight' = {shadow.max_in_flight}: must lie in "
            f"1..{MAX_SHADOW_IN_FLIGHT}"
        )
    if not (0 < shadow.timeout_ms <= MAX_SHADOW_TIMEOUT_MS):
        raise ConfigError(
            f"key 'routing.shadow.timeout_ms' = {shadow.timeout_ms}: must lie in "
            f"(0, {MAX_SHADOW_TIMEOUT_MS:g}]"
        )
    if config.platform == "llm" and shadow.compare not in ("", "exact"):
        raise ConfigError(
            f"key 'routing.shadow.compare' = {shadow.compare!r}: a generative model's shadow "
            "compares token ids ('exact')"
        )
    names = [t.name for t in config.outputs]
    if shadow.output and shadow.output not in names:
        raise ConfigError(f"key 'routing.shadow.output' = {shadow.output!r}: not an output {names}")


def _validate_cascade(config: ModelConfig, cascade: CascadeSettings) -> None:
    if not _MODEL_NAME_RE.fullmatch(cascade.then) or cascade.then == config.name:
        raise ConfigError(
            f"key 'routing.cascade.then' = {cascade.then!r}: name another model of the repository"
        )
    if not math.isfinite(cascade.threshold):
        raise ConfigError(f"key 'routing.cascade.threshold' = {cascade.threshold}: must be finite")
    if config.platform == "llm":
        _validate_generation_cascade(cascade)
        return
    if cascade.score:
        raise ConfigError(
            f"key 'routing.cascade.score' = {cascade.score!r}: a batch model is scored by its "
            "`score_output`; `score` is for generative models"
        )
    names = [t.name for t in config.outputs]
    if cascade.score_output not in names:
        raise ConfigError(
            f"key 'routing.cascade.score_output' = {cascade.score_output!r}: not an output {names}"
        )


def _validate_generation_cascade(cascade: CascadeSettings) -> None:
    """A generative model is scored by its own token logprobs: no score output, and a threshold
    a logprob (<= 0) can reach on both sides."""
    if cascade.score_output:
        raise ConfigError(
            f"key 'routing.cascade.score_output' = {cascade.score_output!r}: a generative model "
            "is scored by its token logprobs; choose `score` (mean_logprob or min_logprob)"
        )
    if cascade.threshold > 0:
        raise ConfigError(
            f"key 'routing.cascade.threshold' = {cascade.threshold}: a generative model's score "
            "is a token logprob (<= 0), e.g. -1.0 for a geometric-mean token probability of 0.37"
        )
