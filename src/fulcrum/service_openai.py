"""OpenAI requests as engine requests: SamplingParams from a completions or chat body (vLLM's
meanings and defaults), the choices a request fans out to (batched prompts times n, each child
seeded seed + index as vLLM does), prompt truncation, and the children's streams merged."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fulcrum.errors import InvalidInput
from fulcrum.llm.sampling_params import MAX_SEED, MIN_SEED, SamplingParams
from fulcrum.protocol.openai import ChatCompletionRequest, CompletionRequest
from fulcrum.protocol.openai_structured import structured_request

if TYPE_CHECKING:
    from fulcrum.llm.outputs import RequestOutput
    from fulcrum.protocol.openai import _Request
    from fulcrum.service_llm import LLMCall

# Starts one choice: (call, its sampling, its engine request id) -> its stream, admitted now.
StartChoice = Callable[["LLMCall", SamplingParams, str], AsyncIterator["RequestOutput"]]

# Each choice is a sequence in the engine: bound what one request may ask for.
MAX_N = 32
MAX_PROMPTS = 64
MAX_CHOICES = 128


@dataclass(frozen=True, slots=True)
class ChoiceOutput:
    """One engine output of the choice it belongs to (OpenAI's choice index)."""

    index: int
    output: RequestOutput


def num_choices_per_prompt(request: _Request) -> int:
    """n, checked (best_of, when set, must equal it: vLLM no longer implements best_of > n)."""
    n = 1 if request.n is None else request.n
    if not 1 <= n <= MAX_N:
        raise InvalidInput(f"n: must be an integer in 1..{MAX_N}, got {n}")
    if isinstance(request, CompletionRequest) and request.best_of not in (None, n):
        raise InvalidInput(
            f"best_of: only best_of = n ({n}) is supported (vLLM removed best_of > n), "
            f"got {request.best_of}"
        )
    return n


def _logit_bias(request: _Request) -> tuple[tuple[int, float], ...]:
    pairs: list[tuple[int, float]] = []
    for key, bias in (request.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidInput(f"logit_bias: keys must be token ids, got {key!r}") from None
        pairs.append((token_id, bias))
    return tuple(pairs)


def _logprobs(request: _Request) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        if not request.logprobs:
            return None
        return request.top_logprobs or 0
    if isinstance(request, CompletionRequest):
        return request.logprobs
    return None


def _prompt_logprobs(request: _Request) -> int | None:
    # vLLM: echo with logprobs scores the echoed prompt with the same number of alternatives.
    if request.prompt_logprobs is not None:
        return request.prompt_logprobs
    if isinstance(request, CompletionRequest) and request.echo:
        return request.logprobs
    return None


def sampling_params(request: _Request, max_tokens: int) -> SamplingParams:
    """SamplingParams for a request (OpenAI defaults: temperature 1, top_p 1), validated."""
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    allowed = request.allowed_token_ids
    structured = structured_request(request)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_k=request.top_k or 0,
        top_p=1.0 if request.top_p is None else request.top_p,
        min_p=request.min_p or 0.0,
        seed=request.seed,
        stop=stop,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=bool(request.ignore_eos),
        min_tokens=request.min_tokens or 0,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0
        if request.repetition_penalty is None
        else request.repetition_penalty,
        logit_bias=_logit_bias(request),
        allowed_token_ids=None if allowed is None else tuple(allowed),
        bad_words=tuple(request.bad_words or ()),
        logprobs=_logprobs(request),
        prompt_logprobs=_prompt_logprobs(request),
        include_stop_str_in_output=bool(request.include_stop_str_in_output),
        skip_special_tokens=request.skip_special_tokens is not False,
        spaces_between_special_tokens=request.spaces_between_special_tokens is not False,
        structured=None if structured is None else structured.spec,
    )
    params.validate()
    return params


async def prepare_structured(
    call: LLMCall, request: _Request, sampling: SamplingParams, field: str | None = None
) -> None:
    """Compile the request's structured-output grammar off the event loop before admission
    (InvalidInput naming `field`, by default the request field it came from, for an invalid
    one); a no-op without one."""
    if sampling.structured is None:
        return
    if field is None:
        found = structured_request(request)
        field = "structured" if found is None else found.field  # None: set by tool calling
    await call.engine.prepare_structured(sampling.structured, field)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n choices: a seeded request's children draw from seed + i (vLLM), so each
    is reproducible and they differ from one another."""
    if params.seed is None or index == 0:
        return params
    span = MAX_SEED - MIN_SEED + 1  # wrap within the range torch accepts
    seed = (params.seed + index - MIN_SEED) % span + MIN_SEED
    return dataclasses.replace(params, seed=seed)


def truncate_prompt(token_ids: list[int], truncate: int | None, max_model_len: int) -> list[int]:
    """The last `truncate` prompt tokens (vLLM's truncate_prompt_tokens; -1: the context)."""
    if truncate is None:
        return token_ids
    if truncate == -1:
        truncate = max_model_len
    if truncate < 1:
        raise InvalidInput(f"truncate_prompt_tokens: must be >= 1 or -1, got {truncate}")
    if truncate > max_model_len:
        raise InvalidInput(
            f"truncate_prompt_tokens: {truncate} exceeds max_model_len ({max_model_len})"
        )
    return token_ids[-truncate:]


def truncated(call: LLMCall, truncate: int | None) -> LLMCall:
    """The call with its prompt cut to its last `truncate` tokens (see truncate_prompt)."""
    token_ids = truncate_prompt(call.token_ids, truncate, call.max_model_len)
    return call if token_ids is call.token_ids else dataclasses.replace(call, token_ids=token_ids)


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: a string, token ids, or a list of either."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(_is_token(t) for t in prompt):
        return [list(prompt)]
    if prompt and all(isinstance(p, str) for p in prompt):
        prompts: list[str | list[int]] = list(prompt)
    elif prompt and all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise InvalidInput(
            "prompt: expected a string, a list of token ids, or a list of strings or of token "
            "id lists"
        )
    if len(prompts) > MAX_PROMPTS:
        raise InvalidInput(f"prompt: at most {MAX_PROMPTS} prompts, got {len(prompts)}")
    return prompts


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_num_choices(num_prompts: int, n: int) -> None:
    """Bound the sequences one request starts."""
    if num_prompts * n > MAX_CHOICES:
        raise InvalidInput(
            f"n: {num_prompts} prompts x n={n} choices exceeds {MAX_CHOICES} per request"
        )


async def merge_choices(
    streams: list[AsyncIterator[RequestOutput]], abort: Callable[[], None]
) -> AsyncGenerator[ChoiceOutput, None]:
    """The outputs of every choice as they come, tagged with the choice index; one failing
    stream fails the merge, and a merge closed early aborts every choice (`abort`)."""
    queue: asyncio.Queue[ChoiceOutput | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait(ChoiceOutput(index, output))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    completed = False
    try:
        num_open = len(tasks)
        while num_open:
            item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
        completed = True
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not completed:  # a stream never started cannot abort its own request
            abort()


def admit_choices(
    start: StartChoice, calls: list[LLMCall], sampling: SamplingParams, n: int, request_id: str
) -> AsyncGenerator[ChoiceOutput, None]:
    """Admit n choices of each prompt (errors raise here, and the siblings already admitted
    are aborted) and merge their streams; choice i of prompt p has index p * n + i."""
    num = len(calls) * n
    ids = [request_id if num == 1 else f"{request_id}-{i}" for i in range(num)]
    streams: list[AsyncIterator[RequestOutput]] = []

    def abort(count: int) -> None:
        for i in range(count):
            calls[i // n].engine.abort(ids[i])

    try:
        for i, choice_id in enumerate(ids):
            streams.append(start(calls[i // n], child_params(sampling, i % n), choice_id))
    except BaseException:
        abort(len(streams))  # nobody will read them
        raise
    return merge_choices(streams, lambda: abort(num))
