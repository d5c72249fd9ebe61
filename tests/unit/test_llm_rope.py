"""RoPE scaling config and tables, sliding-window layouts and attention: what is read from a
config (and what is refused), the frequencies of each type against transformers', each token's
RoPE length, and windowed paged attention (prefill, chunks, both decode paths) against dense
attention under transformers' sliding-window mask."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from fulcrum.errors import ConfigError
from fulcrum.llm.models.attention import build_metadata, kv_cache_shape, paged_attention
from fulcrum.llm.models.llama import LlamaConfig, layer_windows
from fulcrum.llm.models.rope import RopeConfig, RotaryEmbedding, inv_freq

CPU = torch.device("cpu")
HEAD_DIM = 16
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
LONGROPE = {
    "rope_type": "longrope",
    "original_max_position_embeddings": 32,
    "short_factor": [1.0 + i / 8 for i in range(8)],
    "long_factor": [1.0 + i for i in range(8)],
}


def _raw(**extra: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
    }
    raw.update(extra)
    return raw


def _rope(**extra: Any) -> RopeConfig:
    return RopeConfig.from_hf(_raw(**extra), HEAD_DIM)


# --- reading the config -------------------------------------------------------------------


def test_new_and_old_forms_read_the_same_parameters() -> None:
    new = _rope(rope_parameters={"rope_theta": 500.0, **YARN})
    old = _rope(
        rope_theta=500.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    )
    assert new == old
    assert new.rope_type == "yarn" and new.theta == 500.0 and new.get("factor") == 4.0


def test_rope_scaling_wins_over_rope_parameters_and_the_dict_theta_over_the_top_level() -> None:
    # transformers: a non-empty rope_scaling replaces rope_parameters; the dict's theta wins.
    rope = _rope(
        rope_theta=1.0e6,
        rope_parameters={"rope_type": "default", "rope_theta": 7.0},
        rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 300.0},
    )
    assert (rope.rope_type, rope.theta) == ("linear", 300.0)
    assert _rope(rope_theta=1.0e6).theta == 1.0e6
    assert _rope().theta == 10000.0


def test_top_level_original_length_wins_as_transformers_standardises_it() -> None:
    rope = _rope(rope_parameters=LLAMA3, original_max_position_embeddings=16)
    assert rope.original_max_position_embeddings == 16


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({}, 128),
        ({"rope_type": "linear", "factor": 2.0}, 256),
        ({"rope_type": "dynamic", "factor": 4.0}, 512),
        (YARN, 128),  # the original 32 times 4
        (LLAMA3, 128),  # max_position_embeddings already states the extended length
        (LONGROPE, 128),
    ],
)
def test_max_model_len_follows_vllm(parameters: dict[str, Any], expected: int) -> None:
    assert _rope(rope_parameters=parameters).max_model_len == expected


@pytest.mark.parametrize(
    ("parameters", "named"),
    [
        ({"rope_type": "su", "factor": 2.0}, "'rope_parameters.rope_type' = 'su'"),
        ({"rope_type": "mrope", "mrope_section": [2, 2]}, "'mrope'"),
        ({"rope_type": "linear", "factor": 2.0, "mrope_section": [4]}, "mrope_section"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "high_freq_factor"),
        ({"rope_type": "linear"}, "'rope_parameters.factor' is required"),
        ({"rope_type": "linear", "factor": None}, "'rope_parameters.factor' is required"),
        ({"rope_type": "linear", "factor": "2"}, "'rope_parameters.factor' = '2'"),
        ({"rope_type": "dynamic", "factor": -1.0}, "'rope_parameters.factor' = -1.0"),
        ({**LONGROPE, "long_factor": [1.0, 2.0]}, "'rope_parameters.long_factor'"),
        ({**LONGROPE, "short_factor": ["1"] * 8}, "'rope_parameters.short_factor'"),
        ({**LLAMA3, "high_freq_factor": 0.5}, "high_freq_factor' = 0.5"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "0.5"),
    ],
)
def test_what_cannot_be_served_exactly_is_refused_by_name(
    parameters: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError, match=r"config\.json") as info:
        _rope(rope_parameters=parameters)
    assert named in str(info.value)


def test_top_level_partial_rotary_factor_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'partial_rotary_factor' = 0\.5"):
        _rope(partial_rotary_factor=0.5)


def test_llama_config_carries_the_rope_and_windows() -> None:
    cfg = LlamaConfig.from_hf(_raw(model_type="mistral", sliding_window=8, rope_parameters=YARN))
    assert cfg.rope.rope_type == "yarn" and cfg.layer_windows == (8, 8)


# --- sliding windows as transformers applies them -------------------------------------------


def test_windows_per_model_type() -> None:
    assert layer_windows({"model_type": "mistral", "sliding_window": 8}, 3) == (8, 8, 8)
    assert layer_windows({"model_type": "mistral", "sliding_window": None}, 2) == (0, 0)
    # Llama has no window in transformers: a stray key changes nothing.
    assert layer_windows({"model_type": "llama", "sliding_window": 8}, 2) == (0, 0)
    qwen2 = {"model_type": "qwen2", "sliding_window": 8, "max_window_layers": 2}
    assert layer_windows(qwen2, 4) == (0, 0, 0, 0)  # use_sliding_window off: no window
    assert layer_windows({**qwen2, "use_sliding_window": True}, 4) == (0, 0, 8, 8)
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    named = {**qwen2, "use_sliding_window": True, "layer_types": types}
    assert layer_windows(named, 3) == (8, 0, 8)


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"model_type": "mistral", "sliding_window": 0}, "'sliding_window' = 0"),
        ({"model_type": "mistral", "sliding_window": "8"}, "'sliding_window' = '8'"),
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["chunked_attention", "full_attention"],
            },
            "'chunked_attention'",
        ),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
             "layer_types": ["full_attention"]},
            "expected 2 entries",
        ),
        (
            {"model_type": "qwen2", "sliding_window": 8,
             "layer_types": ["sliding_attention", "full_attention"]},
            "'use_sliding_window' = None",
        ),
    ],
)  # fmt: skip
def test_windows_that_cannot_be_honoured_are_refused(raw: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as info:
        layer_windows(raw, 2)
    assert named in str(info.value)


# --- frequencies and tables -------------------------------------------------------------------


@pytest.mark.parametrize(
    "parameters",
    [
        {"rope_type": "linear", "factor": 2.0},
        LLAMA3,
        YARN,
        {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.2, "mscale_all_dim": 0.8},
        {**YARN, "attention_factor": 0.9, "truncate": False},
        {**YARN, "mscale": 0, "mscale_all_dim": 1.0},  # 0: unset, as transformers reads it
        LONGROPE,
        {"rope_type": "dynamic", "factor": 4.0},
    ],
)
def test_frequencies_equal_transformers(parameters: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(
        **{k: v for k, v in _raw().items() if k != "model_type"},
        rope_parameters={"rope_theta": 500.0, **parameters},
    )
    ours = _rope(rope_parameters={"rope_theta": 500.0, **parameters})
    compute = ROPE_INIT_FUNCTIONS[parameters["rope_type"]]
    for seq_len in (None, 40, 200):  # the trained length, then beyond it
        want, want_scale = compute(hf, None, seq_len=seq_len)
        got, got_scale = inv_freq(ours, seq_len)
        assert torch.equal(got, want) and got_scale == pytest.approx(want_scale, rel=1e-12)


def test_length_dependent_tables_use_each_tokens_length() -> None:
    rope = _rope(rope_parameters={"rope_type": "dynamic", "factor": 4.0})
    rotary = RotaryEmbedding(rope, rope.max_model_len)
    positions = torch.tensor([3, 100, 3, 140])
    rope_lens = torch.tensor([20, 120, 150, 141])  # within, then beyond the trained 128
    cos, sin = rotary.tables(positions, rope_lens, torch.float32)
    for row, (pos, length) in enumerate(zip(positions.tolist(), rope_lens.tolist(), strict=True)):
        freqs = pos * inv_freq(rope, length)[0]
        emb = torch.cat((freqs, freqs))
        torch.testing.assert_close(cos[row, 0], emb.cos(), rtol=0, atol=0)
        torch.testing.assert_close(sin[row, 0], emb.sin(), rtol=0, atol=0)
    assert not torch.equal(cos[0], cos[2])  # same position, other length: other rotation
    with pytest.raises(ConfigError, match="needs prompt lengths"):
        rotary.tables(positions, None, torch.float32)


def test_prefix_keys_split_only_length_dependent_prompts() -> None:
    dynamic = _rope(rope_parameters={"rope_type": "dynamic", "factor": 4.0})
    assert dynamic.prefix_key(128) is None  # trained rotation, shared with everyone
    assert dynamic.prefix_key(129) != dynamic.prefix_key(130)
    longrope = _rope(rope_parameters=LONGROPE)
    assert longrope.prefix_key(32) is None
    assert longrope.prefix_key(33) == longrope.prefix_key(90) is not None
    assert _rope(rope_parameters=YARN).prefix_key(1000) is None


def test_rope_lens_are_the_prompt_length_for_prompt_tokens() -> None:
    # A decode at position 40 (prompt 30), a chunk of a 50-token prompt, a whole 5-token prompt.
    meta = build_metadata(
        [1, 4, 5], [41, 24, 5], [[0] * 11, [0] * 6, [0] * 2], 4, CPU, prompt_lens=[30, 50, 5]
    )
    positions = torch.tensor([40, 20, 21, 22, 23, 0, 1, 2, 3, 4])
    assert meta.rope_lens(positions).tolist() == [41, 50, 50, 50, 50, 5, 5, 5, 5, 5]
    one_shot = build_metadata([6], [6], [[0, 1]], 4, CPU)  # no prompt lengths: a whole prompt
    assert one_shot.rope_lens(torch.arange(6)).tolist() == [6] * 6


# --- windowed paged attention ----------------------------------------------------------------

BLOCK_SIZE, HEADS, KV_HEADS, DIM, WINDOW = 4, 4, 2, 8, 5


class _Seqs:
    """Random q/k/v of whole sequences in a scattered block pool."""

    def __init__(self, lengths: list[int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q = [torch.randn(n, HEADS, DIM, generator=gen) for n in lengths]
        self.k = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in lengths]
        self.v = [torch.randn(n, KV_HEADS, DIM, generator=gen) for n in lengths]
        num_blocks = [-(-n // BLOCK_SIZE) for n in lengths]
        ids = list(range(sum(num_blocks)))
        random.Random(seed).shuffle(ids)
        self.tables = [[ids.pop() for _ in range(n)] for n in num_blocks]
        shape = kv_cache_shape(sum(num_blocks), BLOCK_SIZE, KV_HEADS, DIM)
        self.k_cache, self.v_cache = torch.zeros(shape), torch.zeros(shape)

    def step(self, starts: list[int], ends: list[int], *, in_place: bool) -> list[torch.Tensor]:
        """Attend tokens starts[i]:ends[i] of each sequence through the windowed layout."""
        q_lens = [e - s for s, e in zip(starts, ends, strict=True)]
        meta = build_metadata(
            q_lens, ends, self.tables, BLOCK_SIZE, CPU, split_chunks=True, in_place_decode=in_place
        ).windowed(WINDOW)
        q, k, v = (
            torch.cat([t[i][s:e] for i, (s, e) in enumerate(zip(starts, ends, strict=True))])
            for t in (self.q, self.k, self.v)
        )
        out = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, DIM**-0.5)
        return list(torch.split(out, q_lens))

    def dense(self, i: int) -> torch.Tensor:
        """transformers' sliding-window mask: query q sees key k iff q - window < k <= q."""
        n = self.q[i].shape[0]
        pos = torch.arange(n)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - WINDOW)
        group = HEADS // KV_HEADS
        return F.scaled_dot_product_attention(
            self.q[i].transpose(0, 1),
            self.k[i].transpose(0, 1).repeat_interleave(group, 0),
            self.v[i].transpose(0, 1).repeat_interleave(group, 0),
            attn_mask=mask,
            scale=DIM**-0.5,
        ).transpose(0, 1)


@pytest.mark.parametrize("in_place", [True, False])
def test_windowed_prefill_chunks_and_decodes_equal_dense_sliding_attention(in_place: bool) -> None:
    lengths = [23, 4, 17, 9]  # longer and shorter than the window
    seqs = _Seqs(lengths)
    n = len(lengths)
    # Fresh chunks, continued chunks of unequal length (a padded, masked group), then decodes.
    first_ends = [16, 2, 10, 5]
    first = seqs.step([0] * n, first_ends, in_place=in_place)
    second = seqs.step(first_ends, [x - 1 for x in lengths], in_place=in_place)
    last = seqs.step([x - 1 for x in lengths], lengths, in_place=in_place)
    for i in range(n):
        got = torch.cat([first[i], second[i], last[i]])
        torch.testing.assert_close(got, seqs.dense(i), rtol=1e-5, atol=1e-5)


def test_window_wider_than_every_context_reuses_the_step_layout() -> None:
    meta = build_metadata([1, 3], [9, 3], [[0, 1, 2], [3]], 4, CPU, in_place_decode=True)
    assert meta.windowed(9) is meta
    windowed = meta.windowed(4)
    assert windowed is not meta and meta.windowed(4) is windowed  # built once per step
    # The decode (9 keys, window 4: positions 5..8) reads from its window's first block on.
    decode = windowed.groups[0]
    assert decode.block_tables.tolist() == [[1, 2]]
    assert decode.context_lens is not None and decode.context_lens.tolist() == [5]
    assert decode.window_skip is not None and decode.window_skip.tolist() == [1]
