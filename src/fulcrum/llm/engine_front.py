"""What admission needs of an engine, without its weights: the text front, the limits a request
is checked against, and the SLO admission state. `LLMEngine` is one (in the engine's thread);
in process mode (`engine_process = true`) the server process builds one from the checkpoint's
tokenizer files and the limits its engine process reports, and holds no weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from fulcrum.errors import ConfigError, InvalidInput, Shed
from fulcrum.llm.budget import TokenBudget
from fulcrum.llm.chat import ChatTemplate
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.structured import GrammarCompiler
from fulcrum.llm.text_front import TextFrontEnd
from fulcrum.types import Clock, MonotonicClock


class EngineFront(TextFrontEnd):
    """Tokenising, request checks and admission for one model; reads only published state."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat: ChatTemplate,
        params: EngineParams,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_model_len: int,
        metrics: LLMMetrics | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(tokenizer, chat)
        self.params = params
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.clock: Clock = clock or MonotonicClock()
        self.grammars = GrammarCompiler(tokenizer, vocab_size, self.eos_token_ids)
        # With an SLO the token budget and running limit follow the load; without, they stay.
        # In process mode this copy only answers admission, from the state the engine publishes.
        self.budget = TokenBudget(params) if params.has_slo else None

    def check_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise InvalidInput (naming the field) for a request that can never run."""
        sampling.validate()
        sampling.check_vocabulary(self.vocab_size)
        if sampling.structured is not None:  # cached: compiled off the loop by its caller
            self.grammars.compile(sampling.structured)
        if not prompt_token_ids:
            raise InvalidInput("prompt: must have at least one token")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise InvalidInput(f"prompt: token ids must lie in 0..{self.vocab_size - 1}")
        num_prompt = len(prompt_token_ids)
        if num_prompt + sampling.max_tokens > self.max_model_len:
            raise InvalidInput(
                f"max_tokens: prompt ({num_prompt} tokens) + max_tokens ({sampling.max_tokens}) "
                f"exceeds max_model_len ({self.max_model_len})"
            )

    def check_admission(
        self, num_prompt_tokens: int, num_pending_tokens: int = 0, num_pending: int = 0
    ) -> None:
        """Shed (503) a request predicted to miss slo_ttft_ms; num_pending_tokens / num_pending:
        prompt tokens and requests admitted since the last step. Reads only published state:
        any thread may call it."""
        if self.budget is None:
            return
        try:
            self.budget.check_admission(num_prompt_tokens, num_pending_tokens, num_pending)
        except Shed:
            if self.metrics is not None:
                self.metrics.request_shed("slo_ttft")
            raise


def load_tokenizer(version_dir: Path) -> Tokenizer:
    """The checkpoint's tokenizer.json, without its weights (ConfigError if it has none)."""
    path = version_dir / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{version_dir}: no tokenizer.json")
    return Tokenizer.from_file(str(path))
