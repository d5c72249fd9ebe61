"""The service's generative side: an LLM engine as a repository servable, loaded off the event
loop, and prompts prepared (bounded, tokenised) before they are admitted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fulcrum.cache.llm_semantic import ChatSource, CompletionSource, PromptSource
from fulcrum.errors import DeadlineExceeded, PayloadTooLarge
from fulcrum.extras import require_extra
from fulcrum.llm.chat import DEFAULT_OPTIONS, ChatOptions

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from fulcrum.config import ModelConfig
    from fulcrum.context import RequestContext
    from fulcrum.llm.engine import AsyncLLMEngine
    from fulcrum.llm.outputs import RequestOutput
    from fulcrum.llm.sampling_params import SamplingParams

# Tokenising a long text takes milliseconds per 100 KB: past this, do it off the event loop.
LARGE_PROMPT_CHARS = 16 * 1024
# No tokenizer in use has tokens longer than this many bytes on average over a prompt, so a
# prompt this many bytes per token of context past max_model_len cannot fit, and is refused
# before the tokenizer (which holds the GIL) spends seconds on it.
MAX_PROMPT_BYTES_PER_TOKEN = 32


class LLMServable:
    """Adapts an `AsyncLLMEngine` to the repository's `Servable`."""

    def __init__(self, engine: AsyncLLMEngine, variant: str = "default") -> None:
        self.engine = engine
        self.variant = variant

    @classmethod
    async def load(
        cls,
        config: ModelConfig,
        version: int,
        version_dir: Path,
        registry: CollectorRegistry,
        variant: str = "default",
    ) -> LLMServable:
        """Build the engine (weights, KV pool, kernels) on a worker thread, so every other model
        and the health probes keep being served during a load or a hot reload."""
        require_extra("llm", feature=f"serving '{config.name}' (platform 'llm')")
        engine = await asyncio.to_thread(
            _build_engine, config, version_dir, version, variant, registry
        )
        await engine.start()
        return cls(engine, variant)

    @property
    def is_ready(self) -> bool:
        return bool(self.engine.is_healthy)

    @property
    def num_admitted(self) -> int:
        """Requests admitted and not finished: while any runs, the model is not unloaded."""
        return self.engine.num_streams

    @property
    def child_pids(self) -> tuple[int, ...]:
        """Processes holding this model's weights (its engine process), for the memory budget."""
        return self.engine.child_pids

    async def stop(self) -> None:
        await self.engine.stop()


def _build_engine(
    config: ModelConfig,
    version_dir: Path,
    version: int,
    variant: str,
    registry: CollectorRegistry,
) -> AsyncLLMEngine:
    # The first import loads torch (about a second): on this worker thread, not the loop.
    from fulcrum.llm.engine import AsyncLLMEngine

    return AsyncLLMEngine.from_config(
        config, version_dir, version=version, variant=variant, registry=registry
    )


@dataclass(frozen=True, slots=True)
class LLMCall:
    """A prompt tokenised for one engine, ready to be admitted."""

    model: str
    version: int
    token_ids: list[int]
    max_model_len: int
    engine: AsyncLLMEngine
    source: PromptSource | None = None  # what the prompt was made from (the semantic cache)

    # The HTTP layer reaches the engine only through the service: these are what it needs.
    def decode(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens kept."""
        return self.engine.decode(token_ids)

    def decode_token(self, token_id: int) -> str:
        """One token's text (never raises: a top alternative may be a padding id)."""
        return self.engine.decode_token(token_id)

    @property
    def tool_call_parser(self) -> str:
        """The model's tool-call parser name ("" for none): how tool_choice "auto" reads it."""
        return self.engine.engine.params.tool_call_parser


def _check_prompt_size(texts: list[str], engine: AsyncLLMEngine, max_bytes: int) -> None:
    limit = min(max_bytes, engine.max_model_len * MAX_PROMPT_BYTES_PER_TOKEN)
    size = 0
    for text in texts:
        # len() counts characters, never more than bytes: a cheap first test on huge texts.
        size += len(text) if len(text) > limit else len(text.encode("utf-8", "replace"))
        if size > limit:
            raise PayloadTooLarge(
                f"prompt of more than {limit} bytes: the model's context is "
                f"{engine.max_model_len} tokens (limit: min(max_prompt_bytes, "
                f"{MAX_PROMPT_BYTES_PER_TOKEN} bytes per token of context))"
            )


async def prepare_prompt(
    servable: LLMServable,
    name: str,
    version: int,
    prompt: str | list[int],
    max_bytes: int,
    *,
    add_special_tokens: bool = True,
) -> LLMCall:
    engine = servable.engine
    if isinstance(prompt, str):
        _check_prompt_size([prompt], engine, max_bytes)
        if len(prompt) > LARGE_PROMPT_CHARS:
            token_ids = await asyncio.to_thread(
                engine.encode, prompt, add_special_tokens=add_special_tokens
            )
        else:
            token_ids = engine.encode(prompt, add_special_tokens=add_special_tokens)
    else:
        token_ids = list(prompt)
    # Token ids have no text the semantic cache could compare.
    text = prompt if isinstance(prompt, str) else None
    source = None if text is None else CompletionSource(text, add_special_tokens, len(token_ids))
    return LLMCall(name, version, token_ids, engine.max_model_len, engine, source)


async def prepare_chat(
    servable: LLMServable,
    name: str,
    version: int,
    messages: list[dict[str, str]],
    max_bytes: int,
    options: ChatOptions = DEFAULT_OPTIONS,
) -> LLMCall:
    engine = servable.engine
    texts = [m["content"] for m in messages] + options.extra_texts()
    _check_prompt_size(texts, engine, max_bytes)
    # A request's own template may take up to its render budget: never on the event loop.
    large = sum(len(text) for text in texts) > LARGE_PROMPT_CHARS
    if large or options.request_template is not None:
        token_ids = await asyncio.to_thread(engine.encode_chat, messages, options)
    else:
        token_ids = engine.encode_chat(messages, options)
    source = ChatSource(messages, options, len(token_ids))
    return LLMCall(name, version, token_ids, engine.max_model_len, engine, source)


def generate(
    ctx: RequestContext,
    call: LLMCall,
    sampling: SamplingParams,
    *,
    request_id: str,
    priority: int,
    cache_salt: str | None,
) -> AsyncIterator[RequestOutput]:
    left_s = ctx.remaining_s(time.monotonic())
    stream = call.engine.generate(
        call.token_ids, sampling, request_id=request_id, priority=priority, cache_salt=cache_salt
    )
    return stream if left_s is None else _bounded(stream, left_s, ctx.request_id)


async def _bounded(
    stream: AsyncIterator[RequestOutput], left_s: float, request_id: str
) -> AsyncIterator[RequestOutput]:
    """The stream until the deadline; then the request is aborted (the stream closed) with 504."""
    deadline_s = time.monotonic() + left_s
    iterator = aiter(stream)
    try:
        while True:
            try:
                async with asyncio.timeout_at(_loop_time(deadline_s)):
                    output = await anext(iterator)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise DeadlineExceeded(f"request {request_id} passed its deadline") from None
            yield output
    finally:
        await iterator.aclose()  # type: ignore[attr-defined]


def _loop_time(deadline_s: float) -> float:
    """A time.monotonic() deadline on the running loop's clock."""
    return asyncio.get_running_loop().time() + (deadline_s - time.monotonic())
