"""The semantic tier for generations (OpenAI completions and chat): after an exact miss, the
request's text (a completion's prompt, a chat's last user message) is looked up among finished
generations of the same scope: load, tenant, `cache_salt`, sampling fields but the seed, chat
options and the rest of the conversation. A verified candidate answers with this request's
prompt tokens; a generation that finished by itself is indexed under its exact key."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import msgspec

from fulcrum.cache.key import scope_key

if TYPE_CHECKING:
    from fulcrum.cache.codec import CachedGeneration
    from fulcrum.cache.key import LoadIdentity
    from fulcrum.cache.tiered import ModelCache
    from fulcrum.llm.chat import ChatOptions
    from fulcrum.llm.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Longer texts are matched exactly only, never cut: MiniLM reads its first 256 tokens (about
# 1000 characters of English), so two longer texts differing past that would embed alike, and
# the verifier would read a megabyte prompt on the event loop. A question is shorter than this.
MAX_SEMANTIC_CHARS = 1024
# Past this many characters of conversation the scope is hashed on a worker thread.
LARGE_CONTEXT_CHARS = 16 * 1024
# The rejection counted when the verified candidate's answer does not fit this request's
# max_tokens (max_tokens is not in the scope: a chat without one gets what its context leaves,
# which differs between paraphrases of different lengths).
MAX_TOKENS_REASON = "max_tokens"
# Checked against the candidate's answer instead (see above).
_OUT_OF_SCOPE = frozenset({"max_tokens"})


@dataclass(frozen=True, slots=True)
class CompletionSource:
    """A completion prompt the request gave as text."""

    text: str
    add_special_tokens: bool
    num_tokens: int  # the prompt's tokens as prepared: a truncated prompt has fewer

    @property
    def num_chars(self) -> int:
        return len(self.text)

    def query(self) -> tuple[str, dict[str, object]] | None:
        """The text compared and what else decides the answer (part of the scope)."""
        return self.text, {"kind": "completion", "add_special_tokens": self.add_special_tokens}


@dataclass(frozen=True, slots=True)
class ChatSource:
    """Chat messages and the request's template options (held, not copied: nothing is computed
    unless the model has a semantic tier)."""

    messages: Sequence[Mapping[str, str]]
    options: ChatOptions
    num_tokens: int

    @property
    def num_chars(self) -> int:
        texts = [m.get("content", "") for m in self.messages] + self.options.extra_texts()
        return sum(len(t) for t in texts)

    def query(self) -> tuple[str, dict[str, object]] | None:
        """The last user message, and the rest of the conversation with the options as scope:
        a paraphrase of the last turn may hit, another conversation never does."""
        last = _last_user(self.messages)
        if last is None:
            return None
        message = self.messages[last]
        options = {f.name: getattr(self.options, f.name) for f in fields(self.options)}
        context: dict[str, object] = {
            "kind": "chat",
            "before": [dict(m) for m in self.messages[:last]],
            "user": {k: v for k, v in message.items() if k != "content"},  # its name, if any
            "after": [dict(m) for m in self.messages[last + 1 :]],  # a prefill to continue
            "options": options,
        }
        return message.get("content", ""), context


PromptSource = CompletionSource | ChatSource


def _last_user(messages: Sequence[Mapping[str, str]]) -> int | None:
    for i in reversed(range(len(messages))):
        if messages[i].get("role") == "user":
            return i
    return None


@dataclass(frozen=True, slots=True)
class SemanticSlot:
    """Where one generation is looked up and, once finished, indexed."""

    scope: bytes
    text: str


@dataclass(frozen=True, slots=True)
class SemanticOutcome:
    """A lookup's answer: a verified generation (with this request's prompt tokens), and
    whether the live generation should be indexed (not when the embedder just failed)."""

    generation: CachedGeneration | None
    index: bool = True


def semantic_cacheable(sampling: SamplingParams, *, sampled: bool) -> bool:
    """Greedy or seeded requests; sampled ones only with `semantic_sampled`. Log probabilities
    are not kept, so requests asking for them never hit."""
    if sampling.logprobs is not None or sampling.prompt_logprobs is not None:
        return False
    return sampling.is_greedy or sampling.seed is not None or sampled


def _eligible(
    cache: ModelCache,
    source: PromptSource,
    num_tokens: int,
    sampling: SamplingParams,
    max_model_len: int,
) -> bool:
    if cache.semantic is None:
        return False
    if not semantic_cacheable(sampling, sampled=cache.settings.semantic_sampled):
        return False
    # A truncated prompt no longer matches its text; one the engine would refuse (prompt and
    # max_tokens past the context) must be refused live, not answered from the cache.
    return source.num_tokens == num_tokens and num_tokens + sampling.max_tokens <= max_model_len


async def semantic_slot(
    cache: ModelCache,
    identity: LoadIdentity,
    tenant: str,
    source: PromptSource | None,
    token_ids: Sequence[int],
    sampling: SamplingParams,
    *,
    salt: str,
    max_model_len: int,
) -> SemanticSlot | None:
    """The request's place in the model's semantic tier; None when it may not use it."""
    if source is None or not _eligible(cache, source, len(token_ids), sampling, max_model_len):
        return None
    query = source.query()
    if query is None:
        return None
    text, context = query
    if not text.strip() or len(text) > MAX_SEMANTIC_CHARS:
        return None
    # The seed is left out when it cannot matter (greedy) or the model allows sampled hits; a
    # seeded draw otherwise stays reproducible: another seed is another draw.
    keep_seed = not sampling.is_greedy and not cache.settings.semantic_sampled
    params = {"context": context, "salt": salt, "sampling": _sampling(sampling, keep_seed)}
    try:
        if source.num_chars > LARGE_CONTEXT_CHARS:
            scope = await asyncio.to_thread(scope_key, identity, tenant, params)
        else:
            scope = scope_key(identity, tenant, params)
    except (TypeError, msgspec.EncodeError):  # an option value JSON cannot hold: exact only
        return None
    return SemanticSlot(scope, text)


def _sampling(sampling: SamplingParams, keep_seed: bool) -> dict[str, object]:
    out = {
        f.name: getattr(sampling, f.name) for f in fields(sampling) if f.name not in _OUT_OF_SCOPE
    }
    if not keep_seed:
        del out["seed"]
    return out


async def semantic_hit(
    cache: ModelCache, slot: SemanticSlot, sampling: SamplingParams, num_prompt_tokens: int
) -> SemanticOutcome:
    """The verified cached generation for `slot`, counted in the model's statistics (hits are
    counted by the caller, as for the exact tier); a failing embedder or index is a miss."""
    semantic = cache.semantic
    if semantic is None:
        return SemanticOutcome(None, index=False)
    try:
        key, reason = await semantic.lookup(slot.scope, slot.text)
    except Exception:  # the embedder model is unloaded or failing: a miss, never an error
        cache.stats.semantic_errors += 1
        log.warning("cache of %s: semantic lookup failed", cache.model, exc_info=True)
        return SemanticOutcome(None, index=False)
    if key is None:
        if reason is not None:
            cache.stats.rejections[reason] += 1
        return SemanticOutcome(None)
    generation = await cache.exact.get_generation(key)
    if generation is None:  # indexed, but the value expired or was evicted
        return SemanticOutcome(None)
    if not fits(generation, sampling.max_tokens):
        cache.stats.rejections[MAX_TOKENS_REASON] += 1
        return SemanticOutcome(None)
    return SemanticOutcome(dataclasses.replace(generation, prompt_tokens=num_prompt_tokens))


def fits(generation: CachedGeneration, max_tokens: int) -> bool:
    """Whether this request would have ended where the cached one did: cut at the same length,
    or stopped within this request's max_tokens."""
    num_tokens = sum(len(ids) for ids in generation.token_ids)
    if generation.finish_reason == "length":
        return num_tokens == max_tokens
    return num_tokens <= max_tokens


async def index_generation(cache: ModelCache, slot: SemanticSlot, key: bytes) -> None:
    """Index a stored generation's text under its exact key; a failure is counted, not raised."""
    if cache.semantic is None:
        return
    try:
        await cache.semantic.insert(slot.scope, slot.text, key)
    except Exception:
        cache.stats.semantic_errors += 1
        log.warning("cache of %s: semantic insert failed", cache.model, exc_info=True)
