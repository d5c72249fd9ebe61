"""The exact tier and a model's tiers together: results round-trip through bytes; a corrupt,
foreign or hostile value is a miss, never an exception or an object; errors are never stored;
a large value is not cached; the semantic tier's answers and refusals are counted."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import numpy as np
import pytest

from fulcrum.batcher import InferResult
from fulcrum.cache.codec import (
    MAGIC,
    CachedGeneration,
    decode_generation,
    decode_result,
    encode_generation,
    encode_result,
)
from fulcrum.cache.exact import ExactTier
from fulcrum.cache.key import load_identity
from fulcrum.cache.llm import plan_generation
from fulcrum.cache.memory_store import MemoryStore
from fulcrum.cache.settings import CacheSettings
from fulcrum.cache.tiered import CachedResult, CacheRequest, ModelCache
from fulcrum.errors import ModelError
from fulcrum.llm.outputs import RequestOutput, Usage
from fulcrum.llm.sampling_params import SamplingParams

KEY = b"k" * 32
RESULT = InferResult(
    {
        "y": np.arange(6, dtype=np.float32).reshape(2, 3),
        "ids": np.array([[1], [2]], dtype=">i8"),
        "text": np.array([[b"a"], [b"\xff\x00"]], dtype=object),
    },
    queue_s=0.001,
    compute_s=0.25,
    batch_size=4,
)


def test_a_result_round_trips() -> None:
    decoded = decode_result(KEY, encode_result(KEY, RESULT))
    assert decoded is not None
    result, saved_s = decoded
    assert saved_s == 0.25 and (result.queue_s, result.compute_s, result.batch_size) == (0, 0, 0)
    assert set(result.outputs) == {"y", "ids", "text"}
    np.testing.assert_array_equal(result.outputs["y"], RESULT.outputs["y"])
    np.testing.assert_array_equal(result.outputs["ids"], [[1], [2]])
    assert result.outputs["text"].tolist() == [[b"a"], [b"\xff\x00"]]
    result.outputs["y"][0, 0] = 9.0  # the caller owns a writable copy


class _Hostile(msgspec.Struct, array_like=True, tag="r"):
    key: bytes
    compute_s: float
    tensors: list[list[object]]


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"garbage",
        MAGIC + b"\xc1\xc1",  # not msgpack
        encode_result(KEY, RESULT)[:-5],  # truncated
        encode_result(b"o" * 32, RESULT),  # stored under another key
        b"\x80\x04\x95" + encode_result(KEY, RESULT),  # a pickle header in front
        MAGIC + msgspec.msgpack.encode(_Hostile(KEY, 0.0, [["y", "|O", [1], b"12345678", []]])),
        MAGIC + msgspec.msgpack.encode(_Hostile(KEY, 0.0, [["y", "<f4", [3], b"1234", []]])),
        MAGIC + msgspec.msgpack.encode(_Hostile(KEY, 0.0, [["y", "<f4", [-1], b"", []]])),
        MAGIC + msgspec.msgpack.encode(_Hostile(KEY, 0.0, [["y", "nonsense", [1], b"1", []]])),
        MAGIC + msgspec.msgpack.encode(_Hostile(KEY, 0.0, [["t", "bytes", [1 << 40], b"", []]])),
        MAGIC + msgspec.msgpack.encode(_Hostile(KEY, 0.0, [["y", "<f4", [1] * 40, b"1234", []]])),
    ],
)
def test_a_bad_value_is_a_miss(value: bytes) -> None:
    assert decode_result(KEY, value) is None


def test_a_generation_round_trips_and_a_result_is_not_a_generation() -> None:
    gen = CachedGeneration(["Hel", "lo"], [[1], [2, 3]], "length", 4, 0.5)
    assert decode_generation(KEY, encode_generation(KEY, gen)) == gen
    assert decode_generation(KEY, encode_result(KEY, RESULT)) is None
    assert decode_result(KEY, encode_generation(KEY, gen)) is None
    assert decode_generation(b"o" * 32, encode_generation(KEY, gen)) is None


def settings(**kw: object) -> CacheSettings:
    return CacheSettings(**kw)  # type: ignore[arg-type]


async def test_a_value_over_an_eighth_of_the_budget_is_not_cached() -> None:
    budget = 64 * 1024
    tier = ExactTier(MemoryStore(budget), settings(max_bytes=budget))
    small = InferResult({"y": np.zeros(100, np.float32)}, 0, 0, 1)
    large = InferResult({"y": np.zeros(budget // 8 // 4 + 1, np.float32)}, 0, 0, 1)
    assert await tier.put_result(b"s" * 32, small)
    assert not await tier.put_result(b"l" * 32, large)
    assert await tier.get_result(b"l" * 32) is None
    assert await tier.get_result(b"s" * 32) is not None
    assert tier.num_too_large == 1


class Model:
    """A computation that counts its calls and fails when told."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    async def __call__(self) -> InferResult:
        self.calls += 1
        if self.fail:
            raise ModelError("boom")
        return RESULT


async def test_a_miss_computes_and_stores_and_the_next_request_hits() -> None:
    cache = ModelCache("m", settings(), MemoryStore(1 << 20))
    model = Model()
    first = await cache.run(CacheRequest(KEY), model)
    second = await cache.run(CacheRequest(KEY), model)
    assert model.calls == 1
    assert isinstance(first, CachedResult) and first.cache == "miss"
    assert second.cache == "exact" and second.cache_s >= 0
    np.testing.assert_array_equal(second.outputs["y"], RESULT.outputs["y"])
    assert cache.stats.misses == 1 and cache.stats.hits["exact"] == 1
    assert cache.stats.saved_s["exact"] == pytest.approx(0.25)
    assert cache.to_json()["tiers"]["exact"]["entries"] == 1  # type: ignore[index]


async def test_errors_are_never_cached() -> None:
    cache = ModelCache("m", settings(), MemoryStore(1 << 20))
    with pytest.raises(ModelError):
        await cache.run(CacheRequest(KEY), Model(fail=True))
    model = Model()
    result = await cache.run(CacheRequest(KEY), model)
    assert model.calls == 1 and result.cache == "miss"
    assert cache.exact.store.stats().entries == 1


class BrokenStore(MemoryStore):
    async def get(self, key: bytes) -> bytes | None:
        return b"FCv1 not what you think"


async def test_a_corrupt_stored_value_is_a_miss_not_a_failure() -> None:
    cache = ModelCache("m", settings(), BrokenStore(1 << 20))
    model = Model()
    assert (await cache.run(CacheRequest(KEY), model)).cache == "miss"
    assert model.calls == 1


class FakeSemantic:
    """Answers `text` with `key` when told to; otherwise refuses with `reason`."""

    def __init__(self, answer: bytes | None, reason: str | None = None, fail: bool = False):
        self.answer, self.reason, self.fail = answer, reason, fail
        self.inserted: list[tuple[bytes, str, bytes]] = []

    async def lookup(self, scope: bytes, text: str) -> tuple[bytes | None, str | None]:
        if self.fail:
            raise RuntimeError("embedder unloaded")
        return self.answer, self.reason

    async def insert(self, scope: bytes, text: str, key: bytes) -> None:
        self.inserted.append((scope, text, key))


async def test_the_semantic_tier_answers_with_a_stored_result() -> None:
    semantic = FakeSemantic(answer=KEY)
    cache = ModelCache("m", settings(semantic=True), MemoryStore(1 << 20), semantic)
    model = Model()
    await cache.run(CacheRequest(KEY, b"scope", "what is 2+2"), model)
    assert semantic.inserted == [(b"scope", "what is 2+2", KEY)]
    other = await cache.run(CacheRequest(b"o" * 32, b"scope", "whats 2 + 2"), model)
    assert other.cache == "semantic" and model.calls == 1
    assert cache.stats.hits["semantic"] == 1


async def test_semantic_refusals_are_counted_by_reason_and_faults_are_misses() -> None:
    refusing = FakeSemantic(answer=None, reason="negation")
    cache = ModelCache("m", settings(semantic=True), MemoryStore(1 << 20), refusing)
    assert (await cache.run(CacheRequest(KEY, b"s", "is it safe"), Model())).cache == "miss"
    assert dict(cache.stats.rejections) == {"negation": 1}
    failing = FakeSemantic(answer=None, fail=True)
    cache = ModelCache("m", settings(semantic=True), MemoryStore(1 << 20), failing)
    assert (await cache.run(CacheRequest(KEY, b"s", "hello"), Model())).cache == "miss"
    assert cache.stats.semantic_errors == 1


async def test_without_the_exact_tier_only_the_semantic_tier_answers() -> None:
    semantic = FakeSemantic(answer=None)
    cache = ModelCache("m", settings(exact=False, semantic=True), MemoryStore(1 << 20), semantic)
    model = Model()
    await cache.run(CacheRequest(KEY, b"s", "t"), model)
    await cache.run(CacheRequest(KEY, b"s", "t"), model)
    assert model.calls == 2


# --- generations (the LLM exact tier) ----------------------------------------------------------

IDENTITY = load_identity("tiny", 1, "default", b"")
PROMPT = [5, 6, 7]


class Engine:
    """Streams `pieces` then `finish`; counts the generations it started."""

    def __init__(self, finish: str = "length") -> None:
        self.started = 0
        self.finish = finish

    def start(self) -> AsyncIterator[RequestOutput]:
        self.started += 1
        return self._stream()

    async def _stream(self) -> AsyncIterator[RequestOutput]:
        pieces = [("Hel", [1]), ("lo", [2, 3]), ("!", [4])]
        done = 0
        for i, (text, ids) in enumerate(pieces):
            done += len(ids)
            reason = self.finish if i == len(pieces) - 1 else None
            yield RequestOutput("live", ids, text, reason, Usage(len(PROMPT), done, 0))


async def drain(stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [output async for output in stream]


async def generate(
    cache: ModelCache, engine: Engine, sampling: SamplingParams
) -> tuple[str, list[RequestOutput]]:
    plan = await plan_generation(cache, IDENTITY, "acme", PROMPT, sampling, cache_salt=None)
    return plan.status, await drain(plan.open(engine.start, "req-2"))


GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


async def test_a_finished_generation_replays_in_its_pieces_with_its_usage() -> None:
    cache, engine = ModelCache("tiny", settings(), MemoryStore(1 << 20)), Engine()
    status, live = await generate(cache, engine, GREEDY)
    assert status == "miss" and engine.started == 1
    status, replayed = await generate(cache, engine, GREEDY)
    assert status == "exact" and engine.started == 1
    assert [(o.new_text, o.new_token_ids, o.finish_reason) for o in replayed] == [
        (o.new_text, o.new_token_ids, o.finish_reason) for o in live
    ]
    assert [o.usage.completion_tokens for o in replayed] == [1, 3, 4]
    assert replayed[-1].usage.prompt_tokens == 3 and replayed[-1].usage.cached_tokens == 3
    assert {o.request_id for o in replayed} == {"req-2"}


async def test_aborted_or_failed_generations_are_never_cached() -> None:
    for finish in ("abort", "error"):
        cache, engine = ModelCache("tiny", settings(), MemoryStore(1 << 20)), Engine(finish)
        await generate(cache, engine, GREEDY)
        assert (await generate(cache, engine, GREEDY))[0] == "miss" and engine.started == 2
    cache, engine = ModelCache("tiny", settings(), MemoryStore(1 << 20)), Engine()
    plan = await plan_generation(cache, IDENTITY, "acme", PROMPT, GREEDY, cache_salt=None)
    stream = plan.open(engine.start, "r")
    await anext(stream)  # the client goes away after the first piece
    await stream.aclose()  # type: ignore[attr-defined]
    assert (await generate(cache, engine, GREEDY))[0] == "miss"


async def test_only_greedy_or_seeded_generations_without_logprobs_are_cached() -> None:
    cases = [
        (SamplingParams(max_tokens=4, temperature=1.0), False),
        (SamplingParams(max_tokens=4, temperature=1.0, seed=3), True),
        (SamplingParams(max_tokens=4, temperature=0.0, logprobs=2), False),
        (SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1), False),
    ]
    for sampling, cacheable in cases:
        cache, engine = ModelCache("tiny", settings(), MemoryStore(1 << 20)), Engine()
        await generate(cache, engine, sampling)
        status, _ = await generate(cache, engine, sampling)
        assert (status == "exact") is cacheable, sampling
        assert cache.stats.uncacheable == (0 if cacheable else 2)
