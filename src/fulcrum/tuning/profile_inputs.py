"""Fixed inputs for `fulcrum profile`: text of an exact token count (checked with the model's own
tokenizer), tensors shaped by the config with -1 dims set to the length, or the caller's samples
tiled or cut to each batch size."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fulcrum.backends.text import TextFrontEnd
from fulcrum.config import ModelConfig, TensorSpec
from fulcrum.errors import InvalidInput
from fulcrum.loadgen.inputs import (
    LengthDist,
    ModelMeta,
    TensorMeta,
    synthetic_inputs,
    synthetic_text,
)
from fulcrum.types import TensorMap

# Distinct texts per length: rows differ (no accidental caching anywhere) at a bounded cost.
NUM_DISTINCT_TEXTS = 8


def text_of_tokens(count: Callable[[str], int], num_tokens: int, rng: np.random.Generator) -> str:
    """Words appended one at a time, keeping only those that do not overshoot, until `count`
    (the tokenizer's token count, special tokens included) is exactly `num_tokens`."""
    words: list[str] = []
    current = count("")
    if num_tokens < current:
        raise InvalidInput(
            f"length {num_tokens}: the tokenizer adds {current} special tokens to any text"
        )
    for _ in range(4 * num_tokens + 64):  # short words fill the last tokens; bound the tries
        if current == num_tokens:
            return " ".join(words)
        candidate = [*words, synthetic_text(1, rng)]
        tokens = count(" ".join(candidate))
        if tokens <= num_tokens:
            words, current = candidate, tokens
    if current == num_tokens:
        return " ".join(words)
    raise InvalidInput(f"cannot build a text of exactly {num_tokens} tokens (got {current})")


def has_dynamic_dims(config: ModelConfig) -> bool:
    """True when some input has a -1 dim besides the batch axis (a length to sweep)."""
    return any(-1 in spec.shape for spec in config.inputs)


class InputMaker:
    """One batch of rows per (batch size, length); texts are built once per length."""

    def __init__(
        self,
        config: ModelConfig,
        front: TextFrontEnd | None,
        *,
        samples: TensorMap | None = None,
        seed: int = 0,
    ) -> None:
        if samples is None and not config.inputs:
            raise InvalidInput(f"model {config.name!r} declares no inputs; give samples")
        if samples is not None and not samples:
            raise InvalidInput("samples: no tensors given")
        self.config = config
        self.front = front
        self.samples = samples
        self.rng = np.random.default_rng(seed)
        self._texts: dict[int, list[bytes]] = {}

    def rows(self, batch_size: int, length: int) -> TensorMap:
        """`batch_size` rows (no batch axis when the model does not batch) at `length`."""
        if self.samples is not None:
            return _tile(self.samples, batch_size, self.config.max_batch_size > 0)
        rows: TensorMap = {}
        others = list(self.config.inputs)
        if self.front is not None:
            spec = self.config.input(self.front.spec.input)
            if spec is not None:
                rows[spec.name] = self._text_column(spec, batch_size, length)
                others.remove(spec)
        if others:
            rows.update(self._tensors(others, batch_size, length))
        return rows

    def _text_column(self, spec: TensorSpec, batch_size: int, length: int) -> np.ndarray:
        pool = self._text_pool(length)
        column = np.array([pool[i % len(pool)] for i in range(batch_size)], dtype=np.object_)
        if self.config.max_batch_size == 0:
            return column[:1].reshape(spec.shape or (1,))
        return column.reshape((batch_size, *[1 for _ in spec.shape]))  # (N,) or (N, 1)

    def _text_pool(self, length: int) -> list[bytes]:
        if length not in self._texts:
            front = self.front
            assert front is not None
            max_length = front.spec.max_length
            if length > max_length:
                raise InvalidInput(
                    f"length {length} tokens exceeds the model's tokenizer.max_length "
                    f"({max_length}): longer text would be cut to {max_length} tokens"
                )

            def count(text: str) -> int:
                return len(front.tokenizer.encode(text).ids)

            self._texts[length] = [
                text_of_tokens(count, length, self.rng).encode() for _ in range(NUM_DISTINCT_TEXTS)
            ]
        return self._texts[length]

    def _tensors(self, specs: list[TensorSpec], batch_size: int, length: int) -> TensorMap:
        batched = self.config.max_batch_size > 0
        size = max(1, length)  # 0: the shapes are fixed; no -1 dim reads it
        metas = [
            TensorMeta(
                spec.name,
                spec.datatype,
                [-1, *spec.shape] if batched else [size if d < 0 else d for d in spec.shape],
            )
            for spec in specs
        ]
        meta = ModelMeta(name=self.config.name, inputs=metas)
        return synthetic_inputs(
            meta,
            num_rows=batch_size if batched else 1,
            lengths=LengthDist(size, size),
            rng=self.rng,
        )


def _tile(samples: TensorMap, batch_size: int, batched: bool) -> TensorMap:
    """The samples' rows repeated (or cut) to `batch_size` rows; for a model that does not
    batch, the first row without its row axis."""
    num_rows = {len(array) if array.ndim else 0 for array in samples.values()}
    if len(num_rows) != 1 or 0 in num_rows:
        raise InvalidInput(
            f"samples: every tensor needs the same number (>= 1) of rows, got {num_rows}"
        )
    if not batched:
        return {name: array[0] for name, array in samples.items()}
    index = np.arange(batch_size) % num_rows.pop()
    return {name: array[index] for name, array in samples.items()}
