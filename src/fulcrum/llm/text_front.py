"""The engine's text side: prompts and chat messages to token ids and ids back to text, with the
model's tokenizer and compiled chat template. Pure and thread-safe enough for the event loop to
call (tokenizers releases the GIL); the engine inherits it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fulcrum.errors import InvalidInput
from fulcrum.llm.chat import DEFAULT_OPTIONS, ChatOptions

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from fulcrum.llm.chat import ChatTemplate


class TextFrontEnd:
    """Encoding and decoding for one model."""

    def __init__(self, tokenizer: Tokenizer, chat: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        self.chat = chat

    def encode(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's BOS/EOS unless told otherwise)."""
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids)

    def apply_chat_template(
        self, messages: list[dict[str, str]], options: ChatOptions = DEFAULT_OPTIONS
    ) -> str:
        """The prompt text for chat messages."""
        return self.chat.render(messages, options)

    def encode_chat(
        self, messages: list[dict[str, str]], options: ChatOptions = DEFAULT_OPTIONS
    ) -> list[int]:
        """Token ids of chat messages, as transformers' apply_chat_template(tokenize=True)."""
        # A checkpoint's template renders its own special tokens (BOS included): adding the
        # tokenizer's as well would double them (vLLM and transformers encode without them).
        # The role-tagged default renders none, so the tokenizer's are kept there.
        text = self.chat.render(messages, options)
        add = options.add_special_tokens
        if add is None:
            add = not self.chat.renders_special_tokens(options)
        return self.encode(text, add_special_tokens=add)

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """The text of token ids (vLLM's /detokenize keeps special tokens)."""
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= self.tokenizer.get_vocab_size()):
            raise InvalidInput(
                f"tokens: ids must lie in 0..{self.tokenizer.get_vocab_size() - 1}", param="tokens"
            )
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The vocabulary entry of each id (transformers' convert_ids_to_tokens)."""
        return [self.tokenizer.id_to_token(i) or "" for i in token_ids]

    def _encode_plain(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=False)
