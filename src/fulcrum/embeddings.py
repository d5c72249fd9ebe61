"""How a batch model with a text input answers OpenAI's embeddings API: which input takes the text,
which output is the vector, how texts become its input tensor, and how tokens are counted."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fulcrum.config import ModelConfig
from fulcrum.errors import InvalidInput
from fulcrum.types import Array, TensorMap

_FLOAT_TYPES = ("FP16", "FP32", "FP64", "BF16")
_PREFERRED_OUTPUTS = ("embedding", "embeddings", "sentence_embedding", "pooler_output")


@dataclass(frozen=True, slots=True)
class EmbeddingSpec:
    """The text input and vector output of a model that can serve embeddings."""

    text_input: str
    row_shape: tuple[int, ...]  # the text input's per-row shape, ones only: (), (1,) ...
    output: str | None  # None: the model's only output (the config declares none)


def embedding_spec(config: ModelConfig) -> EmbeddingSpec:
    """The model's text input and vector output, or InvalidInput saying why it has none."""
    texts = [s for s in config.inputs if s.datatype == "BYTES" and not s.optional]
    others = [s for s in config.inputs if s not in texts and not s.optional]
    if len(texts) != 1 or others or any(d not in (1, -1) for d in texts[0].shape):
        raise InvalidInput(
            f"model {config.name!r} cannot serve embeddings: it needs exactly one required text "
            "(BYTES) input of one element per row"
        )
    return EmbeddingSpec(
        text_input=texts[0].name,
        row_shape=tuple(1 for _ in texts[0].shape),
        output=_vector_output(config),
    )


def _vector_output(config: ModelConfig) -> str | None:
    floats = [s.name for s in config.outputs if s.datatype in _FLOAT_TYPES]
    if not config.outputs:
        return None
    if len(floats) == 1:
        return floats[0]
    preferred = [n for n in _PREFERRED_OUTPUTS if n in floats]
    if preferred:
        return preferred[0]
    raise InvalidInput(
        f"model {config.name!r} cannot serve embeddings: no single floating-point output "
        f"(it has {[s.name for s in config.outputs]})"
    )


def text_tensor(spec: EmbeddingSpec, texts: list[str], *, batched: bool) -> Array:
    """The texts as the model's BYTES input: rows of UTF-8 bytes, shaped per the config."""
    data = np.empty(len(texts), dtype=object)
    data[:] = [t.encode("utf-8") for t in texts]
    if not batched:  # no batch axis: one text is the whole input
        return data.reshape(spec.row_shape)
    return data.reshape((len(texts), *spec.row_shape))


def vectors(
    spec: EmbeddingSpec, outputs: list[TensorMap], *, num_texts: int, dimensions: int | None
) -> Array:
    """The vector output of each chunk's result as one (texts, dim) float32 matrix;
    `dimensions` must equal dim when given."""
    parts = [_vector_of(spec, out) for out in outputs]
    stacked = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    matrix = np.asarray(stacked, dtype=np.float32).reshape(num_texts, -1)
    if dimensions is not None and dimensions != matrix.shape[1]:
        raise InvalidInput(
            f"dimensions: the model's embeddings have {matrix.shape[1]} dimensions, "
            f"got {dimensions} (shortening is not supported)"
        )
    return matrix


def _vector_of(spec: EmbeddingSpec, outputs: TensorMap) -> Array:
    if spec.output is not None:
        return outputs[spec.output]
    if len(outputs) != 1:
        raise InvalidInput("the model cannot serve embeddings: it returns several outputs")
    return next(iter(outputs.values()))


def encode_vectors(matrix: Array, encoding_format: str) -> list[list[float]] | list[str]:
    """Floats, or base64 of each row's little-endian float32 bytes (OpenAI's base64 format)."""
    if encoding_format == "base64":
        rows = np.ascontiguousarray(matrix, dtype="<f4")
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
    return [[float(x) for x in row] for row in matrix.tolist()]


class TokenCounter:
    """Counts the tokens the model sees (after its truncation), for `usage.prompt_tokens`."""

    def __init__(self, config: ModelConfig, version_dir: Path) -> None:
        from fulcrum.backends.text import TextFrontEnd

        self._front = TextFrontEnd(config.tokenizer, version_dir) if config.tokenizer else None

    def count(self, texts: list[str]) -> int:
        """Tokens over all texts; 0 when the model has no `[tokenizer]` front end to count with."""
        if self._front is None:
            return 0
        encodings = self._front.tokenizer.encode_batch(texts)
        return sum(sum(e.attention_mask) for e in encodings)
