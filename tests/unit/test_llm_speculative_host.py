"""Speculative decoding's host side: the n-gram proposer, the `speculative` setting, which
requests and steps speculate, and the scheduler keeping only verified tokens (KV rollback)."""

from __future__ import annotations

import random

import pytest

from fulcrum.errors import ConfigError
from fulcrum.llm.block_manager import BlockManager
from fulcrum.llm.ngram import propose_ngram
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.scheduler import Scheduler
from fulcrum.llm.sequence import FinishReason, Sequence
from fulcrum.llm.speculative import SpecStats, Speculation, SpeculativeConfig, can_speculate

EOS = 1


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The proposer's definition, literally: longest n first, its most recent occurrence."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # ends before the last token
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


# --- proposer ----------------------------------------------------------------------------------


def test_proposes_what_followed_the_most_recent_occurrence() -> None:
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 3, 5, 6]
    assert propose_ngram(tokens, min_n=2, max_n=2, k=3) == [8, 2, 3]  # the later "5 6"


def test_prefers_the_longest_match_over_a_more_recent_shorter_one() -> None:
    tokens = [4, 5, 6, 9, 9, 7, 5, 6, 8, 8, 4, 5, 6]
    # "4 5 6" occurred at 0 (followed by 9 9); "5 6" more recently at 6 (followed by 8 8).
    assert propose_ngram(tokens, min_n=2, max_n=3, k=2) == [9, 9]
    assert propose_ngram(tokens, min_n=2, max_n=2, k=2) == [8, 8]


def test_no_match_below_min_n_and_short_tail_near_the_end() -> None:
    assert propose_ngram([1, 2, 3, 4, 3], min_n=2, max_n=3, k=4) == []
    assert propose_ngram([1, 2, 3, 4, 3], min_n=1, max_n=3, k=4) == [4, 3]  # only 2 follow
    assert propose_ngram([7], min_n=1, max_n=3, k=4) == []
    assert propose_ngram([7, 7, 7], min_n=1, max_n=4, k=0) == []


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_brute_force_definition(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
    min_n = rng.randrange(1, 4)
    max_n = rng.randrange(min_n, 6)
    k = rng.randrange(1, 6)
    assert propose_ngram(tokens, min_n=min_n, max_n=max_n, k=k) == brute_force(
        tokens, min_n, max_n, k
    )


# --- configuration -----------------------------------------------------------------------------


def test_config_from_parameters_with_vllm_defaults() -> None:
    params = EngineParams.from_parameters(
        {"speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}}
    )
    assert params.speculative == SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_min=4, prompt_lookup_max=4
    )
    assert EngineParams().speculative is None  # off by default


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative.method"),
        ({"num_speculative_tokens": 0}, "speculative.num_speculative_tokens"),
        ({}, "speculative.num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "speculative.num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "lookahead": 1}, "speculative.lookahead"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "speculative.prompt_lookup_min",
        ),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ("ngram", "parameters.speculative"),
    ],
)
def test_bad_config_names_the_key(table: object, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        EngineParams.from_parameters({"speculative": table})


def test_requests_that_verification_cannot_reproduce_do_not_speculate() -> None:
    assert can_speculate(SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3))
    for kwargs in (
        {"logprobs": 1},
        {"prompt_logprobs": 0},
        {"stop": ("x",)},
        {"presence_penalty": 0.5},
        {"repetition_penalty": 1.2},
        {"min_tokens": 2},
        {"logit_bias": {3: 1.0}},
    ):
        assert not can_speculate(SamplingParams(**kwargs)), kwargs  # type: ignore[arg-type]


def test_spare_tokens_rule() -> None:
    spec = Speculation(SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=4))
    assert spec.spare_tokens(32, 3, prefill_pending=False) == 29
    assert spec.spare_tokens(32, 3, prefill_pending=True) == 0  # prefills keep the budget
    assert spec.spare_tokens(32, 5, prefill_pending=False) == 0  # above disable_by_batch_size
    assert spec.spare_tokens(3, 3, prefill_pending=False) == 0


def test_stats_acceptance_rate_and_mean_length() -> None:
    stats = SpecStats()
    stats.record(4, 4)
    stats.record(4, 0)
    stats.record(2, 1)
    assert stats.acceptance_rate == pytest.approx(5 / 10)
    assert stats.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    assert stats.accepted_per_pos == [2, 1, 1, 1]


# --- scheduling and rollback -------------------------------------------------------------------


def _scheduler(num_blocks: int = 16, *, k: int = 4, batch: int = 4) -> Scheduler:
    scheduler = Scheduler(
        BlockManager(num_blocks, 4), max_num_seqs=8, max_num_batched_tokens=64, max_num_waiting=8
    )
    config = SpeculativeConfig(
        num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3,
        disable_by_batch_size=batch,
    )  # fmt: skip
    scheduler.speculation = Speculation(config)
    return scheduler


def _seq(seq_id: int, prompt: list[int], **kwargs: object) -> Sequence:
    params = SamplingParams(max_tokens=kwargs.pop("max_tokens", 20), **kwargs)  # type: ignore[arg-type]
    return Sequence(seq_id, prompt, params, arrival_s=float(seq_id), eos_token_id=EOS)


def _prefill(scheduler: Scheduler, seq: Sequence, first_token: int) -> None:
    scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.seqs == [seq] and batch.num_new_tokens == [seq.num_tokens]
    scheduler.update(batch, [first_token])


PROMPT = [2, 3, 4, 5, 6, 7, 8, 9, 10, 2, 3]  # 11 tokens; "2 3" then 4 5 6 7 before


def test_decode_schedules_its_drafts_and_keeps_only_the_accepted() -> None:
    scheduler = _scheduler()
    bm = scheduler.block_manager
    seq = _seq(0, PROMPT, temperature=0.0)
    _prefill(scheduler, seq, 4)  # tokens: ... 2 3 4 -> drafts 5 6 7 8
    free_before = bm.num_free_blocks()
    batch = scheduler.schedule()
    assert seq.spec_token_ids == [5, 6, 7, 8]
    assert batch.num_new_tokens == [5]  # the last token and 4 drafts
    assert len(seq.block_table) == 4  # 11 + 1 + 4 = 16 slots
    scheduler.update(batch, [[5, 6, 99]])  # 2 drafts accepted, then the model's 99
    assert seq.output_token_ids == [4, 5, 6, 99]
    assert seq.spec_token_ids == []
    assert seq.num_computed_tokens == 14 == seq.num_tokens - 1
    assert len(seq.block_table) == 4  # 14 computed tokens still need 4 blocks
    assert bm.num_free_blocks() == free_before - 1
    assert scheduler.speculation is not None
    assert scheduler.speculation.stats.num_accepted_tokens == 2


def test_rejected_drafts_free_their_blocks_and_never_reach_the_prefix_cache() -> None:
    scheduler = _scheduler()
    bm = scheduler.block_manager
    seq = _seq(0, PROMPT, temperature=0.0)
    _prefill(scheduler, seq, 4)  # 12 tokens, 11 computed: blocks 0-1 full and cached
    assert bm.num_cached_blocks() == 2
    free_before = bm.num_free_blocks()
    batch = scheduler.schedule()  # computes positions 11..15: block 2 full, if all were kept
    assert len(seq.block_table) == 4
    scheduler.update(batch, [[77]])  # every draft rejected
    assert seq.num_computed_tokens == 12
    assert len(seq.block_table) == 3  # the slots of positions 12.. released
    assert bm.num_free_blocks() == free_before
    # Block 2 (positions 8-11: 10 2 3 4) is final and cached; nothing of the drafts is.
    assert bm.num_cached_blocks() == 3
    assert seq.block_hashes[2] == bm._hash_fn(seq.block_hashes[1], (10, 2, 3, 4), seq.cache_salt)
    # Another sequence with the drafts in its prompt finds no cached block of them.
    other = _seq(1, [*PROMPT, 4, 5, 6, 7, 8, 1], temperature=0.0)
    bm.match_prefix(other)
    assert other.num_computed_tokens == 12
    bm.free(other)


def test_accepted_run_stops_at_eos_and_at_max_tokens() -> None:
    scheduler = _scheduler()
    seq = _seq(0, PROMPT, temperature=0.0)
    _prefill(scheduler, seq, 4)
    batch = scheduler.schedule()
    scheduler.update(batch, [[5, EOS, 7]])
    assert seq.output_token_ids == [4, 5, EOS]
    assert seq.finish_reason is FinishReason.STOP
    assert scheduler.block_manager.num_free_blocks() == 16

    scheduler = _scheduler()
    seq = _seq(0, PROMPT, temperature=0.0, max_tokens=3)
    _prefill(scheduler, seq, 4)
    batch = scheduler.schedule()
    assert seq.spec_token_ids == [5]  # max_tokens leaves room for one draft and the model's own
    scheduler.update(batch, [[5, 6]])
    assert seq.output_token_ids == [4, 5, 6]
    assert seq.finish_reason is FinishReason.LENGTH


def test_no_drafts_while_a_prefill_waits_or_above_the_batch_size() -> None:
    scheduler = _scheduler(batch=1)
    seq = _seq(0, PROMPT, temperature=0.0)
    _prefill(scheduler, seq, 4)
    scheduler.add(_seq(1, [2, 3, 4, 5, 6, 7], temperature=0.0))
    batch = scheduler.schedule()  # seq 1 waits: the decode does not speculate
    assert seq.spec_token_ids == [] and batch.num_new_tokens[0] == 1
    scheduler.update(batch, [4, 9])
    batch = scheduler.schedule()  # two running > disable_by_batch_size 1
    assert batch.num_new_tokens == [1, 1]


def test_drafts_take_only_free_blocks_and_never_preempt() -> None:
    scheduler = _scheduler(num_blocks=4)
    first = _seq(0, PROMPT[:10], temperature=0.0, max_tokens=5)
    _prefill(scheduler, first, 4)  # 3 blocks: room for positions 10 and 11
    second = _seq(1, [2, 3, 2], temperature=0.0, max_tokens=4)
    scheduler.add(second)
    scheduler.update(scheduler.schedule(), [4, 3])  # the 4th block; none left
    batch = scheduler.schedule()
    # Both had drafts (their last token occurred before), neither had a free block for them.
    assert propose_ngram(first.token_ids, min_n=1, max_n=3, k=2)
    assert propose_ngram(second.token_ids, min_n=1, max_n=3, k=2)
    assert batch.num_new_tokens == [1, 1]
    assert first.spec_token_ids == second.spec_token_ids == []
    assert scheduler.num_preemptions == 0


def test_update_rejects_a_verification_longer_than_the_drafts() -> None:
    scheduler = _scheduler()
    seq = _seq(0, PROMPT, temperature=0.0)
    _prefill(scheduler, seq, 4)
    batch = scheduler.schedule()
    with pytest.raises(Exception, match="for 4 drafts"):
        scheduler.update(batch, [[5, 6, 7, 8, 9, 10]])


def test_publish_adds_only_the_counts_since_the_last_call() -> None:
    from prometheus_client import CollectorRegistry

    from fulcrum.llm.metrics import LLMMetrics

    registry = CollectorRegistry()
    metrics = LLMMetrics(registry, "m")
    spec = Speculation(SpeculativeConfig(num_speculative_tokens=4))
    spec.stats.record(4, 3)
    spec.publish(metrics)
    spec.stats.record(4, 1)
    spec.publish(metrics)
    spec.publish(metrics)

    def value(name: str) -> float | None:
        return registry.get_sample_value(
            f"fulcrum_llm_{name}", {"model": "m", "version": "1", "variant": "default"}
        )

    assert value("spec_decode_num_drafts_total") == 2
    assert value("spec_decode_num_draft_tokens_total") == 8
    assert value("spec_decode_num_accepted_tokens_total") == 4
    assert value("spec_decode_acceptance_rate") == pytest.approx(0.5)
    assert value("spec_decode_mean_acceptance_length") == pytest.approx(3.0)
