"""Rotary position embeddings and their scaling types, read from a Hugging Face `config.json`.

Each type computes its inverse frequencies as transformers' `modeling_rope_utils` does (float32,
same order of operations), so greedy tokens match it. `dynamic` and `longrope` depend on the
length of the sequence when a token was computed: transformers uses the prompt's length for every
prompt token and the length so far for each generated one, and its cached keys keep the rotation
they were computed with; `rope_lens` gives that length per token, and `prefix_key` keeps prefix-
cache blocks computed under different lengths apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fulcrum.errors import ConfigError

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin: (T, 1, D) each

# The keys each type must have and may have (besides _COMMON_KEYS), as transformers validates them.
_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "yarn": (
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
    "llama3": ("original_max_position_embeddings",),
    "longrope": ("original_max_position_embeddings", "factor", "attention_factor"),
}
_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
ROPE_TYPES = tuple(_REQUIRED)
DEFAULT_THETA = 10000.0


@dataclass(frozen=True)
class RopeConfig:
    """One RoPE variant with its parameters, validated at load."""

    rope_type: str
    theta: float
    head_dim: int
    max_position_embeddings: int
    params: tuple[tuple[str, Any], ...] = ()  # the type's own keys, as read

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    @property
    def original_max_position_embeddings(self) -> int:
        return int(self.get("original_max_position_embeddings") or self.max_position_embeddings)

    @property
    def length_dependent(self) -> bool:
        """True when a token's rotation depends on its sequence's length, not only its position."""
        return self.rope_type in ("dynamic", "longrope")

    @property
    def max_model_len(self) -> int:
        """The context the scaling extends to, as vLLM derives it: linear, dynamic and YaRN
        multiply their base length by `factor`; llama3 and longrope configs state it already."""
        if self.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * float(self.get("factor")))
        if self.rope_type == "yarn":
            return int(self.original_max_position_embeddings * _yarn_factor(self))
        return self.max_position_embeddings

    def prefix_key(self, num_prompt_tokens: int) -> str | None:
        """A prefix-cache salt for a sequence whose prompt rotations depend on its length (None:
        positions alone decide, so its blocks are shared with every other sequence)."""
        if self.rope_type == "dynamic" and num_prompt_tokens > self.max_position_embeddings:
            return f"rope-dynamic:{num_prompt_tokens}"
        long = num_prompt_tokens > self.original_max_position_embeddings
        if self.rope_type == "longrope" and long:
            return "rope-longrope:long"
        return None

    @classmethod
    def from_hf(
        cls, raw: dict[str, Any], head_dim: int, *, partial_rotary: bool = False
    ) -> RopeConfig:
        """Read `rope_scaling` (older form; it wins when set, as in transformers) or
        `rope_parameters`, with `rope_theta` from the dict or the top level. partial_rotary:
        the family rotates only the first `partial_rotary_factor` of each head (Phi-3), so
        `head_dim` here becomes that rotary width."""
        key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
        given = raw.get(key) or {}
        if not isinstance(given, dict):
            raise ConfigError(f"config.json: key {key!r} = {given!r}: expected an object")
        rope_type = given.get("rope_type", given.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"config.json: key '{key}.rope_type' = {rope_type!r}: expected one of {ROPE_TYPES}"
            )
        _check_keys(key, given, rope_type)
        partial = given.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if partial_rotary and partial is not None:
            head_dim = _rotary_dim(head_dim, partial)
        elif partial is not None and float(partial) != 1.0:
            raise ConfigError(
                f"config.json: key 'partial_rotary_factor' = {partial!r}: this model family "
                "rotates the whole head (1.0)"
            )
        # Lists (longrope's factors) become tuples: the config is frozen data.
        params = {
            n: tuple(v) if isinstance(v, list) else v
            for n, v in given.items()
            if n not in _COMMON_KEYS
        }
        # A top-level original_max_position_embeddings wins, as transformers standardises it.
        top_level_original = raw.get("original_max_position_embeddings")
        if rope_type in ("llama3", "yarn", "longrope") and top_level_original is not None:
            params["original_max_position_embeddings"] = top_level_original
        config = cls(
            rope_type=rope_type,
            theta=float(given.get("rope_theta") or raw.get("rope_theta") or DEFAULT_THETA),
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            params=tuple(sorted(params.items())),
        )
        _check_values(config, key)
        return config


def _rotary_dim(head_dim: int, partial: Any) -> int:
    """The rotated width of a head, int(head_dim * factor) as transformers takes it."""
    ok = isinstance(partial, int | float) and not isinstance(partial, bool) and 0 < partial <= 1
    dim = int(head_dim * partial) if ok else 0
    if dim < 2 or dim % 2:
        raise ConfigError(
            f"config.json: key 'partial_rotary_factor' = {partial!r}: expected a number in "
            f"(0, 1] giving an even rotary width of the {head_dim}-wide heads"
        )
    return dim


def _check_keys(key: str, given: dict[str, Any], rope_type: str) -> None:
    """Every key of the dict is one this type reads, and the ones it needs are there."""
    allowed = _COMMON_KEYS + _REQUIRED[rope_type] + _OPTIONAL.get(rope_type, ())
    for name, value in given.items():
        if name not in allowed:
            raise ConfigError(
                f"config.json: key '{key}.{name}' = {value!r}: not used by rope_type "
                f"{rope_type!r}; cannot serve it exactly"
            )
    for name in _REQUIRED[rope_type]:
        # YaRN alone derives a null factor (from the two lengths), as transformers does.
        nullable = (rope_type, name) == ("yarn", "factor")
        if name not in given or (given[name] is None and not nullable):
            raise ConfigError(f"config.json: key '{key}.{name}' is required by {rope_type!r}")


def _check_factors(key: str, name: str, value: Any, length: int) -> None:
    numbers = isinstance(value, tuple) and all(
        isinstance(x, int | float) and not isinstance(x, bool) and x > 0 for x in value
    )
    if not numbers or len(value) != length:
        shown = list(value) if isinstance(value, tuple) else value
        raise ConfigError(
            f"config.json: key '{key}.{name}' = {shown!r}: expected {length} numbers > 0"
        )


def _check_values(config: RopeConfig, key: str) -> None:
    for name, value in config.params:
        if name in ("short_factor", "long_factor"):
            _check_factors(key, name, value, config.head_dim // 2)
        elif name == "truncate":
            if not isinstance(value, bool):
                raise ConfigError(f"config.json: key '{key}.{name}' = {value!r}: expected a bool")
        elif value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or value < 0
        ):
            raise ConfigError(f"config.json: key '{key}.{name}' = {value!r}: expected a number")
        elif value == 0 and name not in ("mscale", "mscale_all_dim"):  # those: 0 means unset
            raise ConfigError(f"config.json: key '{key}.{name}' = 0: must be > 0")
    if config.rope_type == "llama3" and not (
        config.get("high_freq_factor") > config.get("low_freq_factor")
    ):
        raise ConfigError(
            f"config.json: key '{key}.high_freq_factor' = {config.get('high_freq_factor')!r}: "
            "must exceed low_freq_factor"
        )


def _base_inv_freq(theta: float | torch.Tensor, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (theta**exponents)


def _yarn_factor(config: RopeConfig) -> float:
    factor = config.get("factor")
    if factor is None:  # DeepSeek style: the ratio of the two lengths
        return config.max_position_embeddings / config.original_max_position_embeddings
    return float(factor)


def _llama3(config: RopeConfig) -> torch.Tensor:
    inv_freq = _base_inv_freq(config.theta, config.head_dim)
    factor = config.get("factor")
    low, high = config.get("low_freq_factor"), config.get("high_freq_factor")
    old_len = config.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the middle band blended.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_attention_factor(config: RopeConfig, factor: float) -> float:
    given = config.get("attention_factor")
    if given is not None:
        return float(given)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = config.get("mscale"), config.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def _yarn(config: RopeConfig) -> tuple[torch.Tensor, float]:
    dim, base = config.head_dim, config.theta
    factor = _yarn_factor(config)
    beta_fast = config.get("beta_fast") or 32
    beta_slow = config.get("beta_slow") or 1
    old_len = config.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if config.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    # High-frequency dims extrapolate (kept), low-frequency ones interpolate (scaled).
    keep = 1 - ramp
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, _yarn_attention_factor(config, factor)


def _longrope(config: RopeConfig, long: bool) -> tuple[torch.Tensor, float]:
    factor = config.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / config.original_max_position_embeddings
    attention_factor = config.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0
            if factor <= 1.0
            else math.sqrt(1 + math.log(factor) / math.log(config.original_max_position_embeddings))
        )
    ext = torch.tensor(config.get("long_factor" if long else "short_factor"), dtype=torch.float32)
    shape = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    return 1.0 / (ext * config.theta**shape), float(attention_factor)


def _dynamic(config: RopeConfig, seq_len: int | None) -> torch.Tensor:
    factor, mpe, dim = config.get("factor"), config.max_position_embeddings, config.head_dim
    # transformers computes the trained rotation in Python floats and longer ones from a tensor
    # length (float32); each is reproduced as it is computed there.
    length: int | torch.Tensor = mpe if seq_len is None or seq_len <= mpe else torch.tensor(seq_len)
    # NTK-aware: the base grows with the sequence beyond the trained length.
    base = config.theta * ((factor * length / mpe) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim)


def inv_freq(config: RopeConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(D/2,) inverse frequencies and the cos/sin scale; seq_len: the sequence's length when the
    token was computed (dynamic and longrope only; None: the trained length)."""
    kind = config.rope_type
    if kind == "linear":
        return _base_inv_freq(config.theta, config.head_dim) / config.get("factor"), 1.0
    if kind == "llama3":
        return _llama3(config), 1.0
    if kind == "yarn":
        return _yarn(config)
    if kind == "dynamic":
        return _dynamic(config, seq_len), 1.0
    if kind == "longrope":
        return _longrope(config, (seq_len or 0) > config.original_max_position_embeddings)
    return _base_inv_freq(config.theta, config.head_dim), 1.0


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE: cos/sin tables precomputed for every position of the trained rotation;
    length-dependent types compute the others per step."""

    def __init__(self, config: RopeConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        # Computed, never loaded: real tables even when the model is built on the meta device.
        with torch.device("cpu"):
            freq, self.attention_factor = inv_freq(config)
            cos, sin = self._cos_sin(torch.arange(max_positions).float()[:, None] * freq[None, :])
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # dynamic: up to this length a sequence keeps the trained rotation (the table above)
        self._threshold = (
            config.max_position_embeddings
            if config.rope_type == "dynamic"
            else config.original_max_position_embeddings
        )

    def _cos_sin(self, freqs: torch.Tensor) -> RopeTables:
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor

    def tables(
        self, positions: torch.Tensor, rope_lens: torch.Tensor | None, dtype: torch.dtype
    ) -> RopeTables:
        """cos and sin (T, 1, D) of each token; rope_lens (T,): its sequence's length when it
        was computed (needed by length-dependent types only)."""
        cos, sin = self.cos[positions], self.sin[positions]
        if self.config.length_dependent:
            if rope_lens is None:
                raise ConfigError(f"rope_type {self.config.rope_type!r} needs prompt lengths")
            cos, sin = self._length_dependent(positions, rope_lens, cos, sin)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def _length_dependent(
        self, positions: torch.Tensor, rope_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> RopeTables:
        beyond = rope_lens > self._threshold
        if not bool(beyond.any()):
            return cos, sin  # every sequence within the trained length: the table holds
        cos, sin = cos.clone(), sin.clone()
        rows = beyond.nonzero().flatten()
        lens, inverse = torch.unique(rope_lens[rows].cpu(), return_inverse=True)
        # One frequency set per distinct length (a step holds few), as transformers computes it.
        freqs = torch.stack([inv_freq(self.config, int(n))[0] for n in lens.tolist()])
        angles = positions[rows].float()[:, None].cpu() * freqs[inverse]  # (R, D/2)
        row_cos, row_sin = self._cos_sin(angles)
        cos[rows], sin[rows] = row_cos.to(cos.device), row_sin.to(sin.device)
        return cos, sin


def apply_rope(x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
    """x (T, H, D) rotated by each token's position; tables narrower than D (partial rotary)
    rotate the leading dims and pass the rest through."""
    cos, sin = tables
    rotary = cos.shape[-1]
    if rotary != x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], tables), x[..., rotary:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
