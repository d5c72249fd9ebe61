"""The semantic tier for generations with a fake semantic lookup: which requests may use it, what
their scope holds (and leaves out), the answer's fit and usage, and faults (a failing embedder,
a huge text, an option JSON cannot hold) that make misses, never failed requests."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fulcrum.cache.codec import CachedGeneration
from fulcrum.cache.key import load_identity
from fulcrum.cache.llm import GenerationPlan, plan_generation
from fulcrum.cache.llm_semantic import (
    LARGE_CONTEXT_CHARS,
    MAX_SEMANTIC_CHARS,
    ChatSource,
    CompletionSource,
    PromptSource,
    fits,
)
from fulcrum.cache.memory_store import MemoryStore
from fulcrum.cache.settings import CacheSettings
from fulcrum.cache.tiered import ModelCache
from fulcrum.llm.chat import ChatOptions
from fulcrum.llm.outputs import RequestOutput, Usage
from fulcrum.llm.sampling_params import SamplingParams

IDENTITY = load_identity("tiny", 1, "default", b"files")
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
MAX_MODEL_LEN = 64


class FakeSemantic:
    """A semantic tier where every text of a scope is a paraphrase of every other: a lookup
    answers the scope's latest key; `fail` makes it raise, `reason` makes it refuse."""

    def __init__(self) -> None:
        self.entries: dict[bytes, list[tuple[str, bytes]]] = {}
        self.lookups: list[tuple[bytes, str]] = []
        self.fail = False
        self.reason: str | None = None

    async def lookup(self, scope: bytes, text: str) -> tuple[bytes | None, str | None]:
        self.lookups.append((scope, text))
        if self.fail:
            raise ConnectionError("the embedder is not served")
        if self.reason is not None:
            return None, self.reason
        found = self.entries.get(scope)
        return (found[-1][1], None) if found else (None, None)

    async def insert(self, scope: bytes, text: str, key: bytes) -> None:
        if self.fail:
            raise ConnectionError("the embedder is not served")
        self.entries.setdefault(scope, []).append((text, key))


def model_cache(**settings: Any) -> tuple[ModelCache, FakeSemantic]:
    semantic = FakeSemantic()
    chosen = CacheSettings(semantic=True, **settings)
    return ModelCache("tiny", chosen, MemoryStore(1 << 20), semantic), semantic


def chat(
    text: str, *earlier: str, options: ChatOptions | None = None, num_tokens: int = 10
) -> ChatSource:
    roles = ["user", "assistant"]
    turns = [*earlier, text]
    messages = [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    return ChatSource(messages, options or ChatOptions(), num_tokens)


async def plan(
    cache: ModelCache,
    source: PromptSource | None,
    sampling: SamplingParams = GREEDY,
    *,
    tenant: str = "default",
    salt: str | None = None,
    num_tokens: int | None = None,  # the prompt's (default: as the source was prepared)
) -> GenerationPlan:
    if num_tokens is None:
        num_tokens = 10 if source is None else source.num_tokens
    # The prompt's tokens follow from what it was made from, as a tokenizer's would.
    digest = hashlib.blake2b(repr(source).encode(), digest_size=num_tokens).digest()
    token_ids = list(digest)
    return await plan_generation(
        cache, IDENTITY, tenant, token_ids, sampling, cache_salt=salt, source=source,
        max_model_len=MAX_MODEL_LEN,
    )  # fmt: skip


def engine(pieces: list[str], finish: str = "length") -> Any:
    """A live generation of one token per piece."""

    async def stream() -> AsyncIterator[RequestOutput]:
        for i, text in enumerate(pieces):
            reason = finish if i == len(pieces) - 1 else None
            yield RequestOutput("live", [100 + i], text, reason, Usage(10, i + 1, 0))

    return stream


async def drain(outputs: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [o async for o in outputs]


async def run(
    cache: ModelCache, source: PromptSource | None, pieces: list[str], **kwargs: Any
) -> tuple[str, list[RequestOutput]]:
    """Plan and answer one request; its status and outputs."""
    chosen = await plan(cache, source, **kwargs)
    sampling = kwargs.get("sampling", GREEDY)
    finish = "length" if len(pieces) == sampling.max_tokens else "stop"
    return chosen.status, await drain(chosen.open(engine(pieces, finish), "r"))


async def test_a_paraphrase_is_answered_with_its_own_prompt_tokens() -> None:
    cache, _ = model_cache()
    status, live = await run(cache, chat("How do I reset it?"), ["a", "b", "c", "d"])
    assert status == "miss"
    status, hit = await run(cache, chat("How can I reset it?", num_tokens=13), ["x"] * 4)
    assert status == "semantic"
    assert [o.new_text for o in hit] == [o.new_text for o in live]
    assert hit[-1].usage == Usage(13, 4, 13)  # this prompt's tokens, the cached completion
    assert cache.stats.hits["semantic"] == 1 and cache.stats.misses == 1


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"source": chat("q", "hello", "hi")}, {"source": chat("q", "bye", "hi")}),
        ({"source": chat("q")}, {"source": chat("q", "hello", "hi")}),
        (
            {"source": chat("q")},
            {"source": chat("q", options=ChatOptions(add_generation_prompt=False))},
        ),
        ({"tenant": "acme"}, {"tenant": "globex"}),
        ({"salt": "a"}, {"salt": "b"}),
        ({}, {"sampling": SamplingParams(max_tokens=4, temperature=0.0, top_k=5)}),
        ({"source": CompletionSource("q", True, 10)}, {"source": CompletionSource("q", False, 10)}),
        ({"source": CompletionSource("q", True, 10)}, {}),
    ],
)
async def test_what_decides_the_answer_separates_scopes(
    first: dict[str, Any], second: dict[str, Any]
) -> None:
    cache, _ = model_cache()
    first.setdefault("source", chat("q"))
    second.setdefault("source", chat("q"))
    assert (await run(cache, pieces=["a"] * 4, **first))[0] == "miss"
    assert (await run(cache, pieces=["a"] * 4, **second))[0] == "miss"


async def test_the_seed_of_a_greedy_request_and_max_tokens_stay_out_of_the_scope() -> None:
    cache, _ = model_cache()
    await run(cache, chat("q"), ["a", "b"], sampling=SamplingParams(max_tokens=4, temperature=0.0))
    longer = SamplingParams(max_tokens=8, temperature=0.0, seed=3)  # it stopped at 2 tokens
    assert (await run(cache, chat("q2"), ["x"], sampling=longer))[0] == "semantic"


async def test_a_seeded_draw_hits_only_with_its_own_seed() -> None:
    cache, _ = model_cache()
    seeded = SamplingParams(max_tokens=4, temperature=0.8, seed=1)
    await run(cache, chat("q"), ["a"] * 4, sampling=seeded)
    other_seed = SamplingParams(max_tokens=4, temperature=0.8, seed=2)
    assert (await run(cache, chat("q2"), ["b"] * 4, sampling=other_seed))[0] == "miss"
    assert (await run(cache, chat("q3"), ["c"] * 4, sampling=seeded))[0] == "semantic"


async def test_sampled_requests_need_semantic_sampled() -> None:
    sampled = SamplingParams(max_tokens=4, temperature=0.8)
    cache, semantic = model_cache()
    for text in ("q", "q2"):
        assert (await run(cache, chat(text), ["a"] * 4, sampling=sampled))[0] == "miss"
    assert semantic.lookups == [] and cache.stats.uncacheable == 2
    allowing, _ = model_cache(semantic_sampled=True)
    await run(allowing, chat("q"), ["a"] * 4, sampling=sampled)
    reseeded = SamplingParams(max_tokens=4, temperature=0.8, seed=9)  # any seed, any draw
    assert (await run(allowing, chat("q2"), ["b"] * 4, sampling=reseeded))[0] == "semantic"
    assert (await run(allowing, chat("q3"), ["c"] * 4, sampling=sampled))[0] == "semantic"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sampling": SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)},
        {"sampling": SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1)},
        {"source": chat("q" * (MAX_SEMANTIC_CHARS + 1))},  # matched exactly only, never cut
        {"source": chat("   ")},
        {"source": chat("q"), "num_tokens": 9},  # truncated: no longer the text's prompt
        {"sampling": SamplingParams(max_tokens=MAX_MODEL_LEN, temperature=0.0)},  # refused live
        {"source": ChatSource([{"role": "system", "content": "q"}], ChatOptions(), 10)},
        {"source": None},  # token ids: no text
        {"source": chat("q", options=ChatOptions(chat_template_kwargs={"x": object()}))},
    ],
)
async def test_requests_the_tier_cannot_take_are_never_looked_up(kwargs: dict[str, Any]) -> None:
    cache, semantic = model_cache()
    kwargs.setdefault("source", chat("q"))
    chosen = await plan(cache, **kwargs)
    assert chosen.status == "miss" and semantic.lookups == []
    await drain(chosen.open(engine(["a"]), "r"))
    assert semantic.entries == {}


async def test_a_failing_embedder_is_a_miss_counted_and_nothing_is_indexed() -> None:
    cache, semantic = model_cache()
    semantic.fail = True
    status, outputs = await run(cache, chat("q"), ["a", "b", "c", "d"])
    assert status == "miss" and [o.new_text for o in outputs] == ["a", "b", "c", "d"]
    assert cache.stats.semantic_errors == 1  # the lookup's; the insert was not tried
    assert (await run(cache, chat("q"), ["z"] * 4))[0] == "exact"  # stored all the same


async def test_an_insert_failure_is_counted_not_raised() -> None:
    cache, semantic = model_cache()
    chosen = await plan(cache, chat("q"))
    semantic.fail = True
    assert len(await drain(chosen.open(engine(["a"] * 4), "r"))) == 4
    assert cache.stats.semantic_errors == 1


async def test_verifier_rejections_are_counted_by_reason() -> None:
    cache, semantic = model_cache()
    await run(cache, chat("q"), ["a"] * 4)
    semantic.reason = "order"
    assert (await run(cache, chat("q2"), ["b"] * 4))[0] == "miss"
    assert dict(cache.stats.rejections) == {"order": 1}


async def test_an_answer_that_would_not_fit_max_tokens_is_refused() -> None:
    cache, _ = model_cache()
    await run(cache, chat("q"), ["a"] * 4)  # cut at max_tokens = 4
    longer = SamplingParams(max_tokens=6, temperature=0.0)
    assert (await run(cache, chat("q2"), ["b"] * 6, sampling=longer))[0] == "miss"
    assert cache.stats.rejections["max_tokens"] == 1


def test_fits_a_cut_answer_only_at_its_length_and_a_stopped_one_within_budget() -> None:
    cut = CachedGeneration(["a", "b"], [[1], [2]], "length", 5, 0.1)
    stopped = CachedGeneration(["a", "b"], [[1], [2]], "stop", 5, 0.1)
    assert fits(cut, 2) and not fits(cut, 3) and not fits(cut, 1)
    assert fits(stopped, 2) and fits(stopped, 9) and not fits(stopped, 1)


async def test_a_large_conversation_is_scoped_like_a_small_one() -> None:
    cache, _ = model_cache()
    history = "x" * (LARGE_CONTEXT_CHARS + 1)  # hashed on a worker thread
    await run(cache, chat("q", history, "ok"), ["a"] * 4)
    assert (await run(cache, chat("q2", history, "ok"), ["b"] * 4))[0] == "semantic"
    assert (await run(cache, chat("q2", history + "y", "ok"), ["b"] * 4))[0] == "miss"


async def test_exact_off_still_answers_paraphrases() -> None:
    cache, _ = model_cache(exact=False)
    await run(cache, chat("q"), ["a"] * 4)
    assert (await run(cache, chat("q"), ["b"] * 4))[0] == "semantic"


async def test_concurrent_paraphrases_each_get_the_cached_answer() -> None:
    cache, _ = model_cache()
    await run(cache, chat("q"), ["a", "b", "c", "d"])
    answers = await asyncio.gather(*(run(cache, chat(f"q{i}"), ["z"] * 4) for i in range(16)))
    assert {status for status, _ in answers} == {"semantic"}
    assert {"".join(o.new_text for o in outputs) for _, outputs in answers} == {"abcd"}
    assert cache.stats.hits["semantic"] == 16


async def test_a_sampled_miss_is_stored_only_when_it_can_be_indexed() -> None:
    cache, semantic = model_cache(semantic_sampled=True)
    sampled = SamplingParams(max_tokens=4, temperature=0.8)
    semantic.fail = True  # nothing could ever reach the entry: it is not stored
    await run(cache, chat("q"), ["a"] * 4, sampling=sampled)
    assert cache.exact.store.stats().entries == 0
    semantic.fail = False
    await run(cache, chat("q"), ["a"] * 4, sampling=sampled)
    assert cache.exact.store.stats().entries == 1 and len(semantic.entries) == 1
