"""How one request wants its tokens chosen and when it stops; validated before it is queued, so a
value the sampler cannot use is refused (or normalised, as vLLM does) before it reaches a step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from fulcrum.errors import InvalidInput
from fulcrum.llm.structured_spec import StructuredSpec, check_spec

# torch.Generator.manual_seed accepts exactly this range.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
# vLLM's _SAMPLING_EPS: a temperature below it is greedy (dividing by it overflows float32).
SAMPLING_EPS = 1e-5
# vLLM's _MAX_TEMP: a random temperature below it is raised to it, to keep logits finite.
MIN_TEMPERATURE = 1e-2
# Larger top_k values mean "off" for any vocabulary; the bound keeps them in an int64 tensor.
MAX_TOP_K = 2**31 - 1
# Stop lists are searched on every new token: their size bounds the engine's per-token work.
MAX_NUM_STOP = 64
MAX_STOP_CHARS = 1024
MAX_NUM_STOP_TOKEN_IDS = 64
# vLLM's default max_logprobs: top alternatives per token, for logprobs and prompt_logprobs.
MAX_LOGPROBS = 20
# OpenAI's bounds: at most 300 biased tokens, each bias in [-100, 100] (vLLM clamps to it).
MAX_LOGIT_BIAS = 300
MAX_ABS_LOGIT_BIAS = 100.0
# Each bad word is matched against the output on every step: bound the words and their length.
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
# allowed_token_ids becomes a vocabulary-sized mask: any real vocabulary fits under this.
MAX_ALLOWED_TOKEN_IDS = 2**20
# OpenAI's range for the additive penalties.
MAX_ABS_PENALTY = 2.0


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `max_tokens=true` is a client bug, not a number.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value)


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidInput(f"{name}: must be a boolean, got {value!r}")


def _check_top_n(name: str, value: int | None) -> None:
    if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
        raise InvalidInput(
            f"{name}: must be an integer in 0..{MAX_LOGPROBS} or null, got {value!r}"
        )


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping settings of one sequence (OpenAI's names, vLLM's meanings)."""

    max_tokens: int = 16
    temperature: float = 1.0  # below SAMPLING_EPS (0 included) = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens
    presence_penalty: float = 0.0  # over output tokens
    frequency_penalty: float = 0.0  # over output tokens, times their count
    repetition_penalty: float = 1.0  # over prompt and output tokens; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the raw logits
    allowed_token_ids: tuple[int, ...] | None = None  # None = every token
    bad_words: tuple[str, ...] = ()
    # Filled in by the engine from bad_words with its tokenizer (as vLLM: with and without a
    # leading space); the last token of each is banned after the others were generated.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    logprobs: int | None = None  # None = none; k = the sampled token's and the top k
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # fast tokenizers only: no effect (vLLM too)
    structured: StructuredSpec | None = None  # a grammar every output token must follow

    @property
    def is_greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature < SAMPLING_EPS

    @property
    def effective_temperature(self) -> float:
        """The divisor of a random row's logits: never below MIN_TEMPERATURE."""
        return max(self.temperature, MIN_TEMPERATURE)

    @cached_property
    def uses_processors(self) -> bool:
        """True when any processor before sampling changes this row's logits (min_p aside);
        computed once per request, since every step asks."""
        return (
            self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids or self.min_tokens or self.logit_bias)
            or self.has_penalties
        )

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Raise InvalidInput naming the first bad field."""
        self._validate_numbers()
        self._validate_penalties()
        self._validate_bias()
        self._validate_token_lists()
        self._validate_stops()
        self._validate_outputs()

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise InvalidInput for a token id outside 0..vocab_size-1 (logit_bias, allowed ids)."""
        for token_id, _ in self.logit_bias:
            if token_id >= vocab_size:
                raise InvalidInput(
                    f"logit_bias: token id {token_id} is outside the vocabulary "
                    f"(0..{vocab_size - 1})"
                )
        largest = max(self.allowed_token_ids or (0,))  # may be long: one pass, in C
        if largest >= vocab_size:
            raise InvalidInput(
                f"allowed_token_ids: token id {largest} is outside the vocabulary "
                f"(0..{vocab_size - 1})"
            )

    def _validate_numbers(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidInput(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidInput(f"temperature: must be a number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidInput(
                f"top_k: must be an integer in -1..{MAX_TOP_K} (0 or -1 = off), got {self.top_k!r}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidInput(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidInput(f"min_p: must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (
            not _is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED
        ):
            raise InvalidInput(f"seed: must be a 64-bit integer or null, got {self.seed!r}")

    def _validate_penalties(self) -> None:
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidInput(
                f"min_tokens: must be an integer in 0..max_tokens ({self.max_tokens}), "
                f"got {self.min_tokens!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or abs(value) > MAX_ABS_PENALTY:
                raise InvalidInput(f"{name}: must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidInput(
                "repetition_penalty: must be a number > 0 (1 = off), "
                f"got {self.repetition_penalty!r}"
            )

    def _validate_bias(self) -> None:
        bias = self.logit_bias
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidInput(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        for token_id, value in bias:
            if not _is_int(token_id) or token_id < 0:
                raise InvalidInput(f"logit_bias: keys must be token ids >= 0, got {token_id!r}")
            if not _is_number(value):
                raise InvalidInput(f"logit_bias: values must be numbers, got {value!r}")

    def _validate_token_lists(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not allowed:
                raise InvalidInput("allowed_token_ids: must not be empty")
            if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
                raise InvalidInput(f"allowed_token_ids: at most {MAX_ALLOWED_TOKEN_IDS} ids")
            # map/set/min run in C: the list may be as long as a vocabulary.
            if set(map(type, allowed)) != {int} or min(allowed) < 0:
                raise InvalidInput("allowed_token_ids: must be token ids >= 0")
        words = self.bad_words
        if len(words) > MAX_BAD_WORDS:
            raise InvalidInput(f"bad_words: at most {MAX_BAD_WORDS} words, got {len(words)}")
        if not all(isinstance(w, str) and w.strip() for w in words):
            raise InvalidInput("bad_words: each word must be a non-blank string")
        if max((len(w) for w in words), default=0) > MAX_BAD_WORD_CHARS:
            raise InvalidInput(f"bad_words: each word at most {MAX_BAD_WORD_CHARS} characters")

    def _validate_stops(self) -> None:
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidInput(f"stop: must be non-empty strings, got {self.stop!r}")
        if len(self.stop) > MAX_NUM_STOP:
            raise InvalidInput(f"stop: at most {MAX_NUM_STOP} strings, got {len(self.stop)}")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise InvalidInput(
                f"stop: each string at most {MAX_STOP_CHARS} characters, got one of {longest}"
            )
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidInput(
                f"stop_token_ids: must be integers >= 0, got {self.stop_token_ids!r}"
            )
        if len(self.stop_token_ids) > MAX_NUM_STOP_TOKEN_IDS:
            raise InvalidInput(
                f"stop_token_ids: at most {MAX_NUM_STOP_TOKEN_IDS} ids, "
                f"got {len(self.stop_token_ids)}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidInput(f"ignore_eos: must be a boolean, got {self.ignore_eos!r}")

    def _validate_outputs(self) -> None:
        _check_top_n("logprobs", self.logprobs)
        _check_top_n("prompt_logprobs", self.prompt_logprobs)
        _check_flag("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_flag("skip_special_tokens", self.skip_special_tokens)
        _check_flag("spaces_between_special_tokens", self.spaces_between_special_tokens)
        if self.structured is not None:
            check_spec(self.structured)
