"""ModelRunner: turns a ScheduledBatch into tensors, runs the model over the paged KV cache, and
samples a next token for the sequences whose last known token was computed this step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fulcrum.errors import ConfigError
from fulcrum.llm.models import CausalLM
from fulcrum.llm.models.attention import build_metadata
from fulcrum.llm.sampler import Sampler

if TYPE_CHECKING:
    from fulcrum.llm.scheduler import ScheduledBatch


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
        self.model = model
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.device = device
        shape = (num_kv_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(model.num_layers)
        ]
        self.sampler = Sampler(device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int | None]:
        """One forward step; a token id for each sequence that samples, None for the others."""
        if batch.is_empty:
            return []
        input_ids: list[int] = []
        positions: list[int] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []  # index into the flat tokens of each sampling seq's last one
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            context_lens.append(end)
            if end == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
        meta = build_metadata(
            list(batch.num_new_tokens),
            context_lens,
            [list(seq.block_table) for seq in batch.seqs],
            self.block_size,
            self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, pos, meta, self.kv_caches)  # (T, C)
        sampling = [s for s, n in zip(batch.seqs, context_lens, strict=True) if n == s.num_tokens]
        if not sampling:
            return [None] * len(batch.seqs)
        logits = self.model.compute_logits(hidden[sample_rows])  # (S, V)
        tokens = iter(
            self.sampler.sample(
                logits, [s.sampling for s in sampling], [s.seq_id for s in sampling]
            )
        )
        return [
            next(tokens) if n == seq.num_tokens else None
            for seq, n in zip(batch.seqs, context_lens, strict=True)
        ]

    def release(self, seq_id: int) -> None:
        """Drop per-request sampler state of a finished or aborted sequence."""
        self.sampler.release(seq_id)
