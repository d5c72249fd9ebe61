"""The event-loop side of an engine's text work: tokenising, chat templates, detokenising and
compiling structured-output grammars, delegated to the engine (`LLMEngine`'s text front) so the
step loop in `AsyncLLMEngine` stays apart from them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fulcrum.llm.chat import DEFAULT_OPTIONS, ChatOptions

if TYPE_CHECKING:
    from fulcrum.llm.engine_front import EngineFront
    from fulcrum.llm.structured_spec import StructuredSpec


class AsyncTextFront:
    """Text methods of `AsyncLLMEngine`, over its `engine`."""

    engine: EngineFront

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt (the tokenizer's special tokens added unless told not)."""
        return self.engine.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(
        self, messages: list[dict[str, str]], options: ChatOptions = DEFAULT_OPTIONS
    ) -> list[int]:
        """Token ids of chat messages: the template renders the special tokens, so the
        tokenizer adds none (no double BOS), as transformers' apply_chat_template does."""
        return self.engine.encode_chat(messages, options)

    def apply_chat_template(
        self, messages: list[dict[str, str]], options: ChatOptions = DEFAULT_OPTIONS
    ) -> str:
        """The prompt text for chat messages (the checkpoint's template, or a default)."""
        return self.engine.apply_chat_template(messages, options)

    def decode(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens kept (InvalidInput for ids outside the vocab)."""
        return self.engine.decode(token_ids)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The vocabulary entry of each id."""
        return self.engine.token_strings(token_ids)

    def decode_token(self, token_id: int) -> str:
        """One token's text, special tokens kept; "" for a padding id past the tokenizer's."""
        return str(self.engine.tokenizer.decode([token_id], skip_special_tokens=False))

    async def prepare_structured(self, spec: StructuredSpec, field: str = "structured") -> None:
        """Compile a structured-output spec off the event loop (InvalidInput naming `field` if
        it is invalid or too slow to compile), so admitting it later finds it compiled."""
        await self.engine.grammars.compile_async(spec, field)
