"""Draft verification: greedy acceptance, rejection sampling's exact output distribution
(chi-square over many seeds, on a tiny model's next-token distributions), and the runner scoring
a sequence's last token plus its drafts over its paged KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scipy import stats

from fulcrum.llm.examples import build_tiny_llama
from fulcrum.llm.loader import LoadedLLM, load_checkpoint
from fulcrum.llm.models.attention import build_metadata
from fulcrum.llm.runner import ModelRunner
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.scheduler import ScheduledBatch
from fulcrum.llm.sequence import Sequence
from fulcrum.llm.spec_verify import target_probs, verify_greedy, verify_sampled

CPU = torch.device("cpu")
# Below this p-value a chi-square test fails; at 1e-4 a correct sampler fails about once in
# 10,000 runs, and the seeds are fixed, so a run is reproducible.
P_VALUE_FLOOR = 1e-4


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> LoadedLLM:
    directory: Path = tmp_path_factory.mktemp("models")
    return load_checkpoint(directory / build_tiny_llama(directory) / "1")


def _one_hot_logits(targets: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(targets), vocab)
    logits[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    return logits


def test_greedy_accepts_the_prefix_equal_to_the_argmax_then_the_models_token() -> None:
    logits = _one_hot_logits([3, 4, 5, 6])
    assert verify_greedy(logits, [3, 4, 5]) == [3, 4, 5, 6]  # all accepted, plus the bonus
    assert verify_greedy(logits, [3, 7, 5]) == [3, 4]  # the 2nd rejected: the model's 4
    assert verify_greedy(logits, [1, 4, 5]) == [3]
    assert verify_greedy(logits[:1], []) == [3]


def _seq(prompt: list[int], sampling: SamplingParams, block_table: list[int]) -> Sequence:
    seq = Sequence(0, prompt, sampling, arrival_s=0.0)
    seq.block_table = block_table
    return seq


def _model_probs(model: LoadedLLM, tokens: list[int], sampling: SamplingParams) -> torch.Tensor:
    """The target probabilities at each of the last len(tokens) - 8 positions of `tokens`."""
    runner = ModelRunner(model.model, block_size=4, num_kv_blocks=8, device=CPU)
    seq = _seq(tokens, sampling, list(range(8)))
    with torch.inference_mode():
        meta = build_metadata([len(tokens)], [len(tokens)], [seq.block_table], 4, CPU)
        ids = torch.tensor(tokens)
        hidden = runner.model(ids, torch.arange(len(tokens)), meta, runner.kv_caches)
        logits = runner.model.compute_logits(hidden[8:])
    return target_probs(logits, sampling)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert int(counts[~keep].sum()) == 0, "drew a token of probability 0"
    kept = probs[keep].double()
    expected = kept / kept.sum() * float(counts.sum())
    return float(stats.chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue)


def test_rejection_sampling_keeps_the_target_distribution(tiny_llama: LoadedLLM) -> None:
    # top_k 4 at temperature 1.3: four tokens per position, enough draws per cell.
    sampling = SamplingParams(temperature=1.3, top_k=4)
    tokens = [
        int(t) for t in torch.randint(2, 300, (10,), generator=torch.Generator().manual_seed(5))
    ]
    probs = _model_probs(tiny_llama, tokens, sampling)  # positions 8 and 9: p0, p1
    vocab = probs.shape[1]
    # Draft a token of middling probability at position 0, so both branches run often.
    ranked = torch.argsort(probs[0], descending=True)
    draft = int(ranked[1])
    assert 0.05 < float(probs[0, draft]) < 0.95
    first = torch.zeros(vocab, dtype=torch.int64)
    second = torch.zeros(vocab, dtype=torch.int64)  # after an accepted draft: drawn from p1
    generator = torch.Generator().manual_seed(0)
    for _ in range(12_000):
        out = verify_sampled(probs, [draft], generator)
        first[out[0]] += 1
        if out[0] == draft:
            assert len(out) == 2
            second[out[1]] += 1
        else:
            assert len(out) == 1
    assert _chi_square(first, probs[0]) > P_VALUE_FLOOR
    assert _chi_square(second, probs[1]) > P_VALUE_FLOOR


def test_rejection_test_detects_a_biased_sampler(tiny_llama: LoadedLLM) -> None:
    # The statistic has power: always accepting the draft (a wrong verifier) is caught.
    sampling = SamplingParams(temperature=1.3, top_k=4)
    tokens = [
        int(t) for t in torch.randint(2, 300, (10,), generator=torch.Generator().manual_seed(5))
    ]
    probs = _model_probs(tiny_llama, tokens, sampling)
    draft = int(torch.argsort(probs[0], descending=True)[1])
    generator = torch.Generator().manual_seed(0)
    biased = torch.zeros(probs.shape[1], dtype=torch.int64)
    for _ in range(2_000):  # accept with sqrt(p): more often than p
        accept = float(torch.rand(1, generator=generator)) < float(probs[0, draft]) ** 0.5
        biased[draft if accept else int(torch.multinomial(probs[0], 1, generator=generator))] += 1
    assert _chi_square(biased, probs[0]) < P_VALUE_FLOOR


def test_target_probs_follow_temperature_and_top_k() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = target_probs(logits, SamplingParams(temperature=0.5, top_k=2))
    expected = torch.softmax(torch.tensor([4.0, 2.0]), -1)
    torch.testing.assert_close(probs[0, :2], expected)
    assert probs[0, 2:].tolist() == [0.0, 0.0]


def test_runner_scores_last_token_and_drafts_as_plain_decodes_would(tiny_llama: LoadedLLM) -> None:
    gen = torch.Generator().manual_seed(3)
    prompt = [int(t) for t in torch.randint(2, 300, (9,), generator=gen)]
    greedy = SamplingParams(temperature=0.0)
    # Reference: decode token by token without drafts.
    plain = ModelRunner(tiny_llama.model, block_size=4, num_kv_blocks=8, device=CPU)
    seq = _seq(prompt, greedy, [0, 1, 2, 3])
    batch = ScheduledBatch(seqs=[seq], num_new_tokens=[len(prompt)])
    for _ in range(4):
        (token,) = plain.run(batch)
        assert isinstance(token, int)
        seq.num_computed_tokens = seq.num_tokens
        seq.append_token(token)
        batch = ScheduledBatch(seqs=[seq], num_new_tokens=[1])
    expected = seq.output_token_ids  # 4 tokens
    # Speculative: prefill, then the first token plus drafts = the next two true tokens and a
    # wrong third: two accepted, then the model's own third.
    runner = ModelRunner(tiny_llama.model, block_size=4, num_kv_blocks=8, device=CPU)
    spec = _seq(prompt, greedy, [5, 0, 6, 2])
    (first,) = runner.run(ScheduledBatch(seqs=[spec], num_new_tokens=[len(prompt)]))
    assert first == expected[0]
    spec.num_computed_tokens = spec.num_tokens
    spec.append_token(first)
    wrong = (expected[3] + 1) % 300
    spec.spec_token_ids = [expected[1], expected[2], wrong]
    (kept,) = runner.run(ScheduledBatch(seqs=[spec], num_new_tokens=[4]))
    assert kept == expected[1:4]
