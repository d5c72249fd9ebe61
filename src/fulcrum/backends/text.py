"""Text front end: a BYTES input tensor to int64 token tensors, padded to the batch's longest row.

Padding to the longest row (not a fixed length) matters: an encoder's cost grows with the padded
length, so a batch of short sentences stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fulcrum.config import Tokenizer
from fulcrum.errors import ConfigError, InvalidInput
from fulcrum.types import Array, TensorMap

if TYPE_CHECKING:
    import tokenizers


class TextFrontEnd:
    """Tokenizes rows of text with a `tokenizer.json` (Hugging Face `tokenizers`)."""

    def __init__(self, spec: Tokenizer, version_dir: Path) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        if spec.max_length < 1:
            raise ConfigError(f"key 'tokenizer.max_length' = {spec.max_length}: must be >= 1")
        path = version_dir / spec.file
        if not path.is_file():
            raise ConfigError(f"key 'tokenizer.file' = {spec.file!r}: no such file {path}")
        try:
            tokenizer = HfTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on a malformed file
            raise ConfigError(f"{path}: cannot load tokenizer: {exc}") from exc
        self.spec = spec
        self.tokenizer = _configure(tokenizer, spec.max_length)

    @property
    def output_names(self) -> list[str]:
        """The token tensors `encode` returns, in the order a positional model takes them."""
        names = [self.spec.ids, self.spec.mask]
        return [*names, self.spec.type_ids] if self.spec.type_ids else names

    def encode(self, texts: Array) -> TensorMap:
        """Rows of UTF-8 bytes or str (shape [N] or [N, 1]) -> int64 tensors of shape [N, T]."""
        rows = _decode_rows(self.spec.input, texts)
        # encode_batch runs in Rust on its own thread pool and releases the GIL.
        encodings = self.tokenizer.encode_batch(rows)
        shape = (len(encodings), len(encodings[0].ids) if encodings else 0)  # (N, T)
        out: TensorMap = {
            self.spec.ids: _stack([e.ids for e in encodings], shape),
            self.spec.mask: _stack([e.attention_mask for e in encodings], shape),
        }
        if self.spec.type_ids:
            out[self.spec.type_ids] = _stack([e.type_ids for e in encodings], shape)
        return out


def _configure(tokenizer: tokenizers.Tokenizer, max_length: int) -> tokenizers.Tokenizer:
    # Keep the file's pad token but drop its fixed length: pad to the longest row in the batch.
    padding = tokenizer.padding or {}
    tokenizer.enable_padding(
        pad_id=int(padding.get("pad_id", 0)),
        pad_type_id=int(padding.get("pad_type_id", 0)),
        pad_token=str(padding.get("pad_token", "[PAD]")),
        length=None,
    )
    tokenizer.enable_truncation(max_length=max_length)
    return tokenizer


def _stack(rows: list[list[int]], shape: tuple[int, int]) -> Array:
    return np.array(rows, dtype=np.int64).reshape(shape)


def _decode_rows(name: str, texts: Array) -> list[str]:
    if texts.ndim == 2 and texts.shape[1] == 1:
        texts = texts[:, 0]
    if texts.ndim != 1:
        raise InvalidInput(
            f"input {name!r}: expected shape [N] or [N, 1] of text, got {list(texts.shape)}"
        )
    rows: list[str] = []
    for i, item in enumerate(texts.tolist()):
        if isinstance(item, str):
            rows.append(item)
        elif isinstance(item, bytes | bytearray):
            try:
                rows.append(bytes(item).decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise InvalidInput(f"input {name!r} row {i}: not valid UTF-8 ({exc})") from exc
        else:
            raise InvalidInput(f"input {name!r} row {i}: expected text, got {type(item).__name__}")
    return rows
