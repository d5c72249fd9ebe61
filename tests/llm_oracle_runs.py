"""The LLM oracle tests' shared parts: transformers' greedy reference (cut before near-ties),
random prompts, and how an engine is driven: each prompt alone, or all of them arriving
staggered into one engine (batched, chunked, preempted, prefix-cached)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fulcrum.llm.loader import load_checkpoint
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.sync_engine import LLMEngine

# Below this top-1/top-2 logit gap, float32 rounding differences between two correct
# implementations could flip the argmax; such a position and everything after it is not compared.
NEAR_TIE_MARGIN = 1e-3


class Reference:
    """A saved checkpoint and transformers' greedy continuation of each prompt."""

    def __init__(
        self,
        directory: Path,
        model: Any,
        num_new_tokens: int,
        *,
        before_generate: Callable[[Any], None] | None = None,
    ) -> None:
        self.directory = directory
        self.model = model
        self.num_new_tokens = num_new_tokens
        self._before = before_generate
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def sampling(self) -> SamplingParams:
        """The engine's settings for the same greedy continuation."""
        return SamplingParams(max_tokens=self.num_new_tokens, temperature=0.0, ignore_eos=True)

    def assert_matches(
        self, prompt: list[int], got: list[int], *, min_compared: int | None = None
    ) -> None:
        """The engine's tokens equal transformers' up to the first near-tie, which may cut the
        comparison to `min_compared` tokens (default: none may be cut)."""
        expected = self.greedy(prompt)
        least = self.num_new_tokens if min_compared is None else min_compared
        assert len(expected) >= least, "near-ties cut the comparison short: pick another seed"
        assert got[: len(expected)] == expected
        assert len(got) == self.num_new_tokens

    def greedy(self, prompt: list[int]) -> list[int]:
        """transformers' tokens, cut before the first near-tie."""
        key = tuple(prompt)
        if key not in self._cache:
            if self._before is not None:
                self._before(self.model)
            with torch.no_grad():
                out = self.model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=self.num_new_tokens,
                    do_sample=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                    eos_token_id=None,
                )
            tokens = out.sequences[0, len(prompt) :].tolist()
            for i, scores in enumerate(out.scores):
                top2 = torch.topk(scores[0].float(), 2).values
                if float(top2[0] - top2[1]) < NEAR_TIE_MARGIN:
                    tokens = tokens[:i]
                    break
            self._cache[key] = tokens
        return self._cache[key]


def random_prompts(
    num: int, seed: int, vocab_size: int, *, shared_prefix_len: int = 0
) -> list[list[int]]:
    """`num` prompts of 3-39 random ids (0 and 1 left out), after a shared random prefix."""
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(2, vocab_size, (shared_prefix_len,), generator=generator).tolist()
    prompts = []
    for _ in range(num):
        length = int(torch.randint(3, 40, (1,), generator=generator))
        tail = torch.randint(2, vocab_size, (length,), generator=generator).tolist()
        prompts.append(prefix + tail)
    return prompts


def run_alone(
    engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams
) -> list[list[int]]:
    """Each prompt run to completion before the next is added."""
    out = []
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, sampling)
        tokens: list[int] = []
        while engine.has_unfinished():
            for output in engine.step():
                tokens += output.new_token_ids
        out.append(tokens)
    return out


def run_staggered(
    engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams, *, every: int = 3
) -> list[list[int]]:
    """One request added every `every` steps while the others run."""
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, sampling)
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        step += 1
    return [tokens[str(i)] for i in range(len(prompts))]


# Small blocks and budget for a dozen prompts of up to ~90 tokens: the staggered run chunks the
# longest prompts, preempts (224 token slots) and hits the prefix cache.
STAGGERED = EngineParams(
    block_size=4,
    num_kv_blocks=56,
    max_num_batched_tokens=24,
    max_num_seqs=6,
    enable_prefix_caching=True,
)


def check_staggered(
    directory: Path,
    prompts: list[list[int]],
    sampling: SamplingParams,
    check: Callable[[list[int], list[int]], None],
) -> None:
    """Run `prompts` staggered into one engine over `directory` with STAGGERED's settings and
    `check(prompt, tokens)` each answer; asserts the run really chunked, preempted and hit the
    prefix cache (give some prompts a shared prefix of two full blocks)."""
    engine = LLMEngine(load_checkpoint(directory), STAGGERED)
    assert max(len(p) for p in prompts) > STAGGERED.max_num_batched_tokens
    outputs = run_staggered(engine, prompts, sampling)  # one arrival every third step
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.stats.num_hits > 0
    for prompt, tokens in zip(prompts, outputs, strict=True):
        check(prompt, tokens)
