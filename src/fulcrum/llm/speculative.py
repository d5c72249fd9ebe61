"""Speculative decoding without a draft model: the `speculative` engine setting (vLLM's
speculative_config names), which requests and steps speculate, the drafts of one sequence, and
the counters behind the spec-decode metrics. The runner verifies drafts (fulcrum.llm.spec_verify);
the scheduler keeps only the tokens verified (Scheduler.update)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fulcrum.errors import ConfigError
from fulcrum.llm.ngram import propose_ngram

if TYPE_CHECKING:
    from fulcrum.llm.metrics import LLMMetrics
    from fulcrum.llm.sampling_params import SamplingParams
    from fulcrum.llm.sequence import Sequence

_KEY = "parameters.speculative"
_METHODS = ("ngram",)
# Above this many running sequences a step does not speculate: a batched decode step already
# reads the weights once for many tokens, and verification then costs more than it saves.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative = { method = "ngram", num_speculative_tokens = 4, ... }` in [parameters]."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def from_table(cls, table: Any) -> SpeculativeConfig:
        """Read and check the table; ConfigError names the key. As vLLM: one of the lookup
        bounds alone sets both; neither: both 5."""
        if not isinstance(table, dict):
            raise ConfigError(f"key '{_KEY}' = {table!r}: expected a table")
        values: dict[str, Any] = {}
        known = sorted(cls.__dataclass_fields__)
        for key, value in table.items():
            if key not in known:
                raise ConfigError(f"key '{_KEY}.{key}': unknown; expected one of {known}")
            expected = str if key == "method" else int
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ConfigError(f"key '{_KEY}.{key}' = {value!r}: expected {expected.__name__}")
            values[key] = value
        if "num_speculative_tokens" not in values:
            raise ConfigError(f"key '{_KEY}.num_speculative_tokens': required")
        low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        values["prompt_lookup_min"] = low if low is not None else (high or 5)
        values["prompt_lookup_max"] = high if high is not None else (low or 5)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Range checks."""
        if self.method not in _METHODS:
            raise ConfigError(f"key '{_KEY}.method' = {self.method!r}: expected one of {_METHODS}")
        for key in (
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "disable_by_batch_size",
        ):
            if getattr(self, key) < 1:
                raise ConfigError(f"key '{_KEY}.{key}' = {getattr(self, key)}: must be >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"key '{_KEY}.prompt_lookup_min' = {self.prompt_lookup_min}: must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )


def can_speculate(sampling: SamplingParams) -> bool:
    """True for a request whose tokens verification reproduces exactly: none that reads its own
    history (penalties, min_tokens, bad_words), is masked (allowed_token_ids, logit_bias, a
    grammar), reports logprobs or stops on text (a stop string is found per token)."""
    return not (
        sampling.uses_processors
        or sampling.structured is not None
        or sampling.logprobs is not None
        or sampling.prompt_logprobs is not None
        or sampling.stop
    )


@dataclass
class SpecStats:
    """Cumulative counts, as vLLM's spec_decode_num_drafts / _draft_tokens / _accepted_tokens."""

    num_drafts: int = 0  # sequence-steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos.extend([0] * (num_drafted - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step: the accepted drafts plus the model's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculation:
    """Drafts for the scheduler: which steps speculate and how many tokens each sequence drafts."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecStats()
        self._published = (0, 0, 0)  # the counts already added to the metrics

    def publish(self, metrics: LLMMetrics) -> None:
        """Add the counts since the last call to the spec-decode metrics; set the ratios."""
        stats = self.stats
        now = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        drafts, draft_tokens, accepted = (a - b for a, b in zip(now, self._published, strict=True))
        metrics.spec_drafts.inc(drafts)
        metrics.spec_draft_tokens.inc(draft_tokens)
        metrics.spec_accepted_tokens.inc(accepted)
        metrics.spec_acceptance_rate.set(stats.acceptance_rate)
        metrics.spec_mean_acceptance_length.set(stats.mean_acceptance_length)
        self._published = now

    def spare_tokens(self, budget: int, num_running: int, prefill_pending: bool) -> int:
        """Draft tokens this step may add beyond one token per running sequence: none while any
        prefill waits for the budget (admissions and prompt chunks keep it all, so speculation
        never delays a first token) or above disable_by_batch_size running sequences."""
        if prefill_pending or num_running > self.config.disable_by_batch_size:
            return 0
        return max(0, budget - num_running)

    def drafts(self, seq: Sequence, max_tokens: int) -> list[int]:
        """At most max_tokens drafts for a decoding sequence; [] if it must not speculate."""
        # The model's own token follows the accepted drafts: at most this many drafts fit.
        left = seq.sampling.max_tokens - seq.num_output_tokens - 1
        k = min(self.config.num_speculative_tokens, max_tokens, left)
        if k < 1 or not can_speculate(seq.sampling):
            return []
        return propose_ngram(
            seq.token_ids,
            min_n=self.config.prompt_lookup_min,
            max_n=self.config.prompt_lookup_max,
            k=k,
        )
