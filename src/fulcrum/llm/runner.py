"""ModelRunner: turns a ScheduledBatch into tensors, runs the model over the paged KV cache, and
samples a next token for the sequences whose last known token was computed this step; writes the
logprobs a request asked for (of its tokens, and of its prompt) onto its sequence."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from fulcrum.errors import ConfigError, ModelError
from fulcrum.llm.logprobs import token_logprobs
from fulcrum.llm.models import CausalLM, decode_kernel
from fulcrum.llm.models.attention import build_metadata, kv_cache_shape
from fulcrum.llm.sampler import SampledToken, Sampler
from fulcrum.llm.spec_verify import verify_drafts
from fulcrum.llm.step_inputs import step_inputs

if TYPE_CHECKING:
    from fulcrum.llm.models.attention import AttentionMetadata
    from fulcrum.llm.sampling_params import SamplingParams
    from fulcrum.llm.scheduler import ScheduledBatch
    from fulcrum.llm.sequence import Sequence
    from fulcrum.llm.structured import GrammarMasks, PendingMasks, StructuredOutputs

# Prompt positions scored per slice for prompt_logprobs: bounds the (rows, vocabulary) logits.
PROMPT_LOGPROBS_ROWS = 256
# Per sequence of a step: its sampled token, the tokens kept after verifying its drafts, None
# (mid-prefill), or the error of its own row.
Sampled = int | list[int] | ModelError | None


def kv_block_bytes(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * element_bytes


def num_blocks_for_budget(
    model: CausalLM, block_size: int, memory_mb: float, dtype: torch.dtype
) -> int:
    """How many KV blocks fit in `memory_mb` (at least one, or ConfigError)."""
    num_blocks = int(memory_mb * 2**20) // kv_block_bytes(model, block_size, dtype)
    if num_blocks < 1:
        raise ConfigError(f"key 'kv_cache_memory_mb' = {memory_mb}: too small for one KV block")
    return num_blocks


class ModelRunner:
    """Owns the model, its KV block pool and the sampler; `run` executes one scheduled step."""

    def __init__(
        self,
        model: CausalLM,
        *,
        block_size: int,
        num_kv_blocks: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if isinstance(model, torch.nn.Module):
            # The engine's device decides, also for a model loaded elsewhere (`load_checkpoint`
            # loads onto the CPU unless told): it moves once, here, not a tensor per step.
            model.to(device=device)
        self.model = model
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.device = device
        shape = kv_cache_shape(num_kv_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(model.num_layers)
        ]
        self.sampler = Sampler(device)
        # The matchers of structured requests; set by the engine, which owns the tokenizer.
        self.structured: StructuredOutputs | None = None
        # Decodes read the KV pool in place on the CPU (float32); elsewhere gather + SDPA.
        self.in_place_decode = decode_kernel.supported(self.kv_caches[0][0])
        if self.in_place_decode:
            decode_kernel.warm_up()
        # A decode verifying k drafts attends in place too, as k + 1 decode rows (no KV gather);
        # False: as a chunk, through the gather path (kept to measure one against the other).
        self.in_place_verify = self.in_place_decode

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[Sampled]:
        """One forward step; a token id for each sequence that samples, None for the others, a
        ModelError for a sequence whose own row could not be sampled."""
        if batch.is_empty:
            return []
        inputs = step_inputs(batch)
        seqs, query_lens = inputs.seqs, inputs.query_lens
        sample_rows, sampling = inputs.sample_rows, inputs.sampling
        meta = build_metadata(
            query_lens,
            inputs.context_lens,
            [seq.block_table for seq in seqs],
            self.block_size,
            self.device,
            split_chunks=True,
            in_place_decode=self.in_place_decode,
            prompt_lens=[seq.num_prompt_tokens for seq in seqs],  # length-dependent RoPE
            in_place_queries=self._in_place_queries(seqs),
        )
        # Via numpy: torch.tensor converts a Python list element by element, about 4x slower.
        ids = torch.from_numpy(np.array(inputs.input_ids, dtype=np.int64)).to(self.device)
        pos = torch.from_numpy(np.array(inputs.positions, dtype=np.int64)).to(self.device)
        verifying = _split_verifying(batch, sampling, sample_rows)
        # Sample in batch order, so unseeded requests draw from the shared generator as before.
        pairs = sorted(zip(sampling, sample_rows, strict=True))
        sampled_seqs = [batch.seqs[i] for i, _ in pairs]
        pending = self._start_masks(sampled_seqs)
        hidden = self._forward(ids, pos, meta, pending)  # (T, C)
        for seq, first_row, num_new in inputs.scored:
            self._score_prompt(seq, hidden, first_row, num_new)
        sampled: list[Sampled] = [None] * len(batch.seqs)
        self._verify(hidden, batch, verifying, sampled)
        if not sampling:
            return sampled
        rows = torch.from_numpy(np.array([row for _, row in pairs], dtype=np.int64))
        logits = self.model.compute_logits(hidden[rows.to(hidden.device)])  # (S, V)
        tokens = self._sample_structured(logits, sampled_seqs, pending)
        for (index, _), token in zip(pairs, tokens, strict=True):
            if isinstance(token, SampledToken):
                if token.logprob is not None:
                    batch.seqs[index].output_logprobs.append(token.logprob)
                sampled[index] = token.token_id
            else:
                sampled[index] = token
        return sampled

    def _in_place_queries(self, seqs: list[Sequence]) -> int:
        """The longest chunk attended in place: a decode with the step's most drafts."""
        if not self.in_place_verify:
            return 1
        return 1 + max(len(seq.spec_token_ids) for seq in seqs)

    def _verify(
        self,
        hidden: torch.Tensor,
        batch: ScheduledBatch,
        verifying: list[tuple[int, int]],
        sampled: list[Sampled],
    ) -> None:
        """The tokens each drafting sequence keeps (fulcrum.llm.spec_verify), into sampled."""
        if not verifying:
            return
        spans = [(i, first, len(batch.seqs[i].spec_token_ids) + 1) for i, first in verifying]
        rows = [row for _, first, n in spans for row in range(first, first + n)]
        logits = self.model.compute_logits(hidden[rows])  # (sum of k + 1, V)
        offset = 0
        for index, _, n in spans:
            try:
                sampled[index] = verify_drafts(
                    logits[offset : offset + n], batch.seqs[index], self.sampler
                )
            except Exception as exc:  # this row alone, as a failed draw
                sampled[index] = ModelError(f"verifying drafts failed for this request: {exc}")
            offset += n

    def _score_prompt(
        self, seq: Sequence, hidden: torch.Tensor, first_row: int, num_new: int
    ) -> None:
        """Logprobs of the prompt tokens this chunk predicts (position p predicts token p + 1);
        a recomputed chunk (after a preemption) rewrites the same values."""
        assert seq.prompt_logprobs is not None
        start = seq.num_computed_tokens
        end = min(start + num_new, seq.num_prompt_tokens - 1)
        num_top = seq.sampling.prompt_logprobs or 0
        # In slices, so a long chunk never holds (tokens x vocabulary) logits at once.
        for first in range(start, end, PROMPT_LOGPROBS_ROWS):
            last = min(first + PROMPT_LOGPROBS_ROWS, end)
            rows = hidden[first_row + first - start : first_row + last - start]
            targets = seq.token_ids[first + 1 : last + 1]
            found = token_logprobs(self.model.compute_logits(rows), targets, [num_top] * len(rows))
            seq.prompt_logprobs[first + 1 : last + 1] = found

    def _start_masks(self, seqs: list[Sequence]) -> PendingMasks | None:
        return None if self.structured is None else self.structured.start_fill(seqs)

    def _forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        meta: AttentionMetadata,
        pending: PendingMasks | None,
    ) -> torch.Tensor:
        """The model's hidden states (T, C); the grammar masks fill on their worker thread
        meanwhile (llguidance and torch both release the GIL) and are joined here, even when
        the forward fails, so no fill outlives its step."""
        try:
            hidden: torch.Tensor = self.model(ids, pos, meta, self.kv_caches)
        finally:
            if pending is not None:
                pending.wait()
        return hidden

    def _sample_structured(
        self, logits: torch.Tensor, seqs: list[Sequence], pending: PendingMasks | None
    ) -> list[SampledToken | ModelError]:
        """_sample with the grammar masks, then each structured row's matcher advanced."""
        if pending is None or self.structured is None:
            return self._sample(logits, seqs)
        tokens = self._sample(logits, seqs, pending.result())
        return self.structured.accept(seqs, tokens)

    def track(self, seq: Sequence) -> None:
        """Give a new structured sequence its matcher (InvalidInput if its grammar fails)."""
        if self.structured is not None:
            self.structured.add(seq)

    def grammar_complete(self, seq_id: int) -> bool:
        """True once a structured sequence's grammar is complete (it takes no more tokens)."""
        return self.structured is not None and self.structured.is_complete(seq_id)

    def release(self, seq_id: int) -> None:
        """Drop per-request sampler state of a finished or aborted sequence."""
        self.sampler.release(seq_id)
        if self.structured is not None:
            self.structured.release(seq_id)

    def reset(self) -> None:
        """Forget every request's sampler state (after a crash); the KV pool is reused as is:
        a fresh block manager never reads a block before writing it."""
        self.sampler = Sampler(self.device)
        if self.structured is not None:
            self.structured.reset()

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], masks: GrammarMasks | None = None
    ) -> list[SampledToken | ModelError]:
        """logits (S, V) -> a token per row; if the batch fails, each row is drawn alone so only
        the rows that fail on their own get an error (with nothing of another row in it)."""
        params = [seq.sampling for seq in seqs]
        seq_ids = [seq.seq_id for seq in seqs]
        try:
            return self._draw(logits, params, seq_ids, list(seqs), masks)
        except Exception:  # a bad row (NaN logits, say) fails the batched draw; isolate it
            pass
        out: list[SampledToken | ModelError] = []
        for row, seq in enumerate(seqs):
            row_masks = None if masks is None else masks.select(row)
            try:
                out.extend(
                    self._draw(
                        logits[row : row + 1], [seq.sampling], [seq.seq_id], [seq], row_masks
                    )
                )
            except Exception as exc:
                out.append(ModelError(f"sampling failed for this request: {exc}"))
        return out

    def _draw(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seq_ids: list[int],
        seqs: list[Sequence],
        masks: GrammarMasks | None,
    ) -> list[SampledToken | ModelError]:
        # Without masks the sampler is called as before they existed (a sampler may predate them).
        if masks is None:
            return list(self.sampler.sample_tokens(logits, params, seq_ids, list(seqs)))
        return list(self.sampler.sample_tokens(logits, params, seq_ids, list(seqs), masks))


def _split_verifying(
    batch: ScheduledBatch, sampling: list[int], sample_rows: list[int]
) -> list[tuple[int, int]]:
    """Move the sequences with drafts out of (sampling, sample_rows), in place; returned as
    (index into batch.seqs, row of the last token): they are verified, not sampled."""
    verifying = [
        (i, row)
        for i, row in zip(sampling, sample_rows, strict=True)
        if batch.seqs[i].spec_token_ids
    ]
    if verifying:
        kept = [(i, row) for i, row in zip(sampling, sample_rows, strict=True)
                if not batch.seqs[i].spec_token_ids]  # fmt: skip
        sampling[:] = [i for i, _ in kept]
        sample_rows[:] = [row for _, row in kept]
    return verifying
