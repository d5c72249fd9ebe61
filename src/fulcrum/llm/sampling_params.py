"""How one request wants its tokens chosen and when it stops; validated before it is queued, so a
value the sampler cannot use is refused (or normalised, as vLLM does) before it reaches a step."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fulcrum.errors import InvalidInput

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


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `max_tokens=true` is a client bug, not a number.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping settings of one sequence (OpenAI's names, vLLM's meanings)."""

    max_tokens: int = 16
    temperature: float = 1.0  # below SAMPLING_EPS (0 included) = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature < SAMPLING_EPS

    @property
    def effective_temperature(self) -> float:
        """The divisor of a random row's logits: never below MIN_TEMPERATURE."""
        return max(self.temperature, MIN_TEMPERATURE)

    def validate(self) -> None:
        """Raise InvalidInput naming the first bad field."""
        self._validate_numbers()
        self._validate_stops()

    def _validate_numbers(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidInput(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidInput(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidInput(
                f"top_k must be an integer in -1..{MAX_TOP_K} (0 or -1 = off), got {self.top_k!r}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            not _is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED
        ):
            raise InvalidInput(f"seed must be a 64-bit integer or null, got {self.seed!r}")

    def _validate_stops(self) -> None:
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidInput(f"stop must be non-empty strings, got {self.stop!r}")
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
            raise InvalidInput(f"stop_token_ids must be integers >= 0, got {self.stop_token_ids!r}")
        if len(self.stop_token_ids) > MAX_NUM_STOP_TOKEN_IDS:
            raise InvalidInput(
                f"stop_token_ids: at most {MAX_NUM_STOP_TOKEN_IDS} ids, "
                f"got {len(self.stop_token_ids)}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidInput(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
