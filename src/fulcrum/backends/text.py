"""Text front end: a BYTES input tensor to int64 token tensors, padded to the batch's longest row.

Padding to the longest row (not a fixed length) matters: an encoder's cost grows with the padded
length, so a batch of short sentences stays cheap. Each row is cut to a bounded prefix before it
is tokenized, so a huge text costs no more instance time than a long sentence.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, AnyStr

import numpy as np

from fulcrum.config import Tokenizer
from fulcrum.errors import ConfigError, InvalidInput
from fulcrum.protocol.validation import text_column
from fulcrum.types import Array, TensorMap

if TYPE_CHECKING:
    import tokenizers

# Bytes of text kept per token of `max_length` (the prefix a row is cut to before tokenizing).
# Natural text needs ~4-6 UTF-8 bytes per WordPiece or BPE token in English and ~3 in Chinese or
# Japanese (a 3-byte character per token); 64 leaves a tenfold margin, so the first max_length
# tokens of any ordinary text come from well inside the prefix and are unchanged. Only text whose
# tokens are sparser still (runs of whitespace, or words past WordPiece's 100 characters, which
# become one [UNK]) keeps fewer tokens than before: a bounded cost is worth that.
MAX_BYTES_PER_TOKEN = 64
_WHITESPACE = (" ", "\t", "\n", "\r")
_WHITESPACE_BYTES = tuple(w.encode() for w in _WHITESPACE)


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
        self.max_row_bytes = spec.max_length * MAX_BYTES_PER_TOKEN

    @property
    def output_names(self) -> list[str]:
        """The token tensors `encode` returns, in the order a positional model takes them."""
        names = [self.spec.ids, self.spec.mask]
        return [*names, self.spec.type_ids] if self.spec.type_ids else names

    def encode(self, texts: Array) -> TensorMap:
        """Rows of UTF-8 bytes or str (shape [N] or [N, 1]) -> int64 tensors of shape [N, T]."""
        rows = _decode_rows(self.spec.input, texts, self.max_row_bytes)
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


def _decode_rows(name: str, texts: Array, max_row_bytes: int) -> list[str]:
    rows: list[str] = []
    for i, item in enumerate(text_column(name, texts).tolist()):
        if isinstance(item, str):
            rows.append(cut_text(item, max_row_bytes))
        elif isinstance(item, bytes | bytearray):
            try:
                rows.append(cut_text(bytes(item), max_row_bytes).decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise InvalidInput(f"input {name!r} row {i}: not valid UTF-8 ({exc})") from exc
        else:
            raise InvalidInput(f"input {name!r} row {i}: expected text, got {type(item).__name__}")
    return rows


def cut_text(text: AnyStr, max_len: int) -> AnyStr:
    """`text` itself when it has at most `max_len` units (bytes or characters); else its
    prefix up to the last whitespace in the second half of that limit, so no word is split, or,
    without one, up to the limit (for bytes, at a UTF-8 character boundary)."""
    if len(text) <= max_len:
        return text
    seps = _WHITESPACE_BYTES if isinstance(text, bytes) else _WHITESPACE
    end = max(text.rfind(sep, max_len // 2, max_len + 1) for sep in seps)
    if end < 0:
        end = max_len
        if isinstance(text, bytes):
            while end > 0 and text[end] & 0xC0 == 0x80:  # a continuation byte: mid-character
                end -= 1
    return text[:end]
