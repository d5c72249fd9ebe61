"""Structured output with llguidance: each StructuredSpec compiled once for the model's tokenizer
(a bounded cache of compiled matchers, copied per sequence), one matcher per sequence, a step's
token masks filled on a worker thread while the model runs, and each sampled token accepted."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import torch

from fulcrum.errors import InvalidInput, ModelError
from fulcrum.llm.structured_spec import StructuredSpec, check_spec

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions
    from tokenizers import Tokenizer

    from fulcrum.llm.sampler import SampledToken
    from fulcrum.llm.sequence import Sequence as Seq

# Compiled grammars kept (a matcher holds its lexer: tens of KB to a few MB each).
MAX_CACHED_GRAMMARS = 128
# A grammar that takes longer than this to compile is refused; llguidance's own limits (lexer
# fuel, grammar size) bound the work, this bounds the wait.
COMPILE_TIMEOUT_S = 10.0
# Compiles run here, never on the event loop or the engine thread; two bound the cores they take.
NUM_COMPILE_THREADS = 2
# Compact JSON: with free whitespace a sampled model can spend its whole budget on blanks (why
# vLLM has --structured-outputs-config.disable_any_whitespace).
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
_NEG_INF = float("-inf")


class Matcher(Protocol):
    """What the engine uses of an llguidance LLMatcher (a fake satisfies it in tests)."""

    def deep_copy(self) -> Matcher: ...
    def consume_token(self, sampled_token: int) -> bool: ...
    def rollback(self, num_tokens: int) -> bool: ...
    def is_stopped(self) -> bool: ...
    def is_error(self) -> bool: ...
    def get_error(self) -> str: ...


# Writes row i of `bitmask` (R, ceil(V / 32)) int32 with matcher i's allowed tokens (bit set).
MaskFill = Callable[[list[Matcher], np.ndarray], None]
# A compiled template for a spec (InvalidInput naming `field` if it does not compile).
Compile = Callable[[StructuredSpec, str], Matcher]


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar of a spec; ValueError for a source that is not even parseable."""
    import llguidance

    from_json = llguidance.LLMatcher.grammar_from_json_schema
    if spec.kind == "json_schema":
        return from_json(spec.source, defaults=_JSON_OPTIONS)
    if spec.kind == "json_object":
        return from_json('{"type": "object"}', defaults=_JSON_OPTIONS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        choices = json.loads(spec.source)
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise ValueError("expected a non-empty list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices)
        )
    return llguidance.grammar_from("grammar", spec.source)  # Lark, or GBNF converted to Lark


class GrammarCompiler:
    """Compiles specs for one model's tokenizer. Thread-safe: worker threads compile for the
    event loop, the engine thread copies the compiled templates."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer  # serialised for llguidance on the first compile
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredSpec, Matcher] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None

    def compile(self, spec: StructuredSpec, field: str = "structured") -> Matcher:
        """The compiled template of spec (cached); InvalidInput naming `field` with llguidance's
        message for an invalid or unsupported grammar. Copy it (`deep_copy`) to use it."""
        check_spec(spec, field)
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                return template
        template = self._build(spec, field)  # unlocked: a slow compile blocks no other
        with self._lock:
            self._cache[spec] = template
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return template

    async def compile_async(self, spec: StructuredSpec, field: str = "structured") -> None:
        """`compile` on a compile thread, off the event loop; a compile past COMPILE_TIMEOUT_S
        is refused (it finishes in the background, bounded by llguidance's limits)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    NUM_COMPILE_THREADS, thread_name_prefix="fulcrum-grammar"
                )
            executor = self._executor
        work = loop.run_in_executor(executor, self.compile, spec, field)
        try:
            await asyncio.wait_for(work, COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise InvalidInput(
                f"{field}: the {spec.kind} did not compile within {COMPILE_TIMEOUT_S:g} s",
                param=field,
            ) from None

    def _build(self, spec: StructuredSpec, field: str) -> Matcher:
        import llguidance

        try:
            grammar = grammar_text(spec)
        except ValueError as exc:
            raise InvalidInput(f"{field}: invalid {spec.kind}: {exc}", param=field) from None
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidInput(
                f"{field}: invalid {spec.kind}: {matcher.get_error().strip()}", param=field
            )
        return cast("Matcher", matcher)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance view of the model's tokenizer, built on the first compile (cheap for a
        small vocabulary, a fraction of a second for a large one)."""
        import llguidance

        with self._lock:
            if self._ll_tokenizer is None:
                spec = json.loads(self._hf_tokenizer.to_str())
                spec["padding"] = spec["truncation"] = None  # as llguidance.hf does
                self._ll_tokenizer = llguidance.LLTokenizer(
                    json.dumps(spec),
                    n_vocab=self._vocab_size,  # the logits' width: padding ids never allowed
                    eos_token=self._eos_token_ids or None,
                )
            return self._ll_tokenizer


@dataclass(frozen=True, slots=True)
class GrammarMasks:
    """The token masks of one step's constrained rows."""

    rows: list[int]  # rows of the step's sampled logits that follow a grammar
    allowed: torch.Tensor  # (len(rows), V) bool: True where the grammar allows the token

    def select(self, row: int) -> GrammarMasks | None:
        """The mask of one row alone (as row 0), None if it is unconstrained."""
        if row not in self.rows:
            return None
        j = self.rows.index(row)
        return GrammarMasks([0], self.allowed[j : j + 1])


def apply_grammar(logits: torch.Tensor, masks: GrammarMasks) -> torch.Tensor:
    """logits (S, V) with every token its row's grammar forbids at -inf, as a new tensor."""
    out = logits.clone()
    rows = torch.tensor(masks.rows, device=logits.device)
    allowed = masks.allowed[:, : logits.shape[-1]].to(logits.device)
    out[rows] = out[rows].masked_fill(~allowed, _NEG_INF)
    return out


def keep_grammar_tokens(
    processed: torch.Tensor, guided: torch.Tensor, masks: GrammarMasks
) -> torch.Tensor:
    """processed (S, V) where the request's other restrictions (allowed_token_ids, bad_words,
    min_tokens, logit_bias) left a constrained row no token at all: that row is taken from
    `guided` (the grammar alone). The grammar wins, as in vLLM; a row of only -inf would
    otherwise sample garbage (greedy) or NaN (random)."""
    rows = torch.tensor(masks.rows, device=processed.device)
    dead = torch.isneginf(processed[rows]).all(dim=-1)
    if bool(dead.any()):
        processed[rows[dead]] = guided[rows[dead]]
    return processed


def llguidance_fill() -> MaskFill:
    """A MaskFill computing each row with llguidance in turn, without the GIL. Not its parallel
    LLExecutor: a row takes microseconds, and on a few shared cores the executor's pool waited
    for CPU (10 ms per step against 1.3 ms, benchmarks/sampling_features.py)."""
    from llguidance.numpy import fill_next_token_bitmask

    def fill(matchers: list[Matcher], bitmask: np.ndarray) -> None:
        for row, matcher in enumerate(matchers):
            fill_next_token_bitmask(cast("llguidance.LLMatcher", matcher), bitmask, row)

    return fill


@dataclass
class _Tracked:
    matcher: Matcher
    num_consumed: int = 0  # output tokens the matcher has consumed


class PendingMasks:
    """Masks being filled on the worker thread; `result` joins it."""

    def __init__(self, rows: list[int], future: Future[torch.Tensor]) -> None:
        self.rows = rows
        self._future = future

    def result(self) -> GrammarMasks:
        return GrammarMasks(self.rows, self._future.result())

    def wait(self) -> None:
        """Join the fill, whatever it raised (a failed step must not leave it running)."""
        self._future.exception()


class StructuredOutputs:
    """One matcher per structured sequence, kept while the sequence lives. Preemption keeps a
    sequence's tokens (it recomputes them), so its matcher stays as it is; `start_fill` checks
    that the matcher consumed exactly the sequence's output and rolls back or replays otherwise.
    Not thread-safe: the engine thread calls every method."""

    def __init__(
        self, compile_spec: Compile, vocab_size: int, fill: MaskFill | None = None
    ) -> None:
        self._compile = compile_spec
        self._vocab_size = vocab_size
        self._fill_fn = fill
        self._tracked: dict[int, _Tracked] = {}
        self._worker: ThreadPoolExecutor | None = None

    def add(self, seq: Seq) -> None:
        """Give a structured sequence its own matcher (InvalidInput if its grammar fails)."""
        spec = seq.sampling.structured
        if spec is not None:
            self._tracked[seq.seq_id] = _Tracked(self._compile(spec, "structured").deep_copy())

    def release(self, seq_id: int) -> None:
        """Drop a finished, aborted or failed sequence's matcher."""
        self._tracked.pop(seq_id, None)

    def reset(self) -> None:
        """Drop every matcher (the engine forgot its requests)."""
        self._tracked.clear()

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tracked

    def is_complete(self, seq_id: int) -> bool:
        """True once the sequence's grammar can take no further token: it is done."""
        tracked = self._tracked.get(seq_id)
        return tracked is not None and tracked.matcher.is_stopped()

    def start_fill(self, seqs: list[Seq]) -> PendingMasks | None:
        """Start filling the masks of the structured rows of `seqs` (the step's sampled rows, in
        order) on the worker thread; None, at no cost, when no row is structured."""
        rows = [i for i, seq in enumerate(seqs) if seq.seq_id in self._tracked]
        if not rows:
            return None
        matchers = [self._synced(seqs[i]) for i in rows]
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="fulcrum-mask")
        return PendingMasks(rows, self._worker.submit(self._fill, matchers))

    def accept(
        self, seqs: list[Seq], tokens: list[SampledToken | ModelError]
    ) -> list[SampledToken | ModelError]:
        """Advance each structured row's matcher by its sampled token; a token the grammar
        rejects (never, with its mask applied) fails that row alone."""
        out = list(tokens)
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            tracked = self._tracked.get(seq.seq_id)
            if tracked is None or isinstance(token, ModelError):
                continue
            tracked.num_consumed += 1
            if not tracked.matcher.consume_token(token.token_id):
                error = tracked.matcher.get_error()
                out[i] = ModelError(f"structured output: token {token.token_id} rejected: {error}")
        return out

    def _synced(self, seq: Seq) -> Matcher:
        tracked = self._tracked[seq.seq_id]
        output = seq.token_ids[seq.num_prompt_tokens :]
        if tracked.num_consumed > len(output):
            tracked.matcher.rollback(tracked.num_consumed - len(output))
        else:
            for token in output[tracked.num_consumed :]:
                tracked.matcher.consume_token(token)
        tracked.num_consumed = len(output)
        return tracked.matcher

    def _fill(self, matchers: list[Matcher]) -> torch.Tensor:
        """(R, V) bool masks: runs on the worker thread, during the model's forward."""
        if self._fill_fn is None:
            self._fill_fn = llguidance_fill()
        bitmask = np.zeros((len(matchers), (self._vocab_size + 31) // 32), dtype=np.int32)
        self._fill_fn(matchers, bitmask)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits[:, : self._vocab_size].view(np.bool_))
